"""The consume index of one subject: fixed-size entries, one per stored message, in log order.

File ``{root}/index/{subject}/entries``; entry (little-endian, 32 bytes, ``<QIqQI``)::

    u64 offset      message-log offset of the frame (one codec batch) holding the message
    u32 index       the message's index inside that frame's batch
    i64 store_ms    when this node accepted it (= the frame's store_ms column)
    u64 tags_mask   OR over the message's tags of 1 << (zlib.crc32(tag.encode()) & 63); 0 without tags
    u32 entry_crc   zlib.crc32 of the entry's first 28 bytes

The position of an entry in its file (byte offset / 32) is the message's *handle*: what
``pull`` hands out and ``ack`` takes back. Handles of a subject are dense from 0.

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

    ix = SubjectIndex("orders", path)
    ix.repair_tail(log_end, log_start)                      # at open
    runs = frame_runs(offset=0, subject_idx=batch.subject_idx, store_ms=t, masks=batch_tag_masks(batch))
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

log = logging.getLogger("hourglass.realtime.index")

ENTRY = struct.Struct("<QIqQI")
ENTRY_SIZE = ENTRY.size  # 32
_CRC_SPAN = ENTRY_SIZE - 4  # the CRC covers every byte before it
ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("index", "<u4"), ("store_ms", "<i8"), ("mask", "<u8"),
                        ("crc", "<u4")])
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE
ENTRIES_FILE = "entries"
TAIL_SCAN_ENTRIES = 4096  # entries read at once while cutting a torn tail at open


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
    crc = zlib.crc32
    return np.fromiter(map(crc, [raw[p:p + _CRC_SPAN] for p in range(0, n * ENTRY_SIZE, ENTRY_SIZE)]), np.uint32, n)


def encode_entries(*, offset: int, index: np.ndarray, store_ms: int, masks: np.ndarray) -> bytes:
    """The bytes of one run: entries of messages ``index`` of the frame at ``offset``."""
    n = len(index)
    e = np.zeros(n, ENTRY_DTYPE)
    e["offset"] = offset
    e["index"] = index
    e["store_ms"] = store_ms
    e["mask"] = masks
    e["crc"] = _crcs(e.tobytes(), n)
    return e.tobytes()


def frame_runs(*, offset: int, subject_idx: np.ndarray, store_ms: int, masks: np.ndarray) -> dict[int, bytes]:
    """Every run of one frame at once: subject index -> the bytes of its entries (messages of
    that subject in frame order). One structured array, one CRC comprehension."""
    order = np.argsort(subject_idx, kind="stable")
    raw = encode_entries(offset=offset, index=order, store_ms=store_ms, masks=masks[order])
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
    """One subject's index file. RAM: its entry count, its last entry's (offset, index), an fd."""

    __slots__ = ("subject", "path", "count", "last_offset", "last_index", "fd", "dirty", "trusted_from")

    def __init__(self, subject: str, path: Path) -> None:
        self.subject = subject
        self.path = path
        self.count = 0
        self.last_offset = -1  # message-log offset of the last entry's frame; -1 when empty
        self.last_index = -1
        self.fd = -1
        self.dirty = False     # written since the last fsync
        self.trusted_from = 0  # entries from here on were written by this process: read without CRC checks

    def repair_tail(self, log_end: int, log_start: int) -> int | None:
        """Cut a torn tail (see module docstring); set count and last entry. Returns the
        message-log offset replay must start from when CRC-failing entries were dropped
        (they may sit below the checkpoint's ``indexed_offset``), else None."""
        self.path.touch(exist_ok=True)
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
        self.count = self.trusted_from = keep
        self.last_offset, self.last_index = last if last else (-1, -1)
        if crc_dropped:
            return self.last_offset if last else log_start
        return None

    def append_run(self, fd: int, raw: bytes) -> None:
        view = memoryview(raw)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        tail = np.frombuffer(raw, ENTRY_DTYPE, 1, len(raw) - ENTRY_SIZE)
        self.last_offset, self.last_index = int(tail["offset"][0]), int(tail["index"][0])
        self.count += len(raw) // ENTRY_SIZE
        self.dirty = True

    def read(self, fd: int, pos: int, n: int) -> np.ndarray:
        """Entries ``[pos, pos + n)`` (clamped to the file). Entries found on disk at open are
        CRC-checked; the ones this process wrote itself are not (see module docstring)."""
        n = min(n, self.count - pos)
        if n <= 0:
            return np.zeros(0, ENTRY_DTYPE)
        raw = os.pread(fd, n * ENTRY_SIZE, pos * ENTRY_SIZE)
        if len(raw) != n * ENTRY_SIZE:
            raise CorruptRecord(str(self.path), pos * ENTRY_SIZE + len(raw), "index file shorter than expected")
        if pos >= self.trusted_from:
            return np.frombuffer(raw, ENTRY_DTYPE, n)
        return decode_entries(raw, path=str(self.path), first_pos=pos)

    def truncate(self, fd: int, keep: int) -> None:
        """Keep the first ``keep`` entries (a divergent log suffix was cut), fsynced."""
        os.ftruncate(fd, keep * ENTRY_SIZE)
        os.fsync(fd)
        self.dirty = False
        self.count = keep
        self.trusted_from = min(self.trusted_from, keep)
        if keep:
            e = self.read(fd, keep - 1, 1)
            self.last_offset, self.last_index = int(e["offset"][0]), int(e["index"][0])
        else:
            self.last_offset, self.last_index = -1, -1

    def first_at_or_after(self, fd: int, offset: int) -> int:
        """Position of the first entry whose frame offset is >= ``offset`` (entries are in log order)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self.read(fd, mid, 1)["offset"][0]) < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo
