"""Derived data heals itself: a schedule bucket that fails a check is rebuilt from the
message log, nothing lost, nothing delivered twice (node/delay/heal.py)."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.client import Consumer, Producer, StaticResolver
from cluster.codec import Batch
from cluster.devcluster import LocalCluster, free_port
from cluster.errors import NotFound, TooLate
from node.store.log import HEADER, HEADER_SIZE
from node.store.schedule import REBUILT_MARKER, ScheduleLog
from tests.test_delay_store import SMALL, T0, Harness, msg

HOUR = 3_600_000
PAYLOAD_1K = b"f" * 1000


def bucket_dir(root: Path, start_ms: int) -> Path:
    return Path(root) / "schedule" / f"{start_ms:018d}"


def flip(path: Path, at: int | None = None) -> int:
    """Flip one bit of a byte in the middle of ``path`` (or at ``at``); returns the position."""
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if at is None else at
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    return pos


def data_segment(root: Path, start_ms: int) -> Path:
    (seg,) = sorted((bucket_dir(root, start_ms) / "data").glob("*.log"))
    return seg


def scenario(tmp_path, due_base: int, n: int = 60) -> Harness:
    """n messages due over 6 s from ``due_base`` in 6 batches; m3 cancelled."""
    h = Harness(tmp_path)
    for k in range(6):
        h.send([msg(i, due_base + 1_000 * (1 + i % 6) + i) for i in range(k * n // 6, (k + 1) * n // 6)])
    h.store.cancel("m3", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    return h


def test_flipped_byte_in_current_bucket_is_rebuilt_at_open(tmp_path):
    h = scenario(tmp_path, T0)
    h.run_until(T0 + 3_500)  # about half delivered
    first = list(h.delivered)
    assert first and "m3" not in first
    h.store.checkpoint()
    flip(data_segment(tmp_path, T0))
    h.crash()
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert (bucket_dir(tmp_path, T0) / REBUILT_MARKER).exists()
    assert h.store.lookup("m3").status == "cancelled"
    assert h.store.lookup(first[0]).status == "dispatched"
    h.delivered = []
    h.run_until(T0 + 10_000)
    everything = first + h.delivered
    assert sorted(everything) == sorted(f"m{i}" for i in range(60) if i != 3)
    assert len(everything) == len(set(everything))  # nothing delivered twice


def test_flipped_byte_in_future_bucket_heals_on_lookup_and_cancel(tmp_path):
    future = T0 + 2 * HOUR
    h = scenario(tmp_path, future)
    h.store.checkpoint()
    flip(data_segment(tmp_path, future))  # under the running store: found by the next read
    assert h.store.healer.counters["buckets_rebuilt"] == 0
    statuses = {i: h.store.lookup(f"m{i}").status for i in range(60)}  # every id of the hour answers
    assert statuses == {i: "cancelled" if i == 3 else "pending" for i in range(60)}
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert h.store.cancel("m11", now_ms=h.now) > 0
    assert h.store.lookup("m3").status == "cancelled"
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    h.store.flush_messages()
    h.store.iterate(limit=None)
    h.crash()  # the rebuilt bucket survives a restart as it is
    assert h.store.healer.counters["buckets_rebuilt"] == 0
    assert h.store.lookup("m11").status == "cancelled"
    h.now = future
    h.run_until(future + 10_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i not in (3, 11))


def test_lazy_rebuild_while_running_when_the_wheel_reaches_the_hour(tmp_path):
    nxt = T0 + HOUR
    h = scenario(tmp_path, nxt)
    # corrupt the index while the bucket is open (a bad disk): the chain walk fails, the wheel heals it
    b = h.store.schedule.bucket(nxt)
    os.pwrite(b._index_fd, b"\xff\xff\xff\x7f", 8)  # entry 0's prev points forward: chain broken
    h.now = nxt
    h.run_until(nxt + 10_000, step=50)
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i != 3)
    with pytest.raises(TooLate):
        h.store.cancel("m5", now_ms=h.now)


@pytest.mark.parametrize("part", ["index", "heads"])
def test_flipped_index_or_heads_of_current_bucket_is_rebuilt(tmp_path, part):
    h = scenario(tmp_path, T0 + 20_000)
    h.store.checkpoint()
    h.store.schedule.close()
    path = bucket_dir(tmp_path, T0) / part
    size = path.stat().st_size
    if part == "index":
        last = size // 48 - 1
        flip(path, 48 * last + 24 + 3)  # the newest entry's last_seq, raised: filing would skip records
    else:
        heads = path.read_bytes()
        nonzero = [i for i in range(32, size, 4) if heads[i:i + 4] != b"\0\0\0\0"]
        flip(path, nonzero[2])
    h.crash()
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    h.run_until(T0 + 30_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i != 3)


def test_healthy_store_rebuilds_nothing(tmp_path):
    h = scenario(tmp_path, T0)
    h.run_until(T0 + 3_500)
    h.restart()
    h.crash()
    assert h.store.healer.counters == {"corrupt_found": 0, "buckets_rebuilt": 0, "frames_rebuilt": 0,
                                       "id_files_rebuilt": 0, "damaged_bytes": 0, "missing_records": 0,
                                       "fetched_records": 0, "lost_records": 0, "faults": 0}
    assert h.store.healer.missing == {}


def test_an_interrupted_swap_is_finished_or_discarded_at_open(tmp_path):
    root = tmp_path / "schedule"
    sl = ScheduleLog(root)
    sl.bucket(T0)
    sl.close()
    (root / f"{T0:018d}.rebuild").mkdir()          # incomplete: discarded
    ready = root / f"{T0 + HOUR:018d}.ready"        # complete: swapped in
    ready.mkdir()
    (ready / "marker").write_text("x")
    ScheduleLog(root).close()
    assert not (root / f"{T0:018d}.rebuild").exists()
    assert (root / f"{T0 + HOUR:018d}" / "marker").exists()
    assert (root / f"{T0:018d}").exists()


# ---------------------------------------------------------------------- a real node process

ENTRY_SECOND_AT = 32  # byte of an index entry's u32 second (docs/format.md, schedule index)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _collect(resolver, subject: str, n: int, timeout_s: float) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    async with Consumer(resolver, subject, group="g", wait_ms=300) as c:
        while len(got) < n and time.monotonic() < deadline:
            batch = await c.pull()
            got += batch
            await c.ack(batch)
    return got


async def test_real_node_heals_current_and_future_buckets_after_sigkill(tmp_path):
    """A flipped byte in the current bucket's data and in a later bucket's index, under a node
    killed with SIGKILL: the restarted node rebuilds both (the current one before it says
    "serving", the later one when the wheel loads it), keeps serving, delivers every message
    exactly once."""
    bucket_ms = 4_000
    with LocalCluster(tmp_path / "c", env={"HOURGLASS_BUCKET_MS": str(bucket_ms)}) as c:
        resolver = StaticResolver(delay=[n.address for n in c.delay], realtime=[n.address for n in c.realtime])
        t = _now_ms()
        if t % bucket_ms > 500:  # start at the beginning of a bucket: room for everything below
            await asyncio.sleep((bucket_ms - t % bucket_ms) / 1000)
        now = _now_ms()
        cur = now - now % bucket_ms
        later = cur + 2 * bucket_ms
        due = {f"cur-{i}": cur + 2_500 + 40 * i for i in range(20)} | {f"later-{i}": later + 500 + 40 * i
                                                                       for i in range(20)}
        async with Producer(resolver) as p:
            for i, (mid, at) in enumerate(due.items()):
                await p.send_and_wait("heal.real", f"p{i}", deliver_at_ms=at, id=mid)
        await asyncio.sleep(0.5)  # filed (the iterator runs every few ms)
        node = c.delay[0]
        node.kill()
        root = node.data_dir
        flip(data_segment(root, cur))
        index = bucket_dir(root, later) / "index"
        flip(index, ENTRY_SECOND_AT)
        node.start()
        node.wait_ready()
        log_text = node.log_path.read_text()
        serving = log_text.rindex("delay node serving")
        assert "schedule bucket rebuilt bucket=%d" % cur in log_text[:serving]  # before "serving"
        got = await _collect(resolver, "heal.real", len(due), timeout_s=15)
        ids = [m.id for m in got]
        assert sorted(ids) == sorted(due) and len(ids) == len(set(ids))
        assert node.running
        log_text = node.log_path.read_text()
        assert "schedule bucket rebuilt bucket=%d" % later in log_text
        status = (await c.statuses("delay"))[node.name]
        assert status["healing"]["buckets_rebuilt"] == 2


def test_rebuild_after_retention_salvages_what_the_message_log_no_longer_has(tmp_path):
    """Retention deleted the message log's first segment: the records only the bucket still
    holds are salvaged from its good frames; the corrupt frame's records come from the log."""
    future = T0 + 2 * HOUR
    h = Harness(tmp_path)
    for k in range(10):  # 10 batches of 10 x 1000 bytes: the 64 KiB message log rolls
        h.send([msg(k * 10 + i, future + 1_000 + 100 * i, payload=b"s" * 1000) for i in range(10)])
    s = h.store
    s.checkpoint()
    bases = s.messages.segment_bases()
    assert len(bases) >= 2
    assert s.messages.delete_before(bases[1]) > 0  # what retention does once filed and checkpointed
    seg = sorted((bucket_dir(tmp_path, future) / "data").glob("*.log"))[-1]
    size = seg.stat().st_size
    flip(seg, size - 500)  # in the last frame: the last batch, still in the message log
    statuses = {i: s.lookup(f"m{i}").status for i in range(100)}
    assert set(statuses.values()) == {"pending"}
    assert s.healer.counters["buckets_rebuilt"] == 1 and s.healer.counters["damaged_bytes"] > 0
    h.now = future
    h.run_until(future + 3_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(100))


