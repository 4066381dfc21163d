"""Read-only scan of one segment file into frames: good frames, and torn or corrupt bytes as frames too.

The engine (``node.store.log.SegmentedLog``) must stop at the first bad record: a node
that guessed could serve garbage. An audit must not stop: it reads files copied from
sick nodes and has to say what is in them. So this scanner uses the same frame checks
(``node.store.frame.decode_frame`` rules, docs/format.md) but reports instead of raising:

* **good frame**: header CRC and body CRC pass -> a ``Frame`` with its body (a whole
  ``cluster.codec`` batch; ``cluster.spark.rows`` turns it into one row per message);
* **body CRC mismatch** under a good header: the length is trusted (the header CRC
  covers it), so the frame is skipped as one ``corrupt`` error and the scan goes on;
* **header CRC mismatch** (or a length above ``record_bytes_max``): the length cannot
  be trusted; the scanner *resynchronises* by looking for the next position where a
  whole frame passes both CRCs, and reports the bytes in between as one ``corrupt`` error;
* in the **last** segment of a log, an incomplete header, a body running past the end
  of the file, or a tail of zero bytes is a ``torn tail`` (what recovery would
  truncate); in a sealed segment the same is corruption.

An error ``Frame`` carries ``offset`` (global byte offset where the bad bytes start),
``size`` (bytes skipped) and ``error`` (``"torn tail: ..."``, ``"corrupt: ..."``); it
becomes one error row. So the good frames of a file with a flipped bit are exactly the
frames the engine reads before the flip plus the frames after it, and the good frames
of a file with a torn tail are what the engine reads after recovery. (Whether a good
frame's body is a valid batch is ``cluster.spark.rows``' question: ``undecodable``.)

Worked example: segment base 1000, frames at 0 (30 bytes), 30 (30 bytes, one body bit
flipped), 60 (30 bytes), then 7 bytes of a half-written header, last segment ->
``ok@1000``, ``corrupt@1030 (30 bytes, body checksum mismatch)``, ``ok@1060``,
``torn tail@1090 (7 bytes)``.
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from node.store.log import HEADER, HEADER_SIZE, RECORD_BYTES_MAX_DEFAULT


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a segment, or one run of bad bytes (``body`` None, ``error`` set)."""

    offset: int            # global byte offset
    size: int              # framed bytes, or bytes skipped for an error
    body: bytes | None     # None for an error
    error: str | None = None


def _frame_ok(buf, pos: int, end: int, record_bytes_max: int) -> bool:
    """A whole, checked frame starts at ``pos`` (used to resynchronise)."""
    if end - pos < HEADER_SIZE:
        return False
    body_len, body_crc, header_crc = HEADER.unpack_from(buf, pos)
    if body_len > record_bytes_max or pos + HEADER_SIZE + body_len > end:
        return False
    if zlib.crc32(buf[pos:pos + 8]) != header_crc:
        return False
    return zlib.crc32(buf[pos + HEADER_SIZE:pos + HEADER_SIZE + body_len]) == body_crc


def _resync(buf, pos: int, end: int, record_bytes_max: int) -> int:
    """The next position after ``pos`` where a checked frame starts, or ``end``."""
    crc = zlib.crc32
    unpack = HEADER.unpack_from
    q = pos + 1
    last = end - HEADER_SIZE
    while q <= last:
        body_len, _, header_crc = unpack(buf, q)
        # cheap filters first: a plausible length, then the header CRC, then the body
        if body_len <= record_bytes_max and q + HEADER_SIZE + body_len <= end and crc(buf[q:q + 8]) == header_crc:
            if _frame_ok(buf, q, end, record_bytes_max):
                return q
        q += 1
    return end


def _zero_from(buf, pos: int, end: int) -> bool:
    return bytes(buf[pos:end]).count(0) == end - pos


def scan_buffer(buf, base: int, *, last: bool,
                record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT) -> Iterator[Frame]:
    """Frames of one segment's bytes (see module docstring). Never raises on bad bytes."""
    end = len(buf)
    pos = 0
    unpack = HEADER.unpack_from
    crc = zlib.crc32
    while pos < end:
        if end - pos < HEADER_SIZE:
            yield Frame(base + pos, end - pos, None, _tail_error(last, end - pos, "incomplete header"))
            return
        body_len, body_crc, header_crc = unpack(buf, pos)
        if crc(buf[pos:pos + 8]) != header_crc or body_len > record_bytes_max:
            if last and _zero_from(buf, pos, end):
                yield Frame(base + pos, end - pos, None, f"torn tail: {end - pos} zero bytes")
                return
            reason = "header checksum mismatch" if crc(buf[pos:pos + 8]) != header_crc else \
                f"record length {body_len} exceeds {record_bytes_max}"
            nxt = _resync(buf, pos, end, record_bytes_max)
            yield Frame(base + pos, nxt - pos, None, f"corrupt: {reason}; {nxt - pos} bytes skipped")
            pos = nxt
            continue
        stop = pos + HEADER_SIZE + body_len
        if stop > end:
            yield Frame(base + pos, end - pos, None, _tail_error(last, end - pos, "record ends past end of file"))
            return
        body = bytes(buf[pos + HEADER_SIZE:stop])
        if crc(body) != body_crc:
            if last and _zero_from(buf, pos, end):
                yield Frame(base + pos, end - pos, None, f"torn tail: {end - pos} bytes")
                return
            yield Frame(base + pos, stop - pos, None, f"corrupt: body checksum mismatch; {stop - pos} bytes skipped")
            pos = stop
            continue
        yield Frame(base + pos, stop - pos, body)
        pos = stop


def _tail_error(last: bool, n: int, what: str) -> str:
    return f"torn tail: {n} bytes ({what})" if last else f"corrupt: {what} in a sealed segment; {n} bytes skipped"


def scan_file(path: str, base: int, *, last: bool,
              record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT) -> Iterator[Frame]:
    """``scan_buffer`` over a memory map of the file (read-only; the file is never changed)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                yield from scan_buffer(view, base, last=last, record_bytes_max=record_bytes_max)
            finally:
                view.release()
