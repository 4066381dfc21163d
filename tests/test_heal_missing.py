"""Healing when the message log cannot give a bucket's records back (node/delay/heal.py):
records of a corrupt frame whose message-log segment retention deleted are *missing*; a
member's copy gives them back (here: a copy of the folder, as a slave's bucket), records
the wheel passed meanwhile are filed again and delivered late; a single node reports their
ids. A corrupt message-log record met by a rebuild is read around and reported."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cluster.codec import Batch
from cluster.errors import CorruptRecord, NotFound
from node.delay.heal import HealFault, readable_records, salvage_frames
from node.delay.missing import LOST_FILE, Missing, read_missing
from node.store.log import SegmentedLog
from node.store.verify import verify_dir
from tests.test_delay_store import T0, Harness, msg
from tests.test_healing import HOUR, bucket_dir

PAYLOAD = b"s" * 1000


def send_batches(h: Harness, due_of, batches: int = 10, per: int = 10) -> None:
    """``batches`` filing calls of ``per`` messages of 1000 bytes (the 64 KiB message log rolls)."""
    for k in range(batches):
        h.send([msg(k * per + i, due_of(k, i), payload=PAYLOAD) for i in range(per)])


def drop_first_message_segments(h: Harness) -> None:
    """What retention does once the records are filed and a checkpoint covers them."""
    s = h.store
    s.checkpoint()
    bases = s.messages.segment_bases()
    assert len(bases) >= 2
    assert s.messages.delete_before(bases[1]) > 0


def flip_first_frame_payload(root: Path, start_ms: int) -> Path:
    """Flip a byte inside the payloads of the bucket's first frame (its body CRC fails, its
    structure still reads: the ids of its records can be told)."""
    seg = sorted((bucket_dir(root, start_ms) / "data").glob("*.log"))[0]
    data = bytearray(seg.read_bytes())
    at = data.index(PAYLOAD[:100]) + 50
    data[at] ^= 0x10
    fd = os.open(seg, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(data[at:at + 1]), at)
    finally:
        os.close(fd)
    return seg


def first_frame_ids(root: Path, start_ms: int) -> list[str]:
    frames, _ = salvage_frames(bucket_dir(root, start_ms) / "data", 1 << 23)
    return frames[0].id_list()


def test_single_node_reports_the_ids_of_the_damaged_frame_and_loses_nothing_else(tmp_path, caplog):
    future = T0 + 2 * HOUR
    h = Harness(tmp_path)
    send_batches(h, lambda k, i: future + 1_000 * k + i)  # batch k: one frame in second k
    drop_first_message_segments(h)
    damaged = first_frame_ids(tmp_path, future)
    assert damaged == [f"m{i}" for i in range(10)]
    flip_first_frame_payload(tmp_path, future)
    s = h.store
    with caplog.at_level(logging.ERROR, "hourglass.delay.heal"):
        with pytest.raises(NotFound):
            s.lookup("m3")  # the read finds the frame corrupt: rebuilt, m3 missing
        m = s.healer.missing[future]
        assert sorted(m.messages()) == sorted(damaged) and m.count == 10 and not m.lost
        assert s.lookup("m10").status == "pending"  # the rest is there
        assert s.pending_by_bucket() == {future: 90}
        s.healer.give_up(future, "no replica")
    assert "acknowledged records LOST" in caplog.text and "m0,m1,m2" in caplog.text
    assert s.healer.counters["lost_records"] == 10 and s.healer.counters["missing_records"] == 0
    assert read_missing(bucket_dir(tmp_path, future)).lost
    report = verify_dir(tmp_path)
    (lost,) = report.lost
    assert lost["state"] == "lost" and sorted(lost["messages"]) == sorted(damaged) and lost["records"] == 10
    assert "10 records lost and 0 being fetched from a member, in 1 rebuilt bucket" in report.summary()
    h.crash()  # the loss is remembered, not reported again as a new one
    assert h.store.healer.missing[future].lost and h.store.healer.counters["lost_records"] == 0
    h.now = future
    h.run_until(future + 11_000, step=100)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(10, 100))


@pytest.mark.parametrize("crash_after_fetch", [False, True])
def test_records_fetched_after_the_wheel_passed_them_are_delivered_late(tmp_path, crash_after_fetch, caplog):
    """The current bucket: the wheel itself finds the corrupt frame while loading its second;
    its records are missing until a member's copy gives them back; the wheel went on
    meanwhile, so they are filed again under the filing rule and fire at once. Nothing lost,
    nothing twice, the pending count right, the ids found again."""
    h = Harness(tmp_path)
    send_batches(h, lambda k, i: T0 + 15_000 + 300 * k + i)  # past cache_ahead_ms: read from disk
    h.store.checkpoint()
    member = tmp_path.parent / (tmp_path.name + "-member")
    shutil.copytree(tmp_path, member)  # a slave's copy: the same records, the same effective times
    drop_first_message_segments(h)
    flip_first_frame_payload(tmp_path, T0)
    assert h.store.pending_by_bucket() == {T0: 100}
    h.run_until(T0 + 17_000, step=50)
    s = h.store
    m = s.healer.missing[T0]
    assert sorted(m.messages()) == [f"m{i}" for i in range(10)]
    assert not any(f"m{i}" in h.delivered for i in range(10))
    assert len(h.delivered) == 60 and s.wheel.loaded_until_ms > T0 + 15_010  # the wheel passed them
    frames, _ = salvage_frames(bucket_dir(member, T0) / "data", 1 << 23)
    with caplog.at_level(logging.WARNING, "hourglass.delay.heal"):
        s.healer.rebuild(T0, CorruptRecord("member", 0, "fetched"), extra=frames, source="member")
    assert "refiled_late=10 " in caplog.text  # the wheel had passed every one of them
    assert s.healer.missing == {} and not (bucket_dir(tmp_path, T0) / LOST_FILE).exists()
    assert s.healer.counters["fetched_records"] == 10
    assert s.pending_by_bucket() == {T0: 40}
    assert s.lookup("m4").status == "pending"
    if crash_after_fetch:
        h.store.checkpoint()
        h.crash()
    h.run_until(T0 + 21_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(100))  # each once
    assert h.store.pending_by_bucket() == {}
    assert h.store.lookup("m4").status == "dispatched"


def test_a_corrupt_message_log_record_met_by_a_rebuild_is_read_around_and_reported(tmp_path):
    """A second fault: the message log is corrupt where the rebuild reads it. The rebuild
    does not raise (it used to, and the exception stopped the node): the record is read
    around and reported, its records come from the bucket's good frames; the bucket's own
    corrupt frame comes from the log. Nothing lost."""
    future = T0 + 2 * HOUR
    h = Harness(tmp_path)
    send_batches(h, lambda k, i: future + 1_000 * k + i)
    s = h.store
    offsets = [off for off, _ in s.messages.iterate()]
    base = max(b for b in s.messages.segment_bases() if b <= offsets[3])
    seg = s.messages.directory / f"{base:020d}.log"
    flip_at = offsets[3] - base + 600  # inside batch 3's record body
    raw = bytearray(seg.read_bytes())
    raw[flip_at] ^= 0x10
    seg.write_bytes(bytes(raw))
    flip_first_frame_payload(tmp_path, future)  # batch 0's frame: still in the message log
    assert s.lookup("m5").status == "pending"  # rebuilt: no exception
    assert s.healer.counters["buckets_rebuilt"] == 1
    assert s.healer.fault_counts == {"messages": 1}
    (fault,) = s.healer.recent_faults
    assert fault.kind == "messages" and fault.offset == offsets[3]
    assert s.healer.missing == {}
    h.now = future
    h.run_until(future + 11_000, step=100)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(100))


@pytest.mark.parametrize("where", ["body", "header"])
def test_readable_records_reads_around_a_corrupt_record(tmp_path, where):
    lg = SegmentedLog.open(tmp_path / "log", segment_bytes_max=1 << 20)
    bodies = [bytes([i]) * (100 + i) for i in range(20)]
    offs = lg.append(bodies)
    lg.flush()
    seg = sorted((tmp_path / "log").glob("*.log"))[0]
    raw = bytearray(seg.read_bytes())
    raw[offs[7] + (2 if where == "header" else 40)] ^= 0x01
    seg.write_bytes(bytes(raw))
    faults: list[HealFault] = []
    got = [body for _, body in readable_records(lg, lg.start_offset, lg.end_offset, "messages", faults)]
    assert got == bodies[:7] + bodies[8:]
    assert [(f.kind, f.offset) for f in faults] == [("messages", offs[7])]
    lg.close()


def test_missing_round_trips_and_shrinks_as_records_come_back():
    b = Batch.build("s", [b"a"] * 4, ["a", "b", "c", "d"], [T0 + 1, T0 + 2, T0 + 3, T0 + 4],
                    seq=np.arange(10, 14, dtype=np.uint64))
    m = Missing.of(T0, [b], [(100, 109, 10, T0)], 0, from_ms=T0 + 500, damaged_bytes=42)
    again = Missing.from_doc(m.doc())
    assert again.messages() == ["a", "b", "c", "d"] and again.count == 14 and again.damaged_bytes == 42
    assert again.wanted(np.array([9, 11, 105, 110], np.uint64), None).tolist() == [False, True, True, False]
    assert again.from_of(np.array([11, 105], np.uint64)).tolist() == [T0 + 500, T0]
    left = again.minus(np.array([10, 11] + list(range(100, 110)), np.uint64))
    assert left.messages() == ["c", "d"] and left.ranges == [] and left.count == 2
    left.wheel_restarted(T0 + 100)
    assert left.from_ms.tolist() == [T0 + 100, T0 + 100]