def test_a_bad_id_index_location_is_not_a_reason_to_rebuild_a_bucket(tmp_path):
    from node.store.idindex import IdLocation

    future = T0 + 2 * HOUR
    h = scenario(tmp_path, future)
    s = h.store
    loc = s.ids.get_all("m10")[0]
    real_get_all = s.ids.get_all
    s.ids.get_all = lambda mid: [IdLocation(loc.bucket_start_ms, loc.data_offset + 7, loc.frame_size, loc.seq)] \
        if mid == "m10" else real_get_all(mid)  # as if a bit of the entry's offset flipped
    assert s.lookup("m10").status == "pending"
    s.ids.get_all = lambda mid: [IdLocation(loc.bucket_start_ms + HOUR, loc.data_offset, loc.frame_size, loc.seq)]
    with pytest.raises(NotFound):
        s.lookup("m10")
    assert s.healer.counters["buckets_rebuilt"] == 0
    assert not bucket_dir(tmp_path, future + HOUR).exists()


@pytest.mark.parametrize("which", ["sealed", "newest", "both"])
def test_an_id_file_with_a_corrupt_header_is_rebuilt_from_the_schedule_log(tmp_path, which):
    """A flipped byte in an id-index file header used to stop the node at every start. Now
    the file is rebuilt from the schedule frames: every id is found again (pending,
    cancelled, dispatched), a re-send is still a duplicate, nothing is delivered twice."""
    import dataclasses

    h = Harness(tmp_path, settings=dataclasses.replace(SMALL, id_entries_max=16))
    h.send([msg(i, T0 + 1_000 + 100 * i) for i in range(30)])  # two files of 16, then the newest
    h.send([msg(i, T0 + 2 * HOUR + i) for i in range(30, 60)])
    h.store.cancel("m40", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    h.run_until(T0 + 2_000)  # m0..m9 delivered
    h.store.checkpoint()
    first = list(h.delivered)
    files = sorted((tmp_path / "ids").glob("*.idx"))
    assert len(files) >= 3
    targets = {"sealed": [files[1]], "newest": [files[-1]], "both": [files[0], files[-1]]}[which]
    for p in targets:
        flip(p, at=20)  # inside the CRC'd header
    h.crash()
    h.delivered = []
    s = h.store
    assert s.healer.counters["id_files_rebuilt"] == len(targets)
    assert all(p.with_name(p.name + ".corrupt").exists() for p in targets)
    want = {f"m{i}": "dispatched" if f"m{i}" in first else "cancelled" if i == 40 else "pending" for i in range(60)}
    assert {mid: s.lookup(mid).status for mid in want} == want
    again = h.send([msg(5, T0 + 1_500), msg(45, T0 + 2 * HOUR + 45)])
    assert [a.duplicate for a in again] == [True, True]
    h.run_until(T0 + 2 * HOUR + 1_000, step=500)
    everything = first + h.delivered
    assert sorted(everything) == sorted(f"m{i}" for i in range(60) if i != 40)
    assert len(everything) == len(set(everything))
    h.restart()  # the rebuilt files are ordinary files now
    assert h.store.healer.counters["id_files_rebuilt"] == 0
    assert h.store.lookup("m45").status == "dispatched"


# ---------------------------------------------------------------------- a second copy, a second fault (issue 26)


def _flip_in_place(path: Path, pos: int) -> None:
    """Flip a bit at ``pos`` through the file's own inode (a running node keeps it open)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x04]), pos)
    finally:
        os.close(fd)


def _frames(seg: Path) -> list[tuple[int, Batch]]:
    """(offset in the file, batch) of every whole frame of a segment, read raw (the node
    has the log open: opening it here would recover its tail)."""
    buf = seg.read_bytes()
    out, pos = [], 0
    while pos + HEADER_SIZE <= len(buf):
        body_len = HEADER.unpack_from(buf, pos)[0]
        if pos + HEADER_SIZE + body_len > len(buf):
            break
        out.append((pos, Batch.decode(buf[pos + HEADER_SIZE:pos + HEADER_SIZE + body_len])))
        pos += HEADER_SIZE + body_len
    return out


async def _wait(pred, timeout_s: float) -> bool:
    """Poll ``pred`` until it holds, at most ``timeout_s`` (outcome, not timing)."""
    for _ in range(int(timeout_s * 10)):
        if await pred():
            return True
        await asyncio.sleep(0.1)
    return await pred()


async def test_replicated_group_gives_back_a_current_bucket_after_retention_nothing_lost(tmp_path):
    """Issue 26: one flipped byte in a schedule bucket whose records retention had already
    deleted from the message log lost acknowledged messages. Here the master's wheel itself
    finds the frame corrupt when it loads its second; the records are missing from the rebuilt
    bucket; the master fetches them from its slave's copy (CRC-checked) and delivers them -
    late by the fetch, since the wheel went on. Every acknowledged message is delivered once,
    the lookups and the pending count are right."""
    env = {"HOURGLASS_MESSAGE_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "0",
           "HOURGLASS_RETENTION_INTERVAL_MS": "300", "HOURGLASS_CHECKPOINT_INTERVAL_MS": "200"}
    with LocalCluster(tmp_path, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000, env=env) as c:
        c.wait_registered()
        master = await c.wait_master("delay")
        node = next(n for n in c.delay if n.name == master)
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        due = (_now_ms() // 1000 + 25) * 1000  # past cache_ahead_ms: the wheel reads the second from disk
        ids = [f"c{k}-{i}" for k in range(6) for i in range(40)]
        async with Producer(resolver) as p:
            for k in range(6):  # 240 KB: the 64 KiB message log rolls; retention deletes its first segments
                await asyncio.gather(*[p.send_and_wait("heal.current", PAYLOAD_1K, deliver_at_ms=due + i, id=mid)
                                       for i, mid in enumerate(ids[k * 40:(k + 1) * 40])])
        first_seg = node.data_dir / "messages" / f"{0:020d}.log"

        async def deleted() -> bool:
            return not first_seg.exists()
        assert await _wait(deleted, 20), node.tail_log()
        (seg,) = sorted((node.data_dir / "schedule").glob("*/data/*.log"))
        _, first = _frames(seg)[0]
        damaged = first.id_list()  # their only copy here: the message log's segment is gone
        assert _now_ms() < due - 2_000, "the wheel must not have loaded the second yet (a very slow machine)"
        _flip_in_place(seg, seg.read_bytes().index(PAYLOAD_1K[:100]) + 50)
        got = await _collect(resolver, "heal.current", len(ids), timeout_s=(due - _now_ms()) / 1000 + 30)
        delivered = [m.id for m in got]
        assert sorted(delivered) == sorted(ids) and len(delivered) == len(set(delivered)), node.tail_log()
        text = node.log_path.read_text()
        assert "schedule bucket rebuild incomplete" in text  # the wheel found it; records were missing ...
        assert "schedule bucket completed from a member" in text  # ... and the slave gave them back
        assert "LOST" not in text
        status = (await c.statuses("delay"))[node.name]
        healing = status["healing"]
        assert healing["missing"] == [] and healing["fetched_records"] == len(damaged)
        assert healing["lost_records"] == 0 and status["pending"] == 0
        async with Producer(resolver) as p:
            assert {(await p.lookup(mid)).status for mid in damaged} == {"dispatched"}


async def test_a_second_fault_while_healing_is_reported_and_the_node_keeps_serving(tmp_path):
    """Issue 26: a running node that found a damaged bucket while a message-log record was
    also damaged exited (the rebuild read the bad record; CorruptRecord escaped the task
    group). Now the rebuild reads around the bad record, takes its records from the bucket's
    good frames, reports the fault (log, Status, metric), and the node keeps serving: every
    message is delivered, and new ones are accepted and delivered afterwards."""
    env = {"HOURGLASS_MESSAGE_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "64", "HOURGLASS_SCRUB_PASS_INTERVAL_MS": "100",
           "HOURGLASS_RETENTION_INTERVAL_MS": "3600000"}  # the message log stays whole: the rebuild reads it
    c = LocalCluster(tmp_path / "c", n_realtime=1, env=env)
    metrics_port = free_port()
    c.delay[0].env["HOURGLASS_METRICS_PORT"] = str(metrics_port)
    with c:
        node = c.delay[0]
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        due = (_now_ms() // 1000 + 20) * 1000
        ids = [f"f{k}-{i}" for k in range(6) for i in range(40)]

        async def filed() -> bool:
            st = (await c.statuses("delay"))[node.name]
            return st["iterate_offset"] == st["message_log_end"]
        async with Producer(resolver) as p:
            await asyncio.gather(*[p.send_and_wait("heal.double", PAYLOAD_1K, deliver_at_ms=due + i, id=mid)
                                   for i, mid in enumerate(ids[:40])])
            assert await _wait(filed, 10)  # batch 0 filed alone: its frames hold nothing of the others
            batch0_end = (await c.statuses("delay"))[node.name]["message_log_end"]
            for k in range(1, 6):
                await asyncio.gather(*[p.send_and_wait("heal.double", PAYLOAD_1K, deliver_at_ms=due + i, id=mid)
                                       for i, mid in enumerate(ids[k * 40:(k + 1) * 40])])
            assert await _wait(filed, 10)
        segs = sorted((node.data_dir / "messages").glob("*.log"))
        log_seg = next(p for p in segs[:-1] if int(p.stem) >= batch0_end)  # sealed, past batch 0's records
        _flip_in_place(log_seg, HEADER_SIZE + 300)  # inside its first record's body
        (seg,) = sorted((node.data_dir / "schedule").glob("*/data/*.log"))
        _flip_in_place(seg, seg.read_bytes().index(PAYLOAD_1K[:100]) + 50)  # batch 0's frame: still in the log

        async def rebuilt() -> bool:
            return "schedule bucket rebuilt" in node.log_path.read_text()
        assert await _wait(rebuilt, 30), node.tail_log()
        assert node.running
        text = node.log_path.read_text()
        assert "fault while healing kind=messages" in text and "the node keeps serving" in text
        healing = (await c.statuses("delay"))[node.name]["healing"]
        assert healing["faults_by_kind"].get("messages", 0) >= 1 and healing["missing"] == []
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'hourglass_heal_faults_total{kind="messages"}' in metrics
        after = [f"after-{i}" for i in range(20)]
        async with Producer(resolver) as p:  # it still accepts ...
            soon = _now_ms() + 1_000
            await asyncio.gather(*[p.send_and_wait("heal.double", b"late", deliver_at_ms=soon, id=mid) for mid in after])
        got = await _collect(resolver, "heal.double", len(ids) + len(after), timeout_s=(due - _now_ms()) / 1000 + 30)
        delivered = [m.id for m in got]  # ... and delivers, the old messages and the new
        assert sorted(delivered) == sorted(ids + after) and len(delivered) == len(set(delivered)), node.tail_log()
        assert node.running


async def test_a_member_that_cannot_answer_a_fetch_is_reported_and_asked_again_later(tmp_path):
    """A second fault while healing: the member holding the good copy is unreachable. The
    fetch is a reported fault (log, counted by kind), nothing is declared lost, nothing is
    raised; the bucket is asked for again after a backoff, also when no member is listed."""
    import numpy as np

    from cluster.ports import free_port as a_free_port
    from node.config import NodeSettings
    from node.delay.missing import Missing
    from node.replication.delay import ReplicatedDelayNode

    settings = NodeSettings(role="delay", node_id="d1", data_dir=tmp_path / "d", port=0, replicated=True,
                            meta_servers=["127.0.0.1:1"], group="g")
    node = ReplicatedDelayNode(settings)
    try:
        start = node.store.schedule.bucket_start(_now_ms())
        b = Batch.build("s", [b"x"], ["gone-1"], [start + 5_000], seq=np.array([7], np.uint64))
        node.store.healer.missing[start] = Missing.of(start, [b], [], 0, from_ms=start, damaged_bytes=100)
        members: list[str] = [f"127.0.0.1:{a_free_port()}"]  # nothing listens there

        async def listed() -> list[str]:
            return members
        node._member_addresses = listed
        node.registrar = object()  # registered (only its presence is looked at)
        healer = node.store.healer
        await node.fetch_lost_buckets()
        assert healer.fault_counts == {"fetch": 1} and healer.recent_faults[-1].where == members[0]
        m = healer.missing[start]
        assert not m.lost and m.attempts == 1 and healer.counters["lost_records"] == 0
        assert healer.fetch_due(int(asyncio.get_running_loop().time() * 1000)) == []  # backoff
        m.next_try_ms = 0
        members.clear()  # no member registered at all: asked again later, not given up
        await node.fetch_lost_buckets()
        assert not healer.missing[start].lost and healer.missing[start].attempts == 2
        assert healer.status()["missing"][0]["messages"] == ["gone-1"]
    finally:
        await node.channels.close()
        node.store.close()
