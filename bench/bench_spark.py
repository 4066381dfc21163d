"""Spark pipeline benchmark: the data source's scan rate (records per CPU-second of the Python
side), audit throughput over N log records with JVM and Python memory peaks, and the
bulk-schedule rate against a real local cluster.

    python bench/bench_spark.py --records 3000000 --phases scan        # the scan target (docs/spark.md)
    python bench/bench_spark.py --records 10000000                      # scan + audit (data cached under --data)
    python bench/bench_spark.py --records 0 --bulk-rows 20000 --phases bulk

Data: ``records / 3`` messages, each present three times - in a delay node's message
log, its dispatch log and a real-time node's message log - written in the batch format
(``SegmentedLog.append`` of ``cluster.codec.Batch`` / ``DispatchBatch`` bodies, one frame
per batch), shaped like a broker under load:

* message log: one frame per producer batch of ``--batch`` messages (the SDK's
  ``batch_max``), in arrival order;
* dispatch log and real-time message log: one frame per fired wheel tick (10 ms): the
  messages due in that tick, as the delay node forwards them with one SendBatch and
  records them with one dispatch record. Due times arrive at ``--due-rate`` messages a
  second, so a tick holds ``due_rate / 100`` messages (200 at the default 20,000/s);
  ``--due-rate 1000`` gives 10 per frame, the shape of a lightly loaded broker.

16 subjects, 256-byte payloads, every 7th message with a tag; lateness 10..50 ms (the
real-time ``store_ms`` of its tick); one message in 1,000 is never dispatched (lost), one
in 2,000 reaches the real-time log twice (a second frame 700 s later: duplicated). The
data folder is reused when it holds the same shape.

Phases (``--phases``, default ``scan,audit,bulk``):

* ``scan``: per log, (a) ``HourglassReader.read`` over every partition in this process,
  CPU from ``time.process_time`` (the Python side alone, no Spark); (b) the same scan
  through Spark (``write.format("noop")``, after one warm-up scan that starts the Python
  workers), CPU of the Python workers and of the JVM sampled with psutil. Records per
  CPU-second of both;
* ``audit``: the audit job (``overwrite=True`` into ``--out``/audit); checks it finds exactly
  the planted lost and duplicated. Reports wall seconds and records per CPU-second of the
  whole job (driver, JVM and Python workers: ``cpu_s``, load-independent) with the load
  average at start and end. Targets (issue 32): 10M records in <= 60 s wall on the 2-core
  machine, >= 300,000 records per CPU-second (``--records 10000000 --phases audit``;
  docs/benchmarks.md);
* ``bulk``: bulk-schedule against a ``LocalCluster``.

``--conf KEY=VALUE`` (repeatable) sets a Spark setting for the session, to compare settings
one at a time (e.g. ``--conf spark.driver.extraJavaOptions=-XX:+UseParallelGC``).

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

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.codec import Batch, DispatchBatch, encode_extra  # noqa: E402
from node.store.log import SegmentedLog  # noqa: E402

SUBJECTS = [f"bench.s{i:02d}" for i in range(16)]
PAYLOAD = bytes(range(256))
TAGGED = encode_extra(("bench",))
T0 = 1_800_000_000_000
TICK_MS = 10
DUPLICATE_AFTER_MS = 700_000
SAMPLE_S = 0.2
LOGS = ("message", "dispatch", "realtime")


def _batch(i: np.ndarray, due: np.ndarray, *, epoch: int, store_ms, seq_of=None) -> Batch:
    """The messages ``i`` (bench numbering) as one codec batch."""
    ids = [f"m{k}" for k in i.tolist()]
    extras = [TAGGED if k % 7 == 0 else b"" for k in i.tolist()]
    seqs = (epoch | i if seq_of is None else seq_of).astype(np.uint64)
    return Batch.build([SUBJECTS[k % 16] for k in i.tolist()], [PAYLOAD] * len(i), ids, due, seq=seqs,
                       store_ms=store_ms, effective_ms=due, extras=extras)


def generate(root: Path, messages: int, batch: int, due_rate: int) -> dict:
    """Write the three logs; returns counts of what was planted and the frame shapes."""
    marker = root / "bench.json"
    shape = {"messages": messages, "batch": batch, "due_rate": due_rate, "format": 2}
    if marker.exists():
        info = json.loads(marker.read_text())
        if {k: info.get(k) for k in shape} == shape:
            return info
    shutil.rmtree(root, ignore_errors=True)
    (root / "delay-1" / "schedule").mkdir(parents=True)   # marks the folder as a delay node
    (root / "realtime-1" / "index").mkdir(parents=True)   # marks it as a real-time node
    started = time.time()
    epoch_d, epoch_r = 1 << 40, 2 << 40
    span_ms = max(1, messages * 1000 // due_rate)
    i_all = np.arange(messages, dtype=np.int64)
    due_all = T0 + (i_all * 7919) % span_ms
    lost = i_all % 1000 == 999
    dup = (i_all % 2000 == 1) & ~lost
    frames = {log: 0 for log in LOGS}
    with SegmentedLog.open(root / "delay-1" / "messages") as ml, \
            SegmentedLog.open(root / "delay-1" / "dispatch") as dl, \
            SegmentedLog.open(root / "realtime-1" / "messages") as rl:
        for start in range(0, messages, batch):
            i = i_all[start:start + batch]
            ml.append([_batch(i, due_all[i], epoch=epoch_d, store_ms=due_all[i] - 60_000).encode()])
            frames["message"] += 1
        fired = i_all[~lost][np.argsort(due_all[~lost], kind="stable")]
        ticks = due_all[fired] // TICK_MS
        cuts = np.flatnonzero(np.diff(ticks)) + 1
        rseq = 0
        for group in np.split(fired, cuts):
            tick = int(due_all[group[0]] // TICK_MS)
            stored_ms = (tick + 1) * TICK_MS + (tick * 31) % 40   # lateness 10..50 ms
            due = due_all[group]
            rl.append([_batch(group, due, epoch=epoch_r, store_ms=stored_ms,
                              seq_of=epoch_r | np.arange(rseq, rseq + len(group))).encode()])
            rseq += len(group)
            dl.append([DispatchBatch(epoch_d | group.astype(np.uint64), due, due, stored_ms + 1).encode()])
            frames["realtime"] += 1
            frames["dispatch"] += 1
        again = i_all[dup]
        for start in range(0, len(again), batch):
            group = again[start:start + batch]
            stored = due_all[group] + DUPLICATE_AFTER_MS
            rl.append([_batch(group, due_all[group], epoch=epoch_r, store_ms=stored,
                              seq_of=epoch_r | np.arange(rseq, rseq + len(group))).encode()])
            rseq += len(group)
            frames["realtime"] += 1
    records = {"message": messages, "dispatch": int((~lost).sum()), "realtime": int((~lost).sum() + dup.sum())}
    info = {**shape, "lost": int(lost.sum()), "duplicated": int(dup.sum()), "records": records,
            "frames": frames, "messages_per_frame": {k: round(records[k] / max(frames[k], 1), 1) for k in LOGS},
            "span_ms": span_ms, "generate_s": round(time.time() - started, 1)}
    marker.write_text(json.dumps(info))
    return info


class MemorySampler:
    """Peak RSS of the JVM, the Python driver and Spark's Python workers (sum), and CPU
    seconds of each process seen while sampling (Spark reuses its Python workers, so a
    worker lives through the phase and its last sample is its total)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.peak = {"jvm_rss_mb": 0.0, "driver_rss_mb": 0.0, "workers_rss_mb": 0.0}
        self.cpu_start = self._cpu_now()
        self.cpu: dict[int, float] = {}   # pid -> last seen user+system seconds
        self.kind: dict[int, str] = {}    # pid -> "jvm" | "worker"
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
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
                    self.kind[p.pid] = "jvm"
                elif "python" in name:
                    workers += rss
                    self.kind[p.pid] = "worker"
            drv = self.me.memory_info().rss
        except psutil.Error:
            return
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

    def cpu_s(self, kind: str | None = None) -> float:
        """CPU seconds used while sampling by the driver, the JVM and the workers (load-independent),
        or by one ``kind`` of process ("jvm", "worker")."""
        t = self.me.cpu_times()
        self.cpu[self.me.pid] = t.user + t.system
        return sum(v - self.cpu_start.get(pid, 0.0) for pid, v in self.cpu.items()
                   if kind is None or self.kind.get(pid) == kind)

    def __enter__(self) -> "MemorySampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.sample()


