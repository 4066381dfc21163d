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

Lateness is measured from the moment a message became **visible** to consumers, not from
the real-time node's ``store_ms``: a delay node fires each round up to ``dispatch_lead_ms``
ahead and the real-time node stores those messages at once but holds them until they are due
(at most ``visible_hold_ms_max`` after storing them, ``node.realtime.index.visible_ms``). So
``visible_ms = max(first_received_ms, due_ms)`` - or ``first_received_ms + hold_ms`` when the
message was stored more than ``hold_ms`` ahead of its due time: then it was handed out
**early**, by ``early_ms = due_ms - visible_ms``. ``lateness_ms = visible_ms - due_ms`` for
``delivered`` and ``duplicated``, never negative (0 for an early one, which is counted in
``early`` instead); a delivery is **late** when ``lateness_ms > late_ms``.

Worked example (``hold_ms`` 100): due 10:00:00.000, stored by the real-time node at
09:59:59.985 (fired 15 ms ahead) -> visible 10:00:00.000, lateness 0; stored at
10:00:00.040 -> lateness 40 ms; stored at 09:59:59.500 -> visible 09:59:59.600, early by
400 ms, lateness 0.

Percentiles (p50/p90/p99/p99.9, nearest rank; exact below 1 s, at most 1% low above,
``cluster.spark.stats``) and problem counts are grouped per subject and UTC hour of the due
time, per hour, and overall - all from one small histogram of the ``messages`` Parquet.

Outputs under ``out/`` (Parquet): ``messages`` (one row per scheduled message),
``problems`` (lost, duplicated, delivered after cancel, late, early), ``lateness`` (per subject
and hour), ``hourly`` (all subjects per hour), ``corrupt`` (torn/corrupt/undecodable
bytes from any log), plus ``summary.json`` and the report (``cluster.spark.report``).

How it stays fast (docs/benchmarks.md, "Spark audit at 10M records"):

* each log is read with only the columns the audit needs (``.schema(...)`` of a few
  columns: the reader builds no others), and nothing is cached - a narrow scan is
  cheaper than Spark's in-memory columnar cache of it;
* keys are longs: a node is a bit of a long (``bit_or``; its index among the node folders
  found, ``NODES_MAX`` of each role), the delay side's events are grouped and joined by
  ``(node bit, seq)``, and messages meet their copies by ``key = xxhash64(subject, id)``
  (``_key``). The id and subject strings travel only with the delay side, which
  ``messages/`` needs; the received side is all longs. So every aggregation is a hash
  aggregate on fixed-width values, and "counted once per distinct value" is a group-by on
  the value first instead of ``count(distinct)``;
* both sides of the final join are hash-partitioned by the key by the aggregations before
  it, and it is a shuffled hash join (hinted; it was a sort-merge join sorting both sides by
  two strings);
* one pass writes ``messages``; the counts of the summary (records and errors per log,
  messages per status, received but never scheduled) are ``observe`` d during that pass
  (a log whose observation Spark left out of the plan is counted by its ``error`` column:
  ``_log_counts``); the figures come from one histogram of that Parquet
  (``cluster.spark.stats``, no ``percentile_approx`` rollup); the logs are read again for
  ``corrupt`` only when that pass saw a damaged record;
* no Python UDF anywhere in the plan: the Python side is the data source's reader only.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from cluster.errors import InvalidArgument
from node.store.settings import REALTIME_DEFAULTS

from . import layout, outdir, stats

DLQ_SUBJECT = "hourglass.dlq"
EXAMPLES_MAX = 20          # problem rows shown in the report per kind (all are in Parquet)
CORRUPT_FILES_SHOWN_MAX = 20  # segment files named in the summary (the worst first; all rows are in corrupt/)
NODES_MAX = 62             # node folders of one role: a node is a bit of a long
STATUSES = ("delivered", "duplicated", "lost", "delivered_after_cancel", "cancelled", "pending")
LOGS = ("message", "dispatch", "realtime")

