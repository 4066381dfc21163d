"""Micro-benchmark of the timing wheel core: CPU ns per entry for load_second, add and advance.

Entries come in chunks of about ``--chunk`` entries (one per frame), spread
uniformly over the look-ahead window. Two paths fill the wheel: ``load_second``
(the shell reading whole seconds from the per-second index) and ``add`` (new
frames whose second is loaded). ``advance`` then walks the window in
``--step-ms`` steps (default one tick, as the dispatch loop does when it fires
as soon as something is due). CPU time (``time.process_time_ns``); prints one
JSON line.

    python bench/bench_wheel.py --entries 1000000 --chunk 100 --seed 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.wheel import Chunk, TimingWheel  # noqa: E402


def _cpu_ns(fn) -> int:
    gc.collect()
    gc.disable()  # as timeit does: measure the wheel, not the collector
    try:
        t0 = time.process_time_ns()
        fn()
        return time.process_time_ns() - t0
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--chunk", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tick-ms", type=int, default=10)
    p.add_argument("--window-ms", type=int, default=2000)
    p.add_argument("--step-ms", type=int, default=0, help="advance step; 0 = one tick")
    args = p.parse_args()
    step_ms = args.step_ms or args.tick_ms

    rng = np.random.default_rng(args.seed)
    start_ms = 1_700_000_000_000  # a realistic epoch-ms, on a second boundary
    n = args.entries
    due = start_ms + rng.integers(0, args.window_ms, n)
    seq = np.arange(n, dtype=np.uint64)
    # frames as the store files them: one per (batch, due second), ~args.chunk entries each
    order = np.argsort(due // 1000, kind="stable")
    chunks_by_second: dict[int, list[Chunk]] = {}
    for part in np.array_split(order, max(1, n // args.chunk)):
        for s in np.unique(due[part] // 1000).tolist():
            sel = part[due[part] // 1000 == s]
            c = Chunk(due[sel], seq[sel], np.arange(len(sel), dtype=np.int32), ref=("frame", s, int(sel[0])))
            chunks_by_second.setdefault(s, []).append(c)
    chunks = [c for cs in chunks_by_second.values() for c in cs]
    settings = dict(tick_ms=args.tick_ms, window_ms=args.window_ms, entries_max=max(n, 1))

    def advance_all(wheel: TimingWheel) -> int:
        fired = 0
        for now in range(start_ms, start_ms + args.window_ms + step_ms, step_ms):
            for f in wheel.advance(now):
                fired += len(f.idx)
        return fired

    # load_second + advance: the path of entries read from the per-second index
    w1 = TimingWheel(start_ms=start_ms, **settings)

    def load_all() -> None:
        for s in w1.seconds_to_load():
            w1.load_second(s, chunks_by_second.get(s, []))

    load_ns = _cpu_ns(load_all)
    assert len(w1) == n
    fired1 = 0

    def advance1() -> None:
        nonlocal fired1
        fired1 = advance_all(w1)

    advance_loaded_ns = _cpu_ns(advance1)
    assert fired1 == n and len(w1) == 0

    # add + advance: new frames going straight into the wheel, one run per chunk
    w2 = TimingWheel(start_ms=start_ms, **settings)
    for s in w2.seconds_to_load():
        w2.load_second(s, [])

    def add_all() -> None:
        add = w2.add
        for c in chunks:
            add(c)

    add_ns = _cpu_ns(add_all)
    assert len(w2) == n
    fired2 = 0

    def advance2() -> None:
        nonlocal fired2
        fired2 = advance_all(w2)

    advance_added_ns = _cpu_ns(advance2)
    assert fired2 == n and len(w2) == 0

    d = max(n, 1)
    print(
        json.dumps(
            {
                "bench": "wheel",
                "entries": n,
                "chunks": len(chunks),
                "seed": args.seed,
                "tick_ms": args.tick_ms,
                "window_ms": args.window_ms,
                "step_ms": step_ms,
                "advance_steps": args.window_ms // step_ms + 1,
                "load_second_ns_per_entry": round(load_ns / d, 1),
                "advance_loaded_ns_per_entry": round(advance_loaded_ns / d, 1),
                "load_plus_advance_ns_per_entry": round((load_ns + advance_loaded_ns) / d, 1),
                "add_ns_per_entry": round(add_ns / d, 1),
                "advance_added_ns_per_entry": round(advance_added_ns / d, 1),
                "add_plus_advance_ns_per_entry": round((add_ns + advance_added_ns) / d, 1),
                "python": platform.python_version(),
                "numpy": np.__version__,
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
