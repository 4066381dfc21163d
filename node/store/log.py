"""Segmented append-only log: the one storage abstraction under every Hourglass log.

Owns a folder of segment files ``{base_offset:020d}.log``. Every record is
addressed by its *global byte offset*: the base offset of its segment plus its
position inside the file. Segments hold whole records only; a record that does
not fit in the current segment starts a new one whose base offset is the
current end offset, so offsets are dense and ``read_bytes`` can ship raw bytes
to a replica that appends them and ends up byte-identical.

The record frame (``u32 body_len | u32 body_crc | u32 header_crc | body``) is
``node/store/frame.py``'s; segment names, the folder scan and tail recovery at open are
``node/store/segments.py``'s. This module owns the log over them: appending, rolling,
reading by offset, truncation, retention, flushing.

Invariants:

* ``start_offset <= end_offset``; every segment's base equals the previous
  segment's base plus its size (checked at open).
* Bytes below ``end_offset`` are whole, checked records.
* ``append`` writes through ``os.write`` (page cache, survives a process kill);
  only ``flush()`` makes bytes durable against power loss. Callers acknowledge
  after ``flush()`` (see ``node.store.group_commit``).

Recovery (``open``, ``segments.open_segments``): the last segment is scanned from its
start; a torn tail is truncated and reported (``recovery``), anything else failing a check
is ``CorruptRecord(path, offset)``. Sealed segments are checked lazily on read
(``verify()`` checks everything).

Example::

    log = SegmentedLog.open(path, segment_bytes_max=1 << 20)
    offs = log.append([b"a", b"bc"])    # -> [0, 13]
    log.flush()
    log.read_bytes(0, 1 << 16)          # -> both frames, raw
    list(log.iterate(13))               # -> [(13, b"bc")]
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from cluster.errors import CorruptRecord, InvalidArgument, OffsetOutOfRange
from cluster.files import DATA_MODE, fsync_dir  # fsync_dir: the stores import it from here too
from cluster.logformat import RECORD_BYTES_MAX_DEFAULT  # a format bound, shared with cluster.spark
from node.store.diskspace import enospc, is_enospc
from node.store.settings import STORE_DEFAULTS

from .frame import HEADER, HEADER_SIZE, PREFIX, TornRecord, decode_frame, frame, frame_head, frame_many
from .segments import (DELETING_SUFFIX, SUFFIX, RecoveryReport, Segment, open_segments, recover_tail, segment_name,
                       unlink_segments)

log = logging.getLogger("hourglass.store.log")

READ_CHUNK_BYTES = 1 << 20
OPEN_READERS_MAX = 16


class SegmentedLog:
    """See module docstring. Not thread-safe, except ``flush`` may run in a worker thread."""

    def __init__(self, directory: Path, segments: list[Segment], *, segment_bytes_max: int,
                 record_bytes_max: int, recovery: RecoveryReport | None) -> None:
        self.directory = directory
        self.segment_bytes_max = segment_bytes_max
        self.record_bytes_max = record_bytes_max
        self.recovery = recovery
        self._segments = segments
        self._readers: OrderedDict[int, int] = OrderedDict()  # base -> fd
        self._active_fd = -1
        self._closed = False
        self._open_active()

    # ------------------------------------------------------------------ open/close

    @classmethod
    def open(cls, directory: str | os.PathLike, *, segment_bytes_max: int = STORE_DEFAULTS.message_segment_bytes,
             record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT, start_offset: int = 0) -> "SegmentedLog":
        """Open (creating if needed) the log in ``directory`` and recover its tail.

        ``start_offset`` is the base of the first segment of a brand-new log
        (a replica that joins late starts where its master's log starts).
        """
        if segment_bytes_max < HEADER_SIZE + 1:
            raise ValueError("segment_bytes_max too small")
        d = Path(directory)
        segments, recovery = open_segments(d, start_offset, record_bytes_max)
        return cls(d, segments, segment_bytes_max=segment_bytes_max,
                   record_bytes_max=record_bytes_max, recovery=recovery)

    def _open_active(self) -> None:
        seg = self._segments[-1]
        self._active_fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, DATA_MODE)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        os.close(self._active_fd)
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        self._closed = True

    def __del__(self) -> None:
        # an object dropped without close() (a crash simulation, a failed open) gives its
        # descriptors back; nothing is flushed or written
        if getattr(self, "_closed", True):
            return
        try:
            os.close(self._active_fd)
            for fd in self._readers.values():
                os.close(fd)
        except OSError:
            pass
        self._closed = True

    def __enter__(self) -> "SegmentedLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ positions

    @property
    def start_offset(self) -> int:
        return self._segments[0].base

    @property
    def end_offset(self) -> int:
        seg = self._segments[-1]
        return seg.base + seg.size

    @property
    def size_bytes(self) -> int:
        return self.end_offset - self.start_offset

    def segment_bases(self) -> list[int]:
        return [s.base for s in self._segments]

    # ------------------------------------------------------------------ writing

    def append(self, bodies: list[bytes]) -> list[int]:
        """Append records; return their offsets. Durable only after ``flush()``."""
        for b in bodies:
            if len(b) > self.record_bytes_max:
                raise InvalidArgument("record", f"{len(b)} bytes exceeds record_bytes_max {self.record_bytes_max}")
        offsets: list[int] = []
        i = 0
        n = len(bodies)
        while i < n:
            seg = self._segments[-1]
            room = self.segment_bytes_max - seg.size
            # take as many records as fit in the active segment (at least one if it is empty)
            j = i
            used = 0
            while j < n:
                need = HEADER_SIZE + len(bodies[j])
                if used + need > room and not (j == i and seg.size == 0):
                    break
                used += need
                j += 1
            if j == i:
                self._roll()
                continue
            data, positions = frame_many(bodies[i:j])
            self._write(data)
            base = seg.base + seg.size
            offsets.extend(base + p for p in positions)
            seg.size += len(data)
            seg.mtime = time.time()
            i = j
        return offsets

    def append_parts(self, parts: Sequence[bytes]) -> int:
        """``append([b"".join(parts)])[0]``, byte for byte the same file, without joining: the
        header and the pieces go to one ``os.writev`` (a real-time frame of 400 messages is
        ~130 KB: one copy less per append). Returns the record's offset."""
        head, size = frame_head(parts)
        if size > self.record_bytes_max:
            raise InvalidArgument("record", f"{size} bytes exceeds record_bytes_max {self.record_bytes_max}")
        seg = self._segments[-1]
        if seg.size and seg.size + HEADER_SIZE + size > self.segment_bytes_max:  # as ``append``: a full segment rolls
            self._roll()
            seg = self._segments[-1]
        self._write_parts([head, *parts], HEADER_SIZE + size)
        off = seg.base + seg.size
        seg.size += HEADER_SIZE + size
        seg.mtime = time.time()
        return off

    def append_raw(self, offset: int, data: bytes) -> int:
        """Append already-framed records (replication). Checks every record; returns new end offset.

        ``offset`` must equal ``end_offset``. Records are split over segments exactly
        as ``append`` would, so a replica stays byte-identical with its source.
        """
        if offset != self.end_offset:
            raise OffsetOutOfRange(offset, self.start_offset, self.end_offset + 1, "append_raw must continue at end")
        bodies: list[bytes] = []
        pos = 0
        while pos < len(data):
            try:
                body, pos = decode_frame(data, pos, "<replicated>", offset, self.record_bytes_max)
            except TornRecord:
                raise CorruptRecord("<replicated>", offset + pos, "chunk ends inside a record") from None
            bodies.append(body)
        self.append(bodies)
        return self.end_offset

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._active_fd, view)
                view = view[n:]
        except OSError as e:
            self._failed_write(e)

    def _write_parts(self, parts: list[bytes], total: int) -> None:
        """``_write(b"".join(parts))`` by one ``os.writev``; a short write (rare: a signal,
        a full disk) finishes the rest by ``_write``'s loop, and a failure cuts the file back
        the same way."""
        try:
            n = os.writev(self._active_fd, parts)
        except OSError as e:
            self._failed_write(e)
        if n < total:
            self._write(memoryview(b"".join(parts))[n:])

    def _failed_write(self, e: OSError) -> NoReturn:
        """A write failed part way: it may leave part of a frame behind, so cut the file back
        to the last whole record (the next append, space freed, lands where the offsets say it
        does), then raise ``e`` (a full disk as ``enospc``, with the segment's path)."""
        seg = self._segments[-1]
        os.ftruncate(self._active_fd, seg.size)
        if is_enospc(e):
            raise enospc(e, str(seg.path)) from None
        raise e

    def _roll(self) -> None:
        """Seal the active segment (fsync) and start a new one at end_offset. The new file
        is created before the old one is let go: a full disk leaves the log as it was."""
        os.fsync(self._active_fd)
        base = self.end_offset
        p = self.directory / segment_name(base)
        try:
            p.touch(mode=DATA_MODE)
            fsync_dir(self.directory)
        except OSError as e:
            if is_enospc(e):
                raise enospc(e, str(p)) from None
            raise
        os.close(self._active_fd)
        self._segments.append(Segment(base, p, 0, time.time()))
        self._open_active()

    def flush(self) -> None:
        """fsync the active segment. Safe to call from a worker thread."""
        os.fsync(self._active_fd)

    def plan_flush(self, plan) -> None:
        """``flush`` as a step of a ``SyncPlan`` (sealed segments were fsynced when rolled)."""
        plan.fsync(self._active_fd)

    def truncate(self, offset: int) -> int:
        """Drop every byte at or after ``offset`` (a record boundary). Returns bytes dropped."""
        if not self.start_offset <= offset <= self.end_offset:
            raise OffsetOutOfRange(offset, self.start_offset, self.end_offset + 1)
        if offset < self.end_offset:
            self._check_boundary(offset)
        dropped = self.end_offset - offset
        os.close(self._active_fd)
        self._drop_readers()
        while len(self._segments) > 1 and self._segments[-1].base > offset:
            self._segments.pop().path.unlink()
        seg = self._segments[-1]
        with open(seg.path, "r+b") as f:
            f.truncate(offset - seg.base)
            os.fsync(f.fileno())
        seg.size = offset - seg.base
        fsync_dir(self.directory)
        self._open_active()
        log.warning("log truncated path=%s offset=%d bytes_dropped=%d", self.directory, offset, dropped)
        return dropped

    def reset(self, start_offset: int) -> None:
        """Delete everything and restart the log empty at ``start_offset`` (a replica too far behind)."""
        os.close(self._active_fd)
        self._drop_readers()
        for s in self._segments:
            s.path.unlink()
        p = self.directory / segment_name(start_offset)
        p.touch(mode=DATA_MODE)
        fsync_dir(self.directory)
        self._segments = [Segment(start_offset, p, 0, time.time())]
        self._open_active()

    # ------------------------------------------------------------------ repair

    def replace_sealed(self, base: int, data: bytes) -> None:
        """Replace sealed segment ``base`` by ``data``: a healthy copy of it (from a replica,
        byte-identical by construction) found after the scrub saw corruption here. ``data``
        must be exactly the segment's size and every frame must pass its checks. Crash-safe:
        written to ``{name}.tmp`` (removed at open if left), fsynced, renamed over the segment."""
        segs = self._segments
        i = next((k for k, s in enumerate(segs) if s.base == base), None)
        if i is None or i == len(segs) - 1:
            raise InvalidArgument("base", f"{base} is not a sealed segment of {self.directory}")
        seg = segs[i]
        if len(data) != seg.size:
            raise InvalidArgument("data", f"{len(data)} bytes for a segment of {seg.size}")
        pos = 0
        while pos < len(data):
            try:
                _, pos = decode_frame(data, pos, "<copy>", base, self.record_bytes_max)
            except TornRecord:
                raise CorruptRecord("<copy>", base + pos, "copy ends inside a record") from None
        tmp = seg.path.with_name(seg.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, DATA_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self._close_reader(base)
        os.replace(tmp, seg.path)
        fsync_dir(self.directory)
        log.warning("sealed segment replaced by a healthy copy path=%s offset=%d bytes=%d", seg.path, base, seg.size)

    # ------------------------------------------------------------------ retention

    def delete_before(self, offset: int) -> int:
        """Delete whole sealed segments that end at or before ``offset``. Returns bytes freed."""
        freed = 0
        while len(self._segments) > 1 and self._segments[1].base <= offset:
            seg = self._segments.pop(0)
            self._close_reader(seg.base)
            seg.path.unlink()
            freed += seg.size
        if freed:
            fsync_dir(self.directory)
        return freed

    def segments_info(self) -> list[tuple[int, int, int]]:
        """``(base, size, mtime_ms)`` of every segment, oldest first (retention decisions)."""
        return [(s.base, s.size, int(s.mtime * 1000)) for s in self._segments]

    def detach_before(self, offset: int) -> list[Path]:
        """Retention, first half (on the caller's thread): forget whole sealed segments that
        end at or before ``offset`` and return their paths, oldest first, for
        ``unlink_segments`` (second half, any thread). Until then the files stay on disk;
        a crash in between finds them again at open, still contiguous with the rest."""
        gone: list[Path] = []
        while len(self._segments) > 1 and self._segments[1].base <= offset:
            seg = self._segments.pop(0)
            self._close_reader(seg.base)
            # renamed now (one metadata call), so a store reopened on this folder before the
            # unlink never lists it; oldest first, so ``open`` can finish the job (see there)
            dead = seg.path.with_name(seg.path.name + DELETING_SUFFIX)
            os.replace(seg.path, dead)
            gone.append(dead)
        return gone

    def apply_retention(self, *, now_s: float, age_s_max: float | None, bytes_max: int | None,
                        keep_from_offset: int) -> int:
        """Delete sealed segments older than ``age_s_max`` (by last write) or beyond ``bytes_max``
        in total, but never one holding bytes at or after ``keep_from_offset``
        (not yet iterated or replicated). Returns bytes freed."""
        cut = self.start_offset
        total = self.size_bytes
        for seg, nxt in zip(self._segments, self._segments[1:]):
            end = nxt.base
            if end > keep_from_offset:
                break
            too_old = age_s_max is not None and now_s - seg.mtime > age_s_max
            too_big = bytes_max is not None and total > bytes_max
            if not (too_old or too_big):
                break
            total -= seg.size
            cut = end
        return self.delete_before(cut)

    # ------------------------------------------------------------------ reading

    def _segment_for(self, offset: int) -> Segment:
        segs = self._segments
        lo, hi = 0, len(segs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if segs[mid].base <= offset:
                lo = mid
            else:
                hi = mid - 1
        return segs[lo]

    def _reader(self, seg: Segment) -> int:
        fd = self._readers.get(seg.base)
        if fd is None:
            fd = os.open(seg.path, os.O_RDONLY)
            self._readers[seg.base] = fd
            if len(self._readers) > OPEN_READERS_MAX:
                _, old = self._readers.popitem(last=False)
                os.close(old)
        else:
            self._readers.move_to_end(seg.base)
        return fd

    def _close_reader(self, base: int) -> None:
        fd = self._readers.pop(base, None)
        if fd is not None:
            os.close(fd)

    def _drop_readers(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()

    def _check_range(self, offset: int) -> None:
        if not self.start_offset <= offset < self.end_offset:
            raise OffsetOutOfRange(offset, self.start_offset, self.end_offset)

    def _check_boundary(self, offset: int) -> None:
        seg = self._segment_for(offset)
        hdr = os.pread(self._reader(seg), HEADER_SIZE, offset - seg.base)
        if len(hdr) < HEADER_SIZE or zlib.crc32(hdr[:8]) != struct.unpack_from("<I", hdr, 8)[0]:
            raise OffsetOutOfRange(offset, self.start_offset, self.end_offset, "not a record boundary")

    def is_boundary(self, offset: int) -> bool:
        """Whether a record starts at ``offset`` (or ``offset`` is the end); a header whose
        checksum holds is taken for one (a chance match inside a record is 2**-32)."""
        if offset == self.end_offset:
            return True
        try:
            self._check_range(offset)
            self._check_boundary(offset)
        except OffsetOutOfRange:
            return False
        return True

    def boundary_at_or_before(self, offset: int) -> int:
        """The start of the last record at or before ``offset`` (``start_offset`` at most:
        offsets below it are clamped up to it). Walks the records of ``offset``'s segment
        from its start: for a tick state whose offset is not a record boundary here (a
        divergent suffix of another term's bytes), never on a hot path."""
        if offset <= self.start_offset:
            return self.start_offset
        offset = min(offset, self.end_offset)
        if self.is_boundary(offset):
            return offset
        seg = self._segment_for(offset)
        best = max(seg.base, self.start_offset)
        for off, _ in self.iterate(best, seg.base + seg.size):
            if off > offset:
                break
            best = off
        return best

    def read(self, offset: int) -> tuple[bytes, int]:
        """Read one record; return (body, next_offset)."""
        self._check_range(offset)
        seg = self._segment_for(offset)
        fd = self._reader(seg)
        pos = offset - seg.base
        hdr = os.pread(fd, HEADER_SIZE, pos)
        if len(hdr) < HEADER_SIZE or zlib.crc32(hdr[:8]) != struct.unpack_from("<I", hdr, 8)[0]:
            raise OffsetOutOfRange(offset, self.start_offset, self.end_offset, "not a record boundary")
        body_len = struct.unpack_from("<I", hdr, 0)[0]
        buf = hdr + os.pread(fd, body_len, pos + HEADER_SIZE)
        try:
            body, nxt = decode_frame(buf, 0, str(seg.path), offset, self.record_bytes_max)
        except TornRecord:
            raise CorruptRecord(str(seg.path), offset, "record ends past end of segment") from None
        return body, offset + nxt

    def read_at(self, offset: int, size: int) -> bytes:
        """Read one record whose framed size is known (index lookups); checks its CRCs."""
        self._check_range(offset)
        seg = self._segment_for(offset)
        buf = os.pread(self._reader(seg), size, offset - seg.base)
        try:
            body, nxt = decode_frame(buf, 0, str(seg.path), offset, self.record_bytes_max)
        except TornRecord:
            raise CorruptRecord(str(seg.path), offset, "record ends past end of segment") from None
        if nxt != size:
            raise CorruptRecord(str(seg.path), offset, f"index says {size} bytes, record is {nxt}")
        return body

    def read_bytes(self, offset: int, max_bytes: int) -> bytes:
        """Raw framed bytes of whole records from ``offset``, at most ``max_bytes``
        (but always at least one record), never crossing a segment boundary.
        Returns b"" at end_offset. This is what replication ships."""
        if offset == self.end_offset:
            return b""
        self._check_range(offset)
        seg = self._segment_for(offset)
        fd = self._reader(seg)
        pos = offset - seg.base
        avail = seg.size - pos
        want = min(avail, max(max_bytes, HEADER_SIZE))
        buf = os.pread(fd, want, pos)
        cut = 0
        path = str(seg.path)
        while cut < len(buf):
            try:
                _, nxt = decode_frame(buf, cut, path, offset, self.record_bytes_max)
            except TornRecord:
                if cut == 0:  # first record larger than max_bytes: read it whole
                    body_len = HEADER.unpack_from(buf if len(buf) >= HEADER_SIZE else os.pread(fd, HEADER_SIZE, pos), 0)[0]
                    buf = os.pread(fd, HEADER_SIZE + body_len, pos)
                    _, nxt = decode_frame(buf, 0, path, offset, self.record_bytes_max)
                    return buf[:nxt]
                break
            except CorruptRecord as e:
                if cut == 0 and e.reason == "header checksum mismatch":
                    raise OffsetOutOfRange(offset, self.start_offset, self.end_offset, "not a record boundary") from None
                raise
            cut = nxt
        return buf[:cut]

    def iterate(self, offset: int | None = None, end_offset: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yield (offset, body) for every record from ``offset`` up to the end (as of the call)."""
        offset = self.start_offset if offset is None else offset
        stop = self.end_offset if end_offset is None else end_offset
        if offset == stop:
            return
        self._check_range(offset)
        while offset < stop:
            seg = self._segment_for(offset)
            fd = self._reader(seg)
            seg_end = min(seg.base + seg.size, stop)
            pos = offset - seg.base
            carry = b""
            path = str(seg.path)
            while seg.base + pos < seg_end:
                chunk = os.pread(fd, min(READ_CHUNK_BYTES, seg_end - seg.base - pos), pos)
                if not chunk:
                    raise CorruptRecord(path, seg.base + pos, "segment shorter than expected")
                buf = carry + chunk if carry else chunk
                buf_base = seg.base + pos - len(carry)
                cut = 0
                while True:
                    try:
                        body, nxt = decode_frame(buf, cut, path, buf_base, self.record_bytes_max)
                    except TornRecord:
                        break
                    yield buf_base + cut, body
                    cut = nxt
                carry = buf[cut:]
                pos += len(chunk)
            if carry:
                raise CorruptRecord(path, seg_end - len(carry), "record ends past end of segment")
            offset = seg_end

    def verify(self) -> int:
        """Check every record of every segment; return the record count."""
        return sum(1 for _ in self.iterate())


__all__ = ["DELETING_SUFFIX", "HEADER", "HEADER_SIZE", "OPEN_READERS_MAX", "PREFIX", "READ_CHUNK_BYTES",
           "RECORD_BYTES_MAX_DEFAULT", "SUFFIX", "RecoveryReport", "Segment", "SegmentedLog", "TornRecord",
           "decode_frame", "fsync_dir", "frame", "frame_many", "open_segments", "recover_tail", "segment_name",
           "unlink_segments"]
