"""A flood of new subjects against one real-time node (issue 27, 3): the victim's send latency
with and without the flood, and the time per batch of new subjects.

Starts a LocalCluster (etcd, a meta server, one delay and one real-time node; open, the
quotas raised so the flood is not refused), then:

1. the victim alone: ``--victim-sends`` single-message SendBatch calls to an existing subject,
   one after the other (p50 / p99 latency);
2. the same victim while the attacker, another process as another tenant would be, sends
   ``--subjects`` new subjects in SendBatch requests of ``--batch`` straight to the real-time
   node (seconds per batch; victim p50 / p99 / max).

    PYTHONPATH=. python3 bench/bench_subject_flood.py --subjects 1500 --batch 300
    PYTHONPATH=. python3 bench/bench_subject_flood.py --subjects 1500 --batch 300 --default-quotas

Each flood runs twice: new subjects (``flood``), then the same subjects again, ten times over
(``known``: another tenant's sends of the same shape that create nothing: the victim's p99
beside a busy neighbour, against which the cost of creating subjects is measured).

Uses only the wire API, so the same script measures an older checkout (its quota settings
are then ignored). Figures: docs/benchmarks.md, "New subjects off the event loop".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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
FLOOD_TIMEOUT_S = 600
KNOWN_PASSES = 10  # the known-subjects flood sends every batch this many times (enough victim sends for a p99)


def _batch(subjects: list[str], tag: str) -> Batch:
    n = len(subjects)
    return Batch.build(subjects, [b"x" * 100] * n, [f"{tag}-{i}" for i in range(n)], np.zeros(n, np.int64))


async def _send(ch: Channels, address: str, b: Batch, *, refusals_ok: bool = False) -> BatchResult:
    resp = await ch.producer(address).SendBatch(make_request(b, immediate=True), timeout=SEND_TIMEOUT_S)
    res = BatchResult.from_pb(resp, b.n)
    if res.errors and not refusals_ok:
        raise RuntimeError(f"refused: {next(iter(res.errors.values()))}")
    return res


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.array(xs) * 1000
    return {"n": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


async def _flood(address: str, subjects: int, batch: int, run_id: str, tag: str, started) -> tuple[list[float], int]:
    """The attacker: ``subjects // batch`` sends of ``batch`` subjects named by ``run_id``
    (new the first time), one after the other; message ids by ``tag``. Returns the seconds
    per batch and how many messages were refused (the subject quotas)."""
    ch = Channels()
    per_batch = []
    refused = 0
    passes = KNOWN_PASSES if tag == "k" else 1
    batches = [_batch([f"{run_id}.f{k}.{i}" for i in range(batch)], f"{run_id}-{tag}{p}.{k}")
               for p in range(passes) for k in range(subjects // batch)]
    started.set()  # imports and batches done: the victim's "during" starts now
    try:
        for b in batches:
            t = time.perf_counter()
            res = await _send(ch, address, b, refusals_ok=True)
            per_batch.append(time.perf_counter() - t)
            refused += len(res.errors)
    finally:
        await ch.close()
    return per_batch, refused


def _flood_process(address: str, subjects: int, batch: int, run_id: str, tag: str, out, started) -> None:
    """The attacker in its own process (another tenant is another client): building its
    300-subject batches does not hold the victim's event loop, so the victim's figures are the
    node's."""
    try:
        out.send(("ok", asyncio.run(_flood(address, subjects, batch, run_id, tag, started))))
    except BaseException as e:  # reported to the parent, which raises it
        out.send(("error", repr(e)))


async def _beside_flood(ch: Channels, address: str, subjects: int, batch: int, run_id: str,
                        tag: str) -> tuple[list[float], tuple[list[float], int], float]:
    """The victim's one-message sends while a flood process runs: (their latencies, (the
    flood's seconds per batch, its refused messages), the flood's seconds from its first send
    to its last answer)."""
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    started = ctx.Event()
    proc = ctx.Process(target=_flood_process, args=(address, subjects, batch, run_id, tag, tx, started), daemon=True)
    during: list[float] = []
    loop = asyncio.get_running_loop()
    proc.start()
    try:
        for _ in range(int(FLOOD_TIMEOUT_S / 0.2)):
            if await loop.run_in_executor(None, started.wait, 0.2) or not proc.is_alive():
                break
        if not started.is_set():
            raise RuntimeError(f"the flood process did not start (exit code {proc.exitcode})")
        t0 = time.perf_counter()
        j = 0
        deadline = time.monotonic() + FLOOD_TIMEOUT_S
        while proc.is_alive() and not rx.poll() and time.monotonic() < deadline:
            t = time.perf_counter()
            await _send(ch, address, _batch(["victim"], f"{run_id}-{tag}d{j}"))
            during.append(time.perf_counter() - t)
            j += 1
        flood_s = time.perf_counter() - t0
        kind, value = await loop.run_in_executor(None, lambda: rx.recv() if rx.poll(FLOOD_TIMEOUT_S) else
                                                 ("error", "the flood process answered nothing"))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if kind != "ok":
        raise RuntimeError(f"flood: {value}")
    return during, value, flood_s


async def run(address: str, subjects: int, batch: int, victim_sends: int, run_id: str) -> dict:
    ch = Channels()
    try:
        await _send(ch, address, _batch(["victim"], f"{run_id}-warm"))
        alone = []
        for j in range(victim_sends):
            t = time.perf_counter()
            await _send(ch, address, _batch(["victim"], f"{run_id}-a{j}"))
            alone.append(time.perf_counter() - t)

        out = {"victim_alone": _pcts(alone)}
        for name, tag in (("flood", "f"), ("known", "k")):  # new subjects, then the same ones again
            during, (per_batch, refused), flood_s = await _beside_flood(ch, address, subjects, batch, run_id, tag)
            out[f"victim_during_{name}"] = _pcts(during)
            out[f"{name}_refused"] = refused
            out[f"{name}_s"] = round(flood_s, 2)
            out[f"{name}_s_per_batch"] = [round(x, 3) for x in per_batch]
        out.update(flood_subjects=subjects, flood_batch=batch)
        return out
    finally:
        await ch.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subjects", type=int, default=1500)
    p.add_argument("--batch", type=int, default=300)
    p.add_argument("--victim-sends", type=int, default=200)
    p.add_argument("--default-quotas", action="store_true",
                   help="keep the per-principal subject quotas (600 new a minute, then 10 a second): the flood "
                        "is then mostly refused, as an attacker's would be")
    a = p.parse_args()
    env = {} if a.default_quotas else {"HOURGLASS_SUBJECTS_NEW_PER_MINUTE_MAX": "1000000",
                                       "HOURGLASS_SUBJECTS_OWNED_MAX": "1000000"}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d) / "c", n_delay=1, n_realtime=1, env=env) as c:
        c.wait_registered()
        out = asyncio.run(run(c.realtime[0].address, a.subjects, a.batch, a.victim_sends, "r1"))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
