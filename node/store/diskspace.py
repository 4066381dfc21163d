"""Disk space as a managed resource: the free-space watermark, ENOSPC, allocation before mapping.

Pure part (``DiskWatermark.decide``): free and total bytes of the data folder's file
system in, "refuse writes?" out. The shell (``DiskMonitor``) reads ``os.statvfs`` off the
event loop every ``disk_check_interval_ms`` and after every ``ENOSPC``.

Rule: writes are refused while ``free < threshold`` where
``threshold = min(disk_free_min_bytes, disk_free_min_ratio * total)`` (default 2 GiB or
5 %, whichever is smaller: a 1 TB disk keeps 2 GiB free, a 20 GiB disk 1 GiB). Writes
resume once ``free >= threshold + disk_resume_margin_bytes`` (hysteresis, so a node
near the mark does not flap) - or, after an ``ENOSPC``, once a fresh reading is above
the threshold. What the node still writes while refusing (filing of what it already
accepted, dispatch records, checkpoints, retention's own small files) fits in that
reserve.

Nothing that is memory-mapped is written before its blocks are allocated
(``allocate``: ``posix_fallocate``): a store into a mapped page the file system cannot
back is a SIGBUS that kills the process without a word, whereas ``fallocate`` answers
``ENOSPC`` as an ordinary error, which becomes ``DiskFull`` (``enospc``).

Example::

    wm = DiskWatermark(free_min_bytes=2 << 30, free_min_ratio=0.05, resume_margin_bytes=64 << 20)
    wm.decide(free_bytes=1 << 30, total_bytes=100 << 30, low=False)   # -> True (1 GiB < 2 GiB)
    wm.decide(free_bytes=(2 << 30) + (32 << 20), total_bytes=100 << 30, low=True)   # -> True (margin)
    wm.decide(free_bytes=3 << 30, total_bytes=100 << 30, low=True)    # -> False
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from dataclasses import dataclass

from cluster.errors import DiskFull

log = logging.getLogger("hourglass.store.disk")

DISK_FREE_MIN_BYTES_DEFAULT = 2 << 30
DISK_FREE_MIN_RATIO_DEFAULT = 0.05
DISK_RESUME_MARGIN_BYTES_DEFAULT = 64 << 20
DISK_CHECK_INTERVAL_MS_DEFAULT = 1000


def is_enospc(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def enospc(exc: OSError, what: str) -> DiskFull:
    """The domain error for an ``ENOSPC`` (or quota) failure of ``what``."""
    return DiskFull(f"no space left on device while writing {what} ({exc.strerror})")


def allocate(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate ``[offset, offset + length)`` of a file before it is mapped or stored into
    through a map; ``DiskFull`` when the file system cannot."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if is_enospc(e):
            raise enospc(e, what) from None
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: write zeros
            _zero_fill(fd, offset, length, what)
            return
        raise


def _zero_fill(fd: int, offset: int, length: int, what: str) -> None:
    chunk = b"\0" * min(length, 1 << 20)
    end = offset + length
    try:
        while offset < end:
            n = os.pwrite(fd, chunk[: end - offset], offset)
            offset += n
    except OSError as e:
        if is_enospc(e):
            raise enospc(e, what) from None
        raise


@dataclass(frozen=True, slots=True)
class DiskWatermark:
    free_min_bytes: int = DISK_FREE_MIN_BYTES_DEFAULT
    free_min_ratio: float = DISK_FREE_MIN_RATIO_DEFAULT
    resume_margin_bytes: int = DISK_RESUME_MARGIN_BYTES_DEFAULT

    def threshold(self, total_bytes: int) -> int:
        return int(min(self.free_min_bytes, self.free_min_ratio * total_bytes))

    def decide(self, *, free_bytes: int, total_bytes: int, low: bool) -> bool:
        """Whether writes are refused, given the previous answer ``low``."""
        mark = self.threshold(total_bytes)
        if low:
            return free_bytes < mark + self.resume_margin_bytes
        return free_bytes < mark


@dataclass(frozen=True, slots=True)
class DiskReading:
    free_bytes: int
    total_bytes: int


def read_disk(path: str | os.PathLike) -> DiskReading:
    st = os.statvfs(path)
    return DiskReading(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


class DiskMonitor:
    """The watermark's state for one data folder (the shell calls ``update`` off the loop's
    hot path and ``note_enospc`` when a write failed)."""

    def __init__(self, path: str | os.PathLike, watermark: DiskWatermark) -> None:
        self.path = path
        self.watermark = watermark
        self.low = False
        self.reading = DiskReading(0, 0)
        self.refusals = 0
        self.enospc_count = 0

    def update(self, reading: DiskReading) -> bool | None:
        """Take a reading; returns the new state when it changed (None otherwise)."""
        self.reading = reading
        low = self.watermark.decide(free_bytes=reading.free_bytes, total_bytes=reading.total_bytes, low=self.low)
        if low == self.low:
            return None
        self.low = low
        mark = self.watermark.threshold(reading.total_bytes)
        if low:
            log.error("disk low: refusing writes path=%s free_bytes=%d threshold_bytes=%d", self.path,
                      reading.free_bytes, mark)
        else:
            log.warning("disk space back: taking writes again path=%s free_bytes=%d threshold_bytes=%d", self.path,
                        reading.free_bytes, mark)
        return low

    async def run(self, interval_s: float, metrics) -> None:
        """The node's disk task: a reading every ``interval_s`` (``statvfs`` off the loop),
        the watermark updated and the disk gauges of ``metrics`` (``NodeMetrics``) set."""
        while True:
            reading = await asyncio.to_thread(read_disk, self.path)
            self.update(reading)
            metrics.disk_free_bytes.set(reading.free_bytes)
            metrics.disk_total_bytes.set(reading.total_bytes)
            metrics.disk_low.set(1 if self.low else 0)
            await asyncio.sleep(interval_s)

    def note_enospc(self, what: str) -> None:
        self.enospc_count += 1
        if not self.low:
            log.error("ENOSPC: refusing writes path=%s while=%s", self.path, what)
        self.low = True

    def check(self) -> None:
        """Raise ``DiskFull`` while writes are refused."""
        if self.low:
            self.refusals += 1
            r = self.reading
            raise DiskFull(f"{r.free_bytes} bytes free on the data disk, below the watermark "
                           f"{self.watermark.threshold(r.total_bytes)} bytes; writes resume when retention "
                           f"or an operator frees space")
