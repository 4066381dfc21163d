"""Schedule log: messages filed by the UTC time bucket of their due time, one frame per
(batch, due second).

Owns ``{root}/schedule/`` with one folder per bucket, named by the bucket's start in
UTC milliseconds (zero padded, so names sort by time)::

    schedule/meta.json                       {"bucket_ms": 3600000, "version": 2}
    schedule/000001795424400000/data/        a SegmentedLog: one frame per filed group
    schedule/000001795424400000/index        fixed 48-byte entries, one per frame
    schedule/000001795424400000/heads        header + one u32 head per second of the bucket

A *group* is the part of one accepted batch that is due in one second, in due order: its
frame body is a ``cluster.codec.Batch`` (effective_ms column = the time it is filed under,
>= deliver_at_ms). Filing a batch of N messages due over k seconds writes k frames with
one ``write`` per bucket, k index entries with one ``pwrite`` per bucket, and k heads. A
batch made of a few due-ordered runs (SDK batches are sent sorted) is cut into slices
instead, one frame per (run, second): a second may then hold several frames of one call.

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
chain from ``heads[s]`` through ``prev`` (newest first) and reads each frame once; a
recently filed frame is served from a bounded in-memory cache of decoded batches
(``cache_bytes_max``), so the wheel loading the next seconds rarely touches the disk.

Invariants and recovery (``Bucket.open``):

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
  records and ``file`` skips any with ``seq <= last_seq``, so nothing is filed twice. This
  is only sound because a call's frames are kept or dropped together: had the group due in
  second 4 been lost while the group due in second 3 (holding a higher seq) was kept, the
  mark would skip the lost records for good.

Healing (derived data, ``docs/operations.md`` "Self-healing and scrubbing"): every entry
point that reads a bucket (``bucket``, ``load_second``, ``find``, ``locate``) catches
``CorruptRecord`` once, hands the bucket to ``healer`` (the delay store re-files it from
the message log) and tries again. ``replace_bucket`` writes the new bucket into
``{start}.rebuild/``, renames it ``{start}.ready`` once flushed (complete), then swaps it in
by rename; ``ScheduleLog`` finishes or discards an interrupted swap at open. A rebuilt
bucket holds the marker file ``rebuilt``: its frames moved, so id-index locations into
it are stale and ``find`` looks a seq up by the index's seq ranges instead.

Example: filing a batch whose records are due at 1_795_424_401_234 and 1_795_424_402_000
writes two frames in bucket 1_795_424_400_000 (seconds 1 and 2); ``load_second(1_795_424_401)``
returns ``[FrameRef(bucket_start_ms=1_795_424_400_000, data_offset=0, ..., batch=<1 record>)]``.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import zlib
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cluster.codec import KIND_CANCEL, KIND_MESSAGE, Batch
from cluster.errors import CorruptRecord, InvalidArgument
from cluster.files import DATA_DIR_MODE, DATA_MODE, write_atomic
from node.store.settings import STORE_DEFAULTS
from node.store.syncplan import SyncPlan

from .diskspace import allocate, enospc, is_enospc
from .log import HEADER_SIZE, SegmentedLog, fsync_dir

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
# meta.json "version": 3 = frames may use the packed column layout (cluster/codec.py
# FLAG_PACKED); a version 2 folder (plain frames only) is read the same and marked 3 when
# opened, so a node older than the packed layout refuses it instead of misreading it.
META_VERSION = 3
META_VERSIONS_READ = (2, 3)
MEMO_FRAMES_MAX = 4096  # frames one ``ScheduleLog.memo`` block keeps (a batch's duplicates)
OPEN_BUCKETS_MAX = 32  # buckets kept open (LRU) unless ``open_buckets_max`` says otherwise
REBUILD_GROUPS_PER_WRITE = 4096  # frames appended per write while a bucket is rebuilt (bounds memory)
REBUILT_MARKER = "rebuilt"
FILE_SORTED_RUNS_MAX = 64  # a batch of at most this many due-ordered runs is filed as slices,
FILE_SORTED_RUN_MIN = 16  # ... of this many records each on average (else sorted: no tiny frames)

assert ENTRY_DTYPE.itemsize == ENTRY_SIZE


@dataclass(frozen=True, slots=True)
class FrameRef:
    """One filed group: where it lives and its decoded records."""

    bucket_start_ms: int
    data_offset: int
    frame_size: int
    batch: Batch


@dataclass(frozen=True, slots=True)
class Filed:
    """Where each record of a filed batch went, aligned with the batch (``filed`` False:
    filed before a crash, skipped)."""

    filed: np.ndarray          # bool
    bucket_start_ms: np.ndarray
    data_offset: np.ndarray
    frame_size: np.ndarray
    frames: list[FrameRef]


class _FrameCache:
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

    def entries_array(self) -> np.ndarray:
        """Every index entry (for counts): one read."""
        raw = os.pread(self._index_fd, self.entries * ENTRY_SIZE, 0)
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


def _write_meta(path: Path, bucket_ms: int) -> None:
    write_atomic(path, json.dumps({"bucket_ms": bucket_ms, "version": META_VERSION}).encode(), mode=DATA_MODE)


class ScheduleLog:
    """All buckets of one node. Keeps at most ``open_buckets_max`` buckets open (LRU)."""

    def __init__(self, root: str | os.PathLike, *, bucket_ms: int = STORE_DEFAULTS.bucket_ms,
                 data_segment_bytes: int = STORE_DEFAULTS.schedule_segment_bytes,
                 open_buckets_max: int = OPEN_BUCKETS_MAX,
                 cache_bytes_max: int = STORE_DEFAULTS.schedule_cache_bytes_max) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            version = int(meta.get("version", 1))
            if version not in META_VERSIONS_READ:
                raise CorruptRecord(str(meta_path), 0, f"schedule log format {meta.get('version')} "
                                                       f"(this node reads {', '.join(map(str, META_VERSIONS_READ))})")
            bucket_ms = int(meta["bucket_ms"])  # fixed at creation
            if version != META_VERSION:
                _write_meta(meta_path, bucket_ms)
        else:
            if bucket_ms % 1000 or bucket_ms <= 0:
                raise InvalidArgument("bucket_ms", "must be a positive whole number of seconds")
            _write_meta(meta_path, bucket_ms)
        self.bucket_ms = bucket_ms
        self.data_segment_bytes = data_segment_bytes
        self.open_buckets_max = open_buckets_max
        self._open: OrderedDict[int, Bucket] = OrderedDict()
        self.cache = _FrameCache(cache_bytes_max)
        # frames read during one synchronous pass (``memo``): a retried batch's duplicates are
        # confirmed on the frames that hold them, each read and decoded once, not once per id
        self._memo: dict[tuple[int, int], FrameRef] | None = None
        self.rebuilds = 0  # buckets replaced (replace_bucket) since open
        # called with (bucket start, error) when a bucket fails a check; it rebuilds the
        # bucket (``replace_bucket``) or raises. None: corruption is raised to the caller.
        self.healer: Callable[[int, CorruptRecord], None] | None = None
        self._finish_swaps()
        self._finish_deletions()

    def bucket_start(self, deliver_at_ms: int) -> int:
        return deliver_at_ms - deliver_at_ms % self.bucket_ms

    def _path(self, start_ms: int) -> Path:
        return self.root / f"{start_ms:018d}"

    def bucket_path(self, start_ms: int) -> Path:
        """The folder of bucket ``start_ms`` (it may not exist)."""
        return self._path(start_ms)

    # -- healing -------------------------------------------------------------------

    def _finish_swaps(self) -> None:
        """Finish or discard a bucket swap a crash interrupted (see ``replace_bucket``)."""
        for p in sorted(self.root.iterdir()):
            stem, dot, kind = p.name.partition(".")
            if not (dot and stem.isdigit() and p.is_dir()):
                continue
            if kind == "ready":  # complete: it replaces the bucket
                main = self.root / stem
                if main.exists():
                    shutil.rmtree(main)
                os.replace(p, main)
                log.warning("schedule bucket swap finished path=%s", main)
            elif kind in ("rebuild", "old"):
                shutil.rmtree(p)
        fsync_dir(self.root)

    def _healing(self, start_ms: int, fn):
        """``fn()``; on ``CorruptRecord`` let the healer rebuild bucket ``start_ms`` and
        call ``fn()`` once more (a second failure is raised)."""
        try:
            return fn()
        except CorruptRecord as e:
            if self.healer is None:
                raise
            self.healer(start_ms, e)
            if self._memo:
                self._memo.clear()  # the bucket was rebuilt: its frames moved
        return fn()

    def replace_bucket(self, start_ms: int, chunks, *, before_swap: Callable[[Path], None] | None = None) -> int:
        """Replace bucket ``start_ms`` by one holding ``chunks`` (an iterable of lists of
        groups, each a ``Batch`` due in one second of the bucket, seqs increasing from list
        to list). Crash-safe: written and flushed under ``{start}.rebuild``, renamed
        ``{start}.ready``, then swapped in by rename. ``before_swap(folder)`` may add files to
        the new bucket's folder once every chunk is written (they are swapped in with it).
        Returns the frames written."""
        main = self._path(start_ms)
        tmp = self.root / f"{start_ms:018d}.rebuild"
        ready = self.root / f"{start_ms:018d}.ready"
        if tmp.exists():
            shutil.rmtree(tmp)
        nb = Bucket(tmp, start_ms, self.bucket_ms, data_segment_bytes=self.data_segment_bytes)
        frames = 0
        try:
            for groups in chunks:
                for i in range(0, len(groups), REBUILD_GROUPS_PER_WRITE):
                    part = groups[i:i + REBUILD_GROUPS_PER_WRITE]
                    nb.append_groups(part)
                    frames += len(part)
            if before_swap is not None:
                before_swap(tmp)
            write_atomic(tmp / REBUILT_MARKER, b"rebuilt from the message log\n", mode=DATA_MODE)
        except BaseException:
            nb.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        nb.close()  # flushes data, index, heads
        fsync_dir(tmp)
        os.replace(tmp, ready)
        fsync_dir(self.root)
        old = self._open.pop(start_ms, None)
        if old is not None:
            try:
                old.close()
            except (OSError, CorruptRecord):
                pass  # the broken bucket goes away whatever its files say
        self.cache.drop_bucket(start_ms)
        self.rebuilds += 1  # entry numbers and offsets of this bucket changed (DelayStore's second loads restart)
        if main.exists():
            gone = self.root / f"{start_ms:018d}.old"
            os.replace(main, gone)
            os.replace(ready, main)
            fsync_dir(self.root)
            shutil.rmtree(gone)
        else:
            os.replace(ready, main)
            fsync_dir(self.root)
        return frames

    def find_seq(self, bucket_start_ms: int, seq: int) -> tuple[FrameRef, int] | None:
        """A record of a bucket by seq alone (a rebuilt bucket, whose frames moved): the
        index entries whose seq range holds it, then those frames."""
        b = self.bucket(bucket_start_ms, create=False)
        if b is None:
            return None
        e = b.entries_array()
        for n in np.flatnonzero((e["first_seq"] <= np.uint64(seq)) & (e["last_seq"] >= np.uint64(seq))).tolist():
            ref = self._frame(bucket_start_ms, int(e["data_offset"][n]), int(e["frame_size"][n]))
            hit = np.flatnonzero(ref.batch.seq == seq)
            if len(hit):
                return ref, int(hit[0])
        return None

    # -- buckets ---------------------------------------------------------------------

    def bucket(self, start_ms: int, *, create: bool = True) -> Bucket | None:
        b = self._open.get(start_ms)
        if b is not None:
            self._open.move_to_end(start_ms)
            return b
        path = self._path(start_ms)
        if not create and not path.exists():
            return None
        b = self._healing(start_ms, lambda: Bucket(path, start_ms, self.bucket_ms,
                                                   data_segment_bytes=self.data_segment_bytes))
        self._open[start_ms] = b
        while len(self._open) > self.open_buckets_max:
            _, old = self._open.popitem(last=False)
            old.close()
        return b

    def bucket_starts(self) -> list[int]:
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.isdigit():
                out.append(int(p.name))
        return sorted(out)

    def file(self, batch: Batch, *, cache_before_ms: int | None = None, force: np.ndarray | None = None) -> Filed:
        """File every record of ``batch`` (records in seq order, ``effective_ms`` set) under
        its effective second: one frame per (bucket, second), records a bucket already holds
        (``seq <= last_seq``, replay after a crash) skipped. Frames due before
        ``cache_before_ms`` are kept in the frame cache (the wheel loads them soon); a
        backlog due later stays on disk only, so RAM holds nothing per pending message.
        ``force``: records filed even at or below the high-water mark (the caller checked that
        they were never filed: an older term's records after a cut, ``DelayStore._refile_mask``)."""
        n = batch.n
        filed = np.zeros(n, bool)
        bucket_col = np.zeros(n, np.int64)
        off_col = np.zeros(n, np.int64)
        size_col = np.zeros(n, np.int64)
        frames: list[FrameRef] = []
        if not n:
            return Filed(filed, bucket_col, off_col, size_col, frames)
        eff = batch.effective_ms
        # each group in due order: the wheel fires ranges of it
        descents = eff[1:] < eff[:-1]
        runs = int(np.count_nonzero(descents)) + 1
        if runs <= FILE_SORTED_RUNS_MAX and runs * FILE_SORTED_RUN_MIN <= n:
            # a few runs already in due order (the SDK sorts each wire batch; the iterator
            # files several batches at once): a group is a run's slice within one second,
            # so nothing is copied record by record
            order = np.arange(n)
            secs = eff // 1000
            cuts = np.flatnonzero((secs[1:] != secs[:-1]) | descents) + 1
            in_order = batch
        else:
            order = np.argsort(eff, kind="stable")
            cuts = np.flatnonzero(np.diff(eff[order] // 1000)) + 1
            in_order = batch.take(order)  # one take; each group is then a slice of it
        bounds = [0, *cuts.tolist(), n]
        by_bucket: dict[int, list[tuple[int, int]]] = {}  # bucket start -> [(a, b)] ranges of ``order``
        bms = self.bucket_ms
        for a, z in zip(bounds[:-1], bounds[1:]):
            e0 = int(eff[order[a]])
            by_bucket.setdefault(e0 - e0 % bms, []).append((a, z))
        seq = batch.seq
        for start, ranges in by_bucket.items():
            b = self.bucket(start)
            groups, idxs = [], []
            for a, z in ranges:
                part = order[a:z]
                if b.last_seq < 0:
                    fresh = part
                elif force is None:
                    fresh = part[seq[part] > b.last_seq]
                else:
                    fresh = part[(seq[part] > b.last_seq) | force[part]]
                if len(fresh) == len(part):
                    groups.append(in_order.take(slice(a, z)))
                    idxs.append(part)
                elif len(fresh):  # replay after a crash: part of the group was filed before
                    groups.append(batch.take(fresh))
                    idxs.append(fresh)
            if not groups:
                continue
            placed = b.append_groups(groups)
            for g, idx, (off, size) in zip(groups, idxs, placed):
                filed[idx] = True
                bucket_col[idx] = start
                off_col[idx] = off
                size_col[idx] = size
                ref = FrameRef(start, off, size, g)
                frames.append(ref)
                if cache_before_ms is not None and int(g.effective_ms[0]) < cache_before_ms:
                    self.cache.put(ref)
        return Filed(filed, bucket_col, off_col, size_col, frames)

    def second_entries(self, second: int, *, newer_than: int = 0) -> list[tuple[int, int, int]]:
        """(entry number, data_offset, frame_size) of the frames due in epoch-second ``second``,
        newest first, only those appended after entry ``newer_than`` (0: all); with ``frame``,
        a second read a few frames at a time (``DelayStore._load_seconds``)."""
        ms = second * 1000
        start = self.bucket_start(ms)

        def walk() -> list[tuple[int, int, int]]:
            b = self.bucket(start, create=False)
            if b is None:
                return []
            return [(n, off, size) for n, off, size, _ in b.chain((ms - start) // 1000, newer_than=newer_than)]
        return self._healing(start, walk)

    def frames_of(self, bucket_start_ms: int, entries) -> list[FrameRef] | None:
        """The frames at ``entries`` ((entry, data_offset, frame_size) of ``second_entries``)
        of one bucket; None when a frame failed its check and the healer rebuilt the bucket:
        the entries are stale then (offsets moved), walk the chain again."""
        try:
            return [self._frame(bucket_start_ms, off, size) for _, off, size in entries]
        except CorruptRecord as e:
            if self.healer is None:
                raise
            self.healer(bucket_start_ms, e)
            return None

    def load_second(self, second: int) -> list[FrameRef]:
        """Every frame due within epoch-second ``second``, newest first (chain order)."""
        ms = second * 1000
        return self._healing(self.bucket_start(ms), lambda: self._load_second(ms))

    def _load_second(self, ms: int) -> list[FrameRef]:
        b = self.bucket(self.bucket_start(ms), create=False)
        if b is None:
            return []
        out = []
        for _n, off, size, _last in b.chain((ms - b.start_ms) // 1000):
            out.append(self._frame(b.start_ms, off, size))
        return out

    def frame(self, bucket_start_ms: int, data_offset: int, frame_size: int) -> FrameRef:
        return self._healing(bucket_start_ms, lambda: self._frame(bucket_start_ms, data_offset, frame_size))

    @contextmanager
    def memo(self):
        """Within this block (synchronous: nothing is filed or healed meanwhile) a frame read
        once is not read again."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def _frame(self, bucket_start_ms: int, data_offset: int, frame_size: int) -> FrameRef:
        ref = self.cache.get(bucket_start_ms, data_offset)
        if ref is not None:
            return ref
        memo = self._memo
        if memo is not None:
            ref = memo.get((bucket_start_ms, data_offset))
            if ref is not None and ref.frame_size == frame_size:
                return ref
        b = self.bucket(bucket_start_ms, create=False)
        if b is None:
            raise CorruptRecord(str(self._path(bucket_start_ms)), data_offset, "bucket missing")
        ref = FrameRef(bucket_start_ms, data_offset, frame_size, b.read(data_offset, frame_size))
        if memo is not None and len(memo) < MEMO_FRAMES_MAX:
            memo[(bucket_start_ms, data_offset)] = ref
        return ref

    def find(self, bucket_start_ms: int, data_offset: int, frame_size: int, seq: int) -> tuple[FrameRef, int] | None:
        """The frame at this place and the index of ``seq`` in it (None if absent). In a
        rebuilt bucket the place is stale (id-index entries kept their old offsets): the
        seq is looked up by the index's seq ranges."""
        return self._healing(bucket_start_ms, lambda: self._find(bucket_start_ms, data_offset, frame_size, seq))

    def _find(self, bucket_start_ms: int, data_offset: int, frame_size: int, seq: int) -> tuple[FrameRef, int] | None:
        b = self.bucket(bucket_start_ms, create=False)
        if b is None:
            return None  # a location into no bucket: nothing here to heal
        if b.rebuilt:
            return self.find_seq(bucket_start_ms, seq)
        try:
            ref = self._frame(bucket_start_ms, data_offset, frame_size)
        except CorruptRecord:
            e = b.entries_array()
            if not bool(((e["data_offset"] == data_offset) & (e["frame_size"] == frame_size)).any()):
                return self.find_seq(bucket_start_ms, seq)  # the location (an id-index entry) is bad, not the bucket
            raise
        hit = np.flatnonzero(ref.batch.seq == seq)
        return (ref, int(hit[0])) if len(hit) else None

    def locate(self, effective_ms: int, seq: int) -> tuple[FrameRef, int] | None:
        """Find a filed record by its effective time and seq (a walk of one second's chain)."""
        start = self.bucket_start(effective_ms)
        return self._healing(start, lambda: self._locate(start, effective_ms, seq))

    def _locate(self, start: int, effective_ms: int, seq: int) -> tuple[FrameRef, int] | None:
        b = self.bucket(start, create=False)
        if b is None:
            return None
        for _n, off, size, last in b.chain((max(effective_ms, start) - start) // 1000):
            if last < seq:
                continue  # newest first, but after a cut an older term's frames may follow newer ones
            got = self._find(start, off, size, seq)
            if got is not None:
                return got
        return None

    def flush(self) -> None:
        plan = SyncPlan()
        self.plan_flush(plan)
        plan.run()

    def plan_flush(self, plan: SyncPlan) -> None:
        for b in self._open.values():
            b.plan_flush(plan)

    # -- retention -------------------------------------------------------------------

    def _finish_deletions(self) -> None:
        """Buckets renamed ``{start}.deleting`` by ``detach_buckets`` and not yet removed
        when the process stopped: remove them now."""
        left = [p for p in self.root.glob("*.deleting") if p.is_dir()]
        for p in left:
            shutil.rmtree(p)
            log.warning("schedule bucket deletion finished path=%s", p)
        if left:
            fsync_dir(self.root)

    def exists(self, start_ms: int) -> bool:
        """Whether bucket ``start_ms`` is on disk (False once retention deleted it)."""
        return start_ms in self._open or self._path(start_ms).is_dir()

    def detach_buckets(self, starts: list[int]) -> list[Path]:
        """Retention, first half (on the loop): close buckets ``starts`` (all dispatched) and
        rename each folder to ``{start}.deleting`` - one atomic rename, after which the
        bucket no longer exists for this log; ``remove_detached`` (any thread) deletes them.
        A crash in between leaves folders that ``open`` removes."""
        out = []
        for s in starts:
            b = self._open.pop(s, None)
            if b is not None:
                b.discard()
            self.cache.drop_bucket(s)
            path = self._path(s)
            if not path.exists():
                continue
            gone = path.with_name(path.name + ".deleting")
            os.replace(path, gone)
            out.append(gone)
        return out

    def remove_detached(self, paths: list[Path]) -> None:
        """Retention, second half (any thread): delete detached bucket folders."""
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        if paths:
            fsync_dir(self.root)

    def drop_before(self, start_ms: int) -> int:
        """Retention: delete whole buckets that end at or before ``start_ms`` (all dispatched)."""
        n = 0
        for s in self.bucket_starts():
            if s + self.bucket_ms <= start_ms:
                b = self._open.pop(s, None)
                if b is not None:
                    b.close()
                self.cache.drop_bucket(s)
                shutil.rmtree(self._path(s))
                n += 1
        return n

    def close(self) -> None:
        while self._open:
            _, b = self._open.popitem()
            b.close()


__all__ = ["Bucket", "ENTRY", "ENTRY_SIZE", "Filed", "FrameRef", "HEADS_MAGIC", "KIND_MESSAGE", "ScheduleLog"]
