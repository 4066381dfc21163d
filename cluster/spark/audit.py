"""The audit job: what was scheduled, cancelled, dispatched and received, message by message.

Inputs are node data folders (copies are fine: nothing is written to them), read with
the ``hourglass`` data source:

* **scheduled** - ``message`` records of the delay nodes' message logs (kind ``message``);
  a message is identified by ``(subject, id, seq)`` - the same record found on several
  nodes (a master and its replicas hold byte-identical logs) is one message - and matched
  downstream by ``(subject, id)``;
  its **due time** is ``max(deliver_at_ms, store_ms)`` (a due time in the past means
  "now", docs/api.md);
* **cancelled** - tombstones (kind ``cancel``) in the same logs; ``cancels_seq`` names the
  message, the tombstone's ``store_ms`` is when the cancel was accepted;
* **dispatched** - the delay nodes' dispatch logs, by ``(node, seq)``, counted once per
  distinct ``dispatched_ms`` (replicas again);
* **received** - the real-time nodes' message logs. A message counts as *delivered* when
  the real-time side stored it: that is the durable hand-over (consumers pull from that
  log) and the record keeps the original ``deliver_at_ms`` next to the real-time node's
  ``store_ms``. A dead-lettered message (subject ``hourglass.dlq``, original subject in
  property ``dlq.subject``) counts as received for its original subject. Copies are
  counted by distinct ``(seq, store_ms)`` of the real-time record, so a replica's copy
  is not a duplicate while a second hand-over (new seq) is.

Status of each scheduled message (first rule that applies):

=========================  ==================================================================
``delivered_after_cancel``  a cancel was accepted and the message was received anyway
``cancelled``              a cancel was accepted and nothing was received
``duplicated``             received more than once (``received`` > 1)
``delivered``              received once
``lost``                   not received and ``due_ms + grace_ms < as_of_ms`` (overdue); the
                           reason says whether the dispatch log claims it was sent
``pending``                not received and not yet overdue
=========================  ==================================================================

``lateness_ms = first_received_ms - due_ms`` for ``delivered`` and ``duplicated``; a
delivery is **late** when ``lateness_ms > late_ms``. Percentiles (p50/p90/p99/p99.9,
``percentile_approx``) and problem counts are grouped per subject and UTC hour of the
due time.

Outputs under ``out/`` (Parquet): ``messages`` (one row per scheduled message),
``problems`` (lost, duplicated, delivered after cancel, late), ``lateness`` (per subject
and hour), ``hourly`` (all subjects per hour), ``corrupt`` (torn/corrupt/undecodable
bytes from any log), plus ``summary.json`` and the report (``cluster.spark.report``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, Field

DLQ_SUBJECT = "hourglass.dlq"
EXAMPLES_MAX = 20          # problem rows shown in the report per kind (all are in Parquet)
LATENESS_ACCURACY = 10_000  # percentile_approx accuracy (relative error ~ 1/accuracy)
STATUSES = ("delivered", "duplicated", "lost", "delivered_after_cancel", "cancelled", "pending")


class AuditSettings(BaseModel):
    paths: list[str] = Field(min_length=1)          # node folders or a folder of node folders
    out: str
    as_of_ms: int | None = None                     # "now" for overdue; default: the wall clock at start
    grace_ms: int = Field(default=30_000, ge=0)     # overdue = not received by due + grace
    late_ms: int = Field(default=1_000, ge=0)       # a delivery later than this is listed as late
    report: bool = True


def read_log(spark, paths: list[str], log: str):
    return spark.read.format("hourglass").option("log", log).option("path", json.dumps(paths)).load()


def build(spark, s: AuditSettings, as_of_ms: int) -> dict:
    """The audit's DataFrames (lazy), keyed by output name."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    mem = StorageLevel.MEMORY_AND_DISK
    sched = read_log(spark, s.paths, "message").select(
        "node", "log", "segment", "offset", "error", "kind", "seq", "id", "subject", "store_ms", "deliver_at_ms",
        "cancels_seq").persist(mem)
    disp = read_log(spark, s.paths, "dispatch").select(
        "node", "log", "segment", "offset", "error", "seq", "dispatched_ms", "outcome").persist(mem)
    recv = read_log(spark, s.paths, "realtime").select(
        "node", "log", "segment", "offset", "error", "kind", "seq", "id", "subject", "store_ms",
        F.col("properties").getItem("dlq.subject").alias("dlq_subject")).persist(mem)

    corrupt = (sched.select("node", "log", "segment", "offset", "error")
               .unionByName(disp.select("node", "log", "segment", "offset", "error"))
               .unionByName(recv.select("node", "log", "segment", "offset", "error"))
               .where(F.col("error").isNotNull()))

    # one row per message-log record; replicas of a group hold byte-identical logs, so the
    # same (subject, id, seq) found on several nodes is one message (see module docstring)
    rows = (sched.where("error is null and kind = 'message'")
            .select("node", "seq", "id", "subject", "store_ms", "deliver_at_ms"))
    cancels = (sched.where("error is null and kind = 'cancel'")
               .groupBy("node", F.col("cancels_seq").alias("seq"))
               .agg(F.min("store_ms").alias("cancel_ms")))
    dispatched = disp.where("error is null").select("node", "seq", "dispatched_ms", "outcome")
    msgs = (rows.join(cancels, ["node", "seq"], "left")
            .join(dispatched, ["node", "seq"], "left")
            .groupBy("subject", "id", "seq")
            .agg(F.concat_ws(",", F.array_sort(F.collect_set("node"))).alias("nodes"),
                 F.min("store_ms").alias("accepted_ms"), F.min("deliver_at_ms").alias("deliver_at_ms"),
                 F.min("cancel_ms").alias("cancelled_ms"),
                 F.count_distinct("dispatched_ms").alias("dispatched"),
                 F.min("dispatched_ms").alias("first_dispatched_ms"),
                 F.coalesce(F.max(F.col("outcome") == "dead_letter"), F.lit(False)).alias("dead_lettered"))
            .withColumn("due_ms", F.greatest("deliver_at_ms", "accepted_ms")))
    received = (recv.where("error is null and kind = 'message'")
                .withColumn("rsubject", F.when((F.col("subject") == DLQ_SUBJECT) & F.col("dlq_subject").isNotNull(),
                                               F.col("dlq_subject")).otherwise(F.col("subject")))
                .groupBy(F.col("rsubject"), F.col("id").alias("rid"))
                # a replica's copy has the same (seq, store_ms); a second delivery does not
                .agg(F.count_distinct("seq", "store_ms").alias("received"),
                     F.min("store_ms").alias("first_received_ms"),
                     F.max("store_ms").alias("last_received_ms"),
                     F.concat_ws(",", F.array_sort(F.collect_set("node"))).alias("received_on")))

    j = (msgs.join(received, (msgs.subject == received.rsubject) & (msgs.id == received.rid), "left")
         .drop("rsubject", "rid")
         .fillna({"received": 0}))
    overdue = F.col("due_ms") + F.lit(s.grace_ms) < F.lit(as_of_ms)
    status = (F.when(F.col("cancelled_ms").isNotNull() & (F.col("received") > 0), "delivered_after_cancel")
              .when(F.col("cancelled_ms").isNotNull(), "cancelled")
              .when(F.col("received") > 1, "duplicated")
              .when(F.col("received") == 1, "delivered")
              .when(overdue, "lost")
              .otherwise("pending"))
    delivered = F.col("status").isin("delivered", "duplicated")
    messages = (j.withColumn("status", status)
                .withColumn("lateness_ms", F.when(delivered, F.col("first_received_ms") - F.col("due_ms")))
                .withColumn("late", F.coalesce(F.col("lateness_ms") > F.lit(s.late_ms), F.lit(False)))
                .withColumn("reason", F.when(F.col("status") == "lost",
                                             F.when(F.col("dispatched") > 0, "dispatched but never received")
                                             .otherwise("never dispatched"))
                            .when(F.col("status") == "delivered_after_cancel",
                                  F.when(F.col("first_received_ms") >= F.col("cancelled_ms"),
                                         "received after the cancel was accepted")
                                  .otherwise("cancel accepted after delivery"))
                            .when(F.col("status") == "duplicated",
                                  F.concat(F.col("received").cast("string"), F.lit(" copies received"))))
                .withColumn("hour", F.date_trunc("hour", F.timestamp_millis("due_ms")))
                .persist(mem))

    problems = (messages.where("status in ('lost', 'duplicated', 'delivered_after_cancel') or late")
                .withColumn("problem", F.when(F.col("status") == "delivered", F.lit("late"))
                            .otherwise(F.col("status"))))

    def aggs():
        lat = F.col("lateness_ms")
        return [F.count_if(delivered).alias("delivered"),
                F.count_if(F.col("status") == "lost").alias("lost"),
                F.count_if(F.col("status") == "duplicated").alias("duplicated"),
                F.count_if(F.col("status") == "delivered_after_cancel").alias("delivered_after_cancel"),
                F.count_if(F.col("late")).alias("late"),
                F.count_if(F.col("status") == "pending").alias("pending"),
                F.count_if(F.col("status") == "cancelled").alias("cancelled"),
                F.percentile_approx(lat, [0.5, 0.9, 0.99, 0.999], LATENESS_ACCURACY).alias("pct"),
                F.max(lat).alias("max_ms")]

    def flat(df):
        return df.select(*[c for c in df.columns if c != "pct"],
                         *[F.col("pct")[i].alias(n) for i, n in enumerate(["p50_ms", "p90_ms", "p99_ms", "p999_ms"])])

    lateness = flat(messages.groupBy("subject", "hour").agg(*aggs())).orderBy("subject", "hour")
    hourly = flat(messages.groupBy("hour").agg(*aggs())).orderBy("hour")
    unmatched = (received.join(msgs, (received.rsubject == msgs.subject) & (received.rid == msgs.id), "left_anti"))
    return {"messages": messages, "problems": problems, "lateness": lateness, "hourly": hourly,
            "corrupt": corrupt, "_unmatched": unmatched, "_sched": sched, "_disp": disp, "_recv": recv}


