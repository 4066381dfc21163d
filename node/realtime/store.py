"""RealtimeStore: the real-time node's storage engine (message log, consume index, groups).

The unit is the batch (``shared/ARCHITECTURE.md``, "Hot path"): one append stores one
``cluster.codec.Batch`` as one log frame, one pull answers one ``Batch`` built with
``Batch.take`` + ``Batch.concat`` from whole frames, acks take handle ranges. Python
does per-batch work; per-message work runs inside numpy, ``bytes.join`` and list
comprehensions.

Owns a data folder::

    {root}/messages/                     SegmentedLog; each frame's body is one codec Batch (v2)
    {root}/index/{subject}/entries       consume index of one subject (node/realtime/index.py;
                                         entries.{base:020d} once retention dropped a dead prefix)
    {root}/groups/                       offsets log: group positions (node/realtime/offsets.py)
    {root}/subjects.log                  subjects journal: known subjects and their owners
                                         (node/realtime/subjects.py; subjects.json of the old
                                         layout is migrated into it at open)
    {root}/checkpoint                    epoch, indexed_offset, dedup_offset (checkpoint.write_atomic)

Message frame: the batch as stored, every column set: ``seq`` contiguous inside the
frame (``(epoch << 40) | counter``, ``node.store.records.make_seq``), ``store_ms`` = the
append's ``now_ms`` for every message, ``deliver_at_ms`` / ``effective_ms`` / ``attempts``
as given (the original due time: consumers measure lateness with it), kind = message.

Index entry (32 bytes, ``<QIqQI``; ``node/realtime/index.py``): frame offset, index
inside the frame, store_ms, 64-bit tags mask, CRC-32 of the entry. The entry's position
in its file is the message's *handle*.

Group document (JSON; one per changed group in each record of the offsets log)::

    {"version": 1, "subject": s, "group": g, "start": "earliest"|"latest",
     "committed": c,     # lowest position not yet acked (everything below is done)
     "next": n,          # first position never handed out
     "pending": [[a, b], ...]}   # in flight at flush time, as [a, b) runs; subset of [c, n)

Positions in ``[committed, next)`` not in ``pending`` were acked (or skipped by a tag
filter), so a clean close/reopen never redelivers an acked message even when acks
came out of order. The checkpoint is ``{"epoch", "indexed_offset", "dedup_offset"}``.

New subjects (``subjects_plan`` / ``SubjectWork.run`` / ``subjects_finish``): a round of any
number of new subjects costs one fsync of ``index/`` and one subjects-journal record and
fsync, run on a worker thread by the service (``node/realtime/creator.py``) while other
requests go on; ``append`` creates a batch's missing subjects synchronously, as one round,
when it is called directly (tests, dead letters, a store swapped under a request).

Flow (every call takes ``now_ms``; nothing here reads a clock or awaits; group documents
are committed to the offsets log on its one writer thread, ``write_groups_async``: one
record and one fsync per commit round, however many groups it holds):

1. ``append(batch)`` validates with ``Batch.validate`` (the message is due now:
   ``deliver_at_ms`` is kept but not checked against the delay horizon), answers
   (subject, id) seen within ``dedup_window_ms`` as OK/duplicate with the first seq
   (``node/realtime/dedup.py``), takes the rest out with ``Batch.take``, appends them as
   one frame and, right after, one run of index entries per subject (page cache; durable
   after ``flush`` or the caller's group commit of ``messages``). One ``BatchResult``.
2. ``pull(subjects, group)`` first redelivers this group's in-flight handles whose ack
   deadline passed (``now_ms >= pulled_at_ms + ack_timeout_ms``, oldest pull first),
   then hands out new positions from each subject's ``next``, the subjects sharing
   ``max_messages``. It reads each needed frame once (recent frames come decoded from an
   LRU cache bounded by ``frame_cache_bytes_max``) and answers ``(Batch, handles)`` in
   log order; message ``i`` is of subject ``batch.subject(i)`` with handle ``handles[i]``.
   In-flight handles are ranges owned by the group, not by a consumer
   (``node/realtime/inflight.py``), so consumers of one group never get the same handle
   at once. A tag filter skips entries whose mask shares no bit with the requested tags;
   a skipped entry counts as acked *for this group*; the mask may match falsely, so the
   client checks tags exactly. A group seen for the first time starts at the beginning
   of the subject's index (``start="earliest"``) or its current end (``"latest"``); the
   group document is committed at once so the choice survives a restart.
3. ``ack(subject, group, ranges)`` drops handle ranges from the in-flight set; ``nack``
   returns the in-flight messages of its ranges (their deadline restarted) for the
   service to re-send, which then acks them.
4. ``flush`` fsyncs the message log, then the dirty index files and last the checkpoint
   with ``indexed_offset`` = the log end before the fsyncs (a periodic flush does those two
   only every ``checkpoint_bytes_min`` of new log: they only bound the replay, and fsyncs at
   most ``checkpoint_index_fsyncs_max`` index files, vouching only below the first entry it
   left unsynced: ``_plan_index_sync``), and commits changed group documents.

Invariants:

* every message of a frame below ``indexed_offset`` has its entry in its subject's index
  on disk; entries are appended in log order, so a message (frame ``o``, index ``i``) is
  indexed iff ``(o, i) <= (offset, index)`` of its index's last entry, which lets replay
  skip what is indexed without a set of seqs;
* a group's ``committed <= next <= entries in the index``; ``in-flight ⊆ [committed, next)``
  and holds at most ``inflight_per_group_max`` handles;
* RAM holds nothing per stored message except the dedup map (bounded by time and
  ``dedup_entries_max``); in-flight handles are ranges; the frame cache is bounded in bytes.

Recovery (``open``): the SegmentedLog truncates its own torn tail. Each index file loses
a partial trailing entry, then trailing entries that fail their CRC (torn page) or point
at or past the message-log end; a CRC failure in the middle of an index is reported as
``CorruptRecord`` on read. Frames from ``min(indexed_offset, dedup_offset)`` on are
replayed: missing entries re-indexed (from the last surviving entry's frame of a subject
whose tail failed its CRC), and frames with ``store_ms > now_ms - dedup_window_ms`` put
back in the dedup map. Group positions come from the offsets log (its torn tail cut, the
newest document of each group kept); in-flight deadlines do not survive, so handles
pending at the last group commit (and everything handed out after it) are redelivered at
once: delivery is at-least-once. Acks after the last group commit are lost by a crash,
not by ``close`` (which flushes). A data folder of the old layout (one
``groups/{subject}/{group}.json`` per group) is migrated at open: the files become one
snapshot record, then are deleted.

Retention (``retention_plan``, rules in ``node/realtime/retention.py``): sealed segments
every non-idle group, the dedup window, the checkpoint and the slaves are past, and that
are due by age or size, are renamed ``*.deleting`` on the caller's thread and unlinked by
``RetentionWork.run``; each subject's ``live_from`` moves past the dead entries, a group
behind it (it was idle) resumes there on its next pull/ack/nack, and index files are
compacted (``retention_finish`` switches them; handles stay the same).

Example::

    st = RealtimeStore.open(root, now_ms=t)
    res = st.append(Batch.build("orders", [b"x"], ["id-1"], [t]), now_ms=t)   # res.seqs[0]
    batch, handles = st.pull(["orders"], "billing", "c1", max_messages=10, now_ms=t)  # handles == [0]
    st.ack("orders", "billing", [(0, 1)], now_ms=t)                                  # -> 1
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path

import numpy as np

from cluster import status
from cluster.codec import COLUMN_BYTES, INVALID_ARGUMENT, OK, Batch, check_subject
from cluster.codec import HEADER_SIZE as BATCH_HEADER_SIZE
from cluster.errors import (
    Closed,
    CorruptRecord,
    DiskFull,
    HourglassError,
    InvalidArgument,
    Overloaded,
    PayloadTooLarge,
    UnknownSubject,
)
from cluster.files import DATA_DIR_MODE, DATA_MODE, remove_leftover_temps
from cluster.wire import BatchResult
from node.realtime import retention as RR
from node.realtime.dedup import DedupWindow
from node.realtime.index import (
    ENTRY,
    ENTRY_DTYPE,
    ENTRY_SIZE,
    TMP_SUFFIX,
    SubjectIndex,
    batch_tag_masks,
    copy_entries,
    frame_runs,
    held_mask,
    index_path,
    open_files,
    tags_mask,
    visible_ms,
)
from node.realtime.inflight import InflightRanges
from node.realtime.offsets import OffsetsLog
from node.realtime.subjects import SubjectsJournal, SubjectWork
from node.store import checkpoint
from node.store.diskspace import FILE_BLOCK_BYTES
from node.store.log import HEADER_SIZE as LOG_HEADER_SIZE
from node.store.log import RECORD_BYTES_MAX_DEFAULT, SegmentedLog, fsync_dir, unlink_segments
from node.store.records import SEQ_COUNTER_MAX, SEQ_EPOCH_SHIFT, encoded_bytes_max, make_seq
from node.store.settings import RealtimeSettings
from node.store.syncplan import DocGate, SyncPlan

__all__ = ["DLQ_SUBJECT", "ENTRY", "ENTRY_SIZE", "RealtimeSettings", "RealtimeStore", "START_EARLIEST",
           "START_LATEST", "tags_mask"]

log = logging.getLogger("hourglass.realtime.store")

DLQ_SUBJECT = "hourglass.dlq"
GROUP_FILE_VERSION = 1
START_EARLIEST = "earliest"
START_LATEST = "latest"
_DUE_NOW_MS = -(1 << 62)  # pulled_at of handles restored from disk: due for redelivery at once
_SCAN_CHUNK_ENTRIES = 4096  # index entries read at once while a tag filter skips entries
DEDUP_FULL_LOG_EVERY_MS = 60_000  # "dedup map full" is logged at most this often
_EMPTY_BATCH = Batch.empty()
_NO_HANDLES = np.zeros(0, np.uint64)


def _check_name(what: str, name: str, bytes_max: int) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(what, "must be a non-empty string")
    check_subject(name, what, bytes_max)  # the one subject rule (cluster/codec.py), for groups too


def _cat_entries(arrays: list[np.ndarray]) -> np.ndarray:
    """Index entries of several reads as one array. Joined as bytes: ``np.concatenate`` of
    structured arrays promotes their fields pair by pair (~8 us per array, 16 per pull)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8) for a in arrays]).view(arrays[0].dtype)


