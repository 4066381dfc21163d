"""Scrubbing: the pure plan (rate, progress, passes) and the task finding flipped bytes in
sealed segments (node/store/scrub.py, node/delay/scrub.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from node.delay.scrub import DelayScrubTask, log_targets, schedule_targets
from node.metrics import NodeMetrics
from node.role import SINGLE, Role
from node.store.group_commit import GroupCommitter
from node.store.log import SegmentedLog
from node.store.scrub import SCRUB_IDLE_WAIT_MS, ScrubPlan, ScrubStep, ScrubTarget, check_span
from tests.test_delay_store import T0, msg
from tests.test_healing import HOUR, flip, scenario

KIB = 1024


def targets(sizes: dict[str, int]) -> list[ScrubTarget]:
    return [ScrubTarget(k, f"/nowhere/{k}", 0, n, "messages") for k, n in sizes.items()]


def drive(plan: ScrubPlan, ts: list[ScrubTarget], until_ms: int, step_ms: int = 1) -> list[ScrubStep]:
    """Run the plan against a fake clock, every step checking all it asked for."""
    now, steps = 0, []
    while now < until_ms:
        got = plan.next(ts, now)
        if isinstance(got, int):
            now += max(got, step_ms)
            continue
        steps.append(got)
        plan.done(got, got.max_bytes, ts)
    return steps


def test_plan_never_exceeds_its_rate():
    plan = ScrubPlan(rate_bytes_per_s=100 * KIB, step_bytes_max=16 * KIB)
    ts = targets({"a": 300 * KIB, "b": 500 * KIB})
    steps = drive(plan, ts, until_ms=5_000)
    read = sum(s.max_bytes for s in steps)
    assert 400 * KIB <= read <= 100 * KIB * 5 + 16 * KIB  # about the rate, never over it plus one step
    assert all(s.max_bytes <= 16 * KIB for s in steps)


def test_plan_covers_every_byte_once_per_pass_and_counts_passes():
    plan = ScrubPlan(rate_bytes_per_s=1 << 30, step_bytes_max=7 * KIB)
    ts = targets({"a": 20 * KIB, "b": 3 * KIB, "c": 15 * KIB})
    seen: dict[str, list[tuple[int, int]]] = {}
    now = 0
    while plan.progress.passes < 2:
        now += 1000
        got = plan.next(ts, now)
        if isinstance(got, int):  # the bucket starts empty
            continue
        if plan.progress.passes == 0:
            seen.setdefault(got.target.key, []).append((got.pos, got.max_bytes))
        plan.done(got, got.max_bytes, ts)
    for t in ts:
        spans = seen[t.key]
        assert spans[0][0] == 0 and sum(n for _, n in spans) == t.size
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert plan.progress.bytes_checked >= 2 * sum(t.size for t in ts)


def test_plan_skips_a_deleted_target_and_picks_up_new_ones():
    plan = ScrubPlan(rate_bytes_per_s=1 << 30, step_bytes_max=4 * KIB)
    ts = targets({"a": 8 * KIB, "b": 8 * KIB})
    assert isinstance(plan.next(ts, 0), int)  # the rate bucket starts empty
    got = plan.next(ts, 1000)
    plan.done(got, got.max_bytes, ts)
    ts = targets({"b": 8 * KIB, "c": 8 * KIB})  # "a" deleted by retention
    got = plan.next(ts, 2000)
    assert (got.target.key, got.pos) == ("b", 0)
    assert plan.next([], 3000) == SCRUB_IDLE_WAIT_MS


def test_check_span_finds_every_flipped_byte_of_a_sealed_segment(tmp_path):
    lg = SegmentedLog.open(tmp_path / "log", segment_bytes_max=4 * KIB)
    rnd = random.Random(5)
    lg.append([rnd.randbytes(rnd.randint(1, 300)) for _ in range(60)])
    lg.flush()
    sealed = log_targets(lg, "messages")
    assert len(sealed) >= 2
    t = sealed[0]
    assert check_span(t, 0, 1 << 20).checked_bytes == t.size  # healthy
    healthy = open(t.path, "rb").read()
    for pos in rnd.sample(range(t.size), 25):
        data = bytearray(healthy)
        data[pos] ^= 1 << rnd.randrange(8)
        open(t.path, "wb").write(data)
        got, at = None, 0
        while at < t.size:
            r = check_span(t, at, 512)
            if r.corrupt is not None:
                got = r.corrupt
                break
            assert r.checked_bytes > 0
            at += r.checked_bytes
        assert got is not None and got.offset <= t.base + pos < got.offset + 12 + 300, pos  # its own frame
    lg.close()


class FakeNode:
    def __init__(self, store) -> None:
        self.role = Role(SINGLE, store, GroupCommitter(store.messages))
        self.store = store
        self.metrics = NodeMetrics("delay", "n1")


def value(metric, **labels) -> float:
    for fam in metric.collect():
        for s in fam.samples:
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.mark.parametrize("where", ["messages", "schedule"])
def test_scrub_task_finds_a_flipped_byte_in_a_sealed_segment(tmp_path, where):
    from tests.test_delay_store import SMALL

    h = scenario(tmp_path, T0 + 2 * HOUR)
    for k in range(4):  # 120 KB more: the message log rolls a segment (64 KiB)
        h.send([msg(1000 + k * 30 + i, T0 + 2 * HOUR + 7_000, payload=b"p" * 1000) for i in range(30)])
    store = h.store
    if where == "messages":
        sealed = log_targets(store.messages, "messages")
        assert sealed, "the small settings roll message segments"
        flip(Path(sealed[0].path))
    else:
        sealed = [t for t in schedule_targets(store.schedule.root) if not t.growing]
        assert sealed, "the small settings roll schedule data segments"
        flip(Path(sealed[0].path))
    node = FakeNode(store)
    task = DelayScrubTask(node, rate_bytes_per_s=64 << 20, step_bytes_max=8 * KIB)

    async def scrub_one_pass():
        run = asyncio.create_task(task.run())
        for _ in range(200):  # bounded: at most 10 s
            await asyncio.sleep(0.05)
            if task.plan.progress.passes >= 1 or run.done():
                break
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run  # (a task that died raises its own error here)

    asyncio.run(scrub_one_pass())
    assert task.plan.progress.passes >= 1
    assert value(node.metrics.corrupt_found, kind=where) == 1
    if where == "messages":
        assert list(task.unrepaired) == [sealed[0].key]  # no slave here: reported, not repaired
        assert value(node.metrics.corrupt_repaired, kind=where) == 0
    else:
        assert value(node.metrics.corrupt_repaired, kind=where) == 1
        assert store.healer.counters["buckets_rebuilt"] == 1
        h.now = T0 + 2 * HOUR
        h.run_until(T0 + 2 * HOUR + 8_000, step=100)
        assert len(h.delivered) == 179 and len(set(h.delivered)) == 179
    assert SMALL.message_segment_bytes < store.messages.end_offset


async def test_replicated_master_fetches_a_corrupt_sealed_segment_again_from_its_slave(tmp_path):
    """The scrub finds a flipped byte in a sealed message-log segment of the master; the
    master fetches the segment from its slave (Replication.ReadLog) and swaps it in."""
    import time

    from cluster.client import Producer, StaticResolver
    from cluster.devcluster import LocalCluster

    env = {"HOURGLASS_MESSAGE_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "64", "HOURGLASS_SCRUB_PASS_INTERVAL_MS": "100",
           "HOURGLASS_RETENTION_INTERVAL_MS": "3600000"}  # retention would delete the segment first
    with LocalCluster(tmp_path, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000, env=env) as c:
        c.wait_registered()
        master = await c.wait_master("delay")
        node = next(n for n in c.delay if n.name == master)
        slave = next(n for n in c.delay if n.name != master)
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        due = int(time.time() * 1000) + 600_000
        async with Producer(resolver) as p:
            for k in range(4):
                await asyncio.gather(*[p.send_and_wait("scrub.repair", b"r" * 1000, deliver_at_ms=due,
                                                       id=f"r{k}-{i}") for i in range(40)])
        await flip_and_expect_repair(node, slave)


async def test_realtime_node_scrub_finds_a_flipped_byte_in_a_sealed_segment(tmp_path):
    """A real-time node scrubs its message log's sealed segments too: the corrupt one is
    counted, logged and reported by Status and Verify (no member to fetch it from here)."""
    import json

    import numpy as np

    from cluster.codec import Batch
    from cluster.proto import hourglass_pb2 as pb
    from cluster.proto import hourglass_pb2_grpc as rpc
    from cluster.wire import make_request
    from node.config import NodeSettings
    from node.realtime.service import RealtimeNode
    from tests.helpers.inprocess import serving

    settings = NodeSettings(role="realtime", node_id="rt-scrub", data_dir=tmp_path / "rt", port=0,
                            realtime_segment_bytes=65536, scrub_rate_mib_s=64, scrub_pass_interval_ms=100, retention_interval_ms=3_600_000)
    n = RealtimeNode(settings)
    async with serving(n) as channel:
        producer = rpc.ProducerStub(channel)
        for k in range(5):  # 200 KB: the log rolls segments of 64 KiB
            b = Batch.build("scrub.rt", [b"q" * 1000] * 40, [f"q{k}-{i}" for i in range(40)], np.zeros(40, np.int64))
            await producer.SendBatch(make_request(b))
        sealed = log_targets(n.store.messages, "messages")
        assert sealed, "the small settings roll message segments"
        flip(Path(sealed[0].path))
        for _ in range(200):  # bounded: 10 s
            if n.scrubber.unrepaired:
                break
            await asyncio.sleep(0.05)
        assert list(n.scrubber.unrepaired) == [sealed[0].key]
        assert value(n.metrics.corrupt_found, kind="messages") == 1
        admin = rpc.AdminStub(channel)
        st = json.loads((await admin.Status(pb.StatusRequest(), timeout=5)).json)
        assert list(st["scrub"]["unrepaired"]) == [sealed[0].key]
        v = await admin.Verify(pb.VerifyRequest(), timeout=30)
        assert v.corrupt == 1 and v.unrepaired == 1


async def test_replicated_realtime_master_fetches_a_corrupt_sealed_segment_again_from_its_slave(tmp_path):
    """The same repair as the delay group's, for a real-time group (Replication.ReadLog of
    the message log)."""
    import time

    from cluster.client import Producer, StaticResolver
    from cluster.devcluster import LocalCluster

    env = {"HOURGLASS_REALTIME_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "64", "HOURGLASS_SCRUB_PASS_INTERVAL_MS": "100",
           "HOURGLASS_RETENTION_INTERVAL_MS": "3600000"}  # retention would delete the segment first
    with LocalCluster(tmp_path, n_delay=1, n_realtime=2, meta=True, realtime_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000, env=env) as c:
        c.wait_registered()
        master = await c.wait_master("realtime")
        node = next(n for n in c.realtime if n.name == master)
        slave = next(n for n in c.realtime if n.name != master)
        resolver = StaticResolver(delay=[n.address for n in c.delay], realtime=[node.address])
        now = int(time.time() * 1000)
        async with Producer(resolver) as p:
            for k in range(5):
                await asyncio.gather(*[p.send_and_wait("scrub.rt.repair", b"r" * 1000, deliver_at_ms=now,
                                                       id=f"rr{k}-{i}") for i in range(40)])
        for _ in range(100):  # delivered through the delay node: the master's log rolls (bounded: 10 s)
            if len(sorted((node.data_dir / "messages").glob("*.log"))) >= 2:
                break
            await asyncio.sleep(0.1)
        await flip_and_expect_repair(node, slave)


def flip_in_place(path: Path, pos: int) -> None:
    """Flip a bit at ``pos`` through the file's own inode (a running node keeps it open)."""
    import os

    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x04]), pos)
    finally:
        os.close(fd)


