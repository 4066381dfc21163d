"""Spark jobs on real Spark (local mode, one session for the module), real files, real clusters.

* the ``hourglass`` data source reads what the storage engine wrote - including a torn
  tail, a flipped body bit and a flipped header bit - and agrees with the engine's reader;
* the audit finds a planted lost message, duplicate, delivery after cancel and late
  delivery in data produced by a real local cluster (planting described in
  ``plant_anomalies``);
* bulk-schedule delivers every good row once, also when rerun, and rejects bad rows
  with a reason.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from cluster.client import Consumer, Producer, StaticResolver  # noqa: E402
from cluster.devcluster import LocalCluster  # noqa: E402
from cluster.errors import CorruptRecord  # noqa: E402
from node.delay.store import DelayStore, StoreSettings  # noqa: E402
from node.realtime.store import RealtimeSettings, RealtimeStore  # noqa: E402
from node.store import records  # noqa: E402
from node.store.log import HEADER_SIZE, SegmentedLog, frame  # noqa: E402
from node.store.records import Message  # noqa: E402

T0 = 1_800_000_000_000
HOUR = 3_600_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def spark():
    from cluster.spark.session import SessionSettings, build_session

    s = build_session(SessionSettings(master="local[2]", shuffle_partitions=2, app_name="hourglass-tests"))
    yield s
    s.stop()


def read(spark, path, log):
    return spark.read.format("hourglass").option("log", log).load(str(path))


# ---------------------------------------------------------------------- data source vs engine


def write_engine_data(root: Path) -> None:
    """A delay node and a real-time node written by the real stores, several segments per log,
    schedule buckets over three hours, dispatches and a cancel."""
    st = DelayStore.open(root / "delay-1", StoreSettings(message_segment_bytes=1 << 13, dispatch_segment_bytes=1 << 11,
                                                         schedule_segment_bytes=1 << 13), now_ms=T0)
    st.accept([Message(0, 0, T0 + 1000 + i * 10 if i < 150 else T0 + (i % 3 + 1) * HOUR, f"m{i}", "orders",
                       b"p" * (i % 50), tags=("eu",) if i % 2 else ()) for i in range(200)], now_ms=T0)
    st.flush_messages()
    st.iterate(limit=None)
    st.cancel("m7", now_ms=T0)
    st.flush_messages()
    st.iterate(limit=None)
    t = T0
    while t < T0 + 4000:
        t += 10
        due = st.poll_due(now_ms=t)
        st.ack_dispatched([(d.seq, d.effective_ms) for d in due], now_ms=t)
    st.close()
    rt = RealtimeStore.open(root / "realtime-1", RealtimeSettings(segment_bytes=1 << 13), now_ms=T0)
    rt.append([Message(0, 0, T0 + 1000 + i * 10, f"m{i}", "orders", b"q" * (i % 40)) for i in range(150) if i != 7],
              now_ms=T0 + 2500)
    rt.close()


def engine_offsets(directory: Path) -> list[int]:
    with SegmentedLog.open(directory) as log:
        return [off for off, _ in log.iterate()]


def flip_bit(path: Path, pos: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_data_source_reads_engine_files_and_reports_damage_like_the_engine(spark, tmp_path):
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    write_engine_data(clean)
    shutil.copytree(clean, damaged)
    expect = {
        "message": engine_offsets(clean / "delay-1" / "messages"),
        "dispatch": engine_offsets(clean / "delay-1" / "dispatch"),
        "realtime": engine_offsets(clean / "realtime-1" / "messages"),
    }
    assert len(expect["message"]) == 201 and len(expect["realtime"]) == 149
    assert len(expect["dispatch"]) == 149  # 150 due in the first seconds, one of them cancelled

    # torn tail: half a frame at the end of the delay node's newest message segment
    msg_segs = sorted((damaged / "delay-1" / "messages").glob("*.log"))
    torn_at = int(msg_segs[-1].stem) + msg_segs[-1].stat().st_size
    with open(msg_segs[-1], "ab") as f:
        f.write(frame(b"x" * 40)[:25])
    # flipped body bit in the middle of a sealed real-time segment
    rt_segs = sorted((damaged / "realtime-1" / "messages").glob("*.log"))
    assert len(rt_segs) >= 2
    rt_bad = next(o for o in expect["realtime"] if o > int(rt_segs[0].stem) + 1000)
    flip_bit(rt_segs[0], rt_bad - int(rt_segs[0].stem) + HEADER_SIZE + 3, 5)
    # flipped header bit (the length) in a sealed dispatch segment: the reader must resynchronise
    d_segs = sorted((damaged / "delay-1" / "dispatch").glob("*.log"))
    assert len(d_segs) >= 2
    d_bad = expect["dispatch"][5]
    flip_bit(d_segs[0], d_bad + 1, 2)

    got = {}
    for log in ("message", "dispatch", "realtime"):
        rows = read(spark, damaged, log).select("offset", "frame_bytes", "error", "seq").collect()
        got[log] = rows
    good = {log: sorted(r["offset"] for r in rows if r["error"] is None) for log, rows in got.items()}
    bad = {log: [r for r in rows if r["error"] is not None] for log, rows in got.items()}

    # torn tail: every record is read, the tail is one "torn tail" row; the engine agrees after recovery
    assert good["message"] == expect["message"]
    assert [(r["offset"], r["frame_bytes"]) for r in bad["message"]] == [(torn_at, 25)]
    assert bad["message"][0]["error"].startswith("torn tail")
    recovered = tmp_path / "recovered"
    shutil.copytree(damaged / "delay-1" / "messages", recovered)
    assert engine_offsets(recovered) == good["message"]

    # body bit: one corrupt row at the engine's CorruptRecord offset; everything else is read
    assert good["realtime"] == [o for o in expect["realtime"] if o != rt_bad]
    assert [r["offset"] for r in bad["realtime"]] == [rt_bad]
    assert "body checksum mismatch" in bad["realtime"][0]["error"]
    with SegmentedLog.open(damaged / "realtime-1" / "messages") as log:
        seen = []
        with pytest.raises(CorruptRecord) as ei:
            for off, _ in log.iterate():
                seen.append(off)
    assert ei.value.offset == rt_bad
    assert seen == [o for o in good["realtime"] if o < rt_bad]

    # header bit: the reader skips exactly the damaged frame and finds the next one
    assert good["dispatch"] == [o for o in expect["dispatch"] if o != d_bad]
    (row,) = bad["dispatch"]
    assert row["offset"] == d_bad and row["frame_bytes"] == HEADER_SIZE + 25
    assert "header checksum mismatch" in row["error"]

    # the schedule log: as many records as the engine filed, and pushdown skips whole hour buckets
    sched = read(spark, clean, "schedule")
    assert sched.where("error is null").count() == 201
    assert sched.rdd.getNumPartitions() >= 4
    late = sched.where(f"effective_ms >= {T0 + 2 * HOUR}")
    assert late.rdd.getNumPartitions() < sched.rdd.getNumPartitions()
    assert late.count() == sum(1 for i in range(150, 200) if (i % 3 + 1) >= 2)
    # decoded fields are the engine's
    m = read(spark, clean, "message").where("id = 'm7' and kind = 'cancel'").collect()
    assert len(m) == 1 and m[0]["subject"] == "orders" and m[0]["cancels_seq"] is not None


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


def plant_anomalies(data: Path, *, now: int, dup_id: str, cancelled_id: str, subject: str) -> None:
    """Write extra records with the real storage engines into a *copy* of a stopped cluster's data.

    * lost: ``DelayStore.accept`` of ``planted-lost`` due 5 minutes ago; it is never iterated
      nor dispatched, and no real-time node has it;
    * late: ``planted-late`` accepted on the delay node, due 4 minutes ago, and stored by
      ``RealtimeStore.append`` 2 minutes after its due time;
    * duplicate: ``RealtimeStore.append`` of an already delivered message 11 minutes from now,
      past the real-time node's 10-minute de-duplication window, so the engine stores it again
      (what a failover outside the window would do);
    * delivered after cancel: the same for the message the test cancelled through the SDK.
    """
    st = DelayStore.open(data / "delay-1", now_ms=now - 300_000)
    [ok] = st.accept([Message(0, 0, now - 300_000, "planted-lost", subject, b"lost")], now_ms=now - 300_000)
    assert not isinstance(ok, Exception), ok
    [ok] = st.accept([Message(0, 0, now - 240_000, "planted-late", subject, b"late")], now_ms=now - 241_000)
    assert not isinstance(ok, Exception), ok
    st.flush_messages()
    st.close()
    later = now + 11 * 60_000
    rt = RealtimeStore.open(data / "realtime-1", now_ms=later)
    res = rt.append([Message(0, 0, now - 240_000, "planted-late", subject, b"late")], now_ms=now - 120_000)
    res += rt.append([Message(0, 0, now - 60_000, dup_id, subject, b"again"),
                      Message(0, 0, now - 60_000, cancelled_id, subject, b"cancelled")], now_ms=later)
    assert all(not isinstance(r, Exception) and not r.duplicate for r in res), res
    rt.close()


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
    assert st["delivered"] == n + 1  # n sent + other-1 + planted-late, minus a-3 (duplicated)
    assert summary["corrupt_records"] == 0

    msgs = {r["id"]: r for r in spark.read.parquet(str(out / "messages")).collect()}
    assert msgs["planted-lost"]["status"] == "lost" and msgs["planted-lost"]["reason"] == "never dispatched"
    assert msgs["a-3"]["status"] == "duplicated" and msgs["a-3"]["received"] == 2
    assert msgs["cancel-me"]["status"] == "delivered_after_cancel"
    assert msgs["planted-late"]["lateness_ms"] == 120_000 and msgs["planted-late"]["late"]
    problems = {(r["id"], r["problem"]) for r in spark.read.parquet(str(out / "problems")).collect()}
    assert problems == {("planted-lost", "lost"), ("a-3", "duplicated"), ("cancel-me", "delivered_after_cancel"),
                        ("planted-late", "late")}
    lat = [r for r in spark.read.parquet(str(out / "lateness")).collect() if r["subject"] == subject]
    assert max(r["max_ms"] or 0 for r in lat) == 120_000
    assert sum(r["delivered"] for r in lat) == n + 1  # the n sent (a-3 once) and planted-late
    assert (out / "report.html").exists() and (out / "status.png").stat().st_size > 1000
    html = (out / "report.html").read_text()
    assert "PROBLEMS" in html and "planted-lost" in html
    assert json.loads((out / "summary.json").read_text())["status"] == st

    # the untouched cluster data audits clean
    clean = run(spark, AuditSettings(paths=[str(tmp_path / "cluster")], out=str(tmp_path / "audit-clean"),
                                     as_of_ms=t + 60_000, report=False))
    assert clean["status"]["lost"] == clean["status"]["duplicated"] == 0
    assert clean["status"]["delivered_after_cancel"] == 0 and clean["status"]["cancelled"] == 1
    assert clean["status"]["delivered"] == n + 1


# ---------------------------------------------------------------------- bulk-schedule


def test_bulk_schedule_delivers_every_row_once_also_when_rerun(spark, tmp_path):
    from cluster.spark.bulk import BulkSettings, run

    n, subject = 25, "bulk.orders"
    with LocalCluster(tmp_path / "cluster") as c:
        resolver = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])
        due = now_ms() + 1500
        lines = ["id,subject,deliver_at,payload,tags"]
        lines += [f"b-{i},{subject},{due + 20 * i},payload {i},\"red,blue\"" for i in range(n)]
        lines += ["bad-subject,no spaces allowed,1,x,", f",{subject},1,no id,", f"bad-time,{subject},tomorrow,x,"]
        csv = tmp_path / "rows.csv"
        csv.write_text("\n".join(lines) + "\n")

        first = run(spark, BulkSettings(input=str(csv), out=str(tmp_path / "run1"),
                                        delay_nodes=[c.delay[0].address], rate_per_s=200, batch_max=10))
        assert (first["scheduled"], first["duplicate"], first["rejected"], first["failed"]) == (n, 0, 3, 0)
        rejects = [json.loads(line) for p in (tmp_path / "run1" / "rejects").glob("*.json")
                   for line in p.read_text().splitlines()]
        reasons = {r.get("id"): r["reason"] for r in rejects}
        assert set(reasons) == {"bad-subject", None, "bad-time"}
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
    from cluster.spark.bulk import BadRow, TokenBucket, node_for, plan_row

    t = T0
    p = plan_row({"id": "x", "subject": "s", "deliver_at": "2027-01-15T10:00:00Z", "payload": "hi", "tags": "a, b"},
                 now_ms=t)
    assert p.deliver_at_ms == T0 + 2 * HOUR
    assert plan_row({"id": "x", "subject": "s", "deliver_at": "2027-01-15T08:00:00"}, now_ms=t).deliver_at_ms == T0
    assert p.tags == ("a", "b") and p.payload == b"hi"
    for row, why in [({"subject": "s", "deliver_at": 1}, "id is missing"),
                     ({"id": "a b", "subject": "s", "deliver_at": 1}, "invalid id"),
                     ({"id": "x", "subject": "s", "deliver_at": t + 3 * 366 * 24 * HOUR}, "delay horizon"),
                     ({"id": "x", "subject": "s", "deliver_at": 1, "payload": "%%", }, None),
                     ({"id": "x", "subject": "s", "deliver_at": None}, "deliver_at is missing")]:
        if why is None:
            with pytest.raises(BadRow, match="base64"):
                plan_row(row, now_ms=t, payload_encoding="base64")
            continue
        with pytest.raises(BadRow, match=why):
            plan_row(row, now_ms=t)
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
    assert struct.calcsize("<Qqqb") == 25
    assert records.KIND_CANCEL == 2


def test_fast_decoder_agrees_with_engine_codec():
    """``scan.decode_message`` (the audit's hot path) accepts exactly what ``records.decode`` accepts."""
    import random

    from cluster.spark.scan import Undecodable, decode_message

    rnd = random.Random(7)
    for i in range(300):
        kind = records.KIND_CANCEL if i % 7 == 0 else records.KIND_MESSAGE
        m = Message(seq=rnd.randrange(1 << 50), store_ms=rnd.randrange(-5, 1 << 42),
                    deliver_at_ms=rnd.randrange(1 << 42), msg_id=f"id-{i}-é", subject=f"s.{i % 5}",
                    payload=struct.pack("<Q", i) if kind == records.KIND_CANCEL else rnd.randbytes(rnd.randrange(40)),
                    tags=tuple(f"t{j}" for j in range(rnd.randrange(3))),
                    properties=tuple((f"k{j}", "v" * j) for j in range(rnd.randrange(3))),
                    attempts=rnd.randrange(5), kind=kind)
        body = records.encode(m)
        ref = records.decode(body)
        got = decode_message(body, True)
        assert got[:7] == (ref.kind, ref.attempts, ref.seq, ref.store_ms, ref.deliver_at_ms, ref.msg_id, ref.subject)
        assert tuple(got[7]) == ref.tags and tuple(got[8]) == ref.properties
        if kind == records.KIND_MESSAGE:
            assert got[10] == ref.payload and got[9] == len(ref.payload)
        else:
            assert got[11] == i
        for bad in [body[:k] for k in range(0, len(body), 3)] + [body + b"\0", b"\x02" + body[1:],
                                                                 body[:1] + b"\x09" + body[2:]]:
            try:
                records.decode(bad)
                engine_ok = True
            except Exception:
                engine_ok = False
            try:
                decode_message(bad, True)
                fast_ok = True
            except Undecodable:
                fast_ok = False
            assert fast_ok == engine_ok or (engine_ok and kind == records.KIND_CANCEL), bad