def _as_pairs(ranges) -> list[list[int]]:
    """Handle ranges as ``[[lo, hi], ...]`` from a (k, 2) array (``wire.unpack_ranges``) or pairs."""
    if isinstance(ranges, np.ndarray):
        pairs = ranges.astype(np.int64).reshape(-1, 2).tolist()
    else:
        pairs = [[int(a), int(b)] for a, b in ranges]
    if any(lo < 0 or hi <= lo for lo, hi in pairs):
        raise InvalidArgument("ranges", "every range must have 0 <= lo < hi")
    return pairs


def _runs(handles: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct handles as ``[lo, hi)`` runs of consecutive values."""
    if not len(handles):
        return []
    h = handles.astype(np.int64)
    breaks = np.flatnonzero(np.diff(h) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(h)]))
    return list(zip(h[starts].tolist(), (h[ends - 1] + 1).tolist()))


def _encoded_size(b: Batch) -> int:
    table = sum(2 + len(s.encode()) for s in b.subjects)
    return BATCH_HEADER_SIZE + b.n * COLUMN_BYTES + table + len(b.ids) + len(b.payloads) + len(b.extras)


def _with_ids(b: Batch) -> Batch:
    """Messages sent without an id get a random one (sends stay idempotent only with an id)."""
    ends = b.id_end
    if not b.n or (ends[0] and not (ends[1:] == ends[:-1]).any()):
        return b
    ids = [i or uuid.uuid4().hex for i in b.id_list()]
    blob = "".join(ids).encode()
    return b.replace(ids=blob, id_end=np.cumsum([len(i.encode()) for i in ids]).astype(np.uint32))


def _legacy_group_files(groups_dir: Path) -> list[Path]:
    """Group files of the old layout, ``groups/{subject}/{group}.json``."""
    return sorted(p for sd in groups_dir.iterdir() if sd.is_dir() for p in sd.glob("*.json"))


class _Group:
    """A consumer group of one subject."""

    __slots__ = ("subject", "name", "start", "next_pos", "inflight", "persisted", "dirty", "active_ms", "idle",
                 "hold")

    def __init__(self, subject: str, name: str, start: str, next_pos: int) -> None:
        self.subject = subject
        self.name = name
        self.start = start
        self.next_pos = next_pos
        self.inflight = InflightRanges()
        self.persisted: dict | None = None
        self.dirty = True
        self.active_ms: int | None = None  # last pull/ack/nack (None: not known yet, counts from the next retention)
        self.idle = False                  # retention found it idle past group_idle_ms_max: it holds nothing
        self.hold: tuple[int, int] = (-1, -1)  # (committed, frame offset of its entry), cached for retention

    def committed(self) -> int:
        return self.inflight.committed(self.next_pos)

    def doc(self) -> dict:
        return {"version": GROUP_FILE_VERSION, "subject": self.subject, "group": self.name, "start": self.start,
                "committed": self.committed(), "next": self.next_pos, "pending": self.inflight.runs()}


@dataclass(slots=True)
class _Compaction:
    subject: str
    src: Path            # the index file when planned
    src_base: int
    new_base: int        # the subject's live_from: entries below it are dead
    upto: int            # entries [new_base, upto) are copied by the worker
    tmp: Path
    truncations: int     # store._truncations when planned (a divergent-suffix cut abandons it)
    copied: bool = False


@dataclass(slots=True)
class RetentionReport:
    held_by: str = ""      # why the oldest kept segment is kept (retention.decide)
    held_base: int = 0
    held_age_ms: int = 0   # how long ago the oldest kept segment was sealed (0: it is the active one)
    idle_groups: int = 0


@dataclass(slots=True)
class RetentionWork:
    """What ``retention_plan`` detached: run on a worker thread (``run``), then
    ``RealtimeStore.retention_finish`` on the store's thread."""

    directory: Path
    segments: list[Path] = field(default_factory=list)
    compactions: list[_Compaction] = field(default_factory=list)
    old_files: list[tuple[Path, Path]] = field(default_factory=list)  # (old index file, the file replacing it)
    freed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.segments or self.compactions or self.old_files)

    def run(self) -> None:
        """Any thread: unlink detached segments (oldest first), copy the live entries of
        indexes to compact, delete old index files once their replacement is durable."""
        self.freed_bytes += unlink_segments(self.directory, self.segments)
        for old, new in self.old_files:
            try:
                fd = os.open(new, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsync_dir(new.parent)
                self.freed_bytes += old.stat().st_blocks * 512
                old.unlink()
                fsync_dir(new.parent)
            except FileNotFoundError:
                pass
        for c in self.compactions:
            try:
                copy_entries(c.src, c.src_base, c.tmp, c.new_base, c.upto)
                c.copied = True
            except OSError as e:  # ENOSPC, or the store was reopened and removed the files
                log.error("index compaction failed path=%s error=%s", c.tmp, e)
                c.tmp.unlink(missing_ok=True)


class RealtimeStore:
    """See module docstring. Synchronous, not thread-safe."""

    def __init__(self, root: Path, settings: RealtimeSettings, now_ms: int, *, bump_epoch: bool) -> None:
        self.root = root
        self.settings = settings
        root.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        remove_leftover_temps(root)  # a checkpoint write a crash cut short (cluster/files.py)
        (root / "index").mkdir(mode=DATA_DIR_MODE, exist_ok=True)
        # one frame holds one whole batch: the largest request, plus room for the columns the node fills
        self.frame_bytes_max = max(RECORD_BYTES_MAX_DEFAULT, settings.limits.batch_bytes_max + (1 << 20))
        self.messages = SegmentedLog.open(root / "messages", segment_bytes_max=settings.segment_bytes,
                                          record_bytes_max=self.frame_bytes_max)
        self._closed = False
        self._offsets, group_docs = OffsetsLog.open(root / "groups", compact_bytes=settings.offsets_compact_bytes)
        self._ckpt_path = root / "checkpoint"
        self._gate = DocGate()
        ck = checkpoint.read(self._ckpt_path) or {}
        self.epoch = int(ck.get("epoch", 0)) + (1 if bump_epoch else 0)
        self._counter = 0
        start, end = self.messages.start_offset, self.messages.end_offset
        self.indexed_offset = min(max(int(ck.get("indexed_offset", start)), start), end)
        dedup_offset = min(max(int(ck.get("dedup_offset", start)), start), end)
        self._ckpt_saved: dict | None = None
        self._save_checkpoint(self.indexed_offset, dedup_offset)  # the epoch is durable before any seq uses it
        self._dedup_full_logged_ms = -DEDUP_FULL_LOG_EVERY_MS
        self.counters = {"appended": 0, "duplicates": 0, "delivered": 0, "redelivered": 0, "acked": 0,
                         "dedup_evicted_early": 0, "skipped_by_tag": 0, "reindexed": 0, "frame_cache_misses": 0, "groups_idled": 0,
                         "groups_resumed": 0, "resumed_skipped_messages": 0, "segments_deleted": 0,
                         "index_compactions": 0, "checkpoint_index_deferred": 0}

        self._subjects: dict[str, SubjectIndex] = {}
        self._open_fds: OrderedDict[str, None] = OrderedDict()  # LRU of subjects with an open index fd
        self._groups: dict[tuple[str, str], _Group] = {}
        self._dedup = DedupWindow(window_ms=settings.dedup_window_ms, entries_max=settings.dedup_entries_max)
        self._frames: OrderedDict[int, tuple[Batch, int]] = OrderedDict()  # offset -> (batch, body bytes), LRU
        self._frames_bytes = 0
        self._rotation = 0  # which subject of a multi-subject pull goes first (fairness)
        self.held_next_ms: int | None = None  # after a pull: when the first entry it held back becomes visible
        self.appended_visible_ms = 0  # after an append: when its first message becomes visible
        # replication: every group file write gets a seq; (subject, group) -> seq of its last write, oldest first
        self.group_seq = 0
        self._dirty_groups: set[tuple[str, str]] = set()  # groups changed since their last snapshot_groups
        self._group_changes: OrderedDict[tuple[str, str], int] = OrderedDict()
        # retention (retention_plan): sealed time per segment base, index compactions under way,
        # index folders with a rename not fsynced yet, (old file, new file) pairs to delete
        self._seg_sealed_ms: dict[int, int] = {}
        self._compacting: set[str] = set()
        self._index_dirs_unsynced: set[Path] = set()
        self._index_old_files: list[tuple[Path, Path]] = []
        self._truncations = 0

        self._journal, self._owners = SubjectsJournal.open(root)  # subject -> who created it ("" unknown)
        self._creating: set[str] = set()  # subjects of planned rounds not finished yet (count for subjects_max)
        self.subject_order: list[str] = list(self._owners)  # creation order: replicas get owners in it
        reindex_from = self.indexed_offset
        for s in self._owners:
            rebuild = self._load_index(s)
            if rebuild is not None:
                reindex_from = min(reindex_from, rebuild)
        if DLQ_SUBJECT not in self._subjects:
            self._create_now([DLQ_SUBJECT], owner="", now_ms=now_ms)
        self._replay(reindex_from, dedup_offset, now_ms)
        for ix in self._subjects.values():  # entries written before a restart may still be held
            ix.held_until = now_ms + self.settings.visible_hold_ms_max
        self._load_groups(self._migrate_group_files(group_docs))
        self._indexed_upto = self.messages.end_offset
        self.flush()

    @classmethod
    def open(cls, root: str | os.PathLike, settings: RealtimeSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True) -> "RealtimeStore":
        return cls(Path(root), settings or RealtimeSettings(), now_ms, bump_epoch=bump_epoch)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        for s in list(self._open_fds):
            self._close_fd(self._subjects[s])
        self._offsets.close()
        self.messages.close()
        self._journal.close()
        self._gate.close()
        self._closed = True

    def __del__(self) -> None:
        # dropped without close() (a crash simulation): give the index descriptors back
        if getattr(self, "_closed", True):
            return
        try:
            for ix in getattr(self, "_subjects", {}).values():
                if ix.fd >= 0:
                    os.close(ix.fd)
                    ix.fd = -1
            self._offsets.abandon()
            self._journal.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("real-time store is closed")

    # ------------------------------------------------------------------ recovery

    def _load_index(self, subject: str) -> int | None:
        """Open a subject's index and cut its torn tail (``SubjectIndex.repair_tail``); finish
        a compaction a crash interrupted (``index.open_files``, ``adopt_tail``). Returns the
        log offset re-indexing must start from (never below the log start), or None."""
        d = self.root / "index" / subject
        d.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        base, path, older = open_files(d)
        ix = SubjectIndex(subject, path, base)
        self._subjects[subject] = ix
        start, end = self.messages.start_offset, self.messages.end_offset
        rebuild = ix.repair_tail(end, start)
        if older:
            for old_base, old in older:
                ix.adopt_tail(self._fd(ix), old, old_base, end)
            for _, old in older:
                old.unlink()
            fsync_dir(d)
            log.warning("index compaction finished at open path=%s base=%d old_files=%d", path, base, len(older))
        self._advance_live_from(ix)
        return None if rebuild is None else max(rebuild, start)

    def _advance_live_from(self, ix: SubjectIndex) -> None:
        """Move ``ix.live_from`` to the first entry whose frame is still in the message log."""
        start = self.messages.start_offset
        lo = max(ix.live_from, ix.base)
        if lo >= ix.count or int(ix.read(self._fd(ix), lo, 1)["offset"][0]) >= start:
            ix.live_from = lo
            return
        ix.live_from = ix.first_at_or_after(self._fd(ix), start, lo=lo)

    def _replay(self, reindex_from: int, dedup_offset: int, now_ms: int) -> None:
        """Re-index messages missing from their subject index and rebuild the dedup map."""
        last_seq, dropped = self._index_frames(reindex_from, dedup_offset, now_ms)
        if dropped:
            log.warning("dedup map full at recovery path=%s dedup_entries_max=%d entries_dropped=%d",
                        self.root, self.settings.dedup_entries_max, dropped)
        if self.counters["reindexed"]:
            log.info("re-indexed path=%s from_offset=%d entries=%d", self.messages.directory, reindex_from,
                     self.counters["reindexed"])
        if last_seq is None and self.messages.end_offset > self.messages.start_offset:
            last_off = max((ix.last_offset for ix in self._subjects.values()), default=-1)
            if last_off >= 0:
                last_seq = int(self._frame(last_off).seq[-1])
        if last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT > self.epoch:
            # a replica's log holds seqs of its masters' epochs: stay above all of them
            self.epoch = (last_seq >> SEQ_EPOCH_SHIFT) + 1
            self._save_checkpoint(self.indexed_offset, dedup_offset)
        elif last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT == self.epoch:
            self._counter = (last_seq & SEQ_COUNTER_MAX) + 1  # bump_epoch=False: never reuse a seq

    def _decode_frame(self, offset: int, body: bytes) -> Batch:
        try:
            return Batch.decode(body)
        except InvalidArgument as e:  # the CRC matched: written by something that is not this store
            raise CorruptRecord(str(self.messages.directory), offset, f"not a message batch: {e.reason}") from None

    def _index_frames(self, reindex_from: int, dedup_offset: int, now_ms: int) -> tuple[int | None, int]:
        """Index messages of frames from ``reindex_from`` on that their subject index lacks, and
        put frames from ``dedup_offset`` on back in the dedup map. Returns (last seq seen,
        dedup entries dropped because the map was full)."""
        cutoff = now_ms - self.settings.dedup_window_ms
        last_seq = None
        dropped = 0
        for off, body in self.messages.iterate(min(reindex_from, dedup_offset)):
            b = self._decode_frame(off, body)
            if not b.n:
                continue
            last_seq = int(b.seq[-1])
            if off >= reindex_from:
                missing = [s for s in b.subjects if s not in self._subjects]
                if missing:  # a replica learns its master's new subjects from the log: one round per frame
                    self._create_now(missing, owner="", now_ms=now_ms)
                vis = visible_ms(b, b.store_ms, self.settings.visible_hold_ms_max, self.settings.visible_step_ms)
                held = int(vis.max())
                runs = frame_runs(offset=off, subject_idx=b.subject_idx, visible_ms=vis, masks=batch_tag_masks(b))
                for k, raw in runs.items():
                    ix = self._subjects[b.subjects[k]]
                    if off < ix.last_offset:
                        continue
                    if off == ix.last_offset:  # a run cut short: keep the entries past the last one indexed
                        done = int((np.frombuffer(raw, ENTRY_DTYPE)["index"] <= ix.last_index).sum())
                        raw = raw[done * ENTRY_SIZE:]
                    if raw:
                        ix.append_run(self._fd(ix), raw)
                        self.counters["reindexed"] += len(raw) // ENTRY_SIZE
                        if held > ix.held_until:  # a replica's frames: held the same once it is promoted
                            ix.held_until = held
            store_ms = int(b.store_ms[0])
            if off >= dedup_offset and store_ms > cutoff:
                keys = list(zip(b.subject_list(), b.id_list()))
                dropped += self._dedup.add(keys, b.seq.tolist(), store_ms=store_ms, offset=off)
        return last_seq, dropped

    def _migrate_group_files(self, docs: dict[tuple[str, str], dict]) -> dict[tuple[str, str], dict]:
        """Old layout: one JSON file per group. Into an empty offsets log they go as one
        snapshot record (fsynced) before the files are deleted; next to a non-empty log
        they are leftovers of a migration that crashed after that record, and only deleted."""
        files = _legacy_group_files(self._offsets.directory)
        if not files:
            return docs
        if not docs:
            old = [checkpoint.read(p) for p in files]
            docs = {(d["subject"], d["group"]): d for d in old}
            self._offsets.commit(old).result()
            log.warning("group files migrated to the offsets log path=%s groups=%d", self._offsets.directory,
                        len(docs))
        for p in files:
            p.unlink()
        for sd in {p.parent for p in files}:
            if not any(sd.iterdir()):
                sd.rmdir()
        fsync_dir(self._offsets.directory)
        return docs

    def _load_groups(self, docs: dict[tuple[str, str], dict]) -> None:
        for (subject, name), doc in sorted(docs.items()):
            ix = self._subjects.get(subject)
            if ix is None:
                log.warning("group of unknown subject ignored path=%s subject=%s group=%s",
                            self._offsets.directory, subject, name)
                continue
            g = self._group_from_doc(subject, name, doc, ix)
            self._groups[(g.subject, g.name)] = g
            self._note_group_write(g)

    @staticmethod
    def _group_from_doc(subject: str, name: str, doc: dict, ix: SubjectIndex) -> _Group:
        g = _Group(subject, name, doc.get("start", START_EARLIEST), 0)
        g.next_pos = min(int(doc.get("next", doc.get("committed", 0))), ix.count)
        committed = min(int(doc.get("committed", 0)), g.next_pos)
        for a, b in doc.get("pending", []):
            lo, hi = max(int(a), committed), min(int(b), g.next_pos)
            if lo < hi:
                g.inflight.add(lo, hi, _DUE_NOW_MS)
        g.persisted = doc
        g.dirty = False
        return g

    def _mark_dirty(self, g: _Group) -> None:
        g.dirty = True
        self._dirty_groups.add((g.subject, g.name))

    def dirty_groups(self) -> list[tuple[str, str]]:
        """Groups whose position changed since their document was last taken (pulls move
        ``next``; acks, redeliveries and truncation change ``pending``)."""
        return list(self._dirty_groups)

    def _note_group_write(self, g: _Group) -> None:
        self.group_seq += 1
        key = (g.subject, g.name)
        self._group_changes[key] = self.group_seq
        self._group_changes.move_to_end(key)

    # ------------------------------------------------------------------ files

    def _fd(self, ix: SubjectIndex, *, trim: bool = True) -> int:
        """``ix``'s open descriptor (opened if needed, most recently used now). ``trim=False``:
        do not evict yet (a frame's or a round's many subjects; ``_trim_fds`` after them), so
        a frame of more subjects than ``index_files_open_max`` does not evict the descriptors
        it is about to use and reopen every one of them (issue 27: a 300-subject frame opened
        300 files on the loop)."""
        if ix.fd >= 0:
            self._open_fds.move_to_end(ix.subject)
            return ix.fd
        ix.fd = os.open(ix.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, DATA_MODE)
        self._open_fds[ix.subject] = None
        if trim:
            self._trim_fds()
        return ix.fd

    def _trim_fds(self, keep: int = 0) -> None:
        """Evict least recently used descriptors down to ``max(index_files_open_max, keep)``."""
        cap = max(self.settings.index_files_open_max, keep)
        while len(self._open_fds) > cap:
            old, _ = self._open_fds.popitem(last=False)
            self._evict_fd(self._subjects[old])

    def _evict_fd(self, ix: SubjectIndex) -> None:
        """Close an index fd to stay under ``index_files_open_max``, not fsynced here: a dirty
        index stays dirty (its pages are in the page cache) and the checkpoint that vouches
        for its entries reopens and fsyncs it (``_plan_index_sync``). Before issue 27 every evicted
        dirty fd was fsynced by the next periodic flush: a flood of new subjects cost one
        fsync per subject every 200 ms, each a journal commit the message log's waited behind."""
        if ix.fd >= 0 and ix.dirty:
            os.close(ix.fd)
            ix.fd = -1
            self._open_fds.pop(ix.subject, None)
            return
        self._close_fd(ix)

    def _close_fd(self, ix: SubjectIndex) -> None:
        if ix.fd < 0:
            return
        if ix.dirty:
            os.fsync(ix.fd)
            ix.dirty = False
        os.close(ix.fd)
        ix.fd = -1
        self._open_fds.pop(ix.subject, None)

    def _frame(self, offset: int) -> Batch:
        """The batch of the frame at ``offset``: from the LRU cache, else read and decoded once."""
        hit = self._frames.get(offset)
        if hit is not None:
            self._frames.move_to_end(offset)
            return hit[0]
        self.counters["frame_cache_misses"] += 1
        body, _ = self.messages.read(offset)
        b = self._decode_frame(offset, body)
        self._cache_frame(offset, b, len(body))
        return b

    def _cache_frame(self, offset: int, b: Batch, size: int) -> None:
        self._frames[offset] = (b, size)
        self._frames_bytes += size
        while self._frames_bytes > self.settings.frame_cache_bytes_max and len(self._frames) > 1:
            _, (_, old) = self._frames.popitem(last=False)
            self._frames_bytes -= old

    # ------------------------------------------------------------------ subjects

    def create_subject(self, subject: str, *, owner: str = "", now_ms: int = 0) -> bool:
        """Register a subject; True if it is new. ``InvalidArgument`` for a bad name,
        ``Overloaded`` past ``subjects_max``."""
        return bool(self.create_subjects([subject], owner=owner, now_ms=now_ms))

    def create_subjects(self, subjects: Sequence[str], *, owner: str = "", now_ms: int = 0) -> list[str]:
        """Register subjects as one round on this thread (one index-folder fsync, one journal
        record); returns the new ones. Raises the first refusal (nothing is created then)."""
        self._check_open()
        for s in subjects:
            _check_name("subject", s, self.settings.limits.subject_bytes_max)
        new = self.missing_subjects(subjects)
        if new:
            self._create_now(new, owner=owner, now_ms=now_ms)
        return new

    def _create_now(self, subjects: list[str], *, owner: str, now_ms: int) -> None:
        self._create_owned([(s, owner) for s in subjects], now_ms=now_ms)

    def _create_owned(self, items: list[tuple[str, str]], *, now_ms: int) -> None:
        """Create ``(subject, owner)`` pairs as one round on this thread (one journal record)."""
        work = self.subjects_plan(items, now_ms=now_ms)
        if work.refused:
            self.subjects_abandon(work)
            raise next(iter(work.refused.values()))
        try:
            work.run()
        finally:
            self.subjects_finish(work)

    def missing_subjects(self, subjects: Iterable[str]) -> list[str]:
        """The distinct names of ``subjects`` not known yet, in order (names not checked)."""
        known = self._subjects
        return [s for s in dict.fromkeys(subjects) if s not in known]

    def subjects_plan(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> SubjectWork:
        """Plan one creation round of ``(subject, owner)`` pairs: names already known or being
        created are skipped, a bad name or one past ``subjects_max`` (counting rounds under
        way) goes to ``work.refused``; the rest are reserved until ``subjects_finish`` or
        ``subjects_abandon``. ``work.run`` then runs on any thread."""
        self._check_open()
        work = SubjectWork(self.root / "index", self._journal, [], now_ms)
        room = self.settings.subjects_max - len(self._subjects) - len(self._creating)
        seen: set[str] = set()
        for s, owner in items:
            if s in self._subjects or s in self._creating or s in seen:
                continue
            seen.add(s)
            try:
                _check_name("subject", s, self.settings.limits.subject_bytes_max)
                if room <= 0:
                    raise Overloaded(f"{len(self._subjects) + len(self._creating)} subjects "
                                     f"(subjects_max={self.settings.subjects_max})")
            except HourglassError as e:
                work.refused[s] = e
                continue
            room -= 1
            work.items.append((s, owner))
        self._creating.update(work.names)
        return work

    def subjects_finish(self, work: SubjectWork) -> None:
        """On the store's thread after ``work.run``: the round's subjects are known (their
        index folders fsynced by the next checkpoint, before it vouches for their entries).
        A round that did not finish (``run`` raised) only gives its names back."""
        self._creating.difference_update(work.names)
        try:
            self._adopt_round(work)
        finally:
            work.close_fds()

    def _adopt_round(self, work: SubjectWork) -> None:
        if not work.done or self._closed:
            return
        index_root = self.root / "index"
        adopted = 0
        for s, owner in work.items:
            if s in self._subjects:
                continue
            if s not in self._owners:
                self.subject_order.append(s)
            if not self._owners.get(s):
                self._owners[s] = owner
            fresh = work.fresh.get(s)
            if fresh is not None:  # the round made the folder and an empty file: nothing to repair
                folder, path = fresh  # built (and hashed) on the worker thread: no pathlib work here
                ix = SubjectIndex(s, path, 0)
                self._subjects[s] = ix
                fd = work.fds.pop(s, -1)
                if fd >= 0:  # opened off the loop: the first append writes at once
                    ix.fd = fd
                    self._open_fds[s] = None
                    adopted += 1
            else:
                folder = index_root / s
                self._load_index(s)  # adopts a leftover file, cut as at open
            self._index_dirs_unsynced.add(folder)
        # keep every descriptor the round opened: the request that asked appends to them next
        self._trim_fds(keep=adopted)

    def subjects_abandon(self, work: SubjectWork) -> None:
        """A planned round that will not run: its names are free again."""
        self._creating.difference_update(work.names)
        work.close_fds()

    def subjects(self) -> list[str]:
        return sorted(self._subjects)

    def subject_owner(self, subject: str) -> str | None:
        """Who created the subject ("" not known; None: no such subject)."""
        return self._owners.get(subject) if subject in self._subjects else None

    def subject_owners(self, first: int, count_max: int) -> list[tuple[str, str]]:
        """``(subject, owner)`` of subjects ``[first, first + count_max)`` in creation order
        (what a master ships to its replicas, ``adopt_owners``)."""
        return [(s, self._owners.get(s, "")) for s in self.subject_order[first:first + count_max]]

    def adopt_owners(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> None:
        """A replica takes its master's subjects and owners: missing subjects are created and
        owners it did not know are recorded, as one journal record (one fsync)."""
        self._check_open()
        new = [(s, o) for s, o in items if s not in self._subjects]
        named = [(s, o) for s, o in items if o and s in self._subjects and not self._owners.get(s)]
        if new:
            for s, _ in new:
                _check_name("subject", s, self.settings.limits.subject_bytes_max)
            self._create_owned(new, now_ms=now_ms)
        if named:
            self._journal.append(named, created_ms=now_ms)
            self._owners.update(named)

    def owned_counts(self) -> dict[str, int]:
        """Subjects per owner (owners not known, "", are left out)."""
        out: dict[str, int] = {}
        for s, o in self._owners.items():
            if o and s in self._subjects:
                out[o] = out.get(o, 0) + 1
        return out

    def _index(self, subject: str) -> SubjectIndex:
        ix = self._subjects.get(subject) if isinstance(subject, str) else None
        if ix is None:
            raise UnknownSubject(subject)
        return ix

    # ------------------------------------------------------------------ append

    def append(self, batch: Batch, *, now_ms: int,
               refused_subjects: dict[str, HourglassError] | None = None) -> BatchResult:
        """Store a batch; one answer per message (see module docstring, step 1).

        A refused message changes nothing; the others go on. ``InvalidArgument`` for the
        whole call when the batch has more than ``batch_messages_max`` messages or more
        bytes than one frame holds. ``refused_subjects``: subjects the caller would not
        create (a quota), whose messages are refused with that error instead.
        """
        self._check_open()
        limits = self.settings.limits
        n = batch.n
        if n > limits.batch_messages_max:
            raise InvalidArgument("batch", f"{n} messages exceeds batch_messages_max {limits.batch_messages_max}")
        res = BatchResult.sized(n)
        if not n:
            return res
        res.deliver_at_ms[:] = batch.deliver_at_ms
        batch = _with_ids(batch)
        size = _encoded_size(batch)
        if size > self.frame_bytes_max:
            raise PayloadTooLarge("batch", f"{size} bytes exceeds one frame ({self.frame_bytes_max} bytes)")
        self._dedup.expire(now_ms)
        # due now on this node: the delay horizon does not apply to deliver_at_ms
        codes, errors = batch.replace(deliver_at_ms=np.full(n, now_ms, np.int64)).validate(now_ms=now_ms,
                                                                                           limits=limits)
        for i in np.flatnonzero((batch.deliver_at_ms < 0) & (codes == OK)).tolist():
            codes[i], errors[i] = INVALID_ARGUMENT, "deliver_at_ms: must not be negative"
        self._refuse_unknown_subjects(batch, codes, errors, refused_subjects or {}, now_ms)

        ok = np.flatnonzero(codes == OK)
        sub = batch if len(ok) == n else batch.take(ok)  # ok is sorted: all of them is the batch itself
        m = sub.n
        keys = list(zip(sub.subject_list(), sub.id_list()))
        first = dict(zip(reversed(keys), range(m - 1, -1, -1)))  # key -> its first index in the batch
        if len(first) == m:  # no id twice in this batch (the common case: skip the per-message arrays)
            first_idx = np.arange(m)
        else:
            first_idx = np.fromiter(map(first.get, keys), np.int64, m)
        if self._dedup.map.keys().isdisjoint(first):
            prior = np.full(m, -1, np.int64)
        else:
            prior = np.fromiter(map(self._dedup.map.get, keys, repeat(-1)), np.int64, m)
        seen = prior >= 0
        repeated = (first_idx != np.arange(m)) & ~seen
        new = np.flatnonzero(~seen & ~repeated)
        k = len(new)
        seqs = np.zeros(m, np.uint64)
        if k:
            make_seq(self.epoch, self._counter + k - 1)  # Overloaded once the epoch's seqs run out
            base = make_seq(self.epoch, self._counter)
            seqs[new] = np.arange(base, base + k, dtype=np.uint64)
        seqs[seen] = prior[seen].astype(np.uint64)
        seqs[repeated] = seqs[first_idx[repeated]]

        ok_now = codes[ok] == OK
        res.codes[:] = codes
        res.errors = errors
        res.seqs[ok[ok_now]] = seqs[ok_now]
        res.duplicates[ok[ok_now & (seen | repeated)]] = 1
        dup_count = int((ok_now & (seen | repeated)).sum())
        self.counters["duplicates"] += dup_count
        if k:
            if k == m:  # new is sorted: all of them is sub itself
                self._store_frame(sub, seqs, keys, now_ms)
            else:
                self._store_frame(sub.take(new), seqs[new], [keys[i] for i in new.tolist()], now_ms)
        return res

    def write_bytes_bound(self, batch: Batch) -> int:
        """Disk bytes that ``append(batch)`` takes at most (the disk watermark admits or refuses a
        write by it, node/store/diskspace.py): one frame (plain layout, ids the node makes
        included), one index entry per message, and a partly used block for the message
        segment (and a new one) and for each subject's index file and folder (a new subject)."""
        if not batch.n:
            return 0
        return (LOG_HEADER_SIZE + encoded_bytes_max(batch) + batch.n * ENTRY_SIZE
                + (2 + 2 * len(batch.subjects)) * FILE_BLOCK_BYTES)

    def _refuse_unknown_subjects(self, batch: Batch, codes: np.ndarray, errors: dict[int, str],
                                 refused: dict[str, HourglassError], now_ms: int) -> None:
        """Create the batch's new subjects (when allowed) as one round; refuse the messages
        of the others."""
        unknown = [(k, s) for k, s in enumerate(batch.subjects) if s not in self._subjects]
        if not unknown:
            return
        why: dict[int, HourglassError] = {}
        create: list[tuple[int, str]] = []
        for k, s in unknown:
            if not (codes[batch.subject_idx == k] == OK).any():
                continue
            if s in refused:
                why[k] = refused[s]
            elif not (self.settings.auto_create_subjects or s == DLQ_SUBJECT):
                why[k] = UnknownSubject(s)
            else:
                create.append((k, s))
        if create:
            work = self.subjects_plan([(s, "") for _, s in create], now_ms=now_ms)
            try:
                work.run()
            finally:
                self.subjects_finish(work)
            why.update({k: work.refused[s] for k, s in create if s in work.refused})
        for k, e in why.items():
            mine = np.flatnonzero((batch.subject_idx == k) & (codes == OK))
            codes[mine] = status.to_code(e)
            errors.update(dict.fromkeys(mine.tolist(), str(e)))

    def _store_frame(self, stored: Batch, seqs: np.ndarray, keys: list, now_ms: int) -> None:
        """Append one frame and its index runs; remember its ids and keep it decoded for pulls."""
        stored = stored.replace(seq=seqs, store_ms=now_ms)
        body = stored.encode()
        contiguous = self._indexed_upto == self.messages.end_offset  # else replay repairs a failed index write
        [off] = self.messages.append([body])
        self._counter += stored.n
        vis = visible_ms(stored, now_ms, self.settings.visible_hold_ms_max, self.settings.visible_step_ms)
        held = int(vis.max())
        self.appended_visible_ms = int(vis.min())
        runs = frame_runs(offset=off, subject_idx=stored.subject_idx, visible_ms=vis, masks=batch_tag_masks(stored))
        try:
            subjects = self._subjects
            for k, raw in runs.items():
                ix = subjects[stored.subjects[k]]
                ix.append_run(self._fd(ix, trim=False), raw)
                if held > ix.held_until:
                    ix.held_until = held
        except DiskFull:
            self._undo_frame(off, [stored.subjects[k] for k in runs])
            raise
        finally:
            self._trim_fds()
        if contiguous:
            self._indexed_upto = self.messages.end_offset
        evicted = self._dedup.add(keys, seqs.tolist(), store_ms=now_ms, offset=off)
        if evicted:
            self._dedup_full(evicted, now_ms)
        self._cache_frame(off, stored, len(body))
        self.counters["appended"] += stored.n

    def _dedup_full(self, evicted: int, now_ms: int) -> None:
        """The dedup map reached ``dedup_entries_max``: the oldest ids were forgotten before
        their window ended (the window is shorter while the rate is this high). Counted,
        and said at most once per ``DEDUP_FULL_LOG_EVERY_MS``; never a reason to refuse."""
        self.counters["dedup_evicted_early"] += evicted
        if now_ms - self._dedup_full_logged_ms >= DEDUP_FULL_LOG_EVERY_MS:
            self._dedup_full_logged_ms = now_ms
            oldest = self._dedup.order[0][0] if self._dedup.order else now_ms
            log.warning("dedup map full path=%s dedup_entries_max=%d: ids are remembered for %d ms, not "
                        "dedup_window_ms=%d (evicted early so far: %d)", self.root, self.settings.dedup_entries_max,
                        now_ms - oldest, self.settings.dedup_window_ms, self.counters["dedup_evicted_early"])

    def _undo_frame(self, off: int, subjects: list[str]) -> None:
        """An index write of the frame at ``off`` hit ENOSPC (rare): drop the entries written
        for it and the frame, so the refused batch leaves nothing behind."""
        for s in subjects:
            ix = self._subjects[s]
            if ix.last_offset == off:
                fd = self._fd(ix)
                ix.truncate(fd, ix.first_at_or_after(fd, off))
        self.messages.truncate(off)
        log.error("append undone: index write hit no space left path=%s offset=%d", self.messages.directory, off)

    # ------------------------------------------------------------------ durability

    def flush(self, *, groups: bool = True, index_bytes_min: int = 0) -> None:
        """fsync the message log; then, once at least ``index_bytes_min`` log bytes were
        indexed since the last checkpoint, the dirty indexes and the checkpoint; with
        ``groups``, commit changed group documents (and wait for their fsync).

        The index and the checkpoint only bound the replay at ``open``: a periodic flush
        skips them until enough was appended (each index file costs an fsync), ``close``
        and a role change flush everything."""
        self.flush_plan(index_bytes_min=index_bytes_min).run_and_finish()
        if groups:
            items = self.snapshot_groups(self.dirty_groups())
            if items:
                self.write_groups_async(items).result()

    def flush_key(self) -> tuple:
        """What a periodic flush writes, but the clock: equal keys mean that nothing was
        appended, indexed, evicted or moved (groups) in between, so the flush would fsync
        nothing new (the service then skips it, issue 28)."""
        return (self.epoch, self.messages.end_offset, self._indexed_upto, self.indexed_offset,
                bool(self._dirty_groups), any(ix.dirty for ix in self._subjects.values()), self.group_seq)

    def flush_plan(self, *, index_bytes_min: int = 0, fsyncs_max: int | None = None) -> SyncPlan:
        """``flush(groups=False)`` as a plan to ``run`` on a worker thread and ``finish`` on
        the loop: the checkpoint document is taken now and vouches only for index entries
        written before the plan's fsyncs. ``fsyncs_max``: index files and folders this
        checkpoint fsyncs at most (``_plan_index_sync``); None: all of them."""
        self._check_open()
        plan = SyncPlan()
        indexed = self._indexed_upto  # every message below it has its index entry written
        self.messages.plan_flush(plan)
        if indexed - self.indexed_offset >= index_bytes_min:
            indexed = self._plan_index_sync(plan, indexed, fsyncs_max)
            oldest = self._dedup.oldest_offset()
            doc = {"epoch": self.epoch, "indexed_offset": indexed,
                   "dedup_offset": indexed if oldest is None else oldest}
            if doc != self._ckpt_saved:
                plan.write_doc(self._gate, self._ckpt_path, doc)

            def saved() -> None:
                self._ckpt_saved = doc
                self.indexed_offset = max(self.indexed_offset, indexed)
            plan.on_done(saved)
        return plan

    def persist_group(self, subject: str, group: str) -> bool:
        """Commit one group's document now if it changed (an acknowledged ack survives a
        crash). True if it was written. The service commits every group an ack round touched
        as one record with ``snapshot_groups`` + ``write_groups_async`` instead."""
        self._check_open()
        items = self.snapshot_groups([(subject, group)])
        if items:
            self.messages.flush()  # a position is never durable before the messages it passes
            self.write_groups_async(items).result()
        return bool(items)

    def _save_checkpoint(self, indexed: int, dedup_offset: int) -> None:
        doc = {"epoch": self.epoch, "indexed_offset": indexed, "dedup_offset": dedup_offset}
        if doc != self._ckpt_saved:
            plan = SyncPlan()
            plan.write_doc(self._gate, self._ckpt_path, doc)
            plan.run()
            self._ckpt_saved = doc
        self.indexed_offset = indexed

    def write_groups_async(self, items: list[tuple[_Group, dict]]) -> Future:
        """Commit group documents as one offsets-log record (one write, one fsync on the
        offsets writer thread, records in submission order, so a newer document of a group
        never lands before an older one). The in-memory state moves at once; the returned
        future completes when the record is fsynced."""
        for g, _ in items:
            self._note_group_write(g)
        docs = []
        for g, doc in items:
            g.persisted = doc
            docs.append(doc)
        return self._offsets.commit(docs)

    def unpersist_groups(self, items: list[tuple[_Group, dict]]) -> None:
        """A ``write_groups_async`` failed (or its outcome is unknown): these documents are
        not durable, so the groups are dirty again and their next snapshot is written."""
        for g, _ in items:
            g.persisted = None
            self._mark_dirty(g)

    def snapshot_groups(self, keys: Iterable[tuple[str, str]]) -> list[tuple[_Group, dict]]:
        """Documents of the given groups that changed since they were last written."""
        out = []
        for key in keys:
            g = self._groups.get(key)
            if g is None or not g.dirty:
                continue
            doc = g.doc()
            g.dirty = False
            self._dirty_groups.discard(key)
            if doc != g.persisted:
                out.append((g, doc))
        return out

    # ------------------------------------------------------------------ consume

    def _group(self, subject: str, group: str, ix: SubjectIndex, start: str) -> _Group:
        g = self._groups.get((subject, group))
        if g is not None:
            return g
        _check_name("group", group, self.settings.limits.subject_bytes_max)
        if start not in (START_EARLIEST, START_LATEST):
            raise InvalidArgument("start", f"must be {START_EARLIEST!r} or {START_LATEST!r}")
        if len(self._groups) >= self.settings.groups_max:
            raise Overloaded(f"{len(self._groups)} consumer groups (groups_max={self.settings.groups_max})")
        g = _Group(subject, group, start, ix.count if start == START_LATEST else ix.live_from)
        self.write_groups_async([(g, g.doc())]).result()  # the start position survives a restart
        g.dirty = False
        self._groups[(subject, group)] = g
        return g

    def _touch(self, g: _Group, ix: SubjectIndex, now_ms: int) -> None:
        """A pull, ack or nack of the group: it is active; if it was idle, or is behind the
        first entry still on disk, it resumes there (``_resume``)."""
        g.active_ms = now_ms
        if g.idle or g.committed() < ix.live_from:
            self._resume(g, ix)

    def _resume(self, g: _Group, ix: SubjectIndex) -> None:
        """An idle group is back: what retention deleted while it was idle is skipped, its
        position moves to ``ix.live_from`` (the first entry whose frame is still on disk)."""
        was_idle, g.idle = g.idle, False
        skipped = 0
        if g.committed() < ix.live_from:
            live = ix.live_from
            skipped = g.inflight.remove([(0, live)]) + max(0, live - g.next_pos)
            g.next_pos = max(g.next_pos, live)
            self._mark_dirty(g)
        self.counters["groups_resumed"] += 1
        self.counters["resumed_skipped_messages"] += skipped
        log.warning("consumer group active again subject=%s group=%s was_idle=%s skipped_messages=%d position=%d "
                    "path=%s", g.subject, g.name, was_idle, skipped, g.committed(), ix.path)

    def pull(self, subjects: Sequence[str], group: str, consumer_id: str, *, max_messages: int,
             tags: Sequence[str] = (), now_ms: int, start: str = START_EARLIEST) -> tuple[Batch, np.ndarray]:
        """Up to ``max_messages`` messages of ``subjects`` for one consumer of ``group``, as
        ``(batch, handles)`` (see module docstring, step 2).

        ``consumer_id`` only names the caller (handles belong to the group). ``start`` applies
        to a group seen for the first time. ``Overloaded`` when nothing can be handed out
        because a group's in-flight set is full while its subject has more entries.
        """
        self._check_open()
        if isinstance(subjects, str):
            subjects = [subjects]
        subjects = list(dict.fromkeys(subjects))
        if not subjects:
            raise InvalidArgument("subjects", "name at least one subject")
        ixs = [self._index(s) for s in subjects]
        if not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidArgument("max_messages", "must be a positive integer")
        left = min(max_messages, self.settings.pull_max)
        tags = list(tags)
        if not all(isinstance(t, str) and t for t in tags):
            raise InvalidArgument("tags", "a tag filter holds non-empty strings")
        want = np.uint64(tags_mask(tags))
        groups = [self._group(s, group, ix, start) for s, ix in zip(subjects, ixs)]
        for g, ix in zip(groups, ixs):
            self._touch(g, ix, now_ms)
        r = self._rotation % len(subjects)
        self._rotation += 1
        order = list(range(r, len(subjects))) + list(range(r))

        parts: list[tuple[np.ndarray, np.ndarray]] = []  # (entries, handles) per piece
        cutoff = now_ms - self.settings.ack_timeout_ms
        for i in order:  # 1. redeliveries
            if left <= 0:
                break
            g, ix = groups[i], ixs[i]
            for a, b in g.inflight.take_due(cutoff, left, now_ms=now_ms):
                parts.append((ix.read(self._fd(ix), a, b - a), np.arange(a, b, dtype=np.int64)))
                left -= b - a
                self.counters["redelivered"] += b - a
                self._mark_dirty(g)

        self.held_next_ms = None
        full = self._take_new(groups, ixs, left, want, now_ms, parts)  # 2. new positions
        if not parts:
            if full:
                raise Overloaded(f"group {group!r} has inflight_per_group_max="
                                 f"{self.settings.inflight_per_group_max} messages in flight")
            return _EMPTY_BATCH, _NO_HANDLES
        return self._gather(_cat_entries([e for e, _ in parts]), np.concatenate([h for _, h in parts]))

    def _take_new(self, groups: list[_Group], ixs: list[SubjectIndex], left: int, want: np.uint64, now_ms: int,
                  parts: list) -> bool:
        """Hand out up to ``left`` new positions over the groups, oldest in the log first, so
        that a pull covers few frames (one ``take`` each). Each round reads a chunk of every
        subject's unread entries (a little more than its share), merges the matching ones by
        log position and keeps the first ``left``; a subject's ``next`` moves past what it
        handed out and past skipped entries before it. Returns True when a group could not
        hand out because its in-flight set is full while its subject has more entries.

        A subject's entries are handed out in order up to the first one not visible yet
        (``visible_ms`` after ``now_ms``: dispatched ahead of its due time); the earliest such
        time over the subjects is left in ``held_next_ms`` for the caller's wait."""
        scan_left = self.settings.pull_scan_entries_max
        full = False
        hold_window = self.settings.visible_hold_ms_max + self.settings.visible_step_ms
        held: set[int] = set()  # groups stopped at an entry not visible yet
        while left > 0 and scan_left > 0:
            live = []
            for g, ix in zip(groups, ixs):
                if g.next_pos < ix.count and id(g) not in held:
                    room = self.settings.inflight_per_group_max - len(g.inflight)
                    if room > 0:
                        live.append((g, ix, room))
                    else:
                        full = True
            if not live:
                break
            share = -(-left // len(live))
            chunk = share + share // 4 + 8 if not want else max(2 * share, 64)
            chunk = max(1, min(chunk, _SCAN_CHUNK_ENTRIES, scan_left // len(live)))
            cands = []
            for g, ix, room in live:
                e = ix.read(self._fd(ix), g.next_pos, chunk)
                if ix.held_until > now_ms:
                    late = np.flatnonzero(held_mask(e["visible_ms"], now_ms, hold_window))
                    if len(late):
                        cut = int(late[0])
                        at = int(e["visible_ms"][cut])
                        self.held_next_ms = at if self.held_next_ms is None else min(self.held_next_ms, at)
                        held.add(id(g))
                        e = e[:cut]
                if want:
                    sel = np.flatnonzero(e["mask"] & want)
                    cands.append((g, e, sel, min(room, len(sel))))
                else:  # every entry matches: prefixes are slices
                    cands.append((g, e, None, min(room, len(e))))
            offsets = np.concatenate([e["offset"][:k] if sel is None else e["offset"][sel[:k]]
                                      for _, e, sel, k in cands])
            index = np.concatenate([e["index"][:k] if sel is None else e["index"][sel[:k]] for _, e, sel, k in cands])
            owner = np.repeat(np.arange(len(cands)), [k for *_, k in cands])
            if len(owner) > left:  # keep the oldest ``left``: per subject, a prefix of what matched
                first = np.lexsort((index, offsets))[:left]
                taken = np.bincount(owner[first], minlength=len(cands)).tolist()
            else:
                taken = [k for *_, k in cands]
            for (g, e, sel, _), t in zip(cands, taken):
                if sel is None:  # no tag filter: the first t entries
                    used = t
                    if t:
                        parts.append((e[:t], np.arange(g.next_pos, g.next_pos + t, dtype=np.int64)))
                        g.inflight.add(g.next_pos, g.next_pos + t, now_ms)
                else:
                    used = int(sel[t]) if t < len(sel) else len(e)  # stop at the first match not handed out
                    if t:
                        handles = g.next_pos + sel[:t]
                        parts.append((e[sel[:t]], handles))
                        g.inflight.add_runs(_runs(handles), now_ms)
                self.counters["skipped_by_tag"] += used - t
                self.counters["delivered"] += t
                g.next_pos += used
                if used:
                    self._mark_dirty(g)
                left -= t
                scan_left -= used
        return full

    def _gather(self, entries: np.ndarray, handles: np.ndarray) -> tuple[Batch, np.ndarray]:
        """The messages ``entries`` point at, in log order: one take per frame, one concat."""
        order = np.lexsort((entries["index"], entries["offset"]))
        offsets = entries["offset"][order]
        index = entries["index"][order]
        cuts = np.flatnonzero(np.diff(offsets)) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = np.concatenate((cuts, [len(order)])).tolist()
        if len(starts) == 1:
            return self._frame(int(offsets[0])).take(index), handles[order].astype(np.uint64)
        return Batch.gather([(self._frame(int(offsets[a])), index[a:b]) for a, b in zip(starts, ends)]), \
            handles[order].astype(np.uint64)

    def ack(self, subject: str, group: str, ranges, *, now_ms: int) -> int:
        """Drop handle ranges ``[lo, hi)`` from the group's in-flight set; returns how many
        handles were in flight. The group file is written by ``persist_group``,
        ``write_groups_async`` or ``flush``."""
        self._check_open()
        ix = self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return 0
        return self._ack_pairs(g, ix, _as_pairs(ranges), now_ms)

    def _ack_pairs(self, g: _Group, ix: SubjectIndex, pairs: list, now_ms: int) -> int:
        """The group is active; drop ``pairs`` from its in-flight set (``ack``, ``ack_many``)."""
        self._touch(g, ix, now_ms)
        n = g.inflight.remove(pairs)
        if n:
            self._mark_dirty(g)
            self.counters["acked"] += n
        return n

    def ack_many(self, group: str, items: Sequence[tuple[str, bytes]], *, now_ms: int) -> int:
        """``ack`` of several subjects' packed ranges at once (a pull's or an Ack's
        ``SubjectHandles``: u64 LE ``[lo, hi)`` pairs per subject): the ranges of every subject
        are decoded and checked as one array, so a round's acks cost one pass, not one per
        subject. ``InvalidArgument`` (nothing acked) for a malformed range of any subject."""
        self._check_open()
        if not items:
            return 0
        sizes = [len(raw) for _, raw in items]
        if any(n % 16 for n in sizes):
            raise InvalidArgument("ranges", "not a whole number of [lo, hi) pairs")
        r = np.frombuffer(b"".join([raw for _, raw in items]), "<u8").reshape(-1, 2)
        if len(r) and bool((r[:, 1] <= r[:, 0]).any() or (r[:, 1] > np.uint64(1 << 62)).any()):
            raise InvalidArgument("ranges", "every range must have 0 <= lo < hi")
        flat = r.astype(np.int64).tolist()
        n, at = 0, 0
        for (subject, _), size in zip(items, sizes):
            pairs, at = flat[at:at + size // 16], at + size // 16
            ix = self._index(subject)
            g = self._groups.get((subject, group))
            if g is not None and pairs:
                n += self._ack_pairs(g, ix, pairs, now_ms)
        return n

    def nack(self, subject: str, group: str, ranges, *, now_ms: int) -> tuple[Batch, np.ndarray]:
        """The in-flight messages of handle ranges (others ignored) as ``(batch, handles)``,
        their ack deadline restarted so they are not redelivered while the caller re-sends
        them; the caller acks them once the retry copy (or the dead letter) is stored."""
        self._check_open()
        ix = self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return _EMPTY_BATCH, _NO_HANDLES
        pairs = _as_pairs(ranges)
        self._touch(g, ix, now_ms)
        found = g.inflight.touch(pairs, now_ms)
        if not found:
            return _EMPTY_BATCH, _NO_HANDLES
        entries = np.concatenate([ix.read(self._fd(ix), a, b - a) for a, b in found])
        handles = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in found])
        return self._gather(entries, handles)

    def lag(self, subject: str, group: str) -> int:
        """Entries of the subject this group has not acked (a group not seen yet: all of them)."""
        ix = self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return ix.count
        return ix.count - g.next_pos + len(g.inflight)

    def committed(self, subject: str, group: str) -> int:
        """The group's lowest unacked position (0 for a group not seen yet)."""
        self._index(subject)
        g = self._groups.get((subject, group))
        return 0 if g is None else g.committed()

    def groups(self, subject: str) -> list[str]:
        self._index(subject)
        return sorted(name for (s, name) in self._groups if s == subject)

    # ------------------------------------------------------------------ retention (node/realtime/retention.py)

    def retention_plan(self, *, now_ms: int, slave_holds: dict[str, int] | None = None
                       ) -> tuple["RetentionWork", "RetentionReport"]:
        """Decide (``retention.decide``) and detach, on the caller's thread: segments that go
        are renamed ``*.deleting`` (a store reopened on the folder never sees them), the frame
        cache forgets them, each subject's ``live_from`` moves past their entries, groups found
        idle are logged once, and index files worth compacting are planned. The returned work
        runs on a worker thread (``RetentionWork.run``), then ``retention_finish`` on this one."""
        self._check_open()
        work, report = RetentionWork(self.messages.directory), RetentionReport()
        end = self.messages.end_offset
        positions, by_key = [], {}
        for (subject, name), g in self._groups.items():
            ix = self._subjects[subject]
            if g.active_ms is None:
                g.active_ms = now_ms
            c = g.committed()
            hold = None
            if ix.live_from <= c < ix.count:
                if g.hold[0] != c:
                    g.hold = (c, int(ix.read(self._fd(ix), c, 1)["offset"][0]))
                hold = g.hold[1]
            key = f"{subject}/{name}"
            by_key[key] = g
            positions.append(RR.GroupPosition(key, hold, g.active_ms))
        self._dedup.expire(now_ms)
        s = self.settings
        decision = RR.decide(self._segments_sealed(now_ms), end, positions, now_ms=now_ms,
                             retention_ms=s.retention_ms, retention_bytes=s.retention_bytes,
                             group_idle_ms_max=s.group_idle_ms_max, dedup_offset=self._dedup.oldest_offset(),
                             indexed_offset=self.indexed_offset, slave_holds=slave_holds)
        for key in decision.idle:
            g = by_key[key]
            if not g.idle:
                g.idle = True
                self.counters["groups_idled"] += 1
                log.warning("consumer group idle: no longer holds data back subject=%s group=%s idle_ms=%d "
                            "group_idle_ms_max=%d committed=%d", g.subject, g.name, now_ms - g.active_ms,
                            s.group_idle_ms_max, g.committed())
        report.idle_groups = len(decision.idle)
        cut = decision.cut
        report.held_by, report.held_base = cut.held_by, cut.held_base
        paths = self.messages.detach_before(cut.offset)
        start = self.messages.start_offset
        if paths:
            work.segments = paths
            self.counters["segments_deleted"] += len(paths)
            for b in [b for b in self._seg_sealed_ms if b < start]:
                del self._seg_sealed_ms[b]
            for off in [o for o in self._frames if o < start]:
                self._frames_bytes -= self._frames.pop(off)[1]
            for ix in self._subjects.values():
                self._advance_live_from(ix)
            log.info("retention log=messages segments=%d new_start=%d held_by=%s path=%s", len(paths), start,
                     cut.held_by, self.messages.directory)
        sealed = self._seg_sealed_ms.get(self.messages.segment_bases()[0])
        report.held_age_ms = 0 if sealed is None else max(0, now_ms - sealed)
        for ix in self._subjects.values():
            if ix.subject not in self._compacting and RR.compact_index(
                    ix.base, ix.count, ix.live_from, entries_min=s.index_compact_entries_min):
                final = index_path(ix.path.parent, ix.live_from)
                work.compactions.append(_Compaction(ix.subject, ix.path, ix.base, ix.live_from, ix.count,
                                                    final.with_name(final.name + TMP_SUFFIX), self._truncations))
                self._compacting.add(ix.subject)
        work.old_files, self._index_old_files = self._index_old_files, []
        return work, report

    def _segments_sealed(self, now_ms: int) -> list[tuple[int, int, int]]:
        """``(base, size, sealed_ms)`` of every segment; a segment was sealed by the append
        that starts the next one (its ``store_ms``); the active one is ``now_ms``."""
        info = self.messages.segments_info()
        end = self.messages.end_offset
        out = []
        for (base, size, _), nxt in zip(info, info[1:] + [None]):
            ms = self._seg_sealed_ms.get(base)
            if ms is None:
                if nxt is None or nxt[0] >= end:
                    out.append((base, size, now_ms))
                    continue
                hit = self._frames.get(nxt[0])
                b = hit[0] if hit is not None else self._decode_frame(nxt[0], self.messages.read(nxt[0])[0])
                ms = self._seg_sealed_ms[base] = int(b.store_ms[0]) if b.n else now_ms
            out.append((base, size, ms))
        return out

    def retention_finish(self, work: "RetentionWork") -> None:
        """On the store's thread, after ``work.run``: swap compacted index files in. The
        entries appended since the copy are copied too, then the file is renamed to
        ``entries.{base}`` (the switch); its folder is fsynced by the next checkpoint plan
        before the checkpoint, and the old file deleted by the next retention work."""
        for c in work.compactions:
            self._compacting.discard(c.subject)
            ix = self._subjects.get(c.subject)
            if (not c.copied or self._closed or ix is None or ix.path != c.src or ix.count < c.upto
                    or c.truncations != self._truncations):
                c.tmp.unlink(missing_ok=True)
                continue
            try:
                tail = os.pread(self._fd(ix), (ix.count - c.upto) * ENTRY_SIZE, (c.upto - ix.base) * ENTRY_SIZE)
                fd = os.open(c.tmp, os.O_WRONLY | os.O_APPEND)
                try:
                    view = memoryview(tail)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                final = index_path(ix.path.parent, c.new_base)
                os.replace(c.tmp, final)
            except OSError as e:
                log.error("index compaction abandoned path=%s error=%s", c.tmp, e)
                c.tmp.unlink(missing_ok=True)
                continue
            self._evict_fd(ix)  # a dirty old fd is fsynced (then closed) by the next flush plan
            old = ix.path
            ix.path, ix.base = final, c.new_base
            ix.trusted_from = max(ix.trusted_from, c.new_base)
            self._fd(ix)
            ix.dirty_from = self.indexed_offset  # nothing in the new file is synced yet: vouch for none of it
            ix.dirty = True  # the copied tail is fsynced before the next checkpoint
            self._index_dirs_unsynced.add(final.parent)
            self._index_old_files.append((old, final))
            self.counters["index_compactions"] += 1
            log.info("index compacted path=%s base=%d entries_dropped=%d entries=%d", final, c.new_base,
                     c.new_base - c.src_base, ix.count - c.new_base)

    def _plan_index_sync(self, plan: SyncPlan, indexed: int, fsyncs_max: int | None) -> int:
        """Plan the fsyncs a checkpoint at ``indexed`` needs: every dirty index file, and every
        unsynced index folder (a new subject's, or one where a compacted file was renamed).
        With ``fsyncs_max``, only that many, the subjects with the oldest unsynced entries
        first; the checkpoint then vouches only below the first entry left unsynced (replay
        at open re-indexes from there), which is never below the previous checkpoint, as
        every entry below it was synced then. Returns the offset the checkpoint vouches for.

        A dirty index whose fd was evicted is opened here to be fsynced: a descriptor (not a
        path) keeps the plan on the same file if a compaction renames it meanwhile."""
        dirs = self._index_dirs_unsynced
        units: list[tuple[int, str]] = []  # (first unsynced entry's offset, subject); -1 = take now
        for s, ix in self._subjects.items():
            if ix.dirty:
                units.append((ix.dirty_from, s))
        for d in dirs:
            ix = self._subjects.get(d.name)
            if ix is None or not ix.dirty:  # a new, empty subject: no entry waits for it; else take it now
                units.append((indexed if ix is None or ix.count == ix.base else -1, d.name))
        if fsyncs_max is not None and len(units) + len(dirs) > fsyncs_max:  # at most this many fsyncs
            units.sort()
        else:
            fsyncs_max = None
        index_root = self.root / "index"
        used = 0
        left = indexed
        for bound, s in units:
            folder = index_root / s
            ix = self._subjects.get(s)
            n = (ix is not None and ix.dirty) + (folder in dirs)
            if fsyncs_max is not None and used + n > fsyncs_max and bound >= 0:
                left = min(left, bound)
                continue
            used += n
            if ix is not None and ix.dirty:
                if ix.fd >= 0:
                    plan.fsync(ix.fd)
                else:
                    fd = os.open(ix.path, os.O_RDONLY)
                    try:
                        plan.fsync(fd)  # duplicated by the plan
                    finally:
                        os.close(fd)
                ix.dirty = False
            if folder in dirs:
                dirs.discard(folder)
                plan.fsync_dir(folder)  # opened on the plan's thread
        if left < indexed:
            self.counters["checkpoint_index_deferred"] += 1
        return max(min(left, indexed), self.indexed_offset)

    def disk_bytes(self) -> dict[str, int]:
        """Any thread: bytes allocated per part of the data folder (messages, index, groups, other)."""
        out: dict[str, int] = {}
        for top in self.root.iterdir():
            name = top.name if top.is_dir() else "other"
            n = 0
            for p in (top.rglob("*") if top.is_dir() else [top]):
                try:
                    n += p.stat().st_blocks * 512 if p.is_file() else 0
                except FileNotFoundError:
                    pass
            out[name] = out.get(name, 0) + n
        return out

    # ------------------------------------------------------------------ replication (node/replication/realtime.py)

    def index_appended(self, *, now_ms: int) -> int:
        """A replica appended frames to ``messages`` (``append_raw``, byte for byte): index them
        and put them in the dedup map, exactly as ``open`` replays a log. Returns entries added."""
        self._check_open()
        start = self._indexed_upto
        if start >= self.messages.end_offset:
            return 0
        self._dedup.expire(now_ms)
        before = self.counters["reindexed"]
        _, dropped = self._index_frames(start, start, now_ms)
        if dropped:
            log.warning("dedup map full path=%s dedup_entries_max=%d entries_dropped=%d",
                        self.root, self.settings.dedup_entries_max, dropped)
        self._indexed_upto = self.messages.end_offset
        return self.counters["reindexed"] - before

    def truncate_log(self, cut: int) -> int:
        """Drop a divergent suffix of the message log (frames a new master never had): the
        log, the index entries pointing at or past ``cut``, their dedup entries and cached
        frames; groups are clamped to what their indexes still hold. Returns bytes dropped."""
        self._check_open()
        if cut >= self.messages.end_offset:
            return 0
        self._truncations += 1  # index compactions planned before this cut are abandoned
        for g in self._groups.values():
            g.hold = (-1, -1)  # positions at or past the cut will point at other frames
        for ix in self._subjects.values():
            if ix.last_offset < cut:
                continue
            fd = self._fd(ix)
            keep = ix.first_at_or_after(fd, cut)
            ix.truncate(fd, keep)
            for g in self._groups.values():
                if g.subject == ix.subject and g.next_pos > keep:
                    g.next_pos = keep
                    g.inflight.truncate(keep)
                    self._mark_dirty(g)
        self._dedup.truncate(cut)
        for off in [o for o in self._frames if o >= cut]:
            self._frames_bytes -= self._frames.pop(off)[1]
        dropped = self.messages.truncate(cut)
        self.messages.flush()
        self._indexed_upto = min(self._indexed_upto, cut)
        oldest = self._dedup.oldest_offset()
        self._save_checkpoint(min(self.indexed_offset, cut), self._indexed_upto if oldest is None else oldest)
        log.warning("message log truncated path=%s offset=%d bytes_dropped=%d (divergent suffix)",
                    self.messages.directory, cut, dropped)
        return dropped

    def changed_groups(self, since_seq: int) -> list[tuple[str, str]]:
        """Groups whose document was committed after ``since_seq`` (all of them for -1), oldest first."""
        out = []
        for key in reversed(self._group_changes):
            if self._group_changes[key] <= since_seq:
                break
            out.append(key)
        out.reverse()
        return out

    def group_doc(self, subject: str, group: str) -> dict | None:
        """The group's document as last committed to the offsets log (what a replica must hold)."""
        g = self._groups.get((subject, group))
        return None if g is None else g.persisted

    def group_written_seq(self, subject: str, group: str) -> int:
        """``group_seq`` of the group's last commit (0 if never committed by this store)."""
        return self._group_changes.get((subject, group), 0)

    def apply_group_doc(self, doc: dict) -> None:
        """``apply_group_docs`` of one document."""
        self.apply_group_docs([doc])

    def apply_group_docs(self, docs: Sequence[dict]) -> None:
        """A replica takes its master's group documents: committed as given, as one record
        (so they survive a promotion), before the in-memory groups follow them."""
        self._check_open()
        items = []
        new: set[tuple[str, str]] = set()
        self.create_subjects([doc["subject"] for doc in docs])  # one round for the ones not seen yet
        for doc in docs:
            subject, name = doc["subject"], doc["group"]
            _check_name("group", name, self.settings.limits.subject_bytes_max)
            if (subject, name) not in self._groups:
                new.add((subject, name))
            if new and len(self._groups) + len(new) > self.settings.groups_max:
                raise Overloaded(f"{len(self._groups)} consumer groups (groups_max={self.settings.groups_max})")
            items.append((self._group_from_doc(subject, name, doc, self._subjects[subject]), doc))
        if not items:
            return
        self.write_groups_async(items).result()
        for g, _ in items:
            self._groups[(g.subject, g.name)] = g