def bench_scan(args, spark, info: dict) -> list[dict]:
    """Records per CPU-second of the data source, per log: in this process, and through Spark."""
    from cluster.spark.source import HourglassReader

    data = str(Path(args.data))
    # start Spark's Python workers (process start, imports) before measuring them
    spark.read.format("hourglass").option("log", "dispatch").load(data).write.format("noop").mode("overwrite").save()
    out = []
    for log in LOGS:
        reader = HourglassReader([data], log, with_payload=False, record_bytes_max=8 * 1024 * 1024)
        cpu0 = time.process_time()
        rows = errors = 0
        for part in reader.partitions():
            for rb in reader.read(part):
                rows += rb.num_rows
                errors += rb.num_rows - rb.column("error").null_count
        local_cpu_s = time.process_time() - cpu0
        assert rows == info["records"][log] and not errors, (log, rows, errors, info["records"])
        df = spark.read.format("hourglass").option("log", log).load(data)
        started = time.time()
        with MemorySampler() as mem:
            df.write.format("noop").mode("overwrite").save()
        workers_s, jvm_s = mem.cpu_s("worker"), mem.cpu_s("jvm")
        out.append({"bench": "spark_scan", "log": log, "records": rows,
                    "messages_per_frame": info["messages_per_frame"][log],
                    "python_cpu_s": round(local_cpu_s, 2),
                    "records_per_cpu_s": round(rows / max(local_cpu_s, 1e-9)),
                    "spark_wall_s": round(time.time() - started, 2), "spark_workers_cpu_s": round(workers_s, 2),
                    "spark_records_per_worker_cpu_s": round(rows / max(workers_s, 1e-9)),
                    "spark_jvm_cpu_s": round(jvm_s, 2), "cores": os.cpu_count()})
    total_rows = sum(r["records"] for r in out)
    out.append({"bench": "spark_scan", "log": "all", "records": total_rows,
                "records_per_cpu_s": round(total_rows / sum(r["python_cpu_s"] for r in out)),
                "spark_records_per_worker_cpu_s": round(total_rows / sum(r["spark_workers_cpu_s"] for r in out))})
    return out


