"""Schedule log: buckets, per-second chains, replay high-water mark, recovery."""

from __future__ import annotations

import os
import random
import struct

import pytest

from node.store import records
from node.store.records import Message
from node.store.schedule import ENTRY_SIZE, ScheduleLog

H = 3_600_000
T0 = 1_795_424_400_000  # an hour boundary (UTC)


def body(seq, due, kind=records.KIND_MESSAGE, payload=b"p"):
    return records.encode(Message(seq=seq, store_ms=0, deliver_at_ms=due, msg_id=f"m{seq}", subject="s",
                                  payload=payload, kind=kind))


def put(sched, seq, due, **kw):
    return sched.append(body(seq, due, **kw), seq=seq, ref_seq=seq, effective_ms=due, kind=records.KIND_MESSAGE)


def test_chain_per_second_newest_first_across_buckets(tmp_path):
    s = ScheduleLog(tmp_path)
    rnd = random.Random(1)
    model = {}
    for seq in range(1, 2001):
        due = T0 + rnd.randrange(0, 3 * H)
        put(s, seq, due)
        model.setdefault(due // 1000, []).append((due, seq))
    assert len(s.bucket_starts()) == 3
    for second, want in model.items():
        got = [(e.deliver_at_ms, e.seq) for e in s.load_second(second)]
        assert got == list(reversed(want))
    assert s.load_second(T0 // 1000 + 10 * 3600) == []
    s.close()
    s2 = ScheduleLog(tmp_path)
    for second, want in model.items():
        assert [(e.deliver_at_ms, e.seq) for e in s2.load_second(second)] == list(reversed(want))


def test_bucket_size_fixed_at_creation(tmp_path):
    ScheduleLog(tmp_path, bucket_ms=60_000).close()
    assert ScheduleLog(tmp_path, bucket_ms=H).bucket_ms == 60_000


def test_replay_does_not_file_twice(tmp_path):
    s = ScheduleLog(tmp_path)
    assert put(s, 1, T0 + 5) is not None
    assert put(s, 2, T0 + 6) is not None
    assert put(s, 1, T0 + 5) is None and put(s, 2, T0 + 6) is None
    s.close()
    s = ScheduleLog(tmp_path)
    assert put(s, 2, T0 + 6) is None
    assert [e.seq for e in s.load_second(T0 // 1000)] == [2, 1]


def test_read_back_record(tmp_path):
    s = ScheduleLog(tmp_path)
    b, off, size = put(s, 9, T0 + 1500, payload=b"hello")
    assert records.decode(s.read(b, off, size)).payload == b"hello"


def _bucket_dir(tmp_path):
    return tmp_path / f"{T0:018d}"


def test_crash_after_data_before_index_reindexes(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 11):
        put(s, seq, T0 + seq * 100)
    s.flush()
    idx = _bucket_dir(tmp_path) / "index"
    with open(idx, "r+b") as f:  # lose the last three index entries and a torn half entry
        f.truncate(7 * ENTRY_SIZE + 13)
    # note: the process is not closed cleanly (simulates a kill)
    s2 = ScheduleLog(tmp_path)
    assert sorted(e.seq for e in s2.load_second(T0 // 1000)) == list(range(1, 10))
    assert [e.seq for e in s2.load_second(T0 // 1000 + 1)] == [10]
    assert put(s2, 10, T0 + 1000) is None  # high-water mark recovered
    assert put(s2, 11, T0 + 1000) is not None


def test_heads_rebuilt_when_header_is_bad(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 6):
        put(s, seq, T0 + 2000 + seq)
    s.close()
    heads = _bucket_dir(tmp_path) / "heads"
    raw = bytearray(heads.read_bytes())
    raw[0] ^= 0xFF
    raw[32:] = bytes(len(raw) - 32)
    heads.write_bytes(bytes(raw))
    s2 = ScheduleLog(tmp_path)
    assert [e.seq for e in s2.load_second(T0 // 1000 + 2)] == [5, 4, 3, 2, 1]


def test_heads_partially_applied_after_kill_are_not_double_linked(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 6):
        put(s, seq, T0 + 3000)
    s.flush()  # header covers 5 entries
    for seq in range(6, 9):
        put(s, seq, T0 + 3000)  # linked in the mmap, header still says 5
    s2 = ScheduleLog(tmp_path)
    assert [e.seq for e in s2.load_second(T0 // 1000 + 3)] == [8, 7, 6, 5, 4, 3, 2, 1]


def test_index_entry_past_data_end_is_dropped(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 4):
        put(s, seq, T0 + 100)
    s.flush()
    data_dir = _bucket_dir(tmp_path) / "data"
    seg = sorted(data_dir.iterdir())[0]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:  # the last record never reached the disk
        f.truncate(size - 5)
    s2 = ScheduleLog(tmp_path)
    assert [e.seq for e in s2.load_second(T0 // 1000)] == [2, 1]
    assert put(s2, 3, T0 + 100) is not None


def test_retention_drops_whole_past_buckets(tmp_path):
    s = ScheduleLog(tmp_path)
    put(s, 1, T0)
    put(s, 2, T0 + H)
    assert s.drop_before(T0 + H) == 1
    assert s.bucket_starts() == [T0 + H]
