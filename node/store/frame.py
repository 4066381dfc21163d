"""The record frame of every segmented log: its bytes, its encoder and its checked decoder.
Pure: bytes in, bytes out; no files. ``node/store/log.py`` (the segmented log) frames what
it appends and decodes what it reads with these; ``node/store/verify.py`` and the
replication reader follow the same ``decode_frame`` rules.

Frame (little-endian, ``docs/format.md`` "Segmented log")::

    u32 body_len | u32 body_crc | u32 header_crc | body
    body_crc   = zlib.crc32(body)
    header_crc = zlib.crc32(first 8 header bytes)

Invariants: ``frame(b)`` decodes back to ``b``; ``decode_frame`` tells a buffer that ends
inside a frame (``TornRecord``: only a torn tail when it is the end of a file) from a
frame failing a check (``CorruptRecord`` with the path and global offset); a body longer
than the reader's ``record_bytes_max`` is corruption, never an allocation.

Example::

    frame(b"a")                                  # 12-byte header + b"a"
    decode_frame(frame(b"a"), 0, "f", 0, 1 << 20)  # -> (b"a", 13)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence

from cluster.errors import CorruptRecord

HEADER = struct.Struct("<III")
HEADER_SIZE = HEADER.size  # 12
PREFIX = struct.Struct("<II")


def frame(body: bytes) -> bytes:
    """Encode one record frame (header + body)."""
    prefix = PREFIX.pack(len(body), zlib.crc32(body))
    return prefix + struct.pack("<I", zlib.crc32(prefix)) + body


def frame_head(parts: Sequence[bytes]) -> tuple[bytes, int]:
    """The header of one record whose body is ``b"".join(parts)``, without joining them (the
    body CRC runs over the pieces in turn), and the body's length: ``frame(body) ==
    head + body``."""
    crc = 0
    size = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
        size += len(p)
    prefix = PREFIX.pack(size, crc)
    return prefix + struct.pack("<I", zlib.crc32(prefix)), size


def frame_many(bodies: Iterable[bytes]) -> tuple[bytes, list[int]]:
    """Encode several frames; return the bytes and each frame's relative position."""
    parts: list[bytes] = []
    positions: list[int] = []
    pos = 0
    pack_prefix = PREFIX.pack
    pack_u32 = struct.Struct("<I").pack
    crc = zlib.crc32
    for body in bodies:
        prefix = pack_prefix(len(body), crc(body))
        parts.append(prefix)
        parts.append(pack_u32(crc(prefix)))
        parts.append(body)
        positions.append(pos)
        pos += HEADER_SIZE + len(body)
    return b"".join(parts), positions


class TornRecord(Exception):
    """Internal: the bytes end in the middle of a record."""


def decode_frame(buf: bytes | memoryview, pos: int, path: str, base: int, record_bytes_max: int) -> tuple[bytes, int]:
    """Decode the frame at ``buf[pos:]``; return (body, next_pos).

    Raises TornRecord when the buffer ends inside the frame (only meaningful at
    the end of a file) and CorruptRecord when a check fails.
    """
    end = len(buf)
    if end - pos < HEADER_SIZE:
        raise TornRecord()
    body_len, body_crc, header_crc = HEADER.unpack_from(buf, pos)
    if zlib.crc32(bytes(buf[pos : pos + 8])) != header_crc:
        raise CorruptRecord(path, base + pos, "header checksum mismatch")
    if body_len > record_bytes_max:
        raise CorruptRecord(path, base + pos, f"record length {body_len} exceeds {record_bytes_max}")
    start = pos + HEADER_SIZE
    stop = start + body_len
    if stop > end:
        raise TornRecord()
    body = bytes(buf[start:stop])
    if zlib.crc32(body) != body_crc:
        raise CorruptRecord(path, base + pos, "body checksum mismatch")
    return body, stop