# the columns read from each log (the reader builds only these)
SCHED_COLUMNS = ("node", "error", "kind", "seq", "id", "subject", "store_ms", "deliver_at_ms", "cancels_seq")
DISP_COLUMNS = ("node", "error", "seq", "dispatched_ms", "outcome")
RECV_COLUMNS = ("node", "error", "kind", "seq", "id", "subject", "store_ms", "properties")
CORRUPT_COLUMNS = ("node", "log", "segment", "offset", "frame_bytes", "error")


class AuditSettings(BaseModel):
    paths: list[str] = Field(min_length=1)          # node folders or a folder of node folders
    out: str
    as_of_ms: int | None = None                     # "now" for overdue; default: the wall clock at start
    grace_ms: int = Field(default=30_000, ge=0)     # overdue = not received by due + grace
    late_ms: int = Field(default=1_000, ge=0)       # a delivery later than this is listed as late
    # a message stored more than this ahead of its due time was handed out this long after it was
    # stored, i.e. early (the real-time nodes' visible_hold_ms_max)
    hold_ms: int = Field(default=REALTIME_DEFAULTS.visible_hold_ms_max, ge=0)
    report: bool = True
    overwrite: bool = False                         # replace an earlier output in ``out`` (``outdir``)


def read_log(spark, paths: list[str], log: str, columns: tuple[str, ...] | None = None):
    """One log of every node under ``paths`` (only ``columns``, if given); a log no node has
    is an empty DataFrame."""
    from pyspark.sql.types import StructType

    from .source import DISPATCH_SCHEMA, MESSAGE_SCHEMA

    r = spark.read.format("hourglass").option("log", log).option("path", json.dumps(paths))
    if columns is not None:
        full = DISPATCH_SCHEMA if log == "dispatch" else MESSAGE_SCHEMA
        r = r.schema(StructType([full[c] for c in columns]))
    return r.load()


def node_bits(nodes: list[str]) -> dict[str, int]:
    """Node name -> bit (``1 << index`` in name order); refuses more than ``NODES_MAX``."""
    if len(nodes) > NODES_MAX:
        raise InvalidArgument("path", f"{len(nodes)} node folders of one role; the audit handles {NODES_MAX}")
    return {n: 1 << i for i, n in enumerate(sorted(nodes))}


def _bit_of(col: str, bits: dict[str, int]):
    from pyspark.sql import functions as F

    expr = F.lit(0).cast("long")
    for name, bit in bits.items():
        expr = F.when(F.col(col) == F.lit(name), F.lit(bit)).otherwise(expr)
    return expr


def _names_of(col: str, bits: dict[str, int]):
    """``"a,b"`` from a bit set (names in order); concat_ws skips the nulls of unset bits."""
    from pyspark.sql import functions as F

    return F.concat_ws(",", *[F.when(F.col(col).bitwiseAND(F.lit(bit)) != 0, F.lit(name))
                               for name, bit in bits.items()])


def _key(subject, msg_id):
    """A message's join key: ``xxhash64(subject, id)``, a long computed in the JVM (no Python
    UDF). Aggregations and joins keyed by it hash and compare 8 bytes instead of two strings;
    the strings travel only with the delay side, for ``messages/``. Two different (subject, id)
    pairs share a key with probability ~ n^2 / 2^65 (3e-7 for 3.3M messages); they would be
    counted as one message's copies."""
    from pyspark.sql import functions as F

    return F.xxhash64(subject, msg_id)


def _visible(hold_ms: int):
    """When the first copy became visible to consumers (module docstring): its due time, or
    when it was stored if that was later; stored more than ``hold_ms`` ahead, ``hold_ms`` after
    it was stored (early)."""
    from pyspark.sql import functions as F

    stored, due = F.col("first_received_ms"), F.col("due_ms")
    return (F.when(stored + F.lit(hold_ms) < due, stored + F.lit(hold_ms))
            .otherwise(F.greatest(stored, due)))


