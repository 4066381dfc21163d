"""Micro-benchmark of the timing wheel core: ns per entry for add, load_second and advance.

Entries are spread uniformly over the look-ahead window; advance walks the
window in tick-sized steps, as the delay service's dispatch loop does. Prints
one JSON line.

    python bench/bench_wheel.py --entries 1000000 --seed 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.wheel import TimingWheel, WheelEntry  # noqa: E402


def _timed(fn) -> int:
    gc.collect()
    gc.disable()  # as timeit does: measure the wheel, not the collector
    try:
        t0 = time.perf_counter_ns()
        fn()
        return time.perf_counter_ns() - t0
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tick-ms", type=int, default=10)
    p.add_argument("--window-ms", type=int, default=2000)
    args = p.parse_args()

    rng = random.Random(args.seed)
    start_ms = 1_700_000_000_000  # a realistic epoch-ms, on a second boundary
    entries = [
        WheelEntry(start_ms + rng.randrange(args.window_ms), seq, f"msg-{seq}") for seq in range(args.entries)
    ]
    settings = dict(tick_ms=args.tick_ms, window_ms=args.window_ms, entries_max=max(args.entries, 1))

    # add: seconds loaded empty first, then every entry goes straight into the wheel
    wheel = TimingWheel(start_ms=start_ms, **settings)
    for s in wheel.seconds_to_load():
        wheel.load_second(s, [])
    assert wheel.loaded_until_ms >= start_ms + args.window_ms

    def add_all() -> None:
        add = wheel.add
        for e in entries:
            add(e)

    add_ns = _timed(add_all)
    assert len(wheel) == args.entries

    fired = 0

    def advance_all() -> None:
        nonlocal fired
        for now in range(start_ms, start_ms + args.window_ms + args.tick_ms, args.tick_ms):
            fired += len(wheel.advance(now))

    advance_ns = _timed(advance_all)
    assert fired == args.entries and len(wheel) == 0
    steps = args.window_ms // args.tick_ms + 1

    # load_second: the path the shell uses for entries read from the per-second index
    by_second: dict[int, list[WheelEntry]] = {}
    for e in entries:
        by_second.setdefault(e.deliver_at_ms // 1000, []).append(e)
    wheel2 = TimingWheel(start_ms=start_ms, **settings)

    def load_all() -> None:
        for s in wheel2.seconds_to_load():
            wheel2.load_second(s, by_second.get(s, []))

    load_ns = _timed(load_all)
    assert len(wheel2) == args.entries

    n = max(args.entries, 1)
    print(
        json.dumps(
            {
                "bench": "wheel",
                "entries": args.entries,
                "seed": args.seed,
                "tick_ms": args.tick_ms,
                "window_ms": args.window_ms,
                "add_ns_per_entry": round(add_ns / n, 1),
                "advance_ns_per_entry": round(advance_ns / n, 1),
                "advance_steps": steps,
                "advance_us_per_step": round(advance_ns / steps / 1000, 1),
                "load_second_ns_per_entry": round(load_ns / n, 1),
                "python": platform.python_version(),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
