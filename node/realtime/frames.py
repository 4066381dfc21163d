"""FrameCache: recent message-log frames of a real-time node, decoded, for pulls.

A frame's body is one codec ``Batch`` (``node/realtime/store.py``). A pull reads each
frame it needs once; recent ones come from here, already decoded, so a consumer that keeps
up never reads the log nor decodes a frame twice. The cache is an LRU bounded in body
bytes (``frame_cache_bytes_max``); it always keeps the newest frame, however large.

Invariants: ``bytes`` is the sum of the cached bodies' sizes; every cached offset is a
frame still in the log (retention calls ``forget_below``, a divergent-suffix cut calls
``forget_from``).

Example::

    frames = FrameCache(messages, bytes_max=64 << 20, counters=store.counters)
    frames.put(off, batch, len(body))      # right after the append
    frames.get(off)                        # -> batch, from the cache
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from cluster.codec import Batch
from cluster.errors import CorruptRecord, InvalidArgument
from node.store.log import SegmentedLog


def decode_frame(directory: Path, offset: int, body: bytes) -> Batch:
    """The batch of one frame body; ``CorruptRecord`` if it is not one."""
    try:
        return Batch.decode(body)
    except InvalidArgument as e:  # the CRC matched: written by something that is not this store
        raise CorruptRecord(str(directory), offset, f"not a message batch: {e.reason}") from None


class FrameCache:
    __slots__ = ("messages", "bytes_max", "frames", "bytes", "counters")

    def __init__(self, messages: SegmentedLog, *, bytes_max: int, counters: dict[str, int]) -> None:
        self.messages = messages
        self.bytes_max = bytes_max
        self.frames: OrderedDict[int, tuple[Batch, int]] = OrderedDict()  # offset -> (batch, body bytes)
        self.bytes = 0
        self.counters = counters  # the store's: frame_cache_misses

    def get(self, offset: int) -> Batch:
        """The batch of the frame at ``offset``: from the cache, else read and decoded once."""
        hit = self.frames.get(offset)
        if hit is not None:
            self.frames.move_to_end(offset)
            return hit[0]
        self.counters["frame_cache_misses"] += 1
        body, _ = self.messages.read(offset)
        b = decode_frame(self.messages.directory, offset, body)
        self.put(offset, b, len(body))
        return b

    def peek(self, offset: int) -> Batch:
        """The batch at ``offset`` without caching it or moving it in the LRU (a one-off read)."""
        hit = self.frames.get(offset)
        if hit is not None:
            return hit[0]
        return decode_frame(self.messages.directory, offset, self.messages.read(offset)[0])

    def put(self, offset: int, b: Batch, size: int) -> None:
        self.frames[offset] = (b, size)
        self.bytes += size
        while self.bytes > self.bytes_max and len(self.frames) > 1:
            _, (_, old) = self.frames.popitem(last=False)
            self.bytes -= old

    def forget_below(self, start: int) -> None:
        """Retention deleted the log below ``start``."""
        for off in [o for o in self.frames if o < start]:
            self.bytes -= self.frames.pop(off)[1]

    def forget_from(self, cut: int) -> None:
        """A divergent suffix from ``cut`` on was dropped."""
        for off in [o for o in self.frames if o >= cut]:
            self.bytes -= self.frames.pop(off)[1]