def build(spark, s: AuditSettings, as_of_ms: int) -> dict:
    """The audit's lazy DataFrames and the ``Observation`` s filled by writing ``messages``."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    found = layout.find_nodes(s.paths)
    dbits = node_bits([n.name for n in found if n.role == layout.ROLE_DELAY])
    rbits = node_bits([n.name for n in found if n.role == layout.ROLE_REALTIME])
    obs = {log: Observation(f"hourglass_{log}") for log in LOGS}
    obs["messages"] = Observation("hourglass_messages")

    def counted(df, log):
        return df.observe(obs[log], F.count(F.lit(1)).alias("records"),
                          F.count_if(F.col("error").isNotNull()).alias("errors"))

    sched = counted(read_log(spark, s.paths, "message", SCHED_COLUMNS), "message")
    disp = counted(read_log(spark, s.paths, "dispatch", DISP_COLUMNS), "dispatch")
    recv = counted(read_log(spark, s.paths, "realtime", RECV_COLUMNS), "realtime")

    # per (node, seq): the cancel and the dispatches of a message (a second, unobserved scan
    # of the message log for the tombstones: cheaper than caching the first)
    # (the reader takes `kind = 'cancel'` itself: only tombstones reach Spark)
    tombstones = (read_log(spark, s.paths, "message", SCHED_COLUMNS).where("kind = 'cancel' and error is null")
                  .select("node", F.col("cancels_seq").alias("seq"), F.col("store_ms").alias("cancel_ms"),
                          F.lit(None).cast("long").alias("dispatched_ms"), F.lit(False).alias("dead")))
    dispatches = (disp.where("error is null")
                  .select("node", "seq", F.lit(None).cast("long").alias("cancel_ms"), "dispatched_ms",
                          (F.col("outcome") == "dead_letter").alias("dead")))
    # within one node's dispatch log each dispatch of a message is one row, so count() is
    # the distinct dispatches; replicas hold the same rows, hence max() over nodes below.
    # Keyed by (node bit, seq): two longs, not the node's name
    events = (tombstones.unionByName(dispatches).select(_bit_of("node", dbits).alias("node_bit"), "*")
              .drop("node").groupBy("node_bit", "seq")
              .agg(F.min("cancel_ms").alias("cancel_ms"), F.count("dispatched_ms").alias("dispatched"),
                   F.min("dispatched_ms").alias("first_dispatched_ms"), F.max("dead").alias("dead")))
    # one row per message-log record; replicas of a group hold byte-identical logs, so the
    # same (subject, id, seq) found on several nodes is one message (see module docstring)
    rows = (sched.where("error is null and kind = 'message'")
            .select(_bit_of("node", dbits).alias("node_bit"), "seq", "id", "subject", "store_ms", "deliver_at_ms",
                    _key("subject", "id").alias("key")))
    # partitioned by the key once: the group-by below and the join with `received` need no
    # other exchange (a hash partitioning on key clusters (key, seq, subject, id) too)
    msgs = (rows.join(events, ["node_bit", "seq"], "left")
            .repartition("key")
            .groupBy("key", "seq", "subject", "id")
            .agg(F.bit_or("node_bit").alias("node_bits"),
                 F.min("store_ms").alias("accepted_ms"), F.min("deliver_at_ms").alias("deliver_at_ms"),
                 F.min("cancel_ms").alias("cancelled_ms"),
                 F.coalesce(F.max("dispatched"), F.lit(0)).alias("dispatched"),
                 F.min("first_dispatched_ms").alias("first_dispatched_ms"),
                 F.coalesce(F.max("dead"), F.lit(False)).alias("dead_lettered"))
            .withColumn("due_ms", F.greatest("deliver_at_ms", "accepted_ms")))
    # copies received: distinct (seq, store_ms) - a replica's copy has the same, a second hand-over
    # not. The strings end here: the received side is all longs, keyed by the same hash
    dlq = F.col("properties").getItem("dlq.subject")
    copies = (recv.where("error is null and kind = 'message'")
              .select(_key(F.when((F.col("subject") == DLQ_SUBJECT) & dlq.isNotNull(), dlq)
                           .otherwise(F.col("subject")), F.col("id")).alias("rkey"),
                      "seq", "store_ms", _bit_of("node", rbits).alias("node_bit"))
              .repartition("rkey")
              .groupBy("rkey", "seq", "store_ms").agg(F.bit_or("node_bit").alias("node_bits")))
    received = (copies.groupBy("rkey")
                .agg(F.count(F.lit(1)).alias("received"), F.min("store_ms").alias("first_received_ms"),
                     F.max("store_ms").alias("last_received_ms"), F.bit_or("node_bits").alias("received_bits")))

    # both sides are hash-partitioned by the key already: a hash join, no sort of either side
    j = msgs.join(received.hint("shuffle_hash"), msgs.key == received.rkey, "full_outer")
    # received but never scheduled (immediate sends) are counted while the messages are written
    j = j.observe(obs["messages"], F.count_if(F.col("seq").isNull()).alias("received_not_scheduled"))
    j = j.where(F.col("seq").isNotNull()).drop("rkey", "key").fillna({"received": 0})
    overdue = F.col("due_ms") + F.lit(s.grace_ms) < F.lit(as_of_ms)
    status = (F.when(F.col("cancelled_ms").isNotNull() & (F.col("received") > 0), "delivered_after_cancel")
              .when(F.col("cancelled_ms").isNotNull(), "cancelled")
              .when(F.col("received") > 1, "duplicated")
              .when(F.col("received") == 1, "delivered")
              .when(overdue, "lost")
              .otherwise("pending"))
    delivered = F.col("status").isin("delivered", "duplicated")
    # three projections, not a withColumn per column: each DataFrame step analyses the whole plan
    # again in the driver (a dozen analyses of this plan cost seconds of a cold JVM's CPU)
    c = F.col
    step1 = j.select("*", status.alias("status"))
    step2 = step1.select("*", F.when(delivered, _visible(s.hold_ms)).alias("visible_ms"))
    lateness = F.greatest(c("visible_ms") - c("due_ms"), F.lit(0))
    early_ms = F.when(c("visible_ms") < c("due_ms"), c("due_ms") - c("visible_ms"))
    reason = (F.when(c("status") == "lost", F.when(c("dispatched") > 0, "dispatched but never received")
                     .otherwise("never dispatched"))
              .when(c("status") == "delivered_after_cancel",
                    F.when(c("first_received_ms") >= c("cancelled_ms"), "received after the cancel was accepted")
                    .otherwise("cancel accepted after delivery"))
              .when(c("status") == "duplicated", F.concat(c("received").cast("string"), F.lit(" copies received"))))
    messages = step2.select(
        "subject", "id", "seq", _names_of("node_bits", dbits).alias("nodes"), "accepted_ms", "deliver_at_ms",
        "due_ms", "cancelled_ms", "dispatched", "first_dispatched_ms", "dead_lettered", "received",
        "first_received_ms", "last_received_ms", _names_of("received_bits", rbits).alias("received_on"), "status",
        "visible_ms", lateness.alias("lateness_ms"),
        F.coalesce(lateness > F.lit(s.late_ms), F.lit(False)).alias("late"), early_ms.alias("early_ms"),
        early_ms.isNotNull().alias("early"), reason.alias("reason"),
        F.date_trunc("hour", F.timestamp_millis("due_ms")).alias("hour"))
    return {"messages": messages, "observations": obs}


# the joins meet two sides of about the same size, keyed by strings: hashing a partition of
# one side is cheaper than sorting both (AQE turns the sort-merge joins into hash joins
# when a partition is under the threshold)
JOB_CONF = {"spark.sql.adaptive.maxShuffledHashJoinLocalMapThreshold": "256m"}


@contextmanager
def _conf(spark, conf: dict[str, str]):
    """Set session settings for the job, then put back what was there."""
    before = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


OBSERVED_WAIT_S = 60.0  # the metrics are there once the write returned; this only bounds a Spark bug


def _observed(o) -> dict:
    """``Observation.get`` waits without a limit for metrics of a plan node that might have been
    optimised away, and fails when Spark skipped it (AQE drops the branch of a log with no
    segment, or the branches that meet an empty side); wait at most ``OBSERVED_WAIT_S``. ``{}``
    means "not observed" (``_log_counts`` then counts the log itself), never "nothing read"."""
    import threading

    got: list[dict] = []

    def get() -> None:
        try:
            got.append(o.get)
        except Exception:  # no metrics row: Spark skipped the observed part
            got.append({})

    t = threading.Thread(target=get, daemon=True, name="observation")
    t.start()
    t.join(OBSERVED_WAIT_S)
    return got[0] if got else {}


def _log_counts(spark, paths: list[str], log: str, observed: dict) -> dict:
    """Records and errors of one log: what the pass observed, or - when Spark left the observed
    part out of the plan it ran (AQE drops the branches that meet an empty side, e.g. a log
    whose every record is corrupt) - counted by a scan of its ``error`` column alone. A log
    of random bytes must not read as "nothing there"."""
    if "records" in observed:
        return {"records": observed["records"], "errors": observed["errors"]}
    from pyspark.sql import functions as F

    row = (read_log(spark, paths, log, ("error",))
           .agg(F.count(F.lit(1)).alias("records"), F.count_if(F.col("error").isNotNull()).alias("errors"))
           .collect()[0])
    return {"records": row["records"], "errors": row["errors"]}


def _empty_parquet(path: Path, schema) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    path.mkdir()
    pq.write_table(pa.Table.from_batches([], to_arrow_schema(schema)), path / "part-00000.parquet")


# lateness/ and hourly/ (written by the driver from ``stats.figures``: a few rows per subject-hour)
LATENESS_TYPES = {"subject": "string", "hour": "timestamp", "delivered": "int64", "duplicated": "int64",
                  "lost": "int64", "delivered_after_cancel": "int64", "cancelled": "int64", "pending": "int64",
                  "late": "int64", "early": "int64", "p50_ms": "int64", "p90_ms": "int64", "p99_ms": "int64",
                  "p999_ms": "int64", "max_ms": "int64"}


def _write_rows(path: Path, rows: list[dict], types: dict[str, str]) -> None:
    """Small driver-side rows as one Parquet file in a folder (what Spark reads as a dataset)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(k, pa.timestamp("us", tz="UTC") if t == "timestamp" else pa.type_for_alias(t))
                        for k, t in types.items()])
    path.mkdir()
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in types} for r in rows], schema),
                   path / "part-00000.parquet")


