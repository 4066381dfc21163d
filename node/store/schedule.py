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

The files of one bucket - the data log, the 48-byte index entries chaining the frames of
each second, the per-second heads - their format, and how a bucket recovers at open are
``node/store/schedule_bucket.py``'s (``Bucket``). The cache of decoded frames is
``node/store/schedule_cache.py``'s. This module owns the buckets together: ``meta.json``,
the LRU of open buckets, filing a batch (``file``), loading a second (``load_second``,
``second_entries``, ``frames_of``), finding a record (``find``, ``locate``), healing and
retention.

Invariant kept here: filing skips the records a bucket already holds (``seq <= last_seq``
of the bucket, its replay high-water mark), so replaying the message log after a crash
files nothing twice; ``schedule_bucket.py`` says why that mark is sound.

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
import os
import shutil
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cluster.codec import KIND_MESSAGE, Batch
from cluster.errors import CorruptRecord, InvalidArgument
from cluster.files import DATA_DIR_MODE, DATA_MODE, write_atomic
from node.store.settings import STORE_DEFAULTS
from node.store.syncplan import SyncPlan

from .log import fsync_dir
from .schedule_bucket import (ENTRY, ENTRY_DTYPE, ENTRY_SIZE, FORMAT_VERSION, HEADS_HEADER, HEADS_HEADER_SIZE,
                              HEADS_MAGIC, REBUILT_MARKER, Bucket)
from .schedule_cache import FrameCache, FrameRef

log = logging.getLogger("hourglass.store.schedule")

# meta.json "version": 3 = frames may use the packed column layout (cluster/codec.py
# FLAG_PACKED); a version 2 folder (plain frames only) is read the same and marked 3 when
# opened, so a node older than the packed layout refuses it instead of misreading it.
META_VERSION = 3
META_VERSIONS_READ = (2, 3)
MEMO_FRAMES_MAX = 4096  # frames one ``ScheduleLog.memo`` block keeps (a batch's duplicates)
OPEN_BUCKETS_MAX = 32  # buckets kept open (LRU) unless ``open_buckets_max`` says otherwise
REBUILD_GROUPS_PER_WRITE = 4096  # frames appended per write while a bucket is rebuilt (bounds memory)
FILE_SORTED_RUNS_MAX = 64  # a batch of at most this many due-ordered runs may be filed as slices,
FILE_FRAME_RECORDS = 64  # ... when the frames the slices add cost less than sorting: a frame costs
# about as much as copying this many records once (a frame is a take, an encode, an index entry, a
# wheel chunk; a sort copies each record's blobs once: docs/benchmarks.md, fourteenth session)


def _slices_pay(slice_frames: int, secs: np.ndarray, n: int) -> bool:
    """Whether filing ``n`` records as ``slice_frames`` slices costs less than sorting them
    first: the slices' frames beyond one per due second (at most the seconds spanned, at most
    ``n``), each worth ``FILE_FRAME_RECORDS`` records copied, against the ``n`` records the
    sort copies. Several calls filed in one round are as many runs, each cut at every second
    it covers: 20 calls due over 5 s are 100 slices against 5 frames sorted."""
    seconds = min(int(secs.max() - secs.min()) + 1, n)
    return (slice_frames - seconds) * FILE_FRAME_RECORDS <= n


@dataclass(frozen=True, slots=True)
class Filed:
    """Where each record of a filed batch went, aligned with the batch (``filed`` False:
    filed before a crash, skipped)."""

    filed: np.ndarray          # bool
    bucket_start_ms: np.ndarray
    data_offset: np.ndarray
    frame_size: np.ndarray
    frames: list[FrameRef]


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
        self.cache = FrameCache(cache_bytes_max)
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
        secs = eff // 1000
        slice_cuts = np.flatnonzero((secs[1:] != secs[:-1]) | descents) + 1 if runs <= FILE_SORTED_RUNS_MAX else None
        if slice_cuts is not None and (runs == 1 or _slices_pay(len(slice_cuts) + 1, secs, n)):
            # a few runs already in due order (the SDK sorts each wire batch; the iterator
            # files several batches at once): a group is a run's slice within one second,
            # so nothing is copied record by record
            order = np.arange(n)
            cuts = slice_cuts
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


__all__ = ["Bucket", "ENTRY", "ENTRY_DTYPE", "ENTRY_SIZE", "FORMAT_VERSION", "HEADS_HEADER", "HEADS_HEADER_SIZE",
           "HEADS_MAGIC", "KIND_MESSAGE", "REBUILT_MARKER", "Filed", "FrameRef", "ScheduleLog"]
