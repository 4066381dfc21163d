"""Derived data heals itself: a schedule bucket that fails a check is rebuilt from the
message log, nothing lost, nothing delivered twice (node/delay/heal.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from cluster.client import Consumer, Producer, StaticResolver
from cluster.devcluster import LocalCluster
from cluster.errors import NotFound, TooLate
from node.store.schedule import REBUILT_MARKER, ScheduleLog
from tests.test_delay_store import SMALL, T0, Harness, msg

HOUR = 3_600_000


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
                                       "id_files_rebuilt": 0}


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
        cur = _now_ms() - _now_ms() % bucket_ms
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
    assert s.healer.counters["buckets_rebuilt"] == 1 and s.healer.counters.get("lost_bytes", 0) > 0
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