def bench_audit(args, spark, info: dict) -> dict:
    from cluster.spark.audit import AuditSettings, run

    data = Path(args.data)
    out = Path(args.out) / "audit"
    load_start = os.getloadavg()[0]
    with MemorySampler() as mem:
        s = run(spark, AuditSettings(paths=[str(data)], out=str(out), as_of_ms=T0 + info["span_ms"] + 3_600_000,
                                     report=True, overwrite=True))
    assert s["status"]["lost"] == info["lost"], (s["status"], info)
    assert s["status"]["duplicated"] == info["duplicated"], (s["status"], info)
    disk = sum(f.stat().st_size for f in data.rglob("*.log"))
    return {"bench": "spark_audit", "records": s["records_read"], "seconds": s["seconds"],
            "records_per_s": s["records_per_s"], **{k: round(v) for k, v in mem.peak.items()},
            "cpu_s": round(mem.cpu_s(), 1), "records_per_cpu_s": round(s["records_read"] / max(mem.cpu_s(), 1e-9)),
            "cpu_s_jvm": round(mem.cpu_s("jvm"), 1), "cpu_s_workers": round(mem.cpu_s("worker"), 1),
            "phases_s": s["phases_s"],
            "log_bytes": disk, "lost": s["status"]["lost"], "duplicated": s["status"]["duplicated"],
            "cores": os.cpu_count(), "master": args.master, "driver_memory": args.driver_memory,
            "conf": args.conf, "loadavg_start": round(load_start, 1), "loadavg_end": round(os.getloadavg()[0], 1),
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
    ap.add_argument("--phases", default="scan,audit,bulk", help="comma separated: scan, audit, bulk")
    ap.add_argument("--batch", type=int, default=1000, help="messages per message-log frame (producer batch)")
    ap.add_argument("--due-rate", type=int, default=20_000, help="due messages per second (sets the tick frames)")
    ap.add_argument("--data", default="/tmp/hourglass-bench-spark/data")
    ap.add_argument("--out", default="/tmp/hourglass-bench-spark/out")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument("--bulk-rows", type=int, default=20_000)
    ap.add_argument("--bulk-rate", type=float, default=2000)
    ap.add_argument("--bulk-partitions", type=int, default=2)
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting for the session (repeatable), e.g. to compare settings")
    args = ap.parse_args()
    phases = set(args.phases.split(","))

    from cluster.spark.session import SessionSettings, build_session

    info = generate(Path(args.data), args.records // 3, args.batch, args.due_rate) if args.records else None
    if info is not None:
        print(json.dumps({"bench": "spark_data", **info}), flush=True)
    spark = build_session(SessionSettings(master=args.master, driver_memory=args.driver_memory,
                                          app_name="hourglass-bench",
                                          conf=dict(c.split("=", 1) for c in args.conf)))
    try:
        if info is not None and "scan" in phases:
            for r in bench_scan(args, spark, info):
                print(json.dumps(r), flush=True)
        if info is not None and "audit" in phases:
            print(json.dumps(bench_audit(args, spark, info)), flush=True)
        if args.bulk_rows and "bulk" in phases:
            for r in bench_bulk(args, spark):
                print(json.dumps(r), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
