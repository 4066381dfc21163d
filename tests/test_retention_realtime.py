"""Real-time retention (issue 14): pure rules, the store lifecycle (segments deleted once every
group is past them and they are due, index compaction with stable handles), idle groups,
a SIGKILL mid-retention, and the disk watermark on the real-time SendBatch."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from cluster.codec import Batch
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.wire import make_request, pack_ranges
from node.config import NodeSettings
from node.realtime import retention as RR
from node.realtime.retention import GroupPosition
from node.realtime.service import RealtimeNode
from tests.helpers.inprocess import serving
from node.realtime.store import RealtimeSettings, RealtimeStore

REPO = Path(__file__).resolve().parent.parent
T0 = 1_900_000_000_000
HOUR = 3_600_000

# --------------------------------------------------------------------------- pure rules

SEGS = [(0, 100, 1000), (100, 100, 2000), (200, 100, 3000), (300, 10, 10_000)]  # last: active


def decide(groups, *, now=10_000, retention_ms=0, retention_bytes=0, idle_ms=1 << 40, dedup=None, indexed=1 << 40,
           slaves=None):
    return RR.decide(SEGS, 310, groups, now_ms=now, retention_ms=retention_ms, retention_bytes=retention_bytes,
                     group_idle_ms_max=idle_ms, dedup_offset=dedup, indexed_offset=indexed, slave_holds=slaves)


def test_segments_go_once_every_group_is_past_them_and_never_the_active_one():
    d = decide([GroupPosition("s/a", 150, 9000), GroupPosition("s/b", 250, 9000)])
    assert (d.cut.offset, d.cut.held_by) == (100, "group:s/a")
    d = decide([GroupPosition("s/a", None, 9000)])  # everything acked
    assert (d.cut.offset, d.cut.held_by) == (300, "active segment")


def test_age_or_size_is_required_in_addition_to_the_groups():
    g = [GroupPosition("s/a", None, 9000)]
    d = decide(g, retention_ms=8500)  # only segment 0 (sealed at 1000) is older than 8.5 s
    assert (d.cut.offset, d.cut.held_by) == (100, "age/size")
    d = decide(g, retention_ms=1 << 40, retention_bytes=150)  # 310 bytes: two segments over the cap
    assert d.cut.offset == 200
    # unconsumed data of an active group stays however old and large
    d = decide([GroupPosition("s/a", 0, 9000)], retention_ms=0, retention_bytes=1)
    assert (d.cut.offset, d.cut.held_by) == (0, "group:s/a")


def test_an_idle_group_holds_nothing_the_other_holds():
    d = decide([GroupPosition("s/idle", 0, 0), GroupPosition("s/a", 210, 9000)], idle_ms=5000)
    assert d.idle == ["s/idle"]
    assert (d.cut.offset, d.cut.held_by) == (200, "group:s/a")


def test_dedup_checkpoint_and_slaves_hold():
    g = [GroupPosition("s/a", None, 9000)]
    assert decide(g, dedup=120).cut.held_by == "dedup"
    assert decide(g, indexed=199).cut.offset == 100
    assert decide(g, slaves={"slave:b": 0}).cut.held_by == "slave:b"


def test_index_compaction_rule():
    assert not RR.compact_index(0, 100, 0, entries_min=1)
    assert RR.compact_index(0, 100, 50, entries_min=1)
    assert not RR.compact_index(0, 100, 40, entries_min=1)   # less than half dead
    assert not RR.compact_index(0, 100, 60, entries_min=100)  # too few to bother
    assert RR.compact_index(10, 10, 10, entries_min=0) is False  # nothing dead


# --------------------------------------------------------------------------- store lifecycle

SET = RealtimeSettings(segment_bytes=4096, dedup_window_ms=1000, retention_ms=0, index_compact_entries_min=8,
                       group_idle_ms_max=60_000, ack_timeout_ms=600_000)


def batch(k: int, subject: str = "orders", n: int = 10) -> Batch:
    return Batch.build(subject, [b"x" * 100] * n, [f"{subject}-{k}-{j}" for j in range(n)], T0)


def retain(st: RealtimeStore, now: int, slave_holds=None):
    work, report = st.retention_plan(now_ms=now, slave_holds=slave_holds)
    work.run()
    st.retention_finish(work)
    return work, report


def ids_of(b: Batch) -> list[str]:
    return b.id_list()


def test_lifecycle_deletes_consumed_segments_keeps_unacked_and_handles(tmp_path):
    st = RealtimeStore.open(tmp_path, SET, now_ms=T0)
    sent = []
    for k in range(60):  # ~60 frames of ~1.2 KB: about 20 segments
        st.append(batch(k), now_ms=T0 + k)
        sent += [f"orders-{k}-{j}" for j in range(10)]
    st.flush()
    b, h = st.pull(["orders"], "g", "c", max_messages=400, now_ms=T0 + 100)
    assert ids_of(b) == sent[:400]
    st.ack("orders", "g", [(0, 350)], now_ms=T0 + 100)  # 350..399 in flight, 400.. never pulled
    st.flush()
    segs_before = len(st.messages.segment_bases())
    work, report = retain(st, T0 + 10_000)
    assert work.segments and len(st.messages.segment_bases()) < segs_before
    assert report.held_by == "group:orders/g"
    # the frame holding handle 350 is still there; every unacked message can be read
    assert st.messages.start_offset <= int(st._indexes.by_subject["orders"].read(st._indexes.fd(st._indexes.by_subject["orders"]), 350, 1)
                                              ["offset"][0])
    assert st.counters["index_compactions"] == 1
    ix = st._indexes.by_subject["orders"]
    assert ix.base > 0 and ix.path.name == f"entries.{ix.base:020d}"
    retain(st, T0 + 10_001)  # deletes the old index file once the new one is durable
    assert [p.name for p in ix.path.parent.iterdir()] == [ix.path.name]
    st.close()

    st = RealtimeStore.open(tmp_path, SET, now_ms=T0 + 20_000)
    got, handles = [], []
    for _ in range(10):
        b, h = st.pull(["orders"], "g", "c", max_messages=100, now_ms=T0 + 20_000)
        if not b.n:
            break
        got += ids_of(b)
        handles += h.tolist()
        st.ack("orders", "g", pack_pairs(h), now_ms=T0 + 20_000)
    assert sorted(got) == sorted(sent[350:]), "nothing unacked lost, nothing acked redelivered"
    assert sorted(handles) == list(range(350, 600)), "handles are stable across compaction and reopen"
    # new messages get the next handles
    st.append(batch(999), now_ms=T0 + 20_001)
    b, h = st.pull(["orders"], "g", "c", max_messages=100, now_ms=T0 + 20_001)
    assert h.tolist() == list(range(600, 610))
    st.flush()
    retain(st, T0 + 30_000)
    assert st.messages.start_offset > 0
    st.close()


def pack_pairs(h: np.ndarray) -> list[tuple[int, int]]:
    return [(int(a), int(a) + 1) for a in h]


def test_age_keeps_consumed_data_until_due(tmp_path):
    st = RealtimeStore.open(tmp_path, RealtimeSettings(segment_bytes=4096, dedup_window_ms=1000, retention_ms=HOUR),
                            now_ms=T0)
    for k in range(20):
        st.append(batch(k), now_ms=T0 + k)
    st.flush()
    b, h = st.pull(["orders"], "g", "c", max_messages=1000, now_ms=T0 + 100)
    st.ack("orders", "g", [(0, b.n)], now_ms=T0 + 100)
    _, report = retain(st, T0 + 10_000)
    assert st.messages.start_offset == 0 and report.held_by == "age/size"
    retain(st, T0 + 2 * HOUR)
    assert st.messages.start_offset > 0
    st.close()


def test_idle_group_stops_holding_and_resumes_at_the_first_entry_on_disk(tmp_path, caplog):
    st = RealtimeStore.open(tmp_path, SET, now_ms=T0)
    for k in range(40):
        st.append(batch(k), now_ms=T0 + k)
    st.flush()
    st.pull(["orders"], "idle", "c", max_messages=5, now_ms=T0)  # 5 in flight, then silence
    b, h = st.pull(["orders"], "busy", "c", max_messages=1000, now_ms=T0)
    st.ack("orders", "busy", [(0, 300)], now_ms=T0)
    st.flush()
    _, report = retain(st, T0 + 1000)
    assert st.messages.start_offset == 0 and report.held_by == "group:orders/idle"
    st.pull(["orders"], "busy", "c", max_messages=1, now_ms=T0 + 70_000)  # busy stays active
    with caplog.at_level(logging.WARNING, "hourglass.realtime.store"):
        _, report = retain(st, T0 + 70_000)
    assert report.idle_groups == 1 and st.counters["groups_idled"] == 1
    assert "consumer group idle" in caplog.text and "group=idle" in caplog.text
    assert report.held_by == "group:orders/busy"
    live = st._indexes.by_subject["orders"].live_from
    assert live > 0 and st.messages.start_offset > 0
    retain(st, T0 + 70_001)  # idle again: logged once only
    assert st.counters["groups_idled"] == 1
    st.close()
    st = RealtimeStore.open(tmp_path, SET, now_ms=T0 + 80_000)  # positions survive a restart
    with caplog.at_level(logging.WARNING, "hourglass.realtime.store"):
        b, h = st.pull(["orders"], "idle", "c", max_messages=3, now_ms=T0 + 80_000)
    assert h.tolist() == [live, live + 1, live + 2], "resumes at the first entry still on disk"
    assert st.counters["groups_resumed"] == 1 and st.counters["resumed_skipped_messages"] == live
    assert "consumer group active again" in caplog.text
    st.close()


def test_slave_holds_and_replay_after_deletion_with_dedup(tmp_path):
    st = RealtimeStore.open(tmp_path, SET, now_ms=T0)
    for k in range(20):
        st.append(batch(k), now_ms=T0 + k)
    st.flush()
    _, report = retain(st, T0 + 10_000, slave_holds={"slave:b": 0})
    assert st.messages.start_offset == 0 and report.held_by == "slave:b"
    retain(st, T0 + 10_000, slave_holds={"slave:b": st.messages.end_offset})
    start = st.messages.start_offset
    assert start > 0
    # the dedup window holds frames stored within it
    st.append(batch(100), now_ms=T0 + 10_000)
    for k in range(101, 110):
        st.append(batch(k), now_ms=T0 + 10_500)
    st.flush()
    _, report = retain(st, T0 + 10_600)
    assert report.held_by == "dedup"
    st.close()
    st = RealtimeStore.open(tmp_path, SET, now_ms=T0 + 10_700)
    res = st.append(batch(100), now_ms=T0 + 10_700)
    assert res.duplicates.all(), "the dedup window survives a restart after deletions"
    st.close()


# --------------------------------------------------------------------------- crash mid-retention

CHILD = textwrap.dedent("""
    import json, sys, random
    sys.path.insert(0, {repo!r})
    from tests.test_retention_realtime import SET, batch, T0
    from node.realtime.store import RealtimeStore
    now = {now}
    st = RealtimeStore.open({path!r}, SET, now_ms=now)
    sent, acked = open({sent!r}, "a"), open({acked!r}, "a")
    rnd = random.Random({seed})
    k = {start}
    while True:
        now += 100
        st.append(batch(k, n=5), now_ms=now)
        st.flush(groups=False)
        sent.write(json.dumps([f"orders-{{k}}-{{j}}" for j in range(5)]) + "\\n"); sent.flush()
        k += 1
        b, h = st.pull(["orders"], "g", "c", max_messages=rnd.randint(1, 8), now_ms=now)
        done = [(int(x), int(x) + 1) for x, i in zip(h, b.id_list()) if rnd.random() < 0.8]
        ids = [i for x, i in zip(h, b.id_list()) if (int(x), int(x) + 1) in done]
        if done:
            st.ack("orders", "g", done, now_ms=now)
            st.persist_group("orders", "g")
            acked.write(json.dumps(ids) + "\\n"); acked.flush()
        if k % 3 == 0:
            st.flush()
        work, _ = st.retention_plan(now_ms=now + 5000)
        work.run()
        st.retention_finish(work)
