"""CPU per SendBatch of the delay node's store, without gRPC: decode the request
(``cluster.wire.request_batch``), ``DelayStore.accept``, then file it (``iterate``).
Separates the fixed cost per call from the cost per message (issue 12).

    python bench/bench_delay_ingest.py --sizes 20,200,1000 --calls 1000
    python bench/bench_delay_ingest.py --sizes 1000,4000 --calls 200 --spread-ms 10000 [--sorted]

``--spread-ms``: delays uniform over 3 s .. 3 s + spread (phase 1 of shared/BENCHMARK.md:
10000), so a call is filed over many seconds; ``--sorted``: each call in due order, as the
SDK sends it (default: in send order, as an older SDK did).
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
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
