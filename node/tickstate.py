"""Tick state: where dispatching stood, as the small record a delay node persists in its
checkpoint and ships to slaves so a new master can restore the wheel's cursor
(``TimingWheel.state`` makes one, ``TimingWheel.restore`` takes its fields). Pure codec:
bytes in, bytes out.

Layout (little-endian, 37 bytes, ``docs/format.md`` "Tick state")::

    4s  magic            b"HGTS"
    u8  version          1
    i64 epoch
    i64 tick             last fully dispatched tick; -1 = none
    u32 index_in_second  entries dispatched within the second containing ``tick``
    u64 dispatch_offset  dispatch-log end offset when the state was taken
    u32 crc32            zlib.crc32 of all the bytes before it

Invariants: ``decode(encode(s)) == s``; ``decode`` raises ``CorruptRecord`` (path
``<tick-state>``) on a wrong length, a CRC mismatch, a bad magic or version, or a tick
below -1; ``encode`` raises ``ValueError`` for a field out of its range, so nothing
unreadable is ever written.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from cluster.errors import CorruptRecord

# magic, version, epoch, tick, index_in_second, dispatch_offset; then crc32.
_TICK_STATE_BODY = struct.Struct("<4sBqqIQ")
_TICK_STATE_CRC = struct.Struct("<I")
_TICK_STATE_MAGIC = b"HGTS"
_TICK_STATE_VERSION = 1
TICK_STATE_SIZE = _TICK_STATE_BODY.size + _TICK_STATE_CRC.size  # 37 bytes


@dataclass(frozen=True, slots=True)
class TickState:
    """Where dispatching stood; persisted locally and shipped to slaves.

    Layout (little-endian, 37 bytes): ``b"HGTS"``, u8 version = 1, i64 epoch,
    i64 tick, u32 index_in_second, u64 dispatch_offset, u32 zlib.crc32 of all
    the bytes before it.
    """

    epoch: int
    tick: int  # last fully dispatched tick; -1 = none
    index_in_second: int  # entries dispatched within the second containing `tick` (informational)
    dispatch_offset: int  # dispatch-log end offset when the state was taken

    def encode(self) -> bytes:
        if self.tick < -1:
            raise ValueError(f"tick {self.tick} < -1")
        try:
            body = _TICK_STATE_BODY.pack(
                _TICK_STATE_MAGIC,
                _TICK_STATE_VERSION,
                self.epoch,
                self.tick,
                self.index_in_second,
                self.dispatch_offset,
            )
        except struct.error as exc:
            raise ValueError(f"tick state field out of range: {exc}") from None
        return body + _TICK_STATE_CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, data: bytes) -> TickState:
        def corrupt(reason: str) -> CorruptRecord:
            return CorruptRecord(path="<tick-state>", offset=0, reason=reason)

        data = bytes(data)
        if len(data) != TICK_STATE_SIZE:
            raise corrupt(f"length {len(data)}, expected {TICK_STATE_SIZE}")
        body = data[: _TICK_STATE_BODY.size]
        (crc,) = _TICK_STATE_CRC.unpack_from(data, _TICK_STATE_BODY.size)
        if zlib.crc32(body) != crc:
            raise corrupt(f"crc mismatch: stored {crc:#010x}, computed {zlib.crc32(body):#010x}")
        magic, version, epoch, tick, index_in_second, dispatch_offset = _TICK_STATE_BODY.unpack(body)
        if magic != _TICK_STATE_MAGIC:
            raise corrupt(f"bad magic {magic!r}")
        if version != _TICK_STATE_VERSION:
            raise corrupt(f"unknown version {version}")
        if tick < -1:
            raise corrupt(f"tick {tick} < -1")
        return cls(epoch, tick, index_in_second, dispatch_offset)
