"""The real-time node's dedup window alone, as an append uses it: every frame of ``--batch``
new (subject, id) keys is checked (``accept.assign_seqs``) and added (``DedupWindow.add``)
at ``--entries-max`` (the node's ``dedup_entries_max``, default 2,000,000), so the window
fills, then forgets its oldest frames as fast as it learns new ones. Prints, per
``--report`` frames, the mean cost per message and the slowest frame: the slowest is a
pause of the node's event loop (docs/benchmarks.md, "The dedup window in generations").

    PYTHONPATH=. python3 bench/bench_dedup.py                      # this tree
    PYTHONPATH=OLD python3 OLD/bench/bench_dedup.py                # a tree before generations
    PYTHONPATH=. python3 bench/bench_dedup.py --generation-entries 262144   # another split
"""

from __future__ import annotations

import argparse
import json
import os
import time

import node.realtime.dedup as dedup
from node.realtime.accept import assign_seqs


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=15_000)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--entries-max", type=int, default=2_000_000)
    ap.add_argument("--generation-entries", type=int, default=0,
                    help="override dedup.GENERATION_ENTRIES_MAX (0: the module's)")
    ap.add_argument("--report", type=int, default=2_500)
    a = ap.parse_args()
    if a.generation_entries and hasattr(dedup, "GENERATION_ENTRIES_MAX"):
        dedup.GENERATION_ENTRIES_MAX = a.generation_entries
    d = dedup.DedupWindow(window_ms=600_000, entries_max=a.entries_max)
    generational = hasattr(d, "isdisjoint")
    known = d if generational else d.map  # a tree before generations passed the dict itself
    subjects = [f"bench.s{i % 16}" for i in range(a.batch)]
    worst = total = 0.0
    for f in range(a.frames):
        ids = [f"ur20000-{f * a.batch + i}" for i in range(a.batch)]
        t = time.perf_counter()
        keys = dedup.keys_of(subjects, ids) if generational else list(zip(subjects, ids))
        seqs, _, _ = assign_seqs(keys, known, epoch=1, counter=f * a.batch)
        d.add(keys, seqs.tolist(), store_ms=f * 10, offset=f)
        dt = time.perf_counter() - t
        total += dt
        worst = max(worst, dt)
        if (f + 1) % a.report == 0:
            print(json.dumps({"bench": "dedup", "window": f"{len(d.gens)} generations of <= {d.gen_entries_max}"
                              if generational else "one dict", "frames": f + 1, "entries": len(d),
                              "us_per_msg": round(total / (a.report * a.batch) * 1e6, 3),
                              "slowest_frame_ms": round(worst * 1e3, 1), "rss_mib": round(rss_bytes() / 2**20)}))
            total = worst = 0.0


if __name__ == "__main__":
    main()
