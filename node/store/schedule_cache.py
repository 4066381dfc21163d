"""The schedule log's frame cache: decoded frames (``FrameRef``) by (bucket start, data
offset), least recently used out, bounded in bytes (``schedule_cache_bytes_max``).

``ScheduleLog.file`` puts the frames due soon (the wheel loads them next) and reads go
through it first, so loading the next seconds rarely touches the disk. Invariant: ``bytes``
is the sum of the cached frames' ``frame_size`` and is at most ``bytes_max`` after every
``put``; a bucket rebuilt or deleted is dropped whole (``drop_bucket``), since its offsets
no longer name the same frames.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cluster.codec import Batch


@dataclass(frozen=True, slots=True)
class FrameRef:
    """One filed group: where it lives and its decoded records."""

    bucket_start_ms: int
    data_offset: int
    frame_size: int
    batch: Batch


class FrameCache:
    """Decoded frames by (bucket, offset), least recently used out, bounded in bytes."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self.bytes = 0
        self._items: OrderedDict[tuple[int, int], FrameRef] = OrderedDict()

    def put(self, ref: FrameRef) -> None:
        key = (ref.bucket_start_ms, ref.data_offset)
        if key in self._items:
            return
        self._items[key] = ref
        self.bytes += ref.frame_size
        while self.bytes > self.bytes_max and self._items:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.frame_size

    def get(self, bucket: int, offset: int) -> FrameRef | None:
        return self._items.get((bucket, offset))

    def drop_bucket(self, bucket: int) -> None:
        for key in [k for k in self._items if k[0] == bucket]:
            self.bytes -= self._items.pop(key).frame_size
