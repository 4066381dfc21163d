"""Memory per pending message outside the wheel window (issue 2 target: 8 bytes).

A real DelayStore accepts ``--messages`` messages due about an hour ahead (so none
is in the wheel's look-ahead window), through the same path as the service:
accept -> fsync -> iterate into the schedule log and id index, a checkpoint every
``--checkpoint-every`` messages. Then:

* ``in_writer``: growth of the writing process's RSS (it also carries the Python
  garbage of building the messages);
* ``after_restart``: a fresh process opens the store (the backlog on disk) and
  serves (a lookup and a poll): RSS of that process minus the same process before
  the open. This is what holding a backlog costs a running node.

RSS is split into ``anon`` (heap: what the process really holds) and ``file``
(mmap'd pages of the id index and heads tables: page cache the kernel may drop and
re-read on demand). The 8-byte target is about ``anon``; ``file`` is reported beside it.

    python bench/bench_backlog.py --messages 1000000
    python bench/bench_backlog.py --messages 10000000 --payload 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, dir_bytes, emit, proc_mem  # noqa: E402

T0 = 1_800_000_000_000
HOUR = 3_600_000


def due_of(i: int) -> int:
    return T0 + HOUR + (i % 600) * 1000 + (i * 7919) % 1000  # an hour ahead, over ten minutes


def build(root: str, messages: int, payload_bytes: int, batch: int, checkpoint_every: int,
          unfiled_tail: int = 0) -> dict:
    """Accept ``messages`` into a DelayStore at ``root``; leaves it open (the caller closes or exits)."""
    import numpy as np

    from cluster.codec import Batch
    from node.delay.store import DelayStore, StoreSettings

    payload = os.urandom(payload_bytes)
    gc.collect()
    mem0 = proc_mem()
    store = DelayStore.open(root, StoreSettings(), now_ms=T0)
    gc.collect()
    mem_open = proc_mem()
    last_ckpt = 0
    t0 = time.perf_counter()
    for start in range(0, messages, batch):
        end = min(messages, start + batch)
        rng = range(start, end)
        res = store.accept(Batch.build([f"bench.s{i % 16}" for i in rng], [payload] * len(rng),
                                       [f"bk-{i:09d}" for i in rng], np.array([due_of(i) for i in rng], np.int64)),
                           now_ms=T0)
        assert not res.codes.any(), res.errors
        store.flush_messages()
        if end <= messages - unfiled_tail:
            store.iterate(limit=None)
            if end - last_ckpt >= checkpoint_every:
                store.checkpoint()
                last_ckpt = end
    elapsed = time.perf_counter() - t0
    if not unfiled_tail:
        store.checkpoint()
    gc.collect()
    mem1 = proc_mem()
    return {"store": store, "mem_before_open": mem0, "mem_open": mem_open, "mem_after": mem1,
            "ingest_per_s": round(messages / elapsed), "ingest_seconds": round(elapsed, 1),
            "pending_in_wheel": store.pending_in_wheel}


def reopen(root: str, now_ms: int) -> dict:
    """Fresh process: memory and time from nothing to serving a backlog on disk."""
    t_imp = time.perf_counter()
    from cluster.errors import NotFound
    from node.delay.store import DelayStore, StoreSettings
    import_s = time.perf_counter() - t_imp

    gc.collect()
    mem0 = proc_mem()
    t0 = time.perf_counter()
    store = DelayStore.open(root, StoreSettings(), now_ms=now_ms)
    t_open = time.perf_counter()
    gc.collect()
    mem_open = proc_mem()
    try:
        r = store.lookup("bk-000000000")
        assert r.status == "pending", r
    except NotFound:
        assert store.messages.end_offset == 0  # the empty store of the fixed-cost run
    due = store.poll_due(now_ms=now_ms)
    assert due == []
    t_serving = time.perf_counter()
    gc.collect()
    mem1 = proc_mem()
    replayed = store.counters["filed"]
    store.close()
    t_closed = time.perf_counter()
    return {"import_s": round(import_s, 3), "open_s": round(t_open - t0, 3),
            "to_serving_s": round(t_serving - t0, 3), "close_s": round(t_closed - t_serving, 3),
            "replayed_records": replayed, "mem_before_open": mem0, "mem_open": mem_open,
            "mem_serving": mem1}


def reopen_in_subprocess(root: str, now_ms: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--reopen", root, "--now-ms", str(now_ms)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_msg(a: dict, b: dict, n: int) -> dict:
    return {k: round((b[k] - a[k]) / n, 2) for k in ("rss", "anon", "file")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--payload", type=int, default=256)
    p.add_argument("--batch", type=int, default=5000)
    p.add_argument("--checkpoint-every", type=int, default=100_000)
    p.add_argument("--dir", default=None, help="parent folder for the store (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the store folder")
    p.add_argument("--reopen", default=None, help=argparse.SUPPRESS)
    p.add_argument("--now-ms", type=int, default=T0 + 1000, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.reopen:
        print(json.dumps(reopen(a.reopen, a.now_ms)))
        return

    root = tempfile.mkdtemp(prefix="hg-bench-backlog-", dir=a.dir)
    try:
        b = build(root, a.messages, a.payload, a.batch, a.checkpoint_every)
        b["store"].close()
        disk = dir_bytes(root)
        r = reopen_in_subprocess(root, T0 + 1000)
        # the same restart with an empty store: the fixed cost of an open store, not per message
        empty = tempfile.mkdtemp(prefix="hg-bench-backlog-empty-", dir=a.dir)
        try:
            r0 = reopen_in_subprocess(empty, T0 + 1000)
        finally:
            shutil.rmtree(empty, ignore_errors=True)
        n = a.messages
        fixed = {k: r0["mem_serving"][k] - r0["mem_before_open"][k] for k in ("rss", "anon", "file")}
        emit({
            "bench": "backlog_memory", "messages": n,
            "in_writer_bytes_per_pending": per_msg(b["mem_open"], b["mem_after"], n),
            "after_restart_bytes_per_pending": per_msg(r["mem_before_open"], r["mem_serving"], n),
            "after_restart_growth_mb": {k: round((r["mem_serving"][k] - r["mem_before_open"][k]) / 2**20, 1)
                                        for k in ("rss", "anon", "file")},
            "after_restart_minus_empty_store_bytes_per_pending": {
                k: round((r["mem_serving"][k] - r["mem_before_open"][k] - fixed[k]) / n, 2)
                for k in ("rss", "anon", "file")},
            "empty_store_restart_mb": {k: round(v / 2**20, 1) for k, v in fixed.items()},
            "in_writer_growth_mb": {k: round((b["mem_after"][k] - b["mem_open"][k]) / 2**20, 1)
                                    for k in ("rss", "anon", "file")},
            "pending_in_wheel": b["pending_in_wheel"],
            "disk_bytes_per_pending": round(disk / n, 1), "ingest_per_s": b["ingest_per_s"],
            "ingest_seconds": b["ingest_seconds"], "reopen_to_serving_s": r["to_serving_s"],
            "target": "anon growth <= 8 B/pending (1M: <= 8 MB, 10M: <= 80 MB)",
            "settings": {"payload_bytes": a.payload, "batch": a.batch, "checkpoint_every": a.checkpoint_every,
                         "due": "1 h ahead, spread over 10 min", "subjects": 16, "store": "StoreSettings()"},
        })
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
