"""Spark pipeline benchmark: audit throughput over N log records, JVM and Python memory peaks,
and the bulk-schedule rate against a real local cluster.

    python bench/bench_spark.py --records 10000000            # audit (data cached under --data)
    python bench/bench_spark.py --records 0 --bulk-rows 20000  # bulk-schedule only

Audit data: ``records / 3`` messages, each present three times - in a delay node's message
log, its dispatch log and a real-time node's message log - written with the real storage
engine (``SegmentedLog.append`` of records encoded by ``node.store.records``: the engine's
fast path, no per-message validation). 16 subjects, 256-byte payloads, due times spread
over 24 hours, lateness 0..50 ms; one message in 1,000 is never dispatched (lost), one in
2,000 reaches the real-time log twice (duplicated). The data folder is reused when it
already holds the same record count.

Memory: a sampler thread reads RSS every 200 ms of the JVM (the driver's java child),
the Python driver, and the sum over Spark's Python workers; the peaks are reported.
Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.store import records  # noqa: E402
from node.store.log import SegmentedLog  # noqa: E402
from node.store.records import Dispatched, Message  # noqa: E402

SUBJECTS = [f"bench.s{i:02d}" for i in range(16)]
PAYLOAD = bytes(range(256))
T0 = 1_800_000_000_000
SPAN_MS = 24 * 3_600_000
CHUNK = 50_000
SAMPLE_S = 0.2


def generate(root: Path, messages: int) -> dict:
    """Write the three logs; returns counts of what was planted."""
    marker = root / "bench.json"
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("messages") == messages:
            return info
    shutil.rmtree(root, ignore_errors=True)
    (root / "delay-1" / "schedule").mkdir(parents=True)   # marks the folder as a delay node
    (root / "realtime-1" / "index").mkdir(parents=True)   # marks it as a real-time node
    started = time.time()
    lost = dup = 0
    epoch_d, epoch_r = 1 << 40, 2 << 40
    with SegmentedLog.open(root / "delay-1" / "messages") as ml, \
            SegmentedLog.open(root / "delay-1" / "dispatch") as dl, \
            SegmentedLog.open(root / "realtime-1" / "messages") as rl:
        rseq = 0
        for start in range(0, messages, CHUNK):
            mb, db, rb = [], [], []
            for i in range(start, min(messages, start + CHUNK)):
                subject = SUBJECTS[i % 16]
                due = T0 + (i * 7919) % SPAN_MS
                msg_id = f"m{i}"
                mb.append(records.encode(Message(epoch_d | i, due - 60_000, due, msg_id, subject, PAYLOAD)))
                if i % 1000 == 999:
                    lost += 1
                    continue
                sent = due + (i * 31) % 50
                db.append(records.encode_dispatched(Dispatched(epoch_d | i, due, sent)))
                copies = 2 if i % 2000 == 1 else 1
                dup += copies - 1
                for k in range(copies):
                    rb.append(records.encode(Message(epoch_r | rseq, sent + 1 + k * 700_000, due, msg_id, subject,
                                                     PAYLOAD)))
                    rseq += 1
            ml.append(mb)
            dl.append(db)
            rl.append(rb)
    info = {"messages": messages, "lost": lost, "duplicated": dup, "generate_s": round(time.time() - started, 1)}
    marker.write_text(json.dumps(info))
    return info


class MemorySampler:
    """Peak RSS of the JVM, the Python driver and Spark's Python workers (sum)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.peak = {"jvm_rss_mb": 0.0, "driver_rss_mb": 0.0, "workers_rss_mb": 0.0}
        self.cpu_start = self._cpu_now()
        self.cpu: dict[int, float] = {}   # pid -> last seen user+system seconds
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                jvm = workers = 0
                for p in self.me.children(recursive=True):
                    try:
                        name = p.name()
                        rss = p.memory_info().rss
                        t = p.cpu_times()
                        self.cpu[p.pid] = t.user + t.system
                    except psutil.Error:
                        continue
                    if name == "java":
                        jvm += rss
                    elif "python" in name:
                        workers += rss
                drv = self.me.memory_info().rss
            except psutil.Error:
                continue
            for k, v in (("jvm_rss_mb", jvm), ("driver_rss_mb", drv), ("workers_rss_mb", workers)):
                self.peak[k] = max(self.peak[k], v / 2**20)

    def _cpu_now(self) -> dict[int, float]:
        out = {}
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def cpu_s(self) -> float:
        """CPU seconds used by the driver, the JVM and the workers while sampling (load-independent)."""
        t = self.me.cpu_times()
        self.cpu[self.me.pid] = t.user + t.system
        return sum(v - self.cpu_start.get(pid, 0.0) for pid, v in self.cpu.items())

    def __enter__(self) -> "MemorySampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def bench_audit(args, spark) -> dict:
    from cluster.spark.audit import AuditSettings, run

    data = Path(args.data)
    info = generate(data, args.records // 3)
    out = Path(args.out) / "audit"
    with MemorySampler() as mem:
        s = run(spark, AuditSettings(paths=[str(data)], out=str(out), as_of_ms=T0 + SPAN_MS + 3_600_000,
                                     report=True))
    assert s["status"]["lost"] == info["lost"], (s["status"], info)
    assert s["status"]["duplicated"] == info["duplicated"], (s["status"], info)
    disk = sum(f.stat().st_size for f in data.rglob("*.log"))
    return {"bench": "spark_audit", "records": s["records_read"], "seconds": s["seconds"],
            "records_per_s": s["records_per_s"], **{k: round(v) for k, v in mem.peak.items()},
            "cpu_s": round(mem.cpu_s(), 1), "records_per_cpu_s": round(s["records_read"] / max(mem.cpu_s(), 1e-9)),
            "phases_s": s["phases_s"],
            "log_bytes": disk, "lost": s["status"]["lost"], "duplicated": s["status"]["duplicated"],
            "cores": os.cpu_count(), "master": args.master, "driver_memory": args.driver_memory,
            "generate_s": info["generate_s"]}


def bench_bulk(args, spark) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster.devcluster import LocalCluster
    from cluster.spark.bulk import BulkSettings, run

    out = Path(args.out) / "bulk"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n = args.bulk_rows
    due = int(time.time() * 1000) + 3_600_000
    pq.write_table(pa.table({"id": [f"bulk-{i}" for i in range(n)], "subject": [SUBJECTS[i % 16] for i in range(n)],
                             "deliver_at": [due + i for i in range(n)], "payload": [PAYLOAD] * n,
                             "tags": [["bench"]] * n}), out / "rows.parquet")
    results = []
    with LocalCluster(out / "cluster") as c:
        for label, rate, name in (("unlimited", 0.0, "run1"), ("rerun (all duplicates)", 0.0, "run2"),
                                  ("rate limited", args.bulk_rate, "run3")):
            rows = out / "rows.parquet"
            if name == "run3":  # fresh ids, so the limiter paces real scheduling
                m = min(n, int(args.bulk_rate * 10))
                pq.write_table(pa.table({"id": [f"paced-{i}" for i in range(m)],
                                         "subject": [SUBJECTS[i % 16] for i in range(m)],
                                         "deliver_at": [due + i for i in range(m)], "payload": [PAYLOAD] * m,
                                         "tags": [["bench"]] * m}), out / "paced.parquet")
                rows = out / "paced.parquet"
            s = run(spark, BulkSettings(input=str(rows), out=str(out / name), delay_nodes=[c.delay[0].address],
                                        rate_per_s=rate, partitions=args.bulk_partitions))
            results.append({"bench": "spark_bulk_schedule", "mode": label, "rows": s["rows"],
                            "scheduled": s["scheduled"], "duplicate": s["duplicate"], "rejected": s["rejected"],
                            "seconds": s["seconds"], "rows_per_s": s["rows_per_s"], "rate_limit": rate,
                            "tasks": s["tasks"]})
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--data", default="/tmp/hourglass-bench-spark/data")
    ap.add_argument("--out", default="/tmp/hourglass-bench-spark/out")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bulk-rows", type=int, default=20_000)
    ap.add_argument("--bulk-rate", type=float, default=2000)
    ap.add_argument("--bulk-partitions", type=int, default=2)
    args = ap.parse_args()

    from cluster.spark.session import SessionSettings, build_session

    spark = build_session(SessionSettings(master=args.master, driver_memory=args.driver_memory,
                                          app_name="hourglass-bench"))
    try:
        if args.records:
            print(json.dumps(bench_audit(args, spark)), flush=True)
        if args.bulk_rows:
            for r in bench_bulk(args, spark):
                print(json.dumps(r), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