async def wait_for_line(node, text: str, timeout_s: float) -> None:
    """Until ``text`` is in the node's log (bounded by ``timeout_s``)."""
    for _ in range(int(timeout_s * 10)):
        if text in node.log_path.read_text():
            return
        await asyncio.sleep(0.1)


async def flip_and_expect_repair(node, slave) -> None:
    """Flip a byte in the master ``node``'s first sealed message-log segment once ``slave``
    holds it whole; the scrub must fetch it again from the slave (bounded waits)."""
    import json

    from cluster.proto import hourglass_pb2 as pb
    from cluster.transport import Channels

    seg = node.data_dir / "messages" / f"{0:020d}.log"
    copy = slave.data_dir / "messages" / f"{0:020d}.log"
    assert len(sorted((node.data_dir / "messages").glob("*.log"))) >= 2, "a sealed segment"
    for _ in range(100):  # the slave holds the sealed segment whole (bounded wait: 10 s)
        if copy.exists() and copy.stat().st_size == seg.stat().st_size:
            break
        await asyncio.sleep(0.1)
    healthy = seg.read_bytes()
    flip_in_place(seg, len(healthy) // 2)
    await wait_for_line(node, "segment repaired from", 20)
    assert "segment repaired from" in node.log_path.read_text(), node.tail_log()
    assert seg.read_bytes() == healthy == copy.read_bytes()
    ch = Channels()
    try:
        st = json.loads((await ch.admin(node.address).Status(pb.StatusRequest(), timeout=5)).json)
    finally:
        await ch.close()
    assert st["scrub"]["unrepaired"] == {}


async def test_replicated_master_completes_a_bucket_from_its_slave_after_retention(tmp_path):
    """A corrupt frame in a schedule bucket whose records the message log no longer has
    (retention deleted those segments) used to lose them ("lost_bytes"). The master now
    fetches the bucket's frames from its slave (Replication.ReadLog "schedule:{start}") and
    rebuilds the bucket with them: every message is still pending, none lost."""
    import time

    from cluster.client import Producer, StaticResolver
    from cluster.devcluster import LocalCluster
    from cluster.errors import NotFound

    env = {"HOURGLASS_MESSAGE_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "64", "HOURGLASS_SCRUB_PASS_INTERVAL_MS": "100",
           "HOURGLASS_RETENTION_INTERVAL_MS": "300", "HOURGLASS_CHECKPOINT_INTERVAL_MS": "200"}
    with LocalCluster(tmp_path, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000, env=env) as c:
        c.wait_registered()
        master = await c.wait_master("delay")
        node = next(n for n in c.delay if n.name == master)
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        due = int(time.time() * 1000) + 900_000
        ids = [f"b{k}-{i}" for k in range(6) for i in range(40)]
        async with Producer(resolver) as p:
            for k in range(6):
                await asyncio.gather(*[p.send_and_wait("heal.fetch", b"f" * 1000, deliver_at_ms=due + i, id=mid)
                                       for i, mid in enumerate(ids[k * 40:(k + 1) * 40])])
            first_seg = node.data_dir / "messages" / f"{0:020d}.log"
            for _ in range(200):  # retention deletes the first message segments (bounded: 20 s)
                if not first_seg.exists():
                    break
                await asyncio.sleep(0.1)
            assert not first_seg.exists(), node.tail_log()
            (seg,) = sorted((node.data_dir / "schedule").glob("*/data/*.log"))
            flip_in_place(seg, 200)  # inside the first frame: records the message log no longer has
            await wait_for_line(node, "schedule bucket completed from a member", 30)
            statuses = {}
            for mid in ids:
                try:
                    statuses[mid] = (await p.lookup(mid)).status
                except NotFound:
                    statuses[mid] = "lost"
        assert statuses == {mid: "pending" for mid in ids}
        text = node.log_path.read_text()
        assert "rebuild incomplete" in text  # the first rebuild did lose records ...
        assert "schedule bucket completed from a member" in text  # ... and the slave gave them back


def test_plan_paces_passes_by_time_when_there_is_little_to_check():
    """Issue 28: a few KiB of segments were re-checked in a busy loop (161,031 passes in 50 s):
    passes start at least a minute apart, and a small step still costs a minimum of the rate."""
    plan = ScrubPlan(rate_bytes_per_s=4 << 20, step_bytes_max=1 << 20)
    ts = targets({"a": 2 * KIB, "b": 3 * KIB})
    steps = drive(plan, ts, until_ms=10 * 60_000, step_ms=1)
    assert 9 <= plan.progress.passes <= 11  # one a minute, whatever the byte budget allows
    assert len(steps) <= 2 * 11