def run(spark, s: AuditSettings) -> dict:
    """Run the audit, write Parquet + summary (+ report) into ``s.out``; return the summary.
    ``s.out`` must not exist unless ``s.overwrite``; a failed run leaves nothing there."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType
    from pyspark.sql.window import Window

    from .source import MESSAGE_SCHEMA

    started = time.time()
    as_of_ms = s.as_of_ms if s.as_of_ms is not None else int(started * 1000)
    outdir.check(Path(s.out), overwrite=s.overwrite)
    with outdir.writing(Path(s.out), overwrite=s.overwrite) as out, _conf(spark, JOB_CONF):
        dfs = build(spark, s, as_of_ms)
        phases: dict[str, float] = {}
        mark = time.time()

        def phase(name: str) -> None:
            nonlocal mark
            phases[name] = round(time.time() - mark, 3)
            mark = time.time()

        # the one pass over the logs; everything below reads its Parquet back
        dfs["messages"].write.parquet(str(out / "messages"))
        phase("write_messages")
        obs = {k: _observed(v) for k, v in dfs["observations"].items()}
        logs = {log: _log_counts(spark, s.paths, log, obs[log]) for log in LOGS}
        messages = spark.read.parquet(str(out / "messages"))
        (messages.where("status in ('lost', 'duplicated', 'delivered_after_cancel') or late or early")
         .withColumn("problem", F.when(F.col("status") != "delivered", F.col("status"))
                     .when(F.col("late"), F.lit("late")).otherwise(F.lit("early")))
         .write.parquet(str(out / "problems")))
        phase("write_problems")
        # one small histogram (a hash aggregate of a few columns of the Parquet) for every
        # per subject-hour, per hour and overall figure (cluster.spark.stats)
        hist = (messages.groupBy("hour", "subject", "status", "late", "early",
                                 F.expr(stats.bucket_sql()).alias("bucket"))
                .agg(F.count(F.lit(1)).alias("n"), F.max("lateness_ms").alias("max_ms")))
        lateness_rows, hourly_rows, overall = stats.figures(hist.toArrow().to_pylist())
        _write_rows(out / "lateness", lateness_rows, LATENESS_TYPES)
        _write_rows(out / "hourly", hourly_rows, {k: v for k, v in LATENESS_TYPES.items() if k != "subject"})
        by_status = {k: overall[k] for k in STATUSES}
        by_status["delivered"] -= by_status["duplicated"]  # the figures' "delivered" counts both
        late, early = overall["late"], overall["early"]
        phase("write_lateness")
        if any(v["errors"] for v in logs.values()):  # read the logs again only when something is damaged
            corrupt = None
            for log in LOGS:
                part = read_log(spark, s.paths, log, CORRUPT_COLUMNS).where("error is not null")
                corrupt = part if corrupt is None else corrupt.unionByName(part)
            corrupt.write.parquet(str(out / "corrupt"))
            corrupt_files = [{"segment": r["segment"], "records": r["count"]} for r in
                             spark.read.parquet(str(out / "corrupt")).groupBy("segment").count()
                             .orderBy(F.desc("count"), "segment").limit(CORRUPT_FILES_SHOWN_MAX).collect()]
        else:  # an empty dataset with the schema, without a Spark job
            _empty_parquet(out / "corrupt", StructType([MESSAGE_SCHEMA[c] for c in CORRUPT_COLUMNS]))
            corrupt_files = []
        phase("write_corrupt")

        # worst first within each kind: the longest lateness, else the earliest due
        first = Window.partitionBy("problem").orderBy(F.col("lateness_ms").desc_nulls_last(),
                                                     F.col("early_ms").desc_nulls_last(), "due_ms", "id")
        examples: dict[str, list[dict]] = {}
        for r in (spark.read.parquet(str(out / "problems")).withColumn("n", F.row_number().over(first))
                  .where(F.col("n") <= EXAMPLES_MAX).orderBy("problem", "n")
                  .select("problem", "nodes", "seq", "id", "subject", "due_ms", "status", "received", "dispatched",
                          "first_received_ms", "lateness_ms", "early_ms", "reason").collect()):
            examples.setdefault(r["problem"], []).append(r.asDict())
        corrupt_rows = [r.asDict() for r in spark.read.parquet(str(out / "corrupt")).limit(EXAMPLES_MAX).collect()
                        ] if corrupt_files else []  # no query of the empty dataset
        phase("summaries")
        records_read = sum(v["records"] for v in logs.values())
        summary = {
            "as_of_ms": as_of_ms, "grace_ms": s.grace_ms, "late_ms": s.late_ms, "paths": s.paths,
            "records_read": records_read, "logs": logs,
            "scheduled": sum(by_status.values()),
            "status": by_status,
            "late": late,
            "early": early, "hold_ms": s.hold_ms,
            "lateness_ms": {k: overall.get(k) for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")},
            "received_not_scheduled": obs["messages"].get("received_not_scheduled", 0),
            "corrupt_records": sum(v["errors"] for v in logs.values()),
            "corrupt_files": corrupt_files,
            # records read but not one of them good: a folder of random bytes, not an empty cluster
            "no_good_record": records_read > 0 and all(v["records"] == v["errors"] for v in logs.values()),
            "seconds": round(time.time() - started, 3),
            "phases_s": phases,
        }
        summary["records_per_s"] = round(records_read / max(summary["seconds"], 1e-9))
        if s.report:
            from .report import write_report

            write_report(out, summary, lateness_rows, hourly_rows, examples, corrupt_rows)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary
