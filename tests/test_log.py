"""SegmentedLog against a list-of-bytes model, on real files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.errors import CorruptRecord, InvalidArgument, OffsetOutOfRange
from node.store.log import HEADER_SIZE, SegmentedLog, frame

bodies = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=6)


def test_append_read_iterate(tmp_path):
    log = SegmentedLog.open(tmp_path, segment_bytes_max=64)
    offs = log.append([b"a", b"bc", b"x" * 30, b"y" * 40])
    assert offs == [0, 13, 27, 69]
    assert log.segment_bases() == [0, 27, 69]
    assert [b for _, b in log.iterate()] == [b"a", b"bc", b"x" * 30, b"y" * 40]
    assert log.read(13) == (b"bc", 27)
    assert list(log.iterate(27)) == [(27, b"x" * 30), (69, b"y" * 40)]
    log.close()
    again = SegmentedLog.open(tmp_path, segment_bytes_max=64)
    assert again.end_offset == 69 + HEADER_SIZE + 40
    assert again.recovery is None


def test_read_bytes_whole_records_and_replica_identical(tmp_path):
    src = SegmentedLog.open(tmp_path / "a", segment_bytes_max=100)
    src.append([bytes([i]) * (i * 3) for i in range(20)])
    dst = SegmentedLog.open(tmp_path / "b", segment_bytes_max=100)
    off = 0
    while off < src.end_offset:
        chunk = src.read_bytes(off, 37)
        assert chunk, "read_bytes must always make progress"
        off = dst.append_raw(off, chunk)
    src.close(), dst.close()
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()


def test_read_bytes_rejects_non_boundary_and_out_of_range(tmp_path):
    log = SegmentedLog.open(tmp_path)
    log.append([b"hello world"])
    with pytest.raises(OffsetOutOfRange):
        log.read_bytes(3, 100)
    with pytest.raises(OffsetOutOfRange):
        log.read_bytes(10_000, 100)
    assert log.read_bytes(log.end_offset, 100) == b""


def test_append_raw_rejects_bad_chunk_and_changes_nothing(tmp_path):
    log = SegmentedLog.open(tmp_path)
    good = frame(b"abc")
    bad = bytearray(good)
    bad[-1] ^= 1
    with pytest.raises(CorruptRecord):
        log.append_raw(0, bytes(bad))
    with pytest.raises(CorruptRecord):
        log.append_raw(0, good[:-1])
    with pytest.raises(OffsetOutOfRange):
        log.append_raw(5, good)
    assert log.end_offset == 0
    assert log.append_raw(0, good) == len(good)


def test_record_too_large_rejected(tmp_path):
    log = SegmentedLog.open(tmp_path, record_bytes_max=10)
    with pytest.raises(InvalidArgument):
        log.append([b"ok", b"x" * 11])
    assert log.end_offset == 0


def _write_log(path: Path, recs: list[bytes], seg: int = 1 << 20) -> int:
    log = SegmentedLog.open(path, segment_bytes_max=seg)
    log.append(recs)
    end = log.end_offset
    log.close()
    return end


RECS = [b"first record", b"", b"third" * 7, b"\x00\x01\x02"]


def test_every_truncation_is_torn_never_a_record(tmp_path):
    end = _write_log(tmp_path / "base", RECS)
    raw = (tmp_path / "base" / f"{0:020d}.log").read_bytes()
    boundaries, pos = [], 0
    for r in RECS:
        boundaries.append(pos)
        pos += HEADER_SIZE + len(r)
    for cut in range(len(raw) + 1):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / f"{0:020d}.log").write_bytes(raw[:cut])
        log = SegmentedLog.open(d)
        whole = [b for b in boundaries if b + HEADER_SIZE + len(RECS[boundaries.index(b)]) <= cut]
        assert [b for _, b in log.iterate()] == RECS[: len(whole)]
        expected_end = whole[-1] + HEADER_SIZE + len(RECS[len(whole) - 1]) if whole else 0
        assert log.end_offset == expected_end
        if cut != expected_end:
            assert log.recovery is not None and log.recovery.bytes_dropped == cut - expected_end
        log.close()
    assert end == len(raw)


@settings(max_examples=60, deadline=None)
@given(recs=st.lists(st.binary(max_size=30), min_size=1, max_size=5), data=st.data())
def test_every_single_bit_flip_is_detected(recs, data):
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        _write_log(d, recs)
        p = d / f"{0:020d}.log"
        raw = bytearray(p.read_bytes())
        bit = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        p.write_bytes(bytes(raw))
        # a flipped bit must never yield a different sequence of records
        try:
            log = SegmentedLog.open(d)
        except CorruptRecord:
            return
        got = [b for _, b in log.iterate()]
        log.close()
        pytest.fail(f"bit flip {bit} not detected; read {got!r}")


def test_every_single_bit_flip_in_sealed_segment_is_detected_on_read(tmp_path):
    _write_log(tmp_path, [b"a" * 20, b"b" * 20, b"c" * 20], seg=40)
    first = tmp_path / f"{0:020d}.log"
    raw = first.read_bytes()
    for bit in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        first.write_bytes(bytes(flipped))
        log = SegmentedLog.open(tmp_path, segment_bytes_max=40)
        with pytest.raises((CorruptRecord, OffsetOutOfRange)):
            log.verify()
        log.close()
    first.write_bytes(raw)


def test_zero_filled_tail_is_torn(tmp_path):
    end = _write_log(tmp_path, [b"abc"])
    with open(tmp_path / f"{0:020d}.log", "ab") as f:
        f.write(bytes(4096))
    log = SegmentedLog.open(tmp_path)
    assert log.end_offset == end and log.recovery.bytes_dropped == 4096


def test_corruption_in_the_middle_names_file_and_offset(tmp_path):
    _write_log(tmp_path, [b"abc", b"def", b"ghi"])
    p = tmp_path / f"{0:020d}.log"
    raw = bytearray(p.read_bytes())
    raw[HEADER_SIZE + 3 + HEADER_SIZE] ^= 0xFF  # first body byte of record 2
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecord) as e:
        SegmentedLog.open(tmp_path)
    assert e.value.offset == HEADER_SIZE + 3 and str(p) in str(e.value)


def test_missing_segment_is_refused(tmp_path):
    _write_log(tmp_path, [b"a" * 20] * 4, seg=40)
    (tmp_path / f"{32:020d}.log").unlink()
    with pytest.raises(CorruptRecord):
        SegmentedLog.open(tmp_path, segment_bytes_max=40)


def test_truncate_and_retention(tmp_path):
    log = SegmentedLog.open(tmp_path, segment_bytes_max=40)
    offs = log.append([b"a" * 20] * 6)
    assert log.truncate(offs[3]) == 3 * 32
    assert [o for o, _ in log.iterate()] == offs[:3]
    with pytest.raises(OffsetOutOfRange):
        log.truncate(offs[1] + 1)
    log.append([b"z" * 20])
    assert log.read(offs[3])[0] == b"z" * 20
    # retention never deletes bytes not yet consumed
    freed = log.apply_retention(now_s=1e12, age_s_max=0, bytes_max=None, keep_from_offset=offs[1])
    assert freed == 32 and log.start_offset == offs[1]
    freed = log.apply_retention(now_s=0, age_s_max=None, bytes_max=40, keep_from_offset=log.end_offset)
    assert log.size_bytes <= 64 and freed > 0


class LogMachine(RuleBasedStateMachine):
    """The log behaves like a list of bytes across appends, reopens, truncations and reads."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.log = SegmentedLog.open(self.dir, segment_bytes_max=64)
        self.model: list[tuple[int, bytes]] = []

    @rule(batch=bodies)
    def append(self, batch):
        offs = self.log.append(batch)
        self.model.extend(zip(offs, batch))

    @rule()
    def reopen(self):
        self.log.close()
        self.log = SegmentedLog.open(self.dir, segment_bytes_max=64)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 1000))
    def truncate(self, i):
        i %= len(self.model)
        self.log.truncate(self.model[i][0])
        del self.model[i:]

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 1000), max_bytes=st.integers(1, 200))
    def read_bytes_from(self, i, max_bytes):
        off, _ = self.model[i % len(self.model)]
        chunk = self.log.read_bytes(off, max_bytes)
        assert chunk and chunk == b"".join(frame(b) for o, b in self.model if off <= o < off + len(chunk))

    @invariant()
    def matches_model(self):
        assert list(self.log.iterate()) == self.model

    def teardown(self):
        self.log.close()


TestLogMachine = LogMachine.TestCase
TestLogMachine.settings = settings(max_examples=40, stateful_step_count=20, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.binary(max_size=30), max_size=4), max_size=8), st.sampled_from([40, 64, 100, 4096]))
def test_append_parts_writes_what_append_of_the_joined_body_writes(records, seg_max):
    """``append_parts`` (a body as pieces, one writev) leaves the same segment files, offsets
    and records as ``append`` of each joined body, rolls included."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        joined = SegmentedLog.open(a, segment_bytes_max=seg_max)
        parts = SegmentedLog.open(b, segment_bytes_max=seg_max)
        for pieces in records:
            assert parts.append_parts(pieces) == joined.append([b"".join(pieces)])[0]
        assert parts.segment_bases() == joined.segment_bases() and parts.end_offset == joined.end_offset
        assert [x for _, x in parts.iterate()] == [b"".join(p) for p in records]
        joined.close()
        parts.close()
        files = sorted(os.listdir(a))
        assert files == sorted(os.listdir(b))
        assert all(Path(a, f).read_bytes() == Path(b, f).read_bytes() for f in files)


def test_append_parts_refuses_an_oversized_record(tmp_path):
    log = SegmentedLog.open(tmp_path, segment_bytes_max=64, record_bytes_max=10)
    with pytest.raises(InvalidArgument):
        log.append_parts([b"x" * 6, b"y" * 6])
    assert log.end_offset == 0
    log.close()


def test_append_parts_finishes_a_short_writev(tmp_path, monkeypatch):
    """A writev that writes only part (a signal, a nearly full disk) is finished by write."""
    import node.store.log as logmod

    real = os.writev
    monkeypatch.setattr(logmod.os, "writev", lambda fd, parts: os.write(fd, b"".join(parts)[:5]))
    log = SegmentedLog.open(tmp_path, segment_bytes_max=4096)
    assert log.append_parts([b"abc", b"", b"defg"]) == 0
    monkeypatch.setattr(logmod.os, "writev", real)
    assert log.append_parts([b"h"]) == HEADER_SIZE + 7
    assert [b for _, b in log.iterate()] == [b"abcdefg", b"h"]
    log.close()
    assert Path(tmp_path, sorted(os.listdir(tmp_path))[0]).read_bytes() == frame(b"abcdefg") + frame(b"h")
