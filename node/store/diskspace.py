"""Disk space as a managed resource: the free-space watermark, admission of writes, ENOSPC,
allocation before mapping.

Pure part (``DiskWatermark``, ``DiskBudget``): free and total bytes of the data folder's file
system and the size of the write about to be made in, "admit it?" out. No clock, no I/O. The
shell (``DiskMonitor``) reads ``os.statvfs`` off the event loop every
``disk_check_interval_ms`` and turns a refusal into ``DiskFull``.

Rules (docs/operations.md, "When the disk fills"):

* **mark** ``= min(disk_free_min_bytes, disk_free_min_ratio x total)``: free space the node's
  writes never take (default 2 GiB or 5 %, whichever is smaller: a 1 TB disk keeps 2 GiB
  free, a 20 GiB disk 1 GiB). What the node still writes while it refuses (filing of what it
  already accepted, dispatch records, checkpoints, retention's small files) comes out of it.
* **estimated free** ``= last reading - (bytes admitted since that reading began + bytes
  admitted before it but not written yet when it began)``. A reading (statvfs) shows what is
  written; the message-log bytes of a batch are written at once, but its schedule copy and id
  entries only when the filer runs after the group commit, so the shell says, as each reading
  begins, how many admitted bytes are still to be written (``pending``: a delay node's
  ``DelayStore.unfiled_bytes_bound``, 0 on a real-time node, whose writes are synchronous).
  A byte is counted twice at most while a reading is being taken (writes landing during the
  statvfs), so the estimate errs low by little, never high.
* **admission**: a write of ``w`` bytes (the caller's bound of everything it leads to: the
  batch's frame, its schedule-log copy, index entries, allocation steps; ``DelayStore`` /
  ``RealtimeStore.write_bytes_bound``) is admitted only if ``estimated free - w >= mark``.
  So the node's own writes never take free space below the mark; only what the bound missed
  and the reserve writes above can, and the tests hold it to "never below the mark minus one
  write".
* **refusing** (``low``) starts when a write would cross the mark, when a reading shows
  ``estimated free < mark``, or on ``ENOSPC``; every write is refused then. It ends when a
  reading shows ``estimated free >= mark + margin``, with
  **margin** ``= min(disk_resume_margin_ratio x total, disk_resume_margin_bytes_max)``
  (default 2 % of the disk, at most 64 MiB): hysteresis sized to the disk, so a node near the
  mark does not flap between readings, and a small disk (24 MB: 480 KiB) resumes after a few
  MB are freed. A write larger than the margin can be refused again right after resuming.

Worked example (24 MiB tmpfs, mark 4 MiB, margin 2 % = 491,520 bytes)::

    wm = DiskWatermark(free_min_bytes=4 << 20, free_min_ratio=0.5, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 << 20)
    b = DiskBudget(wm)
    b.reading_started(pending_bytes=0); b.reading(free_bytes=10 << 20, total_bytes=24 << 20)
    b.admit(3 << 20)    # None: 10 - 3 = 7 MiB >= 4 MiB; estimated free is now 7 MiB
    b.admit(3 << 20)    # None: 7 - 3 = 4 MiB, exactly the mark
    b.admit(1)          # Refusal(...): would cross the mark; low from now on
    b.reading_started(pending_bytes=2 << 20)   # the filer has 2 MiB of those 6 still to write
    b.reading(free_bytes=6 << 20, total_bytes=24 << 20)    # low: 6 - 2 = 4 < 4 MiB + 480 KiB
    b.reading_started(pending_bytes=0)
    b.reading(free_bytes=5 << 20, total_bytes=24 << 20)    # False: 5 MiB >= 4.47 MiB, writes again

Nothing that is memory-mapped is written before its blocks are allocated
(``allocate``: ``posix_fallocate``): a store into a mapped page the file system cannot
back is a SIGBUS that kills the process without a word, whereas ``fallocate`` answers
``ENOSPC`` as an ordinary error, which becomes ``DiskFull`` (``enospc``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from cluster.errors import DiskFull

log = logging.getLogger("hourglass.store.disk")

MIB = 1 << 20
# a file takes disk space by whole blocks: the stores' bounds of a write count one partly used
# block for each file it touches (``DelayStore`` / ``RealtimeStore.write_bytes_bound``)
FILE_BLOCK_BYTES = 4096


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


# ---------------------------------------------------------------------- the pure rules


@dataclass(frozen=True, slots=True)
class DiskWatermark:
    """The thresholds (node settings ``disk_free_min_bytes``, ``disk_free_min_ratio``,
    ``disk_resume_margin_ratio``, ``disk_resume_margin_bytes_max``; defaults in
    ``node/store/settings.py`` ``DISK_DEFAULTS``, the one place they are written)."""

    free_min_bytes: int
    free_min_ratio: float
    resume_margin_ratio: float
    resume_margin_bytes_max: int

    def __post_init__(self) -> None:
        if self.free_min_bytes < 0 or self.resume_margin_bytes_max < 0:
            raise ValueError("disk watermark byte settings must not be negative")
        if not (0 <= self.free_min_ratio < 1 and 0 <= self.resume_margin_ratio < 1):
            raise ValueError("disk watermark ratios must be in [0, 1)")

    def threshold(self, total_bytes: int) -> int:
        """The mark: free bytes the node's writes never take."""
        return int(min(self.free_min_bytes, self.free_min_ratio * total_bytes))

    def resume_margin(self, total_bytes: int) -> int:
        return int(min(self.resume_margin_bytes_max, self.resume_margin_ratio * total_bytes))

    def resume_bytes(self, total_bytes: int) -> int:
        """Free bytes at which a refusing node takes writes again."""
        return self.threshold(total_bytes) + self.resume_margin(total_bytes)

    def decide(self, *, free_bytes: int, total_bytes: int, low: bool) -> bool:
        """Whether writes are refused after a reading, given the previous answer ``low``."""
        if low:
            return free_bytes < self.resume_bytes(total_bytes)
        return free_bytes < self.threshold(total_bytes)

    def admits(self, *, free_bytes: int, total_bytes: int, write_bytes: int) -> bool:
        """Whether a write of ``write_bytes`` leaves at least the mark free."""
        return free_bytes - write_bytes >= self.threshold(total_bytes)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a write was refused (``DiskMonitor`` makes the ``DiskFull`` of it)."""

    free_bytes: int        # estimated free bytes now (the last reading less what was admitted since)
    threshold_bytes: int   # the mark
    resume_bytes: int      # estimated free bytes at which writes are taken again
    write_bytes: int       # the refused write's bound (0: refused because the node is refusing)
    enospc: bool           # the disk answered ENOSPC (a reading has not cleared it yet)

    def text(self, node: str) -> str:
        """What the client reads after ``disk full: `` (about 230 characters at most)."""
        where = f"node {node}" if node else "this node"
        why = (" and a write hit no space left on device" if self.enospc else
               f" and this write needs up to {_mib(self.write_bytes)}" if self.write_bytes else "")
        return (f"{where} has {self.free_bytes} bytes ({_mib(self.free_bytes)}) free on its data disk; "
                f"it keeps {_mib(self.threshold_bytes)} free{why}; writes resume at {self.resume_bytes} bytes "
                f"({_mib(self.resume_bytes)}) free")


def _mib(n: int) -> str:
    """Bytes as an operator reads them in a message."""
    return f"{n / MIB:.2f} MiB"


class DiskBudget:
    """The watermark's state for one data folder: the last reading, the bytes admitted since,
    refusing or not (rules in the module docstring). Pure: the caller brackets each statvfs
    with ``reading_started`` / ``reading``, asks ``admit`` before a write and calls
    ``note_enospc`` when one failed."""

    def __init__(self, watermark: DiskWatermark) -> None:
        self.watermark = watermark
        self.low = False
        self.enospc = False
        self.free_bytes: int | None = None   # the last reading (None: no reading yet)
        self.total_bytes = 0
        self.admitted_bytes = 0              # every admitted write's bound, summed
        self._start: int | None = None       # the reading in progress: admissions up to here are in it
        self._seen_upto = 0                  # ... of the last reading

    @property
    def unseen_bytes(self) -> int:
        """Bytes admitted that the last reading does not show (it began before they were written)."""
        return self.admitted_bytes - self._seen_upto

    def estimated_free(self) -> int | None:
        return None if self.free_bytes is None else self.free_bytes - self.unseen_bytes

    def reading_started(self, pending_bytes: int = 0) -> None:
        """A reading begins; ``pending_bytes`` of what was admitted are not written yet (they
        will land after it, so it cannot show them)."""
        self._start = self.admitted_bytes - pending_bytes

    def reading(self, *, free_bytes: int, total_bytes: int) -> bool | None:
        """Take a reading begun at the last ``reading_started``; the new ``low`` if it changed."""
        if self._start is None:
            self.reading_started()
        self.free_bytes, self.total_bytes = free_bytes, total_bytes
        self._seen_upto, self._start = self._start, None
        low = self.watermark.decide(free_bytes=self.estimated_free(), total_bytes=total_bytes, low=self.low)
        if not low:
            self.enospc = False
        return self._set(low)

    def admit(self, write_bytes: int) -> Refusal | None:
        """Admit a write of ``write_bytes`` (None) or say why not. Before any reading every write
        is admitted (nothing is known yet; the shell reads once at start)."""
        free = self.estimated_free()
        if free is None:
            self.admitted_bytes += write_bytes
            return None
        if not self.low and self.watermark.admits(free_bytes=free, total_bytes=self.total_bytes,
                                                  write_bytes=write_bytes):
            self.admitted_bytes += write_bytes
            return None
        refused = self.refusal(write_bytes if not self.low else 0)
        self._set(True)
        return refused

    def refusal(self, write_bytes: int = 0) -> Refusal:
        return Refusal(free_bytes=max(0, self.estimated_free() or 0),
                       threshold_bytes=self.watermark.threshold(self.total_bytes),
                       resume_bytes=self.watermark.resume_bytes(self.total_bytes), write_bytes=write_bytes,
                       enospc=self.enospc)

    def note_enospc(self) -> bool | None:
        self.enospc = True
        return self._set(True)

    def _set(self, low: bool) -> bool | None:
        if low == self.low:
            return None
        self.low = low
        return low


# ---------------------------------------------------------------------- the shell


@dataclass(frozen=True, slots=True)
class DiskReading:
    free_bytes: int
    total_bytes: int


def read_disk(path: str | os.PathLike) -> DiskReading:
    st = os.statvfs(path)
    return DiskReading(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


class DiskMonitor:
    """``DiskBudget`` for one data folder, with its readings, logs and ``DiskFull`` errors.
    ``address`` names the node in the errors (``DiskFull.node``): what an operator must find;
    ``pending`` says how many admitted bytes are not written yet (``DiskBudget.reading_started``)."""

    def __init__(self, path: str | os.PathLike, watermark: DiskWatermark, *,
                 address: Callable[[], str] = lambda: "", pending: Callable[[], int] = lambda: 0) -> None:
        self.path = path
        self.watermark = watermark
        self.budget = DiskBudget(watermark)
        self.address = address
        self.pending = pending
        self.refusals = 0
        self.enospc_count = 0
        try:  # one reading at once, so that the first writes are judged too (statvfs takes microseconds)
            self.update(read_disk(path))
        except OSError:
            pass

    @property
    def low(self) -> bool:
        return self.budget.low

    @property
    def reading(self) -> DiskReading:
        b = self.budget
        return DiskReading(b.free_bytes or 0, b.total_bytes)

    def update(self, reading: DiskReading) -> bool | None:
        """Take a reading (begun now, or at the last ``budget.reading_started``); returns the
        new state when it changed (None otherwise)."""
        changed = self.budget.reading(free_bytes=reading.free_bytes, total_bytes=reading.total_bytes)
        self._log_state("a disk reading")
        return changed

    async def run(self, interval_s: float, metrics) -> None:
        """The node's disk task: a reading every ``interval_s`` (``statvfs`` off the loop),
        the watermark updated and the disk gauges of ``metrics`` (``NodeMetrics``) set."""
        while True:
            self.budget.reading_started(self.pending())
            reading = await asyncio.to_thread(read_disk, self.path)
            self.update(reading)
            metrics.disk_free_bytes.set(reading.free_bytes)
            metrics.disk_total_bytes.set(reading.total_bytes)
            metrics.disk_low.set(1 if self.low else 0)
            await asyncio.sleep(interval_s)

    def note_enospc(self, what: str) -> None:
        self.enospc_count += 1
        self.budget.note_enospc()
        self._log_state(f"ENOSPC while {what}")

    def admit(self, write_bytes: int) -> None:
        """Admit a write of at most ``write_bytes`` bytes, or raise ``DiskFull`` (nothing written)."""
        refused = self.budget.admit(write_bytes)
        if refused is None:
            return
        self.refusals += 1
        self._log_state(f"a write of up to {write_bytes} bytes would cross the mark")
        raise self.error(refused)

    def check(self) -> None:
        """Raise ``DiskFull`` while writes are refused (a write whose size is not known)."""
        self.admit(0)

    def error(self, refused: Refusal | None = None) -> DiskFull:
        """The ``DiskFull`` a client gets: node address and free bytes in its text and fields."""
        refused = refused or self.budget.refusal()
        node = self.address()
        return DiskFull(refused.text(node), node, refused.free_bytes)

    _logged_low = False  # the state the log said last: each change is logged once

    def _log_state(self, why: str) -> None:
        b = self.budget
        low = b.low
        if low == self._logged_low:
            return
        self._logged_low = low
        free, mark = b.estimated_free() or 0, self.watermark.threshold(b.total_bytes)
        if low:
            log.error("disk low: refusing writes path=%s free_bytes=%d unseen_bytes=%d threshold_bytes=%d "
                      "resume_bytes=%d why=%s", self.path, free, b.unseen_bytes, mark,
                      self.watermark.resume_bytes(b.total_bytes), why)
        else:
            log.warning("disk space back: taking writes again path=%s free_bytes=%d threshold_bytes=%d",
                        self.path, free, mark)
