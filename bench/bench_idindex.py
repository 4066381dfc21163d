"""Micro-benchmark of the id index: puts/s, get_all/s and RSS growth per id.

Puts ``--ids`` distinct ids (flush every ``--flush-every``), then looks up
``--gets`` random ids (half of them absent). RSS growth is reported in total and
split into anonymous memory (what a dict would cost) and file-backed pages of
the maps (page cache the kernel can drop). Prints one JSON line.

    python bench/bench_idindex.py --ids 1000000 --seed 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.store.idindex import IdIndex, IdLocation  # noqa: E402
from node.store.settings import STORE_DEFAULTS  # noqa: E402


def _mem() -> tuple[int, int]:
    """(rss, anonymous rss) in bytes."""
    info = psutil.Process().memory_info()
    return info.rss, info.rss - getattr(info, "shared", 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ids", type=int, default=1_000_000)
    p.add_argument("--gets", type=int, default=200_000)
    p.add_argument("--flush-every", type=int, default=1000)
    p.add_argument("--slots-count", type=int, default=STORE_DEFAULTS.id_slots)
    p.add_argument("--entries-max", type=int, default=STORE_DEFAULTS.id_entries_max)
    p.add_argument("--dir", type=Path, default=None, help="index folder (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    root = a.dir or Path(tempfile.mkdtemp(prefix="bench-idindex-"))
    rnd = random.Random(a.seed)
    try:
        gc.collect()
        rss0, anon0 = _mem()
        ids = IdIndex.open(root, slots_count=a.slots_count, entries_max=a.entries_max)
        t0 = time.perf_counter_ns()
        for seq in range(a.ids):
            ids.put(f"msg-{seq:012d}", IdLocation(seq // 10_000 * 3_600_000, seq * 256, 256, seq))
            if seq % a.flush_every == a.flush_every - 1:
                ids.flush()
        ids.flush()
        put_ns = time.perf_counter_ns() - t0
        gc.collect()
        rss1, anon1 = _mem()

        probes = [rnd.randrange(2 * a.ids) for _ in range(a.gets)]  # >= ids: absent
        hits = 0
        t0 = time.perf_counter_ns()
        for k in probes:
            hits += bool(ids.get_all(f"msg-{k:012d}"))
        get_ns = time.perf_counter_ns() - t0
        files = ids.file_count()
        ids.close()
        disk_bytes = sum(os.stat(f).st_blocks * 512 for f in root.glob("*.idx"))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(json.dumps({
        "bench": "idindex",
        "ids": a.ids,
        "gets": a.gets,
        "get_hits": hits,
        "slots_count": a.slots_count,
        "entries_max": a.entries_max,
        "files": files,
        "put_per_s": round(a.ids / (put_ns / 1e9)),
        "put_us": round(put_ns / a.ids / 1000, 2),
        "get_per_s": round(a.gets / (get_ns / 1e9)),
        "get_us": round(get_ns / a.gets / 1000, 2),
        "rss_growth_bytes_per_id": round((rss1 - rss0) / a.ids, 1),
        "rss_anon_growth_bytes_per_id": round((anon1 - anon0) / a.ids, 2),
        "disk_bytes_per_id": round(disk_bytes / a.ids, 1),
        "python": platform.python_version(),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
