"""Schedule log v2: one frame per (batch, due second), per-second frame chains, replay
high-water mark, recovery."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.codec import Batch
from cluster.errors import CorruptRecord
from node.store import schedule
from node.store.schedule import ENTRY_SIZE, ScheduleLog

H = 3_600_000
T0 = 1_795_424_400_000  # an hour boundary (UTC)


def batch(seqs, dues, payload=b"p"):
    seqs = list(seqs)
    return Batch.build("s", [payload] * len(seqs), [f"m{q}" for q in seqs], np.array(dues, np.int64),
                       seq=np.array(seqs, np.uint64))


def put(sched, seq, due, **kw):
    """File one record; (bucket, offset, size) or None when it was filed before."""
    f = sched.file(batch([seq], [due], **kw))
    return (int(f.bucket_start_ms[0]), int(f.data_offset[0]), int(f.frame_size[0])) if f.filed[0] else None


def seqs_of(frames):
    """Seqs of a second's frames, newest frame first, each frame's records in order."""
    return [q for f in frames for q in f.batch.seq.tolist()]


def test_batches_filed_per_second_and_chained_newest_first_across_buckets(tmp_path):
    s = ScheduleLog(tmp_path)
    rnd = random.Random(1)
    model: dict[int, list[list[int]]] = {}
    seq = 1
    for _ in range(200):  # 200 batches of 10 records due anywhere in three hours
        dues = sorted(T0 + rnd.randrange(0, 3 * H) for _ in range(10))
        seqs = list(range(seq, seq + 10))
        seq += 10
        f = s.file(batch(seqs, dues))
        assert f.filed.all()
        per_second: dict[int, list[int]] = {}
        for q, d in zip(seqs, dues):
            per_second.setdefault(d // 1000, []).append(q)
        assert len(f.frames) == len(per_second)  # one frame per second touched
        for sec, qs in per_second.items():
            model.setdefault(sec, []).append(qs)
    assert len(s.bucket_starts()) == 3
    for s2 in (s, None):
        if s2 is None:
            s.close()
            s2 = ScheduleLog(tmp_path)
        for second, frames in model.items():
            assert seqs_of(s2.load_second(second)) == [q for qs in reversed(frames) for q in qs]
    assert s2.load_second(T0 // 1000 + 10 * 3600) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5_000), min_size=1, max_size=12), min_size=1, max_size=5),
       st.booleans())
def test_sorted_runs_are_filed_as_slices_like_a_sorted_batch(tmp_path_factory, runs, sort_each):
    """A batch of a few due-ordered runs (the SDK's sorted wire batches, concatenated by the
    iterator) is filed without a record-by-record copy; loading any second gives the same
    records, each frame in due order, as filing through the sort."""
    dues = [sorted(r) if sort_each else r for r in runs]
    flat = [T0 + d for r in dues for d in r]
    b = batch(range(1, len(flat) + 1), flat)
    got = {}
    for limit in (schedule.FILE_SORTED_RUNS_MAX, -1):
        d = tmp_path_factory.mktemp("s")
        old, schedule.FILE_SORTED_RUNS_MAX = schedule.FILE_SORTED_RUNS_MAX, limit
        try:
            s = ScheduleLog(d)
            f = s.file(b)
        finally:
            schedule.FILE_SORTED_RUNS_MAX = old
        assert f.filed.all()
        seconds = {}
        for sec in range(T0 // 1000, T0 // 1000 + 6):
            frames = s.load_second(sec)
            for fr in frames:
                assert (np.diff(fr.batch.effective_ms) >= 0).all()  # each frame in due order
            seconds[sec] = sorted(seqs_of(frames))
        got[limit] = seconds
        s.close()
    assert got[schedule.FILE_SORTED_RUNS_MAX] == got[-1]


def test_an_unsorted_batch_is_sorted_not_cut_into_tiny_frames(tmp_path):
    """Few runs go as slices; a batch in no particular order (an old SDK) is sorted first,
    so a second gets one frame per call, not one per run of one or two records."""
    rnd = random.Random(3)
    dues = [T0 + rnd.randrange(0, 3000) for _ in range(120)]
    s = ScheduleLog(tmp_path)
    f = s.file(batch(range(1, 121), dues))
    assert len(f.frames) == len({d // 1000 for d in dues})  # one frame per second
    s2 = ScheduleLog(tmp_path / "runs")
    two_runs = sorted(dues[:60]) + sorted(dues[60:])
    f2 = s2.file(batch(range(1, 121), two_runs))
    assert len(f2.frames) <= 2 * len({d // 1000 for d in dues})  # one per (run, second)


def test_many_calls_filed_together_are_sorted_and_two_long_runs_stay_slices(tmp_path):
    """The filer's round of many calls (each a due-ordered run over the same few seconds) is
    sorted first: one frame per second, where slices would make one per call and second; two
    long runs are cheaper as slices (a frame per run and second, nothing copied per record)."""
    rnd = random.Random(5)
    calls = [sorted(T0 + rnd.randrange(0, 5000) for _ in range(50)) for _ in range(20)]
    dues = [d for c in calls for d in c]
    s = ScheduleLog(tmp_path / "many")
    f = s.file(batch(range(1, len(dues) + 1), dues))
    assert len(f.frames) == len({d // 1000 for d in dues})  # 5, not about 20 x 5
    long_runs = sorted(T0 + rnd.randrange(0, 2000) for _ in range(400)) * 2
    s2 = ScheduleLog(tmp_path / "two")
    f2 = s2.file(batch(range(1, 801), long_runs))
    assert len(f2.frames) == 2 * len({d // 1000 for d in long_runs})  # slices: per run and second
    for fr in f.frames + f2.frames:  # each frame's records in due order (the wheel fires ranges of it)
        assert fr.batch.effective_ms.tolist() == sorted(fr.batch.effective_ms.tolist())
    s.close()
    s2.close()


def test_bucket_size_fixed_at_creation(tmp_path):
    ScheduleLog(tmp_path, bucket_ms=60_000).close()
    assert ScheduleLog(tmp_path, bucket_ms=H).bucket_ms == 60_000


def test_frames_are_packed_on_disk_and_read_back_the_same_after_reopen(tmp_path):
    """Schedule frames use the packed column layout (docs/format.md): a frame of 100
    records due in one second costs a few bytes of columns per record, not 49, and a
    reopened log (no cache) loads exactly what was filed."""
    s = ScheduleLog(tmp_path)
    dues = T0 + 7_000 + np.arange(100) * 9
    b = batch(range(1000, 1100), dues, payload=b"x" * 32).replace(store_ms=T0 - 5)
    f = s.file(b)
    (size,) = f.frame_size[:1].tolist()
    assert size < 12 + 24 + 100 * (32 + 5 + 8) + 200  # header, ids, payloads, a few bytes of columns each
    s.close()
    s = ScheduleLog(tmp_path)
    (got,) = s.load_second(T0 // 1000 + 7)
    for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "payload_end", "id_end", "kind"):
        assert getattr(got.batch, name).tolist() == getattr(b, name).tolist(), name
    assert got.batch.id_list() == b.id_list()


def test_a_version_2_folder_is_read_and_marked_3(tmp_path):
    import json

    s = ScheduleLog(tmp_path, bucket_ms=60_000)
    put(s, 1, T0 + 5)
    s.close()
    (tmp_path / "meta.json").write_text(json.dumps({"bucket_ms": 60_000, "version": 2}))
    s = ScheduleLog(tmp_path)
    assert json.loads((tmp_path / "meta.json").read_text())["version"] == schedule.META_VERSION == 3
    assert seqs_of(s.load_second(T0 // 1000)) == [1]
    (tmp_path / "meta.json").write_text(json.dumps({"bucket_ms": 60_000, "version": 4}))
    with pytest.raises(CorruptRecord, match="format 4"):
        ScheduleLog(tmp_path)


def test_replay_does_not_file_twice(tmp_path):
    s = ScheduleLog(tmp_path)
    assert put(s, 1, T0 + 5) is not None
    assert put(s, 2, T0 + 6) is not None
    assert put(s, 1, T0 + 5) is None and put(s, 2, T0 + 6) is None
    f = s.file(batch([2, 3], [T0 + 6, T0 + 7]))  # half filed before: only the new half is filed
    assert f.filed.tolist() == [False, True]
    s.close()
    s = ScheduleLog(tmp_path)
    assert put(s, 2, T0 + 6) is None
    assert seqs_of(s.load_second(T0 // 1000)) == [3, 2, 1]


def test_read_back_record_and_locate(tmp_path):
    s = ScheduleLog(tmp_path)
    b, off, size = put(s, 9, T0 + 1500, payload=b"hello")
    s.close()
    s = ScheduleLog(tmp_path)  # no cache: read from disk
    ref, i = s.find(b, off, size, 9)
    assert ref.batch.payload(i) == b"hello" and ref.batch.id(i) == "m9"
    assert s.locate(T0 + 1500, 9)[0].data_offset == off
    assert s.locate(T0 + 1500, 10) is None


def _bucket_dir(tmp_path):
    return tmp_path / f"{T0:018d}"


def test_crash_after_data_before_index_drops_the_unindexed_frames(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 8):
        put(s, seq, T0 + seq * 100)
    s.flush()  # the heads header vouches for 7 entries
    for seq in range(8, 11):
        put(s, seq, T0 + seq * 100)  # written, never flushed: a kill comes first
    idx = _bucket_dir(tmp_path) / "index"
    with open(idx, "r+b") as f:  # lose the last three index entries and a torn half entry
        f.truncate(7 * ENTRY_SIZE + 13)
    s2 = ScheduleLog(tmp_path)  # the first one was never closed (a kill)
    assert sorted(seqs_of(s2.load_second(T0 // 1000))) == list(range(1, 8))
    assert seqs_of(s2.load_second(T0 // 1000 + 1)) == []
    assert put(s2, 7, T0 + 700) is None  # high-water mark recovered
    for seq in range(8, 11):  # the message log replay files the dropped ones again
        assert put(s2, seq, T0 + seq * 100) is not None
    assert seqs_of(s2.load_second(T0 // 1000 + 1)) == [10]


def test_a_filing_call_cut_short_loses_none_of_its_groups(tmp_path, monkeypatch):
    """One batch due over seconds 3 and 4 of a bucket (seqs interleaved: the second-3 group
    holds the highest seq). The process dies after the second-3 frame reached the data log
    and before the second-4 frame did (a segment roll between them). Keeping the second-3
    frame would make its seq the replay mark and skip the second-4 records for good."""
    monkeypatch.setattr(schedule, "FILE_SORTED_RUNS_MAX", -1)  # the sorting path: groups by second
    s = ScheduleLog(tmp_path, data_segment_bytes=64)  # every frame in a segment of its own
    put(s, 1, T0 + 100)
    s.flush()
    b = batch([2, 3, 4, 5], [T0 + 3100, T0 + 4100, T0 + 4200, T0 + 3200])
    s.file(b)  # the kill comes before any flush
    bdir = _bucket_dir(tmp_path)
    segs = sorted(p for p in (bdir / "data").iterdir() if p.stat().st_size)
    assert len(segs) == 3
    segs[-1].unlink()  # the second-4 frame never written
    with open(bdir / "index", "r+b") as f:  # nor were the call's index entries
        f.truncate(ENTRY_SIZE)
    s2 = ScheduleLog(tmp_path, data_segment_bytes=64)
    f = s2.file(b)  # replay of the message log
    assert f.filed.tolist() == [True, True, True, True]
    assert sorted(seqs_of(s2.load_second(T0 // 1000 + 3))) == [2, 5]
    assert sorted(seqs_of(s2.load_second(T0 // 1000 + 4))) == [3, 4]
    s2.close()


def test_a_filing_call_with_missing_index_entries_is_dropped_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(schedule, "FILE_SORTED_RUNS_MAX", -1)
    s = ScheduleLog(tmp_path)
    put(s, 1, T0 + 100)
    s.flush()
    b = batch([2, 3, 4, 5], [T0 + 3100, T0 + 4100, T0 + 4200, T0 + 3200])
    s.file(b)  # a power loss before the flush: only part of the call's index entries on disk
    with open(_bucket_dir(tmp_path) / "index", "r+b") as f:  # the call's second entry lost
        f.truncate(2 * ENTRY_SIZE)
    s2 = ScheduleLog(tmp_path)
    assert seqs_of(s2.load_second(T0 // 1000 + 3)) == []
    assert s2.file(b).filed.tolist() == [True, True, True, True]
    assert sorted(seqs_of(s2.load_second(T0 // 1000 + 4))) == [3, 4]
    s2.close()


def test_index_entries_a_flush_vouched_for_are_never_dropped(tmp_path, monkeypatch):
    """Damage, not a kill: the index loses entries after a flush vouched for them (a checkpoint
    may cover their records, so nothing would file them again). Their frames are indexed
    again from the data, and a flipped bit in a vouched entry's call count drops nothing."""
    monkeypatch.setattr(schedule, "FILE_SORTED_RUNS_MAX", -1)
    s = ScheduleLog(tmp_path)
    put(s, 1, T0 + 100)
    s.file(batch([2, 3, 4, 5], [T0 + 3100, T0 + 4100, T0 + 4200, T0 + 3200]))
    s.flush()
    idx = _bucket_dir(tmp_path) / "index"
    raw = bytearray(idx.read_bytes())
    raw[-4:] = (7).to_bytes(4, "little")  # the last entry's count: a flipped bit
    idx.write_bytes(bytes(raw))
    s2 = ScheduleLog(tmp_path)
    assert sorted(seqs_of(s2.load_second(T0 // 1000 + 3))) == [2, 5]
    assert sorted(seqs_of(s2.load_second(T0 // 1000 + 4))) == [3, 4]
    s2.close()
    with open(idx, "r+b") as f:
        f.truncate(2 * ENTRY_SIZE)  # two vouched entries lost
    s3 = ScheduleLog(tmp_path)
    assert sorted(seqs_of(s3.load_second(T0 // 1000 + 3))) == [2, 5]
    assert sorted(seqs_of(s3.load_second(T0 // 1000 + 4))) == [3, 4]
    s3.close()


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
    assert seqs_of(s2.load_second(T0 // 1000 + 2)) == [5, 4, 3, 2, 1]


def test_heads_partially_applied_after_kill_are_not_double_linked(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 6):
        put(s, seq, T0 + 3000)
    s.flush()  # header covers 5 entries
    for seq in range(6, 9):
        put(s, seq, T0 + 3000)  # linked in the mmap, header still says 5
    s2 = ScheduleLog(tmp_path)
    assert seqs_of(s2.load_second(T0 // 1000 + 3)) == [8, 7, 6, 5, 4, 3, 2, 1]


def test_index_entry_past_data_end_is_dropped(tmp_path):
    s = ScheduleLog(tmp_path)
    for seq in range(1, 4):
        put(s, seq, T0 + 100)
    s.flush()
    data_dir = _bucket_dir(tmp_path) / "data"
    seg = sorted(data_dir.iterdir())[0]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:  # the last frame never reached the disk
        f.truncate(size - 5)
    s2 = ScheduleLog(tmp_path)
    assert seqs_of(s2.load_second(T0 // 1000)) == [2, 1]
    assert put(s2, 3, T0 + 100) is not None


def test_retention_drops_whole_past_buckets(tmp_path):
    s = ScheduleLog(tmp_path)
    put(s, 1, T0)
    put(s, 2, T0 + H)
    assert s.drop_before(T0 + H) == 1
    assert s.bucket_starts() == [T0 + H]


def test_high_water_mark_is_the_largest_seq_when_a_batch_interleaves_seconds(tmp_path):
    # one batch whose seqs alternate between two seconds: its second group ends with a lower
    # seq than its first; a replay (before or after a restart) must file nothing again
    s = ScheduleLog(tmp_path)
    b = batch([1, 2, 3, 4], [T0 + 2000, T0 + 1000, T0 + 2000, T0 + 1000])
    assert s.file(b).filed.all()
    assert not s.file(b).filed.any()
    s.close()
    s = ScheduleLog(tmp_path)
    assert not s.file(b).filed.any()
    assert sorted(seqs_of(s.load_second(T0 // 1000 + 1)) + seqs_of(s.load_second(T0 // 1000 + 2))) == [1, 2, 3, 4]
