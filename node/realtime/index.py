"""The consume index of one subject: fixed-size entries, one per stored message, in log order.

File ``{root}/index/{subject}/entries`` (base 0) or ``entries.{base:020d}`` (after
retention dropped a dead prefix, see "Compaction" below); entry (little-endian, 32 bytes,
``<QIqQI``)::

    u64 offset      message-log offset of the frame (one codec batch) holding the message
    u32 index       the message's index inside that frame's batch
    i64 visible_ms  when a pull may hand it out: 0 if it was due when accepted, else its
                    due time ``deliver_at_ms``, at most ``visible_hold_ms_max`` after it was
                    accepted, rounded up to a multiple of ``visible_step_ms`` (``visible_ms``);
                    files written before this rule hold the acceptance time, which reads
                    the same (never held: ``held_mask``)
    u64 tags_mask   OR over the message's tags of 1 << (zlib.crc32(tag.encode()) & 63); 0 without tags
    u32 entry_crc   zlib.crc32 of the entry's first 28 bytes

The position of an entry (``base`` + byte offset in its file / 32) is the message's
*handle*: what ``pull`` hands out and ``ack`` takes back. Handles of a subject are dense
from 0 and never reused or renumbered.

Compaction (retention, ``node/realtime/retention.py``): once the message-log segments the
first entries point into are deleted, those entries are dead. The file is rewritten
without them: entries ``[new_base, upto)`` are copied to ``entries.{new_base:020d}.tmp``
and fsynced (worker thread), then on the store's thread the entries appended meanwhile
are copied too and the file is renamed to ``entries.{new_base:020d}``; the old file is
deleted once the folder is fsynced. The base lives in the file name, so a rename is the
whole switch. At open (``open_files``) ``*.tmp`` files are removed and the file with the
highest base is the index; an older file still there (a crash before its deletion) only
lends entries past the newer file's end (a power cut that lost the new file's unsynced
tail: the positions are the same in both files), then is deleted.

One append writes, per subject of its batch, one *run*: the entries of that subject's
messages of the frame, built with numpy and written with one ``os.write``. Entries are in
log order, so a message of frame ``o`` at index ``i`` is indexed iff ``(o, i) <= (offset,
index)`` of the file's last entry. The frame size is not stored: the frame's own header
holds it (CRC-protected), and reads of recent frames come from the store's frame cache.

Every entry carries its own CRC (computed in one list comprehension per frame): a torn or
zero-filled page fails it wherever it lands. ``repair_tail`` (at open) drops a partial
trailing entry, then trailing entries that fail their CRC or point at or past the
message-log end. ``read`` checks the CRC of every entry that was on disk when the file was
opened and reports a failure as ``CorruptRecord(path, offset)``; entries this process
appended itself (``trusted_from`` on) are read unchecked: they are the bytes it wrote, and
the frames they point at are CRC-checked whenever they are read from disk.

Example (the store owns the file descriptors and passes them in)::

    base, path, older = open_files(folder)                 # at open
    ix = SubjectIndex("orders", path, base)
    ix.repair_tail(log_end, log_start)
    runs = frame_runs(offset=0, subject_idx=batch.subject_idx, visible_ms=t, masks=batch_tag_masks(batch))
    ix.append_run(fd, runs[0])                              # subject 0 of the frame's subject table
    ix.read(fd, 1, 2)["index"]                              # -> its 2nd and 3rd messages' frame indexes
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from cluster.codec import Batch, decode_extra
from cluster.errors import CorruptRecord
from cluster.files import DATA_MODE
from node.realtime.span_crc import span_crcs
from node.store.diskspace import enospc, is_enospc

log = logging.getLogger("hourglass.realtime.index")

ENTRY = struct.Struct("<QIqQI")
ENTRY_SIZE = ENTRY.size  # 32
_CRC_SPAN = ENTRY_SIZE - 4  # the CRC covers every byte before it
ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("index", "<u4"), ("visible_ms", "<i8"), ("mask", "<u8"),
                        ("crc", "<u4")])
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE
ENTRIES_FILE = "entries"
TMP_SUFFIX = ".tmp"
TAIL_SCAN_ENTRIES = 4096  # entries read at once while cutting a torn tail at open
COPY_CHUNK_ENTRIES = 1 << 15  # entries copied at once by a compaction (1 MiB)


def index_path(folder: Path, base: int) -> Path:
    """The index file of a subject whose first entry has handle ``base``."""
    return folder / (ENTRIES_FILE if base == 0 else f"{ENTRIES_FILE}.{base:020d}")


def _file_base(p: Path) -> int | None:
    if p.name == ENTRIES_FILE:
        return 0
    head, _, tail = p.name.partition(".")
    return int(tail) if head == ENTRIES_FILE and tail.isdigit() else None


def open_files(folder: Path) -> tuple[int, Path, list[tuple[int, Path]]]:
    """At open: remove ``*.tmp`` leftovers of a compaction; return ``(base, path)`` of the
    index file (the highest base) and the older files still there, newest first."""
    for tmp in folder.glob(ENTRIES_FILE + "*" + TMP_SUFFIX):
        tmp.unlink()
    found = sorted(((b, p) for p in folder.glob(ENTRIES_FILE + "*") if (b := _file_base(p)) is not None),
                   reverse=True)
    if not found:
        return 0, index_path(folder, 0), []
    return found[0][0], found[0][1], found[1:]


def copy_entries(src: Path, src_base: int, dst: Path, first: int, upto: int) -> None:
    """Any thread: write entries ``[first, upto)`` of ``src`` (a file whose first entry is
    ``src_base``) to a new file ``dst``, fsynced. The bytes are copied as they are."""
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, DATA_MODE)
    try:
        pos = first
        while pos < upto:
            n = min(COPY_CHUNK_ENTRIES, upto - pos)
            raw = os.pread(fd_in, n * ENTRY_SIZE, (pos - src_base) * ENTRY_SIZE)
            if len(raw) != n * ENTRY_SIZE:
                raise CorruptRecord(str(src), (pos - src_base) * ENTRY_SIZE + len(raw), "index file shorter than expected")
            _write_all(fd_out, raw)
            pos += n
        os.fsync(fd_out)
    finally:
        os.close(fd_in)
        os.close(fd_out)


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]


def tags_mask(tags) -> int:
    """The 64-bit bloom mask of a tag set (see module docstring)."""
    mask = 0
    for t in tags:
        mask |= 1 << (zlib.crc32(t.encode()) & 63)
    return mask


def batch_tag_masks(batch: Batch) -> np.ndarray:
    """u64 tag mask per message; extras are decoded only for messages that have some."""
    masks = np.zeros(batch.n, np.uint64)
    if not batch.extras:
        return masks
    ends = batch.extra_end.astype(np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    has = np.flatnonzero(ends > starts)
    blob = batch.extras
    masks[has] = np.fromiter((tags_mask(decode_extra(blob[a:b])[0])
                              for a, b in zip(starts[has].tolist(), ends[has].tolist())), np.uint64, len(has))
    return masks


def _crcs(raw: bytes, n: int) -> np.ndarray:
    """Each entry's CRC (``zlib.crc32`` of its first 28 bytes), by tables over all of them
    (``node/realtime/span_crc.py``)."""
    return span_crcs(raw, n, span=_CRC_SPAN, stride=ENTRY_SIZE)


def visible_ms(batch: Batch, store_ms, hold_ms_max: int, step_ms: int = 1) -> np.ndarray:
    """When each message of a stored frame may be handed out: its due time rounded up to a
    multiple of ``step_ms``, never before it was accepted (``store_ms``, the frame's or per
    message) nor more than ``hold_ms_max`` (+ the rounding) after; a message due by then is
    visible at once. A delay node dispatches each firing round a few milliseconds ahead
    (``dispatch_lead_ms``) and the real-time node holds those messages until they are due;
    the step lets the messages of a few milliseconds become visible together (one pull
    answer, not one per millisecond)."""
    due = batch.deliver_at_ms
    store = np.asarray(store_ms, np.int64)
    ahead = due > store
    if not ahead.any():  # due already (producers' messages): visible when stored
        return np.zeros(len(due), np.int64)
    v = np.minimum(due, store + hold_ms_max)
    if step_ms > 1:
        v = -(-v // step_ms) * step_ms
    v[~ahead] = 0
    return v


def held_mask(visible: np.ndarray, now_ms: int, window_ms: int) -> np.ndarray:
    """Entries a pull at ``now_ms`` holds back: visible later, but at most ``window_ms``
    later (the hold limit and its rounding). A value further ahead was written under a
    clock that has since stepped back: it is not held for that long. Old entries (the
    acceptance time) and entries due when stored (0) are never held."""
    return (visible - (now_ms + 1)).view(np.uint64) < np.uint64(window_ms)


def encode_entries(*, offset: int, index: np.ndarray, visible_ms, masks: np.ndarray) -> bytes:
    """The bytes of one run: entries of messages ``index`` of the frame at ``offset``."""
    n = len(index)
    e = np.zeros(n, ENTRY_DTYPE)
    e["offset"] = offset
    e["index"] = index
    e["visible_ms"] = visible_ms
    e["mask"] = masks
    e["crc"] = _crcs(e.tobytes(), n)
    return e.tobytes()


def frame_runs(*, offset: int, subject_idx: np.ndarray, visible_ms, masks: np.ndarray) -> dict[int, bytes]:
    """Every run of one frame at once: subject index -> the bytes of its entries (messages of
    that subject in frame order). One structured array, one CRC comprehension.
    ``visible_ms``: one value for the frame, or one per message."""
    order = np.argsort(subject_idx, kind="stable")
    if np.ndim(visible_ms):
        visible_ms = np.asarray(visible_ms)[order]
    raw = encode_entries(offset=offset, index=order, visible_ms=visible_ms, masks=masks[order])
    keys = subject_idx[order]
    cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    ends = np.concatenate((cuts, [len(order)])).tolist()
    return {int(keys[a]): raw[a * ENTRY_SIZE:b * ENTRY_SIZE] for a, b in zip(starts, ends)}


def decode_entries(raw: bytes, *, path: str, first_pos: int) -> np.ndarray:
    """Entries of ``raw`` (whole entries), each CRC-checked; ``first_pos`` names the first
    entry's position for the error."""
    n = len(raw) // ENTRY_SIZE
    e = np.frombuffer(raw, ENTRY_DTYPE, n)
    bad = np.flatnonzero(_crcs(raw, n) != e["crc"])
    if len(bad):
        raise CorruptRecord(path, (first_pos + int(bad[0])) * ENTRY_SIZE, "index entry checksum mismatch")
    return e


