"""A firing round's gather: ``Batch.gather`` against ``take`` of each frame then ``concat``.

    python bench/bench_gather.py [--calls 2000]

Two shapes, as the delay node meets them when it fires: 16 small frames (50 messages each)
giving 1-3 messages each (frames filed after their second was loaded), and the same plus a
loaded second of 20,000 messages giving 45. 256-byte payloads, 16 subjects. Prints one JSON
line per (shape, method) with microseconds per round.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit  # noqa: E402

sys.path.insert(0, str(REPO))
from cluster.codec import Batch  # noqa: E402


def frame(n: int, k: int) -> Batch:
    return Batch.build([f"bench.s{i % 16}" for i in range(n)], [bytes([i % 256]) * 256 for i in range(n)],
                       [f"id-{k}-{i}" for i in range(n)], np.arange(n, dtype=np.int64) + 10**12,
                       seq=np.arange(n, dtype=np.uint64) + 100_000 * k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    small = [(frame(50, k), np.sort(rng.choice(50, 1 + k % 3, replace=False))) for k in range(16)]
    big = frame(20_000, 99)
    shapes = {"16 small frames": small,
              "16 small frames + a loaded second": [(big, np.sort(rng.choice(20_000, 45, replace=False)))] + small}
    for shape, parts in shapes.items():
        want = Batch.concat([b.take(i) for b, i in parts]).encode()
        assert Batch.gather(parts).encode() == want
        for method, fn in (("take+concat", lambda: Batch.concat([b.take(i) for b, i in parts])),
                           ("gather", lambda: Batch.gather(parts))):
            us = timeit.timeit(fn, number=a.calls) / a.calls * 1e6
            emit({"bench": "gather", "shape": shape, "method": method,
                  "messages": sum(len(i) for _, i in parts), "us_per_round": round(us, 1)})


if __name__ == "__main__":
    main()
