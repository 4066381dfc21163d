"""CPU per SendBatch of the delay node's store, without gRPC: decode the request
(``cluster.wire.request_batch``), ``DelayStore.accept``, then file it (``iterate``).
Separates the fixed cost per call from the cost per message (issue 12).

    python bench/bench_delay_ingest.py --sizes 20,200,1000 --calls 1000
    python bench/bench_delay_ingest.py --sizes 1000,4000 --calls 200 --spread-ms 10000 [--sorted]

``--spread-ms``: delays uniform over 3 s .. 3 s + spread (phase 1 of shared/BENCHMARK.md:
10000), so a call is filed over many seconds; ``--sorted``: each call in due order, as the
SDK sends it (default: in send order, as an older SDK did).

``--backlog B --steps 20000,2000``: a filing round behind by B records (accepted and durable,
not filed: what a WAL fsync stall leaves), filed in steps of at most each ``--steps`` value as
the delay node's filing loop does (``file_step_max``; it yields to the event loop between
steps): prints the CPU of the longest step (how long the loop is held at once) and of the
whole backlog, per message (docs/benchmarks.md, "Filing steps").

    python bench/bench_delay_ingest.py --backlog 20000 --steps 20000,2000 --spread-ms 4000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from cluster.codec import Batch  # noqa: E402
from cluster.wire import make_request, request_batch  # noqa: E402
from node.delay.store import DelayStore, StoreSettings  # noqa: E402

T0 = 1_800_000_000_000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="20,200,1000", help="messages per call")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--spread-ms", type=int, default=0, help="delays uniform over 3 s .. 3 s + this")
    p.add_argument("--sorted", action="store_true", help="each call in due order (as the SDK sends it)")
    p.add_argument("--backlog", type=int, default=0, help="records waiting to be filed (with --steps)")
    p.add_argument("--steps", default="20000,2000", help="file_step_max values to file the backlog with")
    p.add_argument("--repeat", type=int, default=3, help="backlogs filed per step value (alternating)")
    a = p.parse_args()
    if a.backlog:
        return steps(a)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(prefix="hg-bench-ingest-") as d:
        store = DelayStore.open(Path(d), StoreSettings(), now_ms=T0)
        out = []
        for n in (int(x) for x in a.sizes.split(",")):
            subjects = [f"bench.s{i % 16}" for i in range(n)]
            reqs = []
            for j in range(a.calls):
                delay = 3000 + rng.integers(0, a.spread_ms + 1, n)
                if a.sorted:
                    delay = np.sort(delay)
                reqs.append(make_request(Batch.build(subjects, [b"x" * 256] * n, [f"i{n}-{j}-{i}" for i in range(n)],
                                                     [0] * n), delay_ms=delay))
            t = time.process_time()
            for j, r in enumerate(reqs):
                store.accept(request_batch(r, now_ms=T0 + j), now_ms=T0 + j)
                store.durable_offset = store.messages.end_offset
                store.iterate(limit=None)
            us = (time.process_time() - t) / a.calls * 1e6
            out.append({"messages_per_call": n, "cpu_us_per_call": round(us), "cpu_us_per_msg": round(us / n, 2)})
        store.close()
    print(json.dumps({"bench": "delay_ingest", "calls": a.calls, "spread_ms": a.spread_ms, "sorted": a.sorted,
                      "results": out, "machine": machine()}))


def steps(a) -> None:
    """The ``--backlog`` mode (module docstring): calls of 200 records accepted, then filed."""
    rng = np.random.default_rng(1)
    per_call = 200
    subjects = [f"bench.s{i % 16}" for i in range(per_call)]
    out = []
    with tempfile.TemporaryDirectory(prefix="hg-bench-steps-") as d:
        store = DelayStore.open(Path(d), StoreSettings(), now_ms=T0)
        j = 0
        for rep in range(a.repeat):
            for limit in (int(x) for x in a.steps.split(",")):
                for _ in range(a.backlog // per_call):
                    delay = np.sort(3000 + rng.integers(0, a.spread_ms + 1, per_call))
                    r = make_request(Batch.build(subjects, [b"x" * 256] * per_call,
                                                 [f"b{j}-{i}" for i in range(per_call)], [0] * per_call), delay_ms=delay)
                    store.accept(request_batch(r, now_ms=T0 + j), now_ms=T0 + j)
                    j += 1
                store.durable_offset = store.messages.end_offset
                longest = total = 0.0
                n = 0
                while True:
                    t = time.process_time()
                    k = store.iterate(limit=limit)
                    dt = time.process_time() - t
                    if not k:
                        break
                    n += k
                    total += dt
                    longest = max(longest, dt)
                out.append({"file_step_max": limit, "repeat": rep, "filed": n, "longest_step_ms": round(longest * 1e3, 1),
                            "cpu_us_per_msg": round(total / max(n, 1) * 1e6, 2)})
        store.close()
    print(json.dumps({"bench": "delay_filing_steps", "backlog": a.backlog, "spread_ms": a.spread_ms,
                      "results": out, "machine": machine()}))


if __name__ == "__main__":
    main()
