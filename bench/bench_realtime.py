"""CPU per message of the real-time store: append batches, pull them, ack them (no network).

Appends ``--messages`` messages in batches of ``--batch`` (``--payload`` bytes, ids unique,
subjects drawn from ``--subjects``), then one consumer group pulls every subject at once
(``--pull`` per call) and acks each pull by handle ranges, as the SDK does (packing the
ranges is the SDK's work and is not timed; parsing them and the ack are). Reports
``time.process_time`` per message for each phase as one JSON line; the budget
(``shared/ARCHITECTURE.md``, "Hot path") is store + pull + ack <= 5 us per message.

    python bench/bench_realtime.py --messages 200000 --batch 500 --subjects 16
    python bench/bench_realtime.py --cycle --messages 60000 --batch 20 --subjects 16   # per-call cost
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import numpy as np

import common  # noqa: F401  (puts the repository on sys.path)
from cluster.codec import Batch
from cluster.wire import pack_ranges, unpack_ranges
from node.realtime.store import RealtimeSettings, RealtimeStore

T0 = 1_800_000_000_000


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="hg-bench-realtime-", dir=args.dir)
    try:
        st = RealtimeStore.open(root, RealtimeSettings(), now_ms=T0)
        rng = np.random.default_rng(1)
        subjects = [f"s{i}" for i in range(args.subjects)]
        payload = b"p" * args.payload
        batches = [Batch.build([subjects[i] for i in rng.integers(0, args.subjects, args.batch)],
                               [payload] * args.batch, [f"id-{k}-{i}" for i in range(args.batch)], T0)
                   for k in range(args.messages // args.batch)]
        n = sum(b.n for b in batches)

        t0 = time.process_time()
        for k, b in enumerate(batches):
            st.append(b, now_ms=T0 + k)
        t_append = time.process_time() - t0

        t_pull = t_ack = 0.0
        got = 0
        while True:
            t0 = time.process_time()
            batch, handles = st.pull(subjects, "g", "c", max_messages=args.pull, now_ms=T0 + 10_000)
            t1 = time.process_time()
            t_pull += t1 - t0
            if not batch.n:
                break
            got += batch.n
            # the SDK packs an Ack request's ranges per subject (its own budget, not timed here)
            acks = [(s, pack_ranges(handles[batch.subject_idx == k])) for k, s in enumerate(batch.subjects)]
            t1 = time.process_time()
            for s, raw in acks:
                if raw:
                    st.ack(s, "g", unpack_ranges(raw), now_ms=T0 + 10_000)
            t_ack += time.process_time() - t1
        assert got == n, (got, n)
        st.close()
        us = 1e6 / n
        return {"bench": "realtime_store", "messages": n, "batch": args.batch, "subjects": args.subjects,
                "payload_bytes": args.payload, "append_us_per_msg": round(t_append * us, 2),
                "pull_us_per_msg": round(t_pull * us, 2), "ack_us_per_msg": round(t_ack * us, 2),
                "total_us_per_msg": round((t_append + t_pull + t_ack) * us, 2)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cycles(args) -> dict:
    """The live pattern at a few thousand msgs/s: append one batch, pull every subject at
    once, ack what the pull returned per subject; CPU per cycle (the best of 10 slices,
    so that other load on the machine counts as little as possible)."""
    root = tempfile.mkdtemp(prefix="hg-bench-realtime-", dir=args.dir)
    try:
        st = RealtimeStore.open(root, RealtimeSettings(), now_ms=T0)
        rng = np.random.default_rng(1)
        subjects = [f"s{i}" for i in range(args.subjects)]
        for s in subjects:
            st.create_subject(s)
        payload = b"p" * args.payload
        n_cycles = args.messages // args.batch
        batches = [Batch.build([subjects[i] for i in rng.integers(0, args.subjects, args.batch)],
                               [payload] * args.batch, [f"id-{k}-{i}" for i in range(args.batch)], T0)
                   for k in range(n_cycles)]
        slices, best = 10, float("inf")
        per = max(1, n_cycles // slices)
        for r in range(slices):
            t0 = time.process_time()
            for k in range(r * per, min(n_cycles, (r + 1) * per)):
                now = T0 + k
                st.append(batches[k], now_ms=now)
                got, handles = st.pull(subjects, "g", "c", max_messages=args.pull, now_ms=now)
                for j, s in enumerate(got.subjects):
                    st.ack(s, "g", unpack_ranges(pack_ranges(handles[got.subject_idx == j])), now_ms=now)
            best = min(best, (time.process_time() - t0) / per)
        st.close()
        return {"bench": "realtime_cycle", "batch": args.batch, "subjects": args.subjects, "cycles": n_cycles,
                "us_per_cycle": round(best * 1e6), "us_per_msg": round(best * 1e6 / args.batch, 2)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycle", action="store_true",
                   help="append one batch, pull all subjects, ack per subject, repeat: CPU per cycle")
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--subjects", type=int, default=16)
    p.add_argument("--payload", type=int, default=256)
    p.add_argument("--pull", type=int, default=500)
    p.add_argument("--dir", default=None, help="where the data folder goes (default: the temp folder)")
    a = p.parse_args()
    print(json.dumps(cycles(a) if a.cycle else run(a)))


if __name__ == "__main__":
    main()
