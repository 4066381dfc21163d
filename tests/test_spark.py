"""Spark jobs on real Spark (local mode, one session for the module), real files, real clusters.

* the ``hourglass`` data source reads logs written in the batch format (``SegmentedLog`` of
  ``cluster.codec`` batches, one frame per batch) - including a torn tail, a flipped body
  bit and a flipped header bit - and agrees with the engine's reader and the codec, one
  row per message;
* the row builder (``cluster.spark.rows``) gives exactly the codec's values, also when it
  merges many frames into one record batch, and reports undecodable frames as rows;
* the audit finds a planted lost message, duplicate, delivery after cancel and late
  delivery in data produced by a real local cluster (planting described in
  ``plant_anomalies``);
* bulk-schedule delivers every good row once, also when rerun, and rejects bad rows
  with a reason.

The audit and bulk-schedule tests run a ``LocalCluster`` (real node processes); every
other test reads files written here.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from cluster.client import Consumer, Producer, StaticResolver  # noqa: E402
from cluster.codec import KIND_CANCEL, OUTCOME_DEAD_LETTER, Batch, DispatchBatch, encode_extra  # noqa: E402
from cluster.devcluster import LocalCluster  # noqa: E402
from cluster.errors import CorruptRecord  # noqa: E402
from node.store.log import HEADER_SIZE, SegmentedLog, frame  # noqa: E402

T0 = 1_800_000_000_000
HOUR = 3_600_000
EPOCH = 1 << 40


def now_ms() -> int:
    return time.time_ns() // 1_000_000


SESSION_TRIES = 2  # the JVM this test process forks may exit at once: one more try, then the error


@pytest.fixture(scope="module")
def spark():
    """One local session for the module. This pytest process has run gRPC servers and clients
    before (their threads may be inside gRPC when pyspark forks the JVM's launcher: "Other
    threads are currently calling into gRPC, skipping fork() handlers"); once, a full suite
    saw that launcher exit before it wrote its port (JAVA_GATEWAY_EXITED) and every test of
    the module error at setup. A second launch is tried; a second failure is the error."""
    from pyspark.errors import PySparkRuntimeError

    from cluster.spark.session import SessionSettings, build_session

    for attempt in range(1, SESSION_TRIES + 1):
        try:
            s = build_session(SessionSettings(master="local[2]", shuffle_partitions=2, app_name="hourglass-tests"))
            break
        except PySparkRuntimeError as e:
            if "JAVA_GATEWAY_EXITED" not in str(e) or attempt == SESSION_TRIES:
                raise
            print(f"spark session: the JVM gateway exited at launch (try {attempt} of {SESSION_TRIES}); again")
    yield s
    s.stop()


def read(spark, path, log):
    return spark.read.format("hourglass").option("log", log).load(str(path))


# ---------------------------------------------------------------------- data source vs engine


def make_batch(first: int, n: int, *, seq_base: int, store_ms: int, due_ms, subjects=("orders", "audit.x"),
               tagged: bool = True) -> Batch:
    """Messages ``m{first}..`` with varied payloads, two subjects, tags on odd ones, a
    property on every fifth."""
    k = range(first, first + n)
    extras = [encode_extra(("eu",) if i % 2 and tagged else (), {"shard": str(i % 3)} if i % 5 == 0 else {})
              for i in k]
    due = np.asarray(due_ms if not isinstance(due_ms, int) else [due_ms + 10 * (i - first) for i in k], np.int64)
    return Batch.build([subjects[i % len(subjects)] for i in k], [b"p" * (i % 50) for i in k], [f"m{i}" for i in k],
                       due, seq=np.arange(seq_base + first, seq_base + first + n, dtype=np.uint64), store_ms=store_ms,
                       attempts=[i % 3 for i in k], extras=extras)


def write_logs(root: Path) -> dict[str, list[Batch]]:
    """A delay node and a real-time node in the batch format, several segments per log:

    * ``delay-1/messages``: 20 batches of 10 (``m0..m199``; 150 due in the first seconds,
      50 over three later hours) and one cancel tombstone of ``m7``;
    * ``delay-1/schedule``: the same messages filed per hour bucket (one frame per batch and
      bucket, ``effective_ms`` set) with the tombstone;
    * ``delay-1/dispatch``: the 149 early ones but ``m7``, 10 per record, the last one a dead letter;
    * ``realtime-1/messages``: the same 149, one frame per 10.

    Returns the batches written per log, in log order."""
    written: dict[str, list[Batch]] = {"message": [], "schedule": [], "dispatch": [], "realtime": []}
    delay, rt = root / "delay-1", root / "realtime-1"
    (rt / "index").mkdir(parents=True)
    due = [T0 + 1000 + i * 10 if i < 150 else T0 + (i % 3 + 1) * HOUR for i in range(200)]
    with SegmentedLog.open(delay / "messages", segment_bytes_max=1 << 13) as ml:
        for first in range(0, 200, 10):
            b = make_batch(first, 10, seq_base=EPOCH, store_ms=T0, due_ms=due[first:first + 10])
            written["message"].append(b)
            ml.append([b.encode()])
        tomb = Batch.build("orders", [struct.pack("<Q", EPOCH + 7)], ["m7"], [due[7]], seq=[EPOCH + 200],
                           store_ms=T0 + 5, kind=KIND_CANCEL)
        written["message"].append(tomb)
        ml.append([tomb.encode()])
    (delay / "schedule").mkdir()
    (delay / "schedule" / "meta.json").write_text(json.dumps({"bucket_ms": HOUR, "version": 2}))
    everything = Batch.concat(written["message"])
    bucket_of = everything.effective_ms // HOUR * HOUR
    for start in sorted(set(bucket_of.tolist())):
        with SegmentedLog.open(delay / "schedule" / f"{start:018d}" / "data", segment_bytes_max=1 << 13) as sl:
            for b in written["message"]:
                part = b.take(np.flatnonzero(b.effective_ms // HOUR * HOUR == start))
                if part.n:
                    written["schedule"].append(part)
                    sl.append([part.encode()])
    fired = everything.take(np.flatnonzero((everything.kind == 1) & (np.arange(everything.n) < 150)
                                           & (everything.seq != EPOCH + 7)))
    with SegmentedLog.open(delay / "dispatch", segment_bytes_max=1 << 11) as dl, \
            SegmentedLog.open(rt / "messages", segment_bytes_max=1 << 13) as rl:
        for k in range(0, fired.n, 10):
            part = fired.take(slice(k, k + 10))
            sent = int(part.deliver_at_ms[-1]) + 5
            d = DispatchBatch(part.seq, part.effective_ms, part.deliver_at_ms, sent,
                              OUTCOME_DEAD_LETTER if k + 10 >= fired.n else 0)
            written["dispatch"].append(d)
            dl.append([d.encode()])
            stored = part.replace(seq=np.arange(2 * EPOCH + k, 2 * EPOCH + k + part.n, dtype=np.uint64),
                                  store_ms=sent - 1)
            written["realtime"].append(stored)
            rl.append([stored.encode()])
    return written


def engine_rows(directory: Path, dispatch: bool = False) -> list[tuple[int, int]]:
    """(frame offset, seq) of every message, as the engine's reader and the codec see them."""
    out = []
    with SegmentedLog.open(directory) as log:
        for off, body in log.iterate():
            seqs = (DispatchBatch if dispatch else Batch).decode(body).seq
            out += [(off, int(q)) for q in seqs]
    return out


def flip_bit(path: Path, pos: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_data_source_reads_engine_files_and_reports_damage_like_the_engine(spark, tmp_path):
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    written = write_logs(clean)
    shutil.copytree(clean, damaged)
    expect = {
        "message": engine_rows(clean / "delay-1" / "messages"),
        "dispatch": engine_rows(clean / "delay-1" / "dispatch", dispatch=True),
        "realtime": engine_rows(clean / "realtime-1" / "messages"),
    }
    assert len(expect["message"]) == 201 and len(expect["realtime"]) == len(expect["dispatch"]) == 149

    # torn tail: half a frame at the end of the delay node's newest message segment
    msg_segs = sorted((damaged / "delay-1" / "messages").glob("*.log"))
    torn_at = int(msg_segs[-1].stem) + msg_segs[-1].stat().st_size
    with open(msg_segs[-1], "ab") as f:
        f.write(frame(written["message"][0].encode())[:25])
    # flipped body bit in the middle of a sealed real-time segment: one whole batch is lost
    rt_segs = sorted((damaged / "realtime-1" / "messages").glob("*.log"))
    assert len(rt_segs) >= 2
    rt_frames = sorted({o for o, _ in expect["realtime"]})
    rt_bad = next(o for o in rt_frames if o > int(rt_segs[0].stem) + 1000)
    flip_bit(rt_segs[0], rt_bad - int(rt_segs[0].stem) + HEADER_SIZE + 3, 5)
    # flipped header bit (the length) in a sealed dispatch segment: the reader must resynchronise
    d_segs = sorted((damaged / "delay-1" / "dispatch").glob("*.log"))
    assert len(d_segs) >= 2
    d_frames = sorted({o for o, _ in expect["dispatch"]})
    d_bad = d_frames[1]
    assert d_bad < int(d_segs[1].stem)
    flip_bit(d_segs[0], d_bad + 1, 2)

    got = {log: read(spark, damaged, log).select("offset", "frame_bytes", "error", "seq").collect()
           for log in ("message", "dispatch", "realtime")}
    good = {log: sorted((r["offset"], r["seq"]) for r in rows if r["error"] is None) for log, rows in got.items()}
    bad = {log: [r for r in rows if r["error"] is not None] for log, rows in got.items()}

    # torn tail: every message is read, the tail is one "torn tail" row; the engine agrees after recovery
    assert good["message"] == expect["message"]
    assert [(r["offset"], r["frame_bytes"]) for r in bad["message"]] == [(torn_at, 25)]
    assert bad["message"][0]["error"].startswith("torn tail")
    recovered = tmp_path / "recovered"
    shutil.copytree(damaged / "delay-1" / "messages", recovered)
    assert engine_rows(recovered) == good["message"]

    # body bit: one corrupt row at the engine's CorruptRecord offset; every other batch is read
    assert good["realtime"] == [(o, q) for o, q in expect["realtime"] if o != rt_bad]
    assert len(good["realtime"]) == 149 - 10
    assert [r["offset"] for r in bad["realtime"]] == [rt_bad]
    assert "body checksum mismatch" in bad["realtime"][0]["error"]
    with SegmentedLog.open(damaged / "realtime-1" / "messages") as log:
        seen = []
        with pytest.raises(CorruptRecord) as ei:
            for off, _ in log.iterate():
                seen.append(off)
    assert ei.value.offset == rt_bad
    assert seen == [o for o in rt_frames if o < rt_bad]

    # header bit: the reader skips exactly the damaged frame and finds the next one
    assert good["dispatch"] == [(o, q) for o, q in expect["dispatch"] if o != d_bad]
    (row,) = bad["dispatch"]
    assert row["offset"] == d_bad and row["frame_bytes"] == HEADER_SIZE + len(written["dispatch"][1].encode())
    assert "header checksum mismatch" in row["error"]

    # the schedule log: every filed record, and pushdown skips whole hour buckets
    sched = read(spark, clean, "schedule")
    assert sched.where("error is null").count() == 201
    assert sched.rdd.getNumPartitions() >= 4
    late = sched.where(f"effective_ms >= {T0 + 2 * HOUR}")
    assert late.rdd.getNumPartitions() < sched.rdd.getNumPartitions()
    assert late.count() == sum(1 for i in range(150, 200) if (i % 3 + 1) >= 2)
    # pushdown by node: another delay node's segments are not read at all
    shutil.copytree(clean / "delay-1", clean / "delay-2")
    both = read(spark, clean, "message")
    assert both.rdd.getNumPartitions() == 6
    one = read(spark, clean, "message").where("node = 'delay-2'")
    assert one.rdd.getNumPartitions() == 3
    assert one.where("error is null").count() == 201
    # Spark keeps the pushed-down reader of a DataFrame for its later queries; the next
    # query's filters replace the pushed ones (docs/spark.md: reload for an unfiltered query)
    assert one.where("error is null").count() == 201
    reused = read(spark, clean, "message")
    assert reused.where("node = 'delay-2'").count() == 201
    assert reused.where("error is null").count() == 402

    # decoded fields are the codec's
    m = read(spark, clean, "message").where("node = 'delay-1' and id = 'm7' and kind = 'cancel'").collect()
    assert len(m) == 1 and m[0]["subject"] == "orders" and m[0]["cancels_seq"] == EPOCH + 7
    assert m[0]["payload_bytes"] == 0
    rows = (spark.read.format("hourglass").option("log", "realtime").option("payload", "true").load(str(clean))
            .orderBy("seq").collect())
    ref = Batch.concat(written["realtime"])
    tags, props = zip(*(ref.extra(i) for i in range(ref.n)))
    assert [r["id"] for r in rows] == ref.id_list()
    assert [r["subject"] for r in rows] == ref.subject_list()
    assert [r["payload"] for r in rows] == ref.payload_list()
    assert [r["payload_bytes"] for r in rows] == [len(p) for p in ref.payload_list()]
    assert [tuple(r["tags"]) for r in rows] == list(tags)
    assert [tuple(sorted(r["properties"].items())) for r in rows] == [tuple(sorted(p)) for p in props]
    assert [(r["store_ms"], r["deliver_at_ms"], r["attempts"]) for r in rows] == list(
        zip(ref.store_ms.tolist(), ref.deliver_at_ms.tolist(), ref.attempts.tolist()))
    disp = read(spark, clean, "dispatch").where("node = 'delay-1' and error is null").groupBy("outcome").count()
    assert {r["outcome"]: r["count"] for r in disp.collect()} == {"delivered": 140, "dead_letter": 9}


def test_empty_inputs_are_empty_results_and_wrong_options_are_refused(spark, tmp_path):
    """A log with no segment is an empty DataFrame (pyspark 4.3 hands ``read`` an empty
    ``InputPartition``); a wrong option or path fails at ``load()`` naming it and the valid ones."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    data = tmp_path / "data"
    write_logs(data)
    (tmp_path / "nothing").mkdir()
    assert read(spark, data / "delay-1", "realtime").count() == 0
    assert read(spark, data / "realtime-1", "dispatch").count() == 0
    assert read(spark, data, "message").where("node = 'delay-9'").count() == 0
    assert read(spark, tmp_path / "nothing", "message").count() == 0
    # `kind = '...'` is taken by the reader itself (exactly), a narrower schema builds only its columns
    from cluster.spark.source import load

    cancels = load(spark, [data], log="message").where("kind = 'cancel'").select("id", "cancels_seq").collect()
    assert [(r["id"], r["cancels_seq"]) for r in cancels] == [("m7", EPOCH + 7)]
    narrow = (spark.read.format("hourglass").schema("seq bigint, subject string").option("log", "realtime")
              .load(str(data)))
    assert narrow.columns == ["seq", "subject"] and narrow.count() == 149
    for options, words in [({"logs": "dispatch"}, "unknown option 'logs'; valid options: path, log, payload"),
                           ({"payload": "yes"}, "invalid payload: 'yes' is not true or false"),
                           ({"log": "bogus"}, "'bogus' is not one of message, schedule, dispatch, realtime")]:
        r = spark.read.format("hourglass")
        for k, v in options.items():
            r = r.option(k, v)
        with pytest.raises(Exception) as ei:
            r.load(str(data)).count()
        assert words in str(ei.value), str(ei.value)[:2000]
    with pytest.raises(Exception, match="does not exist"):
        read(spark, tmp_path / "nope", "message").count()
    bad = StructType([StructField("seq", StringType()), StructField("offset", LongType())])
    with pytest.raises(Exception, match="column 'seq' is bigint, not string"):
        spark.read.format("hourglass").schema(bad).load(str(data)).count()

    # the audit of one delay node's folder: nothing received there, so everything due is lost
    from cluster.errors import InvalidArgument
    from cluster.spark.audit import AuditSettings, run

    settings = AuditSettings(paths=[str(data / "delay-1")], out=str(tmp_path / "audit"), as_of_ms=T0 + 5 * HOUR)
    summary = run(spark, settings)
    assert summary["status"]["lost"] == 199 and summary["status"]["cancelled"] == 1, summary
    assert summary["logs"]["realtime"] == {"records": 0, "errors": 0}
    assert (tmp_path / "audit" / "report.html").exists()
    with pytest.raises(InvalidArgument, match="exists"):  # refused before any Spark job
        run(spark, settings)


def test_rows_match_the_codec_across_merged_frames():
    """Many random batches through the row builder with a small ``rows_max`` (frames are
    merged, and cut between frames): every value is the codec's; undecodable frames are
    rows in log order, and a frame is never split."""
    from pyspark.sql.pandas.types import to_arrow_schema

    from cluster.spark.rows import Where, message_batches
    from cluster.spark.scan import scan_buffer
    from cluster.spark.source import MESSAGE_SCHEMA

    rnd = random.Random(7)
    schema = to_arrow_schema(MESSAGE_SCHEMA, timezone="UTC")
    batches, bodies = [], []
    for k in range(40):
        n = rnd.randrange(1, 30)
        first = k * 100
        b = make_batch(first, n, seq_base=EPOCH, store_ms=T0 + k, due_ms=T0 + k * 1000,
                       subjects=("a", "b.c", f"s{k % 4}"), tagged=k % 3 != 0)
        if k % 7 == 3:  # a tombstone among messages
            kind = np.ones(n, np.uint8)
            kind[0] = KIND_CANCEL
            payloads = [struct.pack("<Q", 99 + k)] + b.payload_list()[1:]
            b = Batch.build(b.subject_list(), payloads, b.id_list(), b.deliver_at_ms, seq=b.seq, store_ms=b.store_ms,
                            kind=kind)
        batches.append(b)
        bodies.append(b.encode())
    not_utf8 = Batch.build("a", [b"x"], ["ok"], [1]).replace(ids=b"\xff\xfe", id_end=np.array([2], np.uint32))
    bad_tomb = Batch.build("a", [b"short"], ["t"], [1], kind=[KIND_CANCEL])
    bodies[10:10] = [b"not a batch", not_utf8.encode(), bad_tomb.encode()]
    data = b"".join(frame(x) for x in bodies)
    out = list(message_batches(scan_buffer(data, 500, last=True), schema, Where("n", "realtime", "seg"),
                               with_payload=True, rows_max=50))
    assert all(rb.schema.equals(schema) for rb in out)
    rows = [r for rb in out for r in rb.to_pylist()]
    errors = [r for r in rows if r["error"] is not None]
    assert [e["error"].split(":")[0] for e in errors] == ["undecodable"] * 3
    assert "UTF-8" in errors[1]["error"] and "u64 target seq" in errors[2]["error"]
    assert rows.index(errors[0]) == sum(b.n for b in batches[:10])  # in log order
    good = [r for r in rows if r["error"] is None]
    ref = Batch.concat(batches)
    assert len(good) == ref.n
    cancel = ref.kind == KIND_CANCEL
    assert [r["id"] for r in good] == ref.id_list()
    assert [r["subject"] for r in good] == ref.subject_list()
    assert [r["seq"] for r in good] == ref.seq.tolist()
    assert [r["kind"] for r in good] == ["cancel" if c else "message" for c in cancel.tolist()]
    assert [r["payload"] for r in good] == [None if c else p for c, p in zip(cancel.tolist(), ref.payload_list())]
    assert [r["cancels_seq"] for r in good] == [
        struct.unpack("<Q", p)[0] if c else None for c, p in zip(cancel.tolist(), ref.payload_list())]
    assert [tuple(r["tags"]) for r in good] == [ref.extra(i)[0] for i in range(ref.n)]
    assert [r["properties"] for r in good] == [list(ref.extra(i)[1]) for i in range(ref.n)]
    offsets, pos = [], 500
    for b, body in zip(batches[:10] + [None] * 3 + batches[10:], bodies):
        if b is not None:
            offsets += [(pos, HEADER_SIZE + len(body))] * b.n
        pos += HEADER_SIZE + len(body)
    assert [(r["offset"], r["frame_bytes"]) for r in good] == offsets
    assert len(out) > 10  # rows_max cut the segment into many record batches, each of whole frames
    assert all(a.column("offset")[-1] != b.column("offset")[0] for a, b in zip(out, out[1:]))


# ---------------------------------------------------------------------- audit on a real cluster


async def collect(resolver, subject, n, timeout_s=30.0):
    got = []
    deadline = time.monotonic() + timeout_s
    async with Consumer(resolver, subject, group="audit-test", wait_ms=300) as c:
        while len(got) < n and time.monotonic() < deadline:
            batch = await c.pull()
            got += batch
            await c.ack(batch)
    return got


PLANTED_EPOCH = 4000 << 40  # seqs of planted records: no node of the test cluster reaches this epoch


def plant_anomalies(data: Path, *, now: int, dup_id: str, cancelled_id: str, subject: str) -> None:
    """Append batches (``SegmentedLog`` + codec, the nodes' own format) to a *copy* of a
    stopped cluster's logs:

    * lost: ``planted-lost``, due 5 minutes ago, in the delay node's message log only -
      never dispatched, on no real-time node;
    * late: ``planted-late`` accepted by the delay node, due 4 minutes ago, and stored by the
      real-time node 2 minutes after its due time;
    * duplicate: a second real-time copy (new seq) of an already delivered message, stored
      11 minutes from now - past the real-time node's de-duplication window, what a
      failover outside the window would do;
    * delivered after cancel: the same for the message the test cancelled through the SDK;
    * early: ``planted-early``, due 200 s ago, stored by the real-time node 5 s before its due
      time - far more than the 100 ms a real-time node holds a message fired ahead, so it was
      handed out 4.9 s early.
    """
    delayed = Batch.build(subject, [b"lost", b"late", b"early"], ["planted-lost", "planted-late", "planted-early"],
                          [now - 300_000, now - 240_000, now - 200_000],
                          seq=[PLANTED_EPOCH, PLANTED_EPOCH + 1, PLANTED_EPOCH + 5],
                          store_ms=[now - 300_000, now - 241_000, now - 300_000])
    with SegmentedLog.open(data / "delay-1" / "messages") as ml:
        ml.append([delayed.encode()])
    late = Batch.build(subject, [b"late"], ["planted-late"], [now - 240_000], seq=[PLANTED_EPOCH + 2],
                       store_ms=now - 120_000)
    later = now + 11 * 60_000
    again = Batch.build(subject, [b"again", b"cancelled"], [dup_id, cancelled_id], [now - 60_000, now - 60_000],
                        seq=[PLANTED_EPOCH + 3, PLANTED_EPOCH + 4], store_ms=later)
    early = Batch.build(subject, [b"early"], ["planted-early"], [now - 200_000], seq=[PLANTED_EPOCH + 6],
                        store_ms=now - 205_000)
    with SegmentedLog.open(data / "realtime-1" / "messages") as rl:
        rl.append([late.encode(), again.encode(), early.encode()])


def test_audit_finds_planted_problems_in_real_cluster_data(spark, tmp_path):
    from cluster.spark.audit import AuditSettings, run

    subject, n = "audit.orders", 30
    with LocalCluster(tmp_path / "cluster") as c:
        resolver = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])

        async def traffic():
            async with Producer(resolver) as p:
                futs = [await p.send(subject, f"m{i}", delay_ms=200 + 40 * i, id=f"a-{i}",
                                     tags=["even"] if i % 2 == 0 else []) for i in range(n)]
                futs.append(await p.send("audit.other", "x", delay_ms=300, id="other-1"))
                await asyncio.gather(*futs)
                await p.send_and_wait(subject, "never", delay_ms=120_000, id="cancel-me")
                await p.cancel("cancel-me")
            return await collect(resolver, subject, n)

        got = asyncio.run(traffic())
        assert sorted(m.id for m in got) == sorted(f"a-{i}" for i in range(n))
    t = now_ms()
    planted = tmp_path / "planted"
    shutil.copytree(tmp_path / "cluster", planted)  # the cluster is stopped: its files are final
    plant_anomalies(planted, now=t, dup_id="a-3", cancelled_id="cancel-me", subject=subject)

    out = tmp_path / "audit"
    summary = run(spark, AuditSettings(paths=[str(planted)], out=str(out), as_of_ms=t + 12 * 60_000,
                                       grace_ms=30_000, late_ms=60_000))
    st = summary["status"]
    assert st["lost"] == 1 and st["duplicated"] == 1 and st["delivered_after_cancel"] == 1, st
    assert st["delivered"] == n + 2  # n sent + other-1 + planted-late + planted-early, minus a-3 (duplicated)
    assert summary["corrupt_records"] == 0 and summary["early"] == 1

    msgs = {r["id"]: r for r in spark.read.parquet(str(out / "messages")).collect()}
    assert msgs["planted-lost"]["status"] == "lost" and msgs["planted-lost"]["reason"] == "never dispatched"
    assert msgs["a-3"]["status"] == "duplicated" and msgs["a-3"]["received"] == 2
    assert msgs["cancel-me"]["status"] == "delivered_after_cancel"
    assert msgs["planted-late"]["lateness_ms"] == 120_000 and msgs["planted-late"]["late"]
    early = msgs["planted-early"]
    assert (early["early"], early["early_ms"], early["lateness_ms"], early["late"]) == (True, 4_900, 0, False)
    # lateness counts from when a message became visible, so a message the delay node fired
    # ahead and the real-time node held until due is on time, never "early" or negative
    assert all(r["lateness_ms"] >= 0 for r in msgs.values() if r["lateness_ms"] is not None)
    real = [r for k, r in msgs.items() if k.startswith("a-") and k != "a-3"]
    assert all(not r["early"] and r["visible_ms"] >= r["due_ms"] for r in real)
    fired_ahead = (read(spark, tmp_path / "cluster", "realtime").where("error is null and store_ms < deliver_at_ms")
                   .count())
    assert fired_ahead > 0  # the fire-ahead path was taken (dispatch_lead_ms), so the check above means something
    problems = {(r["id"], r["problem"]) for r in spark.read.parquet(str(out / "problems")).collect()}
    assert problems == {("planted-lost", "lost"), ("a-3", "duplicated"), ("cancel-me", "delivered_after_cancel"),
                        ("planted-late", "late"), ("planted-early", "early")}
    lat = [r for r in spark.read.parquet(str(out / "lateness")).collect() if r["subject"] == subject]
    # a subject-hour holding only messages not delivered (the cancelled one, due 2 minutes on,
    # falls in the next hour when the test runs near its end) has no percentiles
    assert max(r["max_ms"] or 0 for r in lat) == 120_000
    assert min(r["p50_ms"] for r in lat if r["p50_ms"] is not None) >= 0
    assert sum(r["delivered"] for r in lat) == n + 2  # the n sent (a-3 once), planted-late and planted-early
    assert sum(r["early"] for r in lat) == 1
    assert summary["lateness_ms"]["p50_ms"] >= 0
    assert (out / "report.html").exists() and (out / "status.png").stat().st_size > 1000
    html = (out / "report.html").read_text()
    assert "PROBLEMS" in html and "planted-lost" in html and "1 delivered early" in html
    assert json.loads((out / "summary.json").read_text())["status"] == st

    # the untouched cluster data audits clean
    clean = run(spark, AuditSettings(paths=[str(tmp_path / "cluster")], out=str(tmp_path / "audit-clean"),
                                     as_of_ms=t + 60_000, report=False))
    assert clean["status"]["lost"] == clean["status"]["duplicated"] == 0
    assert clean["status"]["delivered_after_cancel"] == 0 and clean["status"]["cancelled"] == 1
    assert clean["status"]["delivered"] == n + 1
    assert clean["early"] == 0 and clean["lateness_ms"]["p50_ms"] >= 0


# ---------------------------------------------------------------------- bulk-schedule


def test_bulk_schedule_delivers_every_row_once_also_when_rerun(spark, tmp_path):
    from cluster.spark.bulk import BulkSettings, run

    n, subject = 25, "bulk.orders"
    with LocalCluster(tmp_path / "cluster") as c:
        resolver = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])
        due = now_ms() + 1500
        lines = ["id,subject,deliver_at,payload,tags"]
        lines += [f"b-{i},{subject},{due + 20 * i},payload {i},\"red,blue\"" for i in range(n)]
        lines += ["bad-subject,no spaces allowed,1,x,", f",{subject},1,no id,", f"bad-time,{subject},tomorrow,x,",
                  f"long-bad,no spaces,1,{'y' * 10_000},"]
        csv = tmp_path / "rows.csv"
        csv.write_text("\n".join(lines) + "\n")

        first = run(spark, BulkSettings(input=str(csv), out=str(tmp_path / "run1"),
                                        delay_nodes=[c.delay[0].address], rate_per_s=200, batch_max=10))
        assert (first["scheduled"], first["duplicate"], first["rejected"], first["failed"]) == (n, 0, 4, 0)
        rejects = [json.loads(line) for p in (tmp_path / "run1" / "rejects").glob("*.json")
                   for line in p.read_text().splitlines()]
        reasons = {r.get("id"): r["reason"] for r in rejects}
        assert set(reasons) == {"bad-subject", None, "bad-time", "long-bad"}
        sources = {r.get("id"): json.loads(r["source"]) for r in rejects}  # whole JSON, however long the row
        assert sources["long-bad"]["payload"].endswith("[cut: 10000 characters]")
        assert sources["bad-time"]["deliver_at"] == "tomorrow"
        assert "subject" in reasons["bad-subject"] and "id is missing" in reasons[None]
        assert "deliver_at" in reasons["bad-time"]

        got = asyncio.run(collect(resolver, subject, n))
        assert sorted(m.id for m in got) == sorted(f"b-{i}" for i in range(n))
        assert all(m.tags == ("red", "blue") for m in got)

        # rerun after delivery, from Parquet this time: nothing is scheduled twice
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [f"b-{i}" for i in range(n)], "subject": [subject] * n,
                                 "deliver_at": [due + 20 * i for i in range(n)],
                                 "payload": [f"payload {i}".encode() for i in range(n)],
                                 "tags": [["red", "blue"]] * n}), tmp_path / "rows.parquet")
        second = run(spark, BulkSettings(input=str(tmp_path / "rows.parquet"), out=str(tmp_path / "run2"),
                                         delay_nodes=[c.delay[0].address]))
        assert (second["scheduled"], second["duplicate"], second["rejected"]) == (0, n, 0)
        assert asyncio.run(collect(resolver, subject, 1, timeout_s=2.5)) == []
    # every id is in the real-time node's log exactly once
    rt = read(spark, tmp_path / "cluster", "realtime").where(f"subject = '{subject}' and error is null")
    counts = {r["id"]: r["count"] for r in rt.groupBy("id").count().collect()}
    assert counts == {f"b-{i}": 1 for i in range(n)}


def test_bulk_plan_rejects_with_reasons():
    from cluster.spark.bulk import BadRow, TokenBucket, node_for, plan_row, plan_rows

    t = T0
    p = plan_row({"id": "x", "subject": "s", "deliver_at": "2027-01-15T10:00:00Z", "payload": "hi", "tags": "a, b"})
    assert p.deliver_at_ms == T0 + 2 * HOUR
    assert plan_row({"id": "x", "subject": "s", "deliver_at": "2027-01-15T08:00:00"}).deliver_at_ms == T0
    assert p.tags == ("a", "b") and p.payload == b"hi"
    for row, why in [({"subject": "s", "deliver_at": 1}, "id is missing"),
                     ({"id": "x", "subject": "s", "deliver_at": None}, "deliver_at is missing"),
                     ({"id": "x", "subject": "s", "deliver_at": "soon"}, "neither epoch"),
                     ({"id": "x", "subject": "s", "deliver_at": 1, "_corrupt_record": "{"}, "malformed")]:
        with pytest.raises(BadRow, match=why):
            plan_row(row)
    with pytest.raises(BadRow, match="base64"):
        plan_row({"id": "x", "subject": "s", "deliver_at": 1, "payload": "%%"}, payload_encoding="base64")

    # the broker's limits, for a whole task at once (the codec's Batch.validate)
    rows = [{"id": "ok-1", "subject": "s", "deliver_at": t + 5, "tags": ["red"]},
            {"id": "a b", "subject": "s", "deliver_at": 1},
            {"subject": "s", "deliver_at": 1},
            {"id": "far", "subject": "s", "deliver_at": t + 3 * 366 * 24 * HOUR},
            {"id": "bad-subject", "subject": "no spaces", "deliver_at": 1},
            {"id": "ok-2", "subject": "s", "deliver_at": 0, "payload": b"\x00"},
            # the codec's rule: a whole number of milliseconds, not negative (no clamping to "now")
            {"id": "negative", "subject": "s", "deliver_at": -5},
            {"id": "negative-text", "subject": "s", "deliver_at": "-5"},
            {"id": "fraction", "subject": "s", "deliver_at": 1.5},
            {"id": "before-1970", "subject": "s", "deliver_at": "1969-12-31T23:59:59Z"},
            {"id": "whole-float", "subject": "s", "deliver_at": 7.0}]
    planned, rejects = plan_rows(rows, now_ms=t)
    assert [(i, p.msg_id) for i, p in planned] == [(0, "ok-1"), (5, "ok-2"), (10, "whole-float")]
    assert sorted(rejects) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert "printable ASCII" in rejects[1] and "id is missing" in rejects[2]
    assert "delay horizon" in rejects[3] and "subject" in rejects[4]
    assert all("must not be negative" in rejects[i] for i in (6, 7, 9)), rejects
    assert "not a whole number" in rejects[8]
    planned, rejects = plan_rows([{"id": "x", "subject": "s", "deliver_at": 1, "tags": ["t" * 300]}], now_ms=t)
    assert planned == [] and "255" in rejects[0]

    nodes = ["a:1", "b:2", "c:3"]
    assert {node_for(f"id-{i}", nodes) for i in range(100)} == set(nodes)
    assert all(node_for(f"id-{i}", nodes) == node_for(f"id-{i}", nodes) for i in range(100))
    b = TokenBucket(100, burst=10, now_s=0.0)
    assert b.wait_s(10, 0.0) == 0.0
    assert b.wait_s(10, 0.0) == pytest.approx(0.1)
    assert b.wait_s(5, 1.0) == 0.0  # refilled, capped at the burst


def test_scan_buffer_examples():
    """The worked example of cluster/spark/scan.py, byte for byte."""
    from cluster.spark.scan import scan_buffer

    bodies = [bytes([i]) * 18 for i in range(3)]
    data = bytearray(b"".join(frame(b) for b in bodies))
    data[30 + HEADER_SIZE] ^= 1
    data += frame(b"y" * 20)[:7]
    got = [(f.offset, f.size, f.body is not None, (f.error or "").split(":")[0]) for f in
           scan_buffer(bytes(data), 1000, last=True)]
    assert got == [(1000, 30, True, ""), (1030, 30, False, "corrupt"), (1060, 30, True, ""),
                   (1090, 7, False, "torn tail")]
    # the same tail in a sealed segment is corruption, and zero bytes at the end are torn
    assert list(scan_buffer(bytes(data), 0, last=False))[-1].error.startswith("corrupt")
    z = list(scan_buffer(frame(b"a") + bytes(40), 0, last=True))
    assert z[-1].error.startswith("torn tail") and z[-1].size == 40


def random_node_folders(root: Path, seed: int = 5) -> Path:
    """A delay node's and a real-time node's folders shaped like the real thing whose segment
    files hold random bytes only."""
    rnd = random.Random(seed)
    for log in ("delay-1/messages", "delay-1/dispatch", "realtime-1/messages"):
        (root / log).mkdir(parents=True)
        (root / log / f"{0:020d}.log").write_bytes(rnd.randbytes(20_000))
    (root / "realtime-1" / "index").mkdir()
    return root


def test_a_folder_of_random_bytes_is_never_ok(spark, tmp_path):
    """Every log of the input is damaged: the counts come from the logs themselves (not from an
    observation Spark may leave out of the plan it ran), and the verdict names the files."""
    from cluster.spark.audit import AuditSettings, run
    from cluster.spark.report import verdict

    data = random_node_folders(tmp_path / "data")
    summary = run(spark, AuditSettings(paths=[str(data)], out=str(tmp_path / "out"), as_of_ms=T0))
    assert summary["no_good_record"] and summary["corrupt_records"] >= 3, summary
    assert all(v["records"] == v["errors"] > 0 for v in summary["logs"].values()), summary["logs"]
    assert {Path(f["segment"]).parent.name for f in summary["corrupt_files"]} == {"messages", "dispatch"}
    line = verdict(summary)
    assert line.startswith("PROBLEMS: no log yields a good record") and "delay-1/messages" in line, line
    assert line in (tmp_path / "out" / "report.html").read_text()
    # one good log beside damaged ones: the damage is a PROBLEMS verdict, not "OK"
    good = tmp_path / "mixed"
    write_logs(good)
    shutil.copytree(data / "realtime-1", good / "realtime-2")
    mixed = run(spark, AuditSettings(paths=[str(good)], out=str(tmp_path / "out-mixed"), as_of_ms=T0 + 5 * HOUR,
                                     report=False))
    assert not mixed["no_good_record"] and mixed["logs"]["realtime"]["errors"] >= 1
    assert verdict(mixed).startswith("PROBLEMS") and "realtime-2" in verdict(mixed)


def test_local_sessions_stay_on_the_loopback_interface(spark):
    """SPARK_LOCAL_IP defaults to 127.0.0.1 for a local master: the driver does not bind to the
    machine's network address (what spark-submit did without it)."""
    import os

    assert spark.conf.get("spark.driver.host") == "127.0.0.1"
    assert spark.conf.get("spark.driver.bindAddress") == "127.0.0.1"
    assert os.environ["SPARK_LOCAL_IP"] == "127.0.0.1"


def test_lateness_buckets_in_spark_are_the_python_ones(spark):
    """The audit's histogram buckets (``stats.bucket_sql``, run by Spark) are ``stats.bucket``."""
    from cluster.spark import stats

    vals = [0, 1, 999, 1000, 1001, 9_999, 12_345, 99_999, 100_000, 9_876_543, 86_400_000]
    rows = spark.sql(f"select v, {stats.bucket_sql('v')} as b from values "
                     + ", ".join(f"(cast({v} as bigint))" for v in vals) + " as t(v)").collect()
    assert [(r["v"], r["b"]) for r in rows] == [(v, stats.bucket(v)) for v in vals]


def test_reader_modules_agree_with_what_they_no_longer_import():
    """``cluster.spark.source`` and ``options`` keep numpy, pyarrow and the node's store out of the
    Python processes that only plan a scan; the columns and the frame-size default still agree."""
    from cluster.spark import options, rows, source
    from node.store.log import RECORD_BYTES_MAX_DEFAULT

    assert options.RECORD_BYTES_MAX_DEFAULT == RECORD_BYTES_MAX_DEFAULT
    assert tuple(source.MESSAGE_SCHEMA.fieldNames()) == rows.MESSAGE_COLUMNS
    assert tuple(source.DISPATCH_SCHEMA.fieldNames()) == rows.DISPATCH_COLUMNS