""")


@pytest.mark.integration  # tier: a subprocess killed with SIGKILL
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_during_retention_loses_nothing_unacked(tmp_path, seed):
    """A child appends, pulls, acks and runs retention in a loop; it is SIGKILLed at a seeded
    moment, twice; the store opens every time and every sent message not acked is delivered."""
    rnd = random.Random(seed)
    data, sent_f, acked_f = tmp_path / "data", tmp_path / "sent.jsonl", tmp_path / "acked.jsonl"
    now, start = T0, 0
    for round_ in range(2):
        code = CHILD.format(repo=str(REPO), path=str(data), now=now, sent=str(sent_f), acked=str(acked_f),
                            seed=seed * 10 + round_, start=start)
        p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True,
                             stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while not (sent_f.exists() and sent_f.stat().st_size) and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)  # the child is up (imports take a while on a busy machine)
            time.sleep(rnd.uniform(0.5, 2.0))
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
            p.stderr.close()
        start = 100_000 * (round_ + 1)
        now += 10_000_000
        st = RealtimeStore.open(data, SET, now_ms=now)  # starts after the kill
        assert not list(data.rglob("*.deleting")) and not list(data.rglob("*.tmp"))
        sent = [i for x in sent_f.read_text().splitlines() if x.endswith("]") for i in json.loads(x)]
        acked = {i for x in acked_f.read_text().splitlines() if x.endswith("]") for i in json.loads(x)}
        assert st.messages.start_offset > 0 or round_ == 0
        got: set[str] = set()
        for _ in range(1000):
            b, h = st.pull(["orders"], "check", "c", max_messages=1000, now_ms=now)
            if not b.n:
                break
            got |= set(b.id_list())
            st.ack("orders", "check", [(int(h.min()), int(h.max()) + 1)], now_ms=now)
        # group "g" resumed after the kill: whatever it has not acked must still be there
        for _ in range(1000):
            b, h = st.pull(["orders"], "g", "c", max_messages=1000, now_ms=now)
            if not b.n:
                break
            got |= set(b.id_list())
            st.ack("orders", "g", [(int(h.min()), int(h.max()) + 1)], now_ms=now)
        missing = [i for i in sent if i not in acked and i not in got]
        assert not missing, missing[:10]
        st.close()
        sent_f.write_text(""), acked_f.write_text("")  # the next round starts from a drained store
        st = RealtimeStore.open(data, SET, now_ms=now)
        b, h = st.pull(["orders"], "g", "c", max_messages=1, now_ms=now)
        assert not b.n
        st.close()


# --------------------------------------------------------------------------- disk watermark on SendBatch

TMPFS_BYTES = 8 << 20


@pytest.mark.integration  # tier: a node on a real port, a tmpfs mounted
@pytest.mark.parametrize("watermark_bytes", [2 << 20, 0], ids=["watermark", "enospc"])
async def test_realtime_send_refused_when_disk_low_pulls_and_acks_go_on(tmpfs, watermark_bytes):
    disk = tmpfs(TMPFS_BYTES)
    settings = NodeSettings(role="realtime", node_id="rt-disk", data_dir=disk / "rt", port=0,
                            disk_free_min_bytes=watermark_bytes, disk_free_min_ratio=0.5,
                            disk_resume_margin_bytes_max=256 << 10, disk_check_interval_ms=50,
                            realtime_segment_bytes=1 << 20, retention_interval_ms=100_000)
    n = RealtimeNode(settings)
    async with serving(n) as channel:
        producer, consumer = rpc.ProducerStub(channel), rpc.ConsumerStub(channel)
        try:
            await producer.SendBatch(make_request(Batch.build("orders", [b"a", b"b"], ["first", "second"], 0)))
            pull = pb.PullRequest(subject="orders", group="g", consumer_id="c", max_messages=1)
            assert Batch.decode((await consumer.Pull(pull)).batch).id_list() == ["first"]  # the group exists
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            ballast = (free - (1 << 20)) if watermark_bytes else free  # below the mark / completely full
            with open(disk / "ballast", "wb") as f:
                try:
                    f.write(b"\1" * ballast)
                except OSError:
                    pass
            await asyncio.sleep(0.3)  # a disk reading
            code = details = None
            for k in range(50):
                b = Batch.build("orders", [os.urandom(2000)] * 50, [f"k{k}-{j}" for j in range(50)], 0)
                try:
                    await producer.SendBatch(make_request(b))
                except grpc.aio.AioRpcError as e:
                    code, details = e.code(), e.details()
                    break
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("disk full"), (code, details)
            # pulls and acks go on
            resp = await consumer.Pull(pull)
            h = np.frombuffer(resp.handles, "<u8")
            assert Batch.decode(resp.batch).id_list() == ["second"]
            ack = pb.AckRequest(group="g", acks=[pb.SubjectHandles(subject="orders", ranges=pack_ranges(h))])
            try:
                await consumer.Ack(ack)
            except grpc.aio.AioRpcError as e:  # a disk with no reserve left cannot record an ack either
                assert not watermark_bytes and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert e.details().startswith("disk full"), e.details()
            (disk / "ballast").unlink()
            for _ in range(100):  # writes are taken again, by themselves
                try:
                    await producer.SendBatch(make_request(Batch.build("orders", [b"y"], ["after"], 0)))
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("writes not taken again after space was freed")
            await consumer.Ack(ack)
            assert n.metrics.disk_refusals._value.get() >= 1
        finally:
            (disk / "ballast").unlink(missing_ok=True)
