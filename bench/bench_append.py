"""Append throughput of the message log with group-commit fsync.

Producers (asyncio tasks) append batches of records of a 256-byte payload and
count a record only when its fsync has completed. Prints one JSON line.

    python bench/bench_append.py --records 1000000 --producers 64 --batch 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time

import numpy as np

from cluster.codec import Batch
from node.store.group_commit import GroupCommitter
from node.store.log import SegmentedLog


async def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="hg-bench-append-", dir=args.dir)
    try:
        log = SegmentedLog.open(root)
        gc = GroupCommitter(log)
        task = gc.start()
        payload = os.urandom(256)
        per_producer = args.records // args.producers
        acked = 0

        async def producer(p: int) -> None:
            nonlocal acked
            seq = p * per_producer
            for _ in range(per_producer // args.batch):
                if args.encode:
                    ids = [f"m{seq + i}" for i in range(args.batch)]
                    bodies = [Batch.build("bench.s1", [payload] * args.batch, ids, 1000,
                                          seq=np.arange(seq, seq + args.batch, dtype=np.uint64)).encode()]
                else:
                    bodies = [payload] * args.batch
                seq += args.batch
                await gc.append(bodies)
                acked += args.batch

        t0 = time.perf_counter()
        await asyncio.gather(*(producer(p) for p in range(args.producers)))
        elapsed = time.perf_counter() - t0
        await gc.close()
        await task
        log.close()
        return {
            "bench": "append_group_commit", "records": acked, "seconds": round(elapsed, 3),
            "records_per_s": round(acked / elapsed), "fsyncs": gc.fsyncs,
            "records_per_fsync": round(acked / max(1, gc.fsyncs), 1),
            "settings": {"producers": args.producers, "batch": args.batch, "payload_bytes": 256,
                         "encode_batch_records": args.encode},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--producers", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--encode", action="store_true", help="append one encoded batch record per batch (cluster.codec) instead of raw payloads")
    ap.add_argument("--dir", default=None, help="where to write (default: system temp)")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