def run(spark, s: AuditSettings) -> dict:
    """Run the audit, write Parquet + summary (+ report); return the summary."""
    from pyspark.sql import functions as F

    started = time.time()
    as_of_ms = s.as_of_ms if s.as_of_ms is not None else int(started * 1000)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    dfs = build(spark, s, as_of_ms)
    phases: dict[str, float] = {}
    mark = time.time()
    for name in ("messages", "problems", "lateness", "hourly", "corrupt"):
        dfs[name].write.mode("overwrite").parquet(str(out / name))
        phases[f"write_{name}"] = round(time.time() - mark, 3)
        mark = time.time()

    logs = {r["log"]: {"records": r["records"], "errors": r["errors"]} for r in (
        dfs["_sched"].select("log", "error").unionByName(dfs["_disp"].select("log", "error"))
        .unionByName(dfs["_recv"].select("log", "error"))
        .groupBy("log").agg(F.count(F.lit(1)).alias("records"),
                            F.count_if(F.col("error").isNotNull()).alias("errors")).collect())}
    by_status, late = {}, 0
    for r in dfs["messages"].groupBy("status").agg(F.count(F.lit(1)).alias("n"),
                                                   F.count_if("late").alias("late")).collect():
        by_status[r["status"]] = r["n"]
        late += r["late"]
    lateness_rows = [r.asDict() for r in spark.read.parquet(str(out / "lateness")).collect()]
    hourly_rows = [r.asDict() for r in spark.read.parquet(str(out / "hourly")).orderBy("hour").collect()]
    from pyspark.sql.window import Window

    first = Window.partitionBy("problem").orderBy("due_ms", "id")
    examples: dict[str, list[dict]] = {}
    for r in (spark.read.parquet(str(out / "problems")).withColumn("n", F.row_number().over(first))
              .where(F.col("n") <= EXAMPLES_MAX).orderBy("problem", "n")
              .select("problem", "nodes", "seq", "id", "subject", "due_ms", "status", "received", "dispatched",
                      "lateness_ms", "reason").collect()):
        examples.setdefault(r["problem"], []).append(r.asDict())
    corrupt_rows = [r.asDict() for r in spark.read.parquet(str(out / "corrupt")).limit(EXAMPLES_MAX).collect()]
    phases["summaries"] = round(time.time() - mark, 3)
    records_read = sum(v["records"] for v in logs.values())
    summary = {
        "as_of_ms": as_of_ms, "grace_ms": s.grace_ms, "late_ms": s.late_ms, "paths": s.paths,
        "records_read": records_read, "logs": logs,
        "scheduled": sum(by_status.values()),
        "status": {k: by_status.get(k, 0) for k in STATUSES},
        "late": late,
        "received_not_scheduled": dfs["_unmatched"].count(),
        "corrupt_records": sum(v["errors"] for v in logs.values()),
        "seconds": round(time.time() - started, 3),
        "phases_s": phases,
    }
    summary["records_per_s"] = round(records_read / max(summary["seconds"], 1e-9))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    for key in ("messages", "_sched", "_disp", "_recv"):
        dfs[key].unpersist()
    if s.report:
        from .report import write_report

        write_report(out, summary, lateness_rows, hourly_rows, examples, corrupt_rows)
    return summary
