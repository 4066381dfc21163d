"""Disk lifecycle (issue 14 A), at the delay store with a fake clock (no gRPC, no processes).

pending: N messages (256-byte payloads, SDK-style ids, batches of 1,000, all due in one
hour, as bench_e2e phase 2), filed, checkpointed, one retention pass: disk per pending
message (st_blocks of the data folder / N).

soak: messages go in as fast as they come due (R per fake second, due D later) for T fake
seconds with small segments and buckets; retention every 10 fake seconds. Disk sampled
every 60 fake seconds must stay flat (bounded by the figure of docs/operations.md "Disk"),
memory too; every message is delivered once (lost = sent - delivered after draining).

    python bench/bench_lifecycle.py --pending 200000 --soak-s 3600 --rate 500
"""

from __future__ import annotations

import argparse
import json
import resource
import secrets
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import dir_bytes  # noqa: E402
from cluster.codec import Batch  # noqa: E402
from node.delay import retention as DR  # noqa: E402
from node.delay.store import DelayStore, StoreSettings  # noqa: E402

T0 = 1_800_000_000_000


def ids(prefix: str, start: int, n: int) -> list[str]:
    return [f"{prefix}{k:x}" for k in range(start, start + n)]


def rss_kb() -> int:
    """Anonymous resident memory now (KiB): flat memory is about the current size, not the
    peak, and not the page cache of the memory-mapped id index (file-backed, reclaimable)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def retention(store, now_ms):
    s = store.settings
    work, report = DR.plan(store, now_ms=now_ms, dedupe_window_ms=s.dedupe_window_ms,
                           id_compact_ratio_min=s.id_compact_ratio_min)
    work.run()
    DR.finish(store, work, same_store=True)
    return report


def pending(args) -> dict:
    rnd = np.random.default_rng(1)
    pool = [rnd.bytes(256) for _ in range(64)]
    prefix = secrets.token_hex(8)
    with tempfile.TemporaryDirectory() as d:
        st = DelayStore.open(Path(d), StoreSettings(), now_ms=T0)
        st.checkpoint()
        d0 = dir_bytes(d)
        for k in range(0, args.pending, 1000):
            b = Batch.build("orders", [pool[i % 64] for i in range(1000)], ids(prefix, k, 1000),
                            np.full(1000, T0 + 3_600_000, np.int64))
            st.accept(b, now_ms=T0)
            st.flush_messages()
            st.iterate(limit=None)
        st.checkpoint()
        before = dir_bytes(d)
        retention(st, T0)
        after = dir_bytes(d)
        out = {"bench": "lifecycle", "phase": "pending", "pending": args.pending,
               "disk_bytes_per_pending_before_retention": round((before - d0) / args.pending, 1),
               "disk_bytes_per_pending": round((after - d0) / args.pending, 1),
               "by_folder": DR.disk_usage(Path(d))}
        st.close()
    return out


def soak(args) -> dict:
    rnd = np.random.default_rng(2)
    pool = [rnd.bytes(256) for _ in range(64)]
    s = StoreSettings(bucket_ms=60_000, message_segment_bytes=1 << 20, dispatch_segment_bytes=256 << 10,
                      id_entries_max=args.id_entries_max, id_slots=args.id_entries_max // 4,
                      dedupe_window_ms=args.dedupe_window_s * 1000)
    samples, rss = [], []
    sent = delivered = 0
    with tempfile.TemporaryDirectory() as d:
        st = DelayStore.open(Path(d), s, now_ms=T0)
        now = T0
        for sec in range(args.soak_s + args.delay_s + 5):
            if sec < args.soak_s:
                b = Batch.build("orders", [pool[i % 64] for i in range(args.rate)], ids("s", sent, args.rate),
                                np.full(args.rate, now + args.delay_s * 1000, np.int64))
                st.accept(b, now_ms=now)
                st.flush_messages()
                st.iterate(limit=None)
                sent += args.rate
            for step in range(10):
                now += 100
                for due in st.poll_due(now_ms=now):
                    delivered += due.batch.n
                    st.ack_dispatched(due.unit, np.arange(due.batch.n), now_ms=now)
            if sec % 10 == 9:
                st.checkpoint()
                retention(st, now)
            if sec % 60 == 59:
                samples.append(dir_bytes(d))
                rss.append(rss_kb())
        st.checkpoint()
        # the bound of docs/operations.md "Disk": (D + bucket) x R x copy + (D + bucket + window) x R x 44
        copy = 256 + 49 + 8 + 60  # plain columns: an upper bound (packed frames take ~4 B, not 49)
        bound = (args.delay_s * 1000 + s.bucket_ms) / 1000 * args.rate * copy \
            + (args.delay_s * 1000 + s.bucket_ms + s.dedupe_window_ms + 20_000) / 1000 * args.rate * 44 \
            + 2 * s.message_segment_bytes + 2 * s.dispatch_segment_bytes + 2 * (64 + 4 * s.id_slots)
        half = samples[len(samples) // 2:]
        tenth = max(1, len(rss) // 10)
        out = {"bench": "lifecycle", "phase": "soak", "fake_seconds": args.soak_s, "rate": args.rate,
               "delay_s": args.delay_s, "sent": sent, "delivered": delivered, "lost": sent - delivered,
               "disk_mb_samples": [round(x / 2**20, 2) for x in samples[::max(1, len(samples) // 60)]],
               "disk_mb_max_second_half": round(max(half) / 2**20, 2) if half else None,
               "disk_mb_bound": round(bound / 2**20, 2),
               "rss_anon_mb_samples": [round(x / 1024, 1) for x in rss[::max(1, len(rss) // 60)]],
               "rss_anon_mb_max_second_tenth_last_tenth": [round(max(rss[tenth:2 * tenth]) / 1024, 1),
                                                      round(max(rss[-tenth:]) / 1024, 1)] if rss else None,
               "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        st.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pending", type=int, default=200_000)
    ap.add_argument("--soak-s", type=int, default=1800, help="fake seconds of traffic")
    ap.add_argument("--rate", type=int, default=500, help="messages per fake second")
    ap.add_argument("--delay-s", type=int, default=120)
    ap.add_argument("--dedupe-window-s", type=int, default=300)
    ap.add_argument("--id-entries-max", type=int, default=65_536,
                    help="soak: entries per id file (every file is probed for each accepted batch)")
    ap.add_argument("--phases", default="pending,soak")
    args = ap.parse_args()
    for ph in args.phases.split(","):
        print(json.dumps(pending(args) if ph == "pending" else soak(args)), flush=True)


if __name__ == "__main__":
    main()