class SubjectIndex:
    """One subject's index file. RAM: its entry count, its last entry's (offset, index), an fd.
    ``count`` and every position are handles (absolute); the file holds ``[base, count)``.
    ``live_from``: the first handle whose frame is still in the message log (retention)."""

    __slots__ = ("subject", "path", "base", "count", "last_offset", "last_index", "fd", "dirty", "dirty_from",
                 "trusted_from", "live_from", "held_until", "held_pos", "held_visible_ms")

    def __init__(self, subject: str, path: Path, base: int = 0) -> None:
        self.subject = subject
        self.path = path
        self.base = base
        self.live_from = base
        self.count = base
        self.last_offset = -1  # message-log offset of the last entry's frame; -1 when empty
        self.last_index = -1
        self.fd = -1
        self.dirty = False     # written since the last fsync
        self.dirty_from = -1   # message-log offset of the first entry written since the last fsync
        self.trusted_from = 0  # entries from here on were written by this process: read without CRC checks
        # no entry has visible_ms past this (pulls skip the check until then); set by the store
        self.held_until = 0
        # the last entry a pull found held (not visible yet) and when it becomes visible: a pull
        # that starts there before then has nothing to read (``Delivery.take_new``)
        self.held_pos = -1
        self.held_visible_ms = 0

    def repair_tail(self, log_end: int, log_start: int) -> int | None:
        """Cut a torn tail (see module docstring); set count and last entry. Returns the
        message-log offset replay must start from when CRC-failing entries were dropped
        (they may sit below the checkpoint's ``indexed_offset``), else None."""
        self.path.touch(mode=DATA_MODE, exist_ok=True)
        size = self.path.stat().st_size
        keep = size // ENTRY_SIZE
        crc_dropped = False
        last: tuple[int, int] | None = None
        with open(self.path, "rb") as f:
            while keep > 0 and last is None:
                lo = max(0, keep - TAIL_SCAN_ENTRIES)
                f.seek(lo * ENTRY_SIZE)
                raw = f.read((keep - lo) * ENTRY_SIZE)
                e = np.frombuffer(raw, ENTRY_DTYPE)
                crc_ok = _crcs(raw, len(e)) == e["crc"]
                ok = crc_ok & (e["offset"] < log_end)
                good = np.flatnonzero(ok)
                upto = int(good[-1]) + 1 if len(good) else 0
                crc_dropped |= not bool(crc_ok[upto:].all())
                keep = lo + upto
                if len(good):
                    last = (int(e["offset"][upto - 1]), int(e["index"][upto - 1]))
        if keep * ENTRY_SIZE != size:
            with open(self.path, "r+b") as f:
                f.truncate(keep * ENTRY_SIZE)
                os.fsync(f.fileno())
            log.warning("index torn tail truncated path=%s offset=%d bytes_dropped=%d",
                        self.path, keep * ENTRY_SIZE, size - keep * ENTRY_SIZE)
        self.count = self.trusted_from = self.base + keep
        self.last_offset, self.last_index = last if last else (-1, -1)
        if crc_dropped:
            return self.last_offset if last else log_start
        return None

    def adopt_tail(self, fd: int, older: Path, older_base: int, log_end: int) -> int:
        """At open, after ``repair_tail``: append the entries an older file of this subject
        (a compaction's source, not deleted yet) holds past this file's end, as long as they
        pass their CRC and point below ``log_end``. Returns entries adopted."""
        size = older.stat().st_size
        first, upto = self.count, older_base + size // ENTRY_SIZE
        if upto <= first or first < older_base:
            return 0
        with open(older, "rb") as f:
            f.seek((first - older_base) * ENTRY_SIZE)
            raw = f.read((upto - first) * ENTRY_SIZE)
        e = np.frombuffer(raw, ENTRY_DTYPE, len(raw) // ENTRY_SIZE)
        bad = np.flatnonzero((_crcs(raw, len(e)) != e["crc"]) | (e["offset"] >= log_end))
        n = int(bad[0]) if len(bad) else len(e)
        if n:
            self.append_run(fd, raw[:n * ENTRY_SIZE])
            os.fsync(fd)
            self.dirty = False
            log.warning("index entries taken from the previous file path=%s from=%s entries=%d", self.path, older, n)
        return n

    def append_run(self, fd: int, raw: bytes) -> None:
        view = memoryview(raw)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as e:
            # a short write leaves part of the run behind: cut the file back to whole entries
            # the count knows, so positions and handles stay aligned
            os.ftruncate(fd, (self.count - self.base) * ENTRY_SIZE)
            if is_enospc(e):
                raise enospc(e, str(self.path)) from None
            raise
        if not self.dirty:
            self.dirty_from = ENTRY.unpack_from(raw, 0)[0]
        self.last_offset, self.last_index = ENTRY.unpack_from(raw, len(raw) - ENTRY_SIZE)[:2]
        self.count += len(raw) // ENTRY_SIZE
        self.dirty = True

    def read(self, fd: int, pos: int, n: int) -> np.ndarray:
        """Entries ``[pos, pos + n)`` (clamped to the file). Entries found on disk at open are
        CRC-checked; the ones this process wrote itself are not (see module docstring)."""
        n = min(n, self.count - pos)
        if n <= 0:
            return np.zeros(0, ENTRY_DTYPE)
        assert pos >= self.base, f"handle {pos} below the index base {self.base} of {self.subject!r}"
        rel = pos - self.base
        raw = os.pread(fd, n * ENTRY_SIZE, rel * ENTRY_SIZE)
        if len(raw) != n * ENTRY_SIZE:
            raise CorruptRecord(str(self.path), rel * ENTRY_SIZE + len(raw), "index file shorter than expected")
        if pos >= self.trusted_from:
            return np.frombuffer(raw, ENTRY_DTYPE, n)
        return decode_entries(raw, path=str(self.path), first_pos=rel)

    def truncate(self, fd: int, keep: int) -> None:
        """Keep the entries below handle ``keep`` (a divergent log suffix was cut), fsynced."""
        keep = max(keep, self.base)
        os.ftruncate(fd, (keep - self.base) * ENTRY_SIZE)
        os.fsync(fd)
        self.dirty = False
        self.count = keep
        self.held_pos = -1
        self.trusted_from = min(self.trusted_from, keep)
        if keep > self.base:
            e = self.read(fd, keep - 1, 1)
            self.last_offset, self.last_index = int(e["offset"][0]), int(e["index"][0])
        else:
            self.last_offset, self.last_index = -1, -1

    def first_at_or_after(self, fd: int, offset: int, *, lo: int | None = None) -> int:
        """Position of the first entry (from ``lo`` on) whose frame offset is >= ``offset``
        (entries are in log order)."""
        lo, hi = self.base if lo is None else max(lo, self.base), self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self.read(fd, mid, 1)["offset"][0]) < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo
