"""A flood of new subjects against one real-time node (issue 27, 3): the victim's send latency
with and without the flood, and the time per batch of new subjects.

Starts a LocalCluster (etcd, a meta server, one delay and one real-time node; open, the
quotas raised so the flood is not refused), then:

1. the victim alone: ``--victim-sends`` single-message SendBatch calls to an existing subject,
   one after the other (p50 / p99 latency);
2. the same victim while the attacker sends ``--subjects`` new subjects in SendBatch requests
   of ``--batch`` straight to the real-time node (seconds per batch; victim p50 / p99 / max).

    PYTHONPATH=. python3 bench/bench_subject_flood.py --subjects 1500 --batch 300

Uses only the wire API, so the same script measures an older checkout (its quota settings
are then ignored). Figures: docs/benchmarks.md, "New subjects off the event loop".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.codec import Batch  # noqa: E402
from cluster.devcluster import LocalCluster  # noqa: E402
from cluster.transport import Channels  # noqa: E402
from cluster.wire import BatchResult, make_request  # noqa: E402

SEND_TIMEOUT_S = 300


def _batch(subjects: list[str], tag: str) -> Batch:
    n = len(subjects)
    return Batch.build(subjects, [b"x" * 100] * n, [f"{tag}-{i}" for i in range(n)], np.zeros(n, np.int64))


async def _send(ch: Channels, address: str, b: Batch) -> BatchResult:
    resp = await ch.producer(address).SendBatch(make_request(b, immediate=True), timeout=SEND_TIMEOUT_S)
    res = BatchResult.from_pb(resp, b.n)
    if res.errors:
        raise RuntimeError(f"refused: {next(iter(res.errors.values()))}")
    return res


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.array(xs) * 1000
    return {"n": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


async def run(address: str, subjects: int, batch: int, victim_sends: int, run_id: str) -> dict:
    ch = Channels()
    try:
        await _send(ch, address, _batch(["victim"], f"{run_id}-warm"))
        alone = []
        for j in range(victim_sends):
            t = time.perf_counter()
            await _send(ch, address, _batch(["victim"], f"{run_id}-a{j}"))
            alone.append(time.perf_counter() - t)

        done = asyncio.Event()
        per_batch: list[float] = []

        async def flood() -> None:
            try:
                for k in range(subjects // batch):
                    t = time.perf_counter()
                    await _send(ch, address, _batch([f"{run_id}.f{k}.{i}" for i in range(batch)], f"{run_id}-f{k}"))
                    per_batch.append(time.perf_counter() - t)
            finally:
                done.set()

        during: list[float] = []

        async def victim() -> None:
            j = 0
            while not done.is_set():
                t = time.perf_counter()
                await _send(ch, address, _batch(["victim"], f"{run_id}-d{j}"))
                during.append(time.perf_counter() - t)
                j += 1

        t0 = time.perf_counter()
        await asyncio.gather(flood(), victim())
        flood_s = time.perf_counter() - t0
        return {"victim_alone": _pcts(alone), "victim_during_flood": _pcts(during),
                "flood_subjects": subjects, "flood_batch": batch, "flood_s": round(flood_s, 2),
                "s_per_batch": [round(x, 3) for x in per_batch]}
    finally:
        await ch.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subjects", type=int, default=1500)
    p.add_argument("--batch", type=int, default=300)
    p.add_argument("--victim-sends", type=int, default=200)
    a = p.parse_args()
    env = {"HOURGLASS_SUBJECTS_NEW_PER_MINUTE_MAX": "1000000", "HOURGLASS_SUBJECTS_OWNED_MAX": "1000000"}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d) / "c", n_delay=1, n_realtime=1, env=env) as c:
        c.wait_registered()
        out = asyncio.run(run(c.realtime[0].address, a.subjects, a.batch, a.victim_sends, "r1"))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
