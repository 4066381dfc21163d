"""One bucket of the schedule log: its data log, its index of fixed entries chaining the
frames of each second, and its mmap'd per-second heads. ``node/store/schedule.py`` owns the
buckets together (which are open, filing a batch, the frame cache, healing, retention).

A bucket folder (``schedule/{start_ms:018d}/``, ``docs/format.md`` "Schedule log")::

    data/      a SegmentedLog: one frame per filed group (a ``cluster.codec.Batch`` due in one second)
    index      fixed 48-byte entries, one per frame, in filing order
    heads      header + one u32 head per second of the bucket
    rebuilt    marker: the bucket was rebuilt from the message log (its frames moved)

Index entry (``<QIIQQIIII``, 48 bytes, little-endian)::

    u64 data_offset   offset of the frame in the bucket's data log
    u32 frame_size    header + body bytes
    u32 prev          entry number + 1 of the previous frame of the same second (0 = none)
    u64 first_seq     lowest seq in the frame
    u64 last_seq      highest seq in the frame
    u32 second        due second relative to the bucket start
    u32 messages      records of kind message in the frame
    u32 cancels       cancel tombstones in the frame
    u32 pad           entries written after this one by the same filing call (0: its last)

heads: 32-byte header ``magic "HGH2" | u32 version | i64 bucket_start_ms | u32 seconds |
u64 entries_covered | u32 crc32(first 28 bytes)`` then ``seconds`` x u32 (entry number +
1 of the newest frame of that second, 0 = none). Loading second ``s`` walks its frame
chain from ``heads[s]`` through ``prev`` (newest first, ``Bucket.chain``): no sort, O(1)
insert. One filing call (``append_groups``) is one data ``write`` and one index ``pwrite``.

Invariants and recovery (``Bucket.__init__``):

* data is written before its index entries, index entries before their heads;
* the frames one filing call puts in a bucket are all kept or all dropped: the data log
  recovers its own torn tail; index entries pointing past the data end are dropped, and so
  are the entries of a call cut short (``pad`` of an entry counts the entries written after
  it by the same call, so a call's last entry has 0); frames in data past the last kept
  entry are cut off. Replaying the message log files them again: a checkpoint only covers
  records whose index entries were written and flushed. Nothing a flush vouched for (the
  heads header's ``entries_covered``) is ever dropped this way: if the index holds fewer
  entries than that, it was damaged, and the frames past it are indexed again instead;
* ``entries_covered`` in the heads header says which index entries are reflected in the
  heads; entries after it are re-applied; a heads file failing its checks is rebuilt;
* the high-water mark ``last_seq`` is the largest ``last_seq`` of the index entries (the
  groups of one batch are filed second by second, so their seqs interleave; every batch
  is filed after the ones before it in the log): replaying the message log re-offers
  records and ``ScheduleLog.file`` skips any with ``seq <= last_seq``, so nothing is filed
  twice. This is only sound because a call's frames are kept or dropped together: had the
  group due in second 4 been lost while the group due in second 3 (holding a higher seq)
  was kept, the mark would skip the lost records for good. The entry holding the mark is
  checked against its frame at open (``_check_mark``).

``verify`` checks a bucket against itself (scrubbing): the index covers the data log
contiguously, every chain and head is the one the index implies, and frames match their
entries; a failure is ``CorruptRecord`` naming the file and offset.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from cluster.codec import KIND_CANCEL, Batch
from cluster.errors import CorruptRecord
from cluster.files import DATA_DIR_MODE, DATA_MODE
from node.store.syncplan import SyncPlan

from .diskspace import allocate, enospc, is_enospc
from .log import HEADER_SIZE, SegmentedLog

log = logging.getLogger("hourglass.store.schedule")

ENTRY = struct.Struct("<QIIQQIIII")
ENTRY_SIZE = ENTRY.size  # 48
ENTRY_DTYPE = np.dtype([("data_offset", "<u8"), ("frame_size", "<u4"), ("prev", "<u4"), ("first_seq", "<u8"),
                        ("last_seq", "<u8"), ("second", "<u4"), ("messages", "<u4"), ("cancels", "<u4"),
                        ("pad", "<u4")])
HEADS_HEADER = struct.Struct("<4sIqIQ")  # 28 bytes, then u32 crc, padded to 32
HEADS_HEADER_SIZE = 32
HEADS_MAGIC = b"HGH2"
FORMAT_VERSION = 2  # of the heads header
REBUILT_MARKER = "rebuilt"

assert ENTRY_DTYPE.itemsize == ENTRY_SIZE


def _group_counts(b: Batch) -> tuple[int, int]:
    cancels = int(np.count_nonzero(b.kind == KIND_CANCEL))
    return b.n - cancels, cancels


class Bucket:
    """One time bucket: data log + index + mmap'd heads."""

    def __init__(self, path: Path, start_ms: int, bucket_ms: int, *, data_segment_bytes: int) -> None:
        self.path = path
        self.start_ms = start_ms
        self.seconds = bucket_ms // 1000
        path.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        self.data = SegmentedLog.open(path / "data", segment_bytes_max=data_segment_bytes)
        self._index_path = path / "index"
        self._index_fd = os.open(self._index_path, os.O_RDWR | os.O_CREAT, DATA_MODE)
        self._heads_path = path / "heads"
        self.entries = 0
        self.last_seq = -1
        self._repaired = False
        self.rebuilt = (path / REBUILT_MARKER).exists()
        self._recover_index()
        self._open_heads()
        self._check_mark()

    # -- recovery ----------------------------------------------------------------

    def _read_entry(self, n: int) -> tuple:
        raw = os.pread(self._index_fd, ENTRY_SIZE, n * ENTRY_SIZE)
        if len(raw) != ENTRY_SIZE:
            raise CorruptRecord(str(self._index_path), n * ENTRY_SIZE, "short index entry")
        return ENTRY.unpack(raw)

    def _recover_index(self) -> None:
        size = os.fstat(self._index_fd).st_size
        n = size // ENTRY_SIZE
        data_end = self.data.end_offset
        while n > 0:  # drop entries whose frame is not (or no longer) in the data log
            off, fsize, *_ = self._read_entry(n - 1)
            if off + fsize <= data_end:
                break
            n -= 1
        # a filing call cut short: its entries after one whose count is not 0. Never below what
        # a flush vouched for (the heads header's count): a checkpoint may cover those records,
        # so they would not be filed again; a count there that is not 0 is a flipped bit.
        vouched = self._vouched_entries()
        while n > vouched:
            if self._read_entry(n - 1)[-1] == 0:
                break
            n -= 1
        if n * ENTRY_SIZE != size:
            os.ftruncate(self._index_fd, n * ENTRY_SIZE)
            log.warning("schedule index truncated path=%s entries=%d bytes_dropped=%d",
                        self._index_path, n, size - n * ENTRY_SIZE)
            self._repaired = True
        self.entries = n
        indexed_end = self.data.start_offset
        if n:
            off, fsize, *_ = self._read_entry(n - 1)
            indexed_end = off + fsize
            # the groups of one batch are filed by second, not by seq: the mark is the maximum
            self.last_seq = int(self.entries_array()["last_seq"].max())
        if indexed_end < data_end and n >= vouched:
            # frames of a filing call that reached the data log but not the index (the process
            # died between the two writes, maybe after only some of its frames): cut them off.
            # Indexing them would keep part of a call, and its highest seq as the mark would
            # skip the rest when the message log is replayed; the replay files them all again
            # (no flush vouched for them, so no checkpoint covers them).
            dropped = self.data.truncate(indexed_end)
            self._repaired = True
            log.warning("schedule data cut to its index path=%s offset=%d bytes_dropped=%d",
                        self.data.directory, indexed_end, dropped)
        elif indexed_end < data_end:
            # the index lost entries a flush vouched for (damage, not a kill): a checkpoint may
            # cover these frames, so they are indexed again from their bodies rather than lost
            rows = []
            for off, body in self.data.iterate(indexed_end):
                rows.append(self._entry_row(off, HEADER_SIZE + len(body), Batch.decode(body)))
            self._write_entries(rows, link=False)
            self._repaired = True
            log.warning("schedule index rebuilt from data path=%s frames=%d (fewer entries than flushed: %d < %d)",
                        self._index_path, len(rows), n, vouched)

    def _vouched_entries(self) -> int:
        """``entries_covered`` of the heads header when it passes its checks (the entries the
        last completed flush made durable), else 0."""
        try:
            with open(self._heads_path, "rb") as f:
                hdr = f.read(HEADS_HEADER_SIZE)
        except FileNotFoundError:
            return 0
        if len(hdr) < HEADS_HEADER_SIZE:
            return 0
        covered = self._heads_covered(hdr)
        return 0 if covered is None else covered

    def _heads_covered(self, hdr: bytes) -> int | None:
        """``entries_covered`` of a heads header that is this bucket's and passes its CRC, else None."""
        magic, version, start, seconds, covered = HEADS_HEADER.unpack_from(hdr)
        crc = struct.unpack_from("<I", hdr, 28)[0]
        ok = (magic == HEADS_MAGIC and version == FORMAT_VERSION and start == self.start_ms
              and seconds == self.seconds and crc == zlib.crc32(hdr[:28]))
        return int(covered) if ok else None

    def _check_mark(self) -> None:
        """The replay high-water mark comes from one entry (the largest ``last_seq``): read
        its frame and check it, so a flipped bit there cannot make filing skip records."""
        if not self.entries:
            return
        e = self.entries_array()
        n = int(np.argmax(e["last_seq"]))
        b = self.read(int(e["data_offset"][n]), int(e["frame_size"][n]))
        if b.n == 0 or int(b.seq.max()) != int(e["last_seq"][n]) or int(b.seq.min()) != int(e["first_seq"][n]):
            raise CorruptRecord(str(self._index_path), n * ENTRY_SIZE, "index entry seq range does not match its frame")

    def _entry_row(self, off: int, fsize: int, b: Batch) -> tuple:
        if not b.n:
            raise CorruptRecord(str(self.data.directory), off, "empty schedule frame")
        second = (max(int(b.effective_ms[0]), self.start_ms) - self.start_ms) // 1000
        if not 0 <= second < self.seconds:
            raise CorruptRecord(str(self.data.directory), off, f"frame due outside bucket {self.start_ms}")
        msgs, cancels = _group_counts(b)
        return (off, fsize, 0, int(b.seq.min()), int(b.seq.max()), second, msgs, cancels, 0)

    def _open_heads(self) -> None:
        want = HEADS_HEADER_SIZE + 4 * self.seconds
        fd = os.open(self._heads_path, os.O_RDWR | os.O_CREAT, DATA_MODE)
        try:
            fresh = os.fstat(fd).st_size != want
            if fresh:
                os.ftruncate(fd, 0)
            # allocated before it is mapped: a store into a page the disk cannot back is a SIGBUS
            allocate(fd, 0, want, str(self._heads_path))
            self._heads_map = mmap.mmap(fd, want)
        except BaseException:
            os.close(fd)
            raise
        self._heads_fd = fd  # kept: a flush planned on the loop fsyncs it from a worker thread
        self.heads = np.frombuffer(self._heads_map, "<u4", self.seconds, HEADS_HEADER_SIZE)
        covered = 0
        if not fresh:
            vouched = self._heads_covered(bytes(self._heads_map[:HEADS_HEADER_SIZE]))
            ok = vouched is not None and vouched <= self.entries
            covered = vouched or 0
            if not ok or self._repaired:
                log.warning("schedule heads rebuilt path=%s reason=%s", self._heads_path,
                            "index repaired" if ok else "bad header")
                covered = 0
        if covered == 0:
            self.heads[:] = 0
        # Re-apply index entries the header does not vouch for. A killed process may have
        # linked some already (the map lives in the page cache): a head at or past the entry
        # means it is linked; otherwise relink it, since its stored prev may be stale.
        if covered < self.entries:
            region = bytearray(os.pread(self._index_fd, (self.entries - covered) * ENTRY_SIZE, covered * ENTRY_SIZE))
            rows = np.frombuffer(region, ENTRY_DTYPE)
            heads = self.heads
            for i in range(len(rows)):
                n = covered + i
                second = int(rows["second"][i])
                if second >= self.seconds:
                    raise CorruptRecord(str(self._index_path), n * ENTRY_SIZE, "index entry second past bucket end")
                if heads[second] >= n + 1:
                    continue
                rows["prev"][i] = heads[second]
                heads[second] = n + 1
            os.pwrite(self._index_fd, region, covered * ENTRY_SIZE)
        self._write_heads_header()

    def _heads_header(self) -> bytes:
        hdr = HEADS_HEADER.pack(HEADS_MAGIC, FORMAT_VERSION, self.start_ms, self.seconds, self.entries)
        return hdr + struct.pack("<I", zlib.crc32(hdr))

    def _write_heads_header(self) -> None:
        self._heads_map[:HEADS_HEADER_SIZE] = self._heads_header()

    # -- writing -----------------------------------------------------------------

    def _write_entries(self, rows: list[tuple], *, link: bool = True) -> None:
        """Append one filing call's index entries with one pwrite, then (``link``) point their
        seconds' heads at them: one step per frame, never per message. Recovery writes
        unlinked entries and relinks everything from the heads rebuild."""
        if not rows:
            return
        arr = np.array(rows, ENTRY_DTYPE)
        arr["pad"] = np.arange(len(rows) - 1, -1, -1)  # one call's entries: kept or dropped together
        n0 = self.entries
        new_heads: dict[int, int] = {}
        if link:
            heads = self.heads
            for i, sec in enumerate(arr["second"].tolist()):
                arr["prev"][i] = new_heads.get(sec, int(heads[sec]))
                new_heads[sec] = n0 + i + 1
        os.pwrite(self._index_fd, arr.tobytes(), n0 * ENTRY_SIZE)
        for sec, head in new_heads.items():
            self.heads[sec] = head
        self.entries = n0 + len(rows)
        self.last_seq = max(self.last_seq, int(arr["last_seq"].max()))

    def append_groups(self, groups: list[Batch]) -> list[tuple[int, int]]:
        """File groups (each due in one second of this bucket, in due order, all newer than
        ``last_seq``): one data write, one index write. Returns (offset, size) each."""
        bodies = [g.encode(packed=True) for g in groups]
        data_end = self.data.end_offset
        offsets = self.data.append(bodies)
        sizes = [HEADER_SIZE + len(body) for body in bodies]
        try:
            self._write_entries([self._entry_row(off, size, g) for off, size, g in zip(offsets, sizes, groups)])
        except OSError as e:  # the disk filled between data and index: as if nothing was filed
            self.data.truncate(data_end)
            if is_enospc(e):
                raise enospc(e, str(self._index_path)) from None
            raise
        return list(zip(offsets, sizes))

    def discard(self) -> None:
        """Let go of the files without flushing them (the bucket is being deleted)."""
        if hasattr(self, "heads"):
            del self.heads
        self._heads_map.close()
        for name in ("_index_fd", "_heads_fd"):
            if getattr(self, name, -1) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)
        self.data.close()

    def flush(self) -> None:
        """Make data, index and heads durable, in that order."""
        plan = SyncPlan()
        self.plan_flush(plan)
        plan.run()

    def plan_flush(self, plan: SyncPlan) -> None:
        """``flush`` as steps for a worker thread: data, index, heads (the page cache the
        map shares), then the heads header vouching for the entries filed so far."""
        self.data.plan_flush(plan)
        plan.fsync(self._index_fd)
        plan.fsync(self._heads_fd)
        plan.pwrite(self._heads_fd, self._heads_header(), 0)
        plan.fsync(self._heads_fd)

    # -- reading -----------------------------------------------------------------

    def chain(self, second_in_bucket: int, *, newer_than: int = 0) -> list[tuple[int, int, int, int]]:
        """(entry number, data_offset, frame_size, last_seq) of the frames due in one second,
        newest first; only entries numbered above ``newer_than`` (appended after it)."""
        n = int(self.heads[second_in_bucket])
        out = []
        steps = 0
        while n > newer_than:
            if n > self.entries or steps > self.entries:
                raise CorruptRecord(str(self._index_path), (n - 1) * ENTRY_SIZE, "index chain points past the end")
            off, fsize, prev, _first, last, second, *_ = self._read_entry(n - 1)
            if prev >= n or second != second_in_bucket:
                raise CorruptRecord(str(self._index_path), (n - 1) * ENTRY_SIZE, "index chain is broken")
            out.append((n, off, fsize, last))
            n = prev
            steps += 1
        return out

    def entries_array(self, first: int = 0) -> np.ndarray:
        """Every index entry from entry ``first`` on (for counts): one read."""
        raw = os.pread(self._index_fd, max(0, self.entries - first) * ENTRY_SIZE, first * ENTRY_SIZE)
        return np.frombuffer(raw[: len(raw) - len(raw) % ENTRY_SIZE], ENTRY_DTYPE)

    def read(self, data_offset: int, frame_size: int) -> Batch:
        return Batch.decode(self.data.read_at(data_offset, frame_size))

    def verify(self, *, seconds: range | None = None, seq_below: int | None = None) -> int:
        """Check this bucket against itself; return the frames read. Raises ``CorruptRecord``
        naming the file and offset.

        Always (numpy over the whole index, no frame read): entries in filing order cover the
        data log contiguously, every ``prev`` links the previous entry of the same second,
        every head the newest one, every seq range is ordered and below ``seq_below`` (the
        first seq not issued yet: a flipped high bit in ``last_seq`` would make filing skip
        new records). Then the frames - all of them (``seconds`` None, one pass over the data
        log), or only those of ``seconds`` (relative to the bucket start) - pass their CRCs
        and match their entries exactly (seq range, second, counts)."""
        e = self.entries_array().copy()
        ipath = str(self._index_path)
        n = len(e)
        if n:
            bad = np.flatnonzero(e["first_seq"] > e["last_seq"])
            if seq_below is not None:
                bad = np.union1d(bad, np.flatnonzero(e["last_seq"] >= np.uint64(seq_below)))
            if len(bad):
                raise CorruptRecord(ipath, int(bad[0]) * ENTRY_SIZE, "index entry seq range is impossible")
            ends = e["data_offset"].astype(np.int64) + e["frame_size"]
            starts = np.concatenate([[self.data.start_offset], ends[:-1]])
            bad = np.flatnonzero((e["data_offset"].astype(np.int64) != starts) | (e["second"] >= self.seconds))
            if len(bad):
                raise CorruptRecord(ipath, int(bad[0]) * ENTRY_SIZE, "index entry does not describe the next frame")
            if int(ends[-1]) != self.data.end_offset:
                raise CorruptRecord(ipath, (n - 1) * ENTRY_SIZE, "index does not cover the data log")
            # the chain of each second, recomputed: prev = previous entry of the same second
            order = np.argsort(e["second"], kind="stable")
            sec_sorted = e["second"][order]
            want_prev = np.zeros(n, np.int64)
            same = np.zeros(n, bool)
            same[1:] = sec_sorted[1:] == sec_sorted[:-1]
            want_prev[order[same]] = order[np.flatnonzero(same) - 1] + 1
            bad = np.flatnonzero(e["prev"].astype(np.int64) != want_prev)
            if len(bad):
                raise CorruptRecord(ipath, int(bad[0]) * ENTRY_SIZE, "index chain is broken")
            last = np.ones(n, bool)
            last[:-1] = sec_sorted[:-1] != sec_sorted[1:]
            want_heads = np.zeros(self.seconds, np.int64)
            want_heads[sec_sorted[last].astype(np.int64)] = order[last] + 1
        else:
            want_heads = np.zeros(self.seconds, np.int64)
        bad = np.flatnonzero(self.heads.astype(np.int64) != want_heads)
        if len(bad):
            raise CorruptRecord(str(self._heads_path), HEADS_HEADER_SIZE + 4 * int(bad[0]), "head does not match index")
        def check(i: int, off: int, body: bytes) -> None:
            row = self._entry_row(off, HEADER_SIZE + len(body), Batch.decode(body))
            got = (int(e["data_offset"][i]), int(e["frame_size"][i]), 0, int(e["first_seq"][i]),
                   int(e["last_seq"][i]), int(e["second"][i]), int(e["messages"][i]), int(e["cancels"][i]), 0)
            if got != row:
                raise CorruptRecord(ipath, i * ENTRY_SIZE, "index entry does not match its frame")

        if seconds is not None:
            picked = np.flatnonzero((e["second"] >= seconds.start) & (e["second"] < seconds.stop)).tolist()
            for i in picked:
                off, size = int(e["data_offset"][i]), int(e["frame_size"][i])
                check(i, off, self.data.read_at(off, size))
            return len(picked)
        i = 0
        for off, body in self.data.iterate():
            if i >= n:
                raise CorruptRecord(str(self.data.directory), off, "frame not in the index")
            check(i, off, body)
            i += 1
        return i

    def close(self) -> None:
        self.flush()
        del self.heads
        self._heads_map.close()
        os.close(self._heads_fd)
        self._heads_fd = -1
        os.close(self._index_fd)
        self._index_fd = -1
        self.data.close()

    def __del__(self) -> None:
        # dropped without close(): give the descriptors back, write nothing
        try:
            for name in ("_index_fd", "_heads_fd"):
                if getattr(self, name, -1) >= 0:
                    os.close(getattr(self, name))
                    setattr(self, name, -1)
            if hasattr(self, "heads"):
                del self.heads
            self._heads_map.close()
        except Exception:
            pass
