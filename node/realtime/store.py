"""RealtimeStore: the real-time node's storage engine, a facade over one module per part.

The unit is the batch (``shared/ARCHITECTURE.md``, "Hot path"): one append stores one
``cluster.codec.Batch`` as one log frame, one pull answers one ``Batch`` built with
``Batch.take`` + ``Batch.concat`` from whole frames, acks take handle ranges. Python does
per-batch work; per-message work runs inside numpy, ``bytes.join`` and comprehensions.

This module owns the message log and the checkpoint (the seq counter: append.py), and composes the
parts (``docs/design.md``, "The real-time store: who owns what")::

    accept.py          pure: which messages of a batch are new, and their seqs
    append.py          the append path: the seq counter, one frame and its index runs per batch
    dedup.py           pure: the de-duplication window, (subject, id) -> seq
    index.py           one subject's consume index file (entry format, tail repair)
    indexfiles.py      every subject's index, the descriptor LRU, the checkpoint's index fsyncs
    frames.py          the LRU of decoded recent frames
    subjects.py        the subjects journal, creation rounds, the registry of known subjects
    groups.py          consumer groups: positions, documents, commits (offsets.py: their log)
    consume.py         pull / ack / nack
    retention.py       pure: which segments go, which groups are idle, what to compact
    retention_work.py  retention carried out: detach, unlink, compact
    recovery.py        ``recover`` at open (-> ``RecoveryReport``), the replay replicas share

Data folder (``docs/format.md``, "Real-time node data folder")::

    {root}/messages/                  SegmentedLog; each frame's body is one codec Batch (v2)
    {root}/index/{subject}/entries    consume index of one subject (entries.{base:020d} after retention)
    {root}/groups/                    offsets log: group positions
    {root}/subjects.log               subjects journal: known subjects and their owners
    {root}/checkpoint                 epoch, indexed_offset, dedup_offset (checkpoint.write_atomic)

Message frame: the batch as stored, every column set: ``seq`` contiguous inside the frame
(``(epoch << 40) | counter``, ``node.store.records.make_seq``), ``store_ms`` = the append's
``now_ms``, ``deliver_at_ms`` / ``effective_ms`` / ``attempts`` as given (consumers measure
lateness with the original due time). The position of a message's index entry is its
*handle*.

Flow (every call takes ``now_ms``; nothing here reads a clock or awaits):

1. ``append(batch)`` validates (the message is due now: the delay horizon does not apply),
   creates missing subjects as one round (the service does it off the loop first:
   ``subjects_plan`` / ``SubjectWork.run`` / ``subjects_finish``), answers ids seen within
   ``dedup_window_ms`` as duplicates with the first seq (``accept.assign_seqs``), and
   appends the rest as one frame plus one run of index entries per subject (page cache;
   durable after ``flush`` or the caller's group commit of ``messages``).
2. ``pull`` / ``ack`` / ``ack_many`` / ``nack``: ``consume.py``; group documents are
   committed to the offsets log on its writer thread (``write_groups_async``: one record
   and one fsync per round, however many groups).
3. ``flush`` fsyncs the message log, then the dirty index files and last the checkpoint with
   ``indexed_offset`` = the log end before the fsyncs (a periodic flush does those two only
   every ``checkpoint_bytes_min`` of new log, at most ``checkpoint_index_fsyncs_max`` index
   files, vouching only below the first entry it left unsynced: ``IndexFiles.plan_sync``),
   and commits changed group documents.

Invariants: every message of a frame below ``indexed_offset`` has its index entry on disk
(so replay starts there); RAM holds nothing per stored message but the dedup map (bounded
by time and ``dedup_entries_max``); in-flight handles are ranges; the frame cache is bounded
in bytes. Acks after the last group commit are lost by a crash, not by ``close``.

Example::

    st = RealtimeStore.open(root, now_ms=t)          # st.recovery: what recovery found and did
    res = st.append(Batch.build("orders", [b"x"], ["id-1"], [t]), now_ms=t)   # res.seqs[0]
    batch, handles = st.pull(["orders"], "billing", "c1", max_messages=10, now_ms=t)  # handles == [0]
    st.ack("orders", "billing", [(0, 1)], now_ms=t)                                  # -> 1
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from cluster.codec import Batch
from cluster.errors import Closed, HourglassError
from cluster.files import DATA_DIR_MODE, remove_leftover_temps
from cluster.wire import BatchResult
from node.realtime.accept import write_bytes_bound
from node.realtime.append import Appender
from node.realtime.consume import Delivery, as_pairs
from node.realtime.dedup import DedupWindow
from node.realtime.frames import FrameCache
from node.realtime.browse import browse
from node.realtime.group_status import group_rows
from node.realtime.groups import START_EARLIEST, START_LATEST, ConsumerGroups, Group
from node.realtime.index import ENTRY, ENTRY_SIZE, tags_mask
from node.realtime.indexfiles import IndexFiles
from node.realtime.lookup import SCAN_ENTRIES_MAX, Found, lookup
from node.realtime.offsets import OffsetsLog
from node.realtime.recovery import RecoveryReport, index_frames, recover
from node.realtime.retention_work import Retainer, RetentionReport, RetentionWork
from node.realtime.subjects import DLQ_SUBJECT, SubjectRegistry, SubjectsJournal, SubjectWork
from node.store import checkpoint
from node.store.log import RECORD_BYTES_MAX_DEFAULT, SegmentedLog
from node.store.records import SEQ_COUNTER_MAX, SEQ_EPOCH_SHIFT
from node.store.settings import RealtimeSettings
from node.store.syncplan import DocGate, SyncPlan

__all__ = ["DLQ_SUBJECT", "ENTRY", "ENTRY_SIZE", "RealtimeSettings", "RealtimeStore", "RecoveryReport",
           "RetentionReport", "RetentionWork", "START_EARLIEST", "START_LATEST", "tags_mask"]

log = logging.getLogger("hourglass.realtime.store")


class RealtimeStore:
    """See module docstring. Synchronous, not thread-safe."""

    def __init__(self, root: Path, settings: RealtimeSettings, *, bump_epoch: bool) -> None:
        """Open the files and build the parts; no replay (``open`` recovers next)."""
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
        self._offsets, self._group_docs = OffsetsLog.open(root / "groups",
                                                          compact_bytes=settings.offsets_compact_bytes)
        self._ckpt_path = root / "checkpoint"
        self._gate = DocGate()
        ck = checkpoint.read(self._ckpt_path) or {}
        self.epoch = int(ck.get("epoch", 0)) + (1 if bump_epoch else 0)
        start, end = self.messages.start_offset, self.messages.end_offset
        self.indexed_offset = min(max(int(ck.get("indexed_offset", start)), start), end)
        self._dedup_offset = min(max(int(ck.get("dedup_offset", start)), start), end)
        self._ckpt_saved: dict | None = None
        self.counters = {"appended": 0, "duplicates": 0, "delivered": 0, "redelivered": 0, "acked": 0,
                         "dedup_evicted_early": 0, "skipped_by_tag": 0, "skipped_other_group_retry": 0,
                         "reindexed": 0, "frame_cache_misses": 0,
                         "groups_idled": 0, "groups_resumed": 0, "resumed_skipped_messages": 0,
                         "segments_deleted": 0, "index_compactions": 0, "checkpoint_index_deferred": 0}
        self._indexed_upto = end  # every message below it has its index entry written (after recovery)
        self.recovery = RecoveryReport()

        self._indexes = IndexFiles(root / "index", self.messages, open_max=settings.index_files_open_max)
        self._frames = FrameCache(self.messages, bytes_max=settings.frame_cache_bytes_max, counters=self.counters)
        self._dedup = DedupWindow(window_ms=settings.dedup_window_ms, entries_max=settings.dedup_entries_max)
        self._journal, owners = SubjectsJournal.open(root)
        self._subjects = SubjectRegistry(root, self._journal, owners, self._indexes, settings)
        self._groups = ConsumerGroups(self._offsets, settings, self.counters)
        self._delivery = Delivery(self._indexes, self._groups, self._frames, settings, self.counters)
        self._appender = Appender(self.messages, self._indexes, self._dedup, self._frames, self._subjects, settings,
                                  self.counters, frame_bytes_max=self.frame_bytes_max, root=root)
        self._retainer = Retainer(self.messages, self._indexes, self._groups, self._frames, settings, self.counters)

    @classmethod
    def open(cls, root: str | os.PathLike, settings: RealtimeSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True) -> "RealtimeStore":
        """Open the data folder, recover it (``store.recovery`` says what was found and done)
        and flush what recovery wrote."""
        st = cls(Path(root), settings or RealtimeSettings(), bump_epoch=bump_epoch)
        try:
            st._save_checkpoint(st.indexed_offset, st._dedup_offset)  # the epoch is durable before any seq uses it
            st.recovery = st._recover(now_ms)
            st.flush()
        except BaseException:
            st._abandon()
            raise
        return st

    def _recover(self, now_ms: int) -> RecoveryReport:
        """``recovery.recover``, then the seq counter stays above every seq in the log."""
        report = recover(messages=self.messages, indexes=self._indexes, registry=self._subjects,
                         groups=self._groups, group_docs=self._group_docs, dedup=self._dedup, frames=self._frames,
                         settings=self.settings, indexed_offset=self.indexed_offset,
                         dedup_offset=self._dedup_offset, now_ms=now_ms)
        self._group_docs = {}
        self.counters["reindexed"] += report.entries_reindexed
        last_seq = report.last_seq
        if last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT > self.epoch:
            # a replica's log holds seqs of its masters' epochs: stay above all of them
            self.epoch = (last_seq >> SEQ_EPOCH_SHIFT) + 1
            self._save_checkpoint(self.indexed_offset, self._dedup_offset)
        elif last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT == self.epoch:
            self._appender.counter = (last_seq & SEQ_COUNTER_MAX) + 1  # bump_epoch=False: never reuse a seq
        self._indexed_upto = self.messages.end_offset
        return report

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._indexes.close_all()
        self._offsets.close()
        self.messages.close()
        self._journal.close()
        self._gate.close()
        self._closed = True

    def _abandon(self) -> None:
        """Give descriptors and the offsets writer back without flushing (a failed open, a
        store dropped without ``close``); the message log's own ``__del__`` closes its files."""
        self._closed = True
        for name, release in (("_indexes", IndexFiles.abandon), ("_offsets", OffsetsLog.abandon),
                              ("_journal", SubjectsJournal.close)):
            part = getattr(self, name, None)  # None: __init__ failed before opening it
            if part is not None:
                release(part)

    def __del__(self) -> None:
        # a safety net, not a way to close: a store dropped without close() (a crash
        # simulation in tests) is said out loud and gives its descriptors back, unflushed
        if getattr(self, "_closed", True):
            return
        log.warning("real-time store dropped without close(): nothing flushed path=%s", self.root)
        self._abandon()

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("real-time store is closed")

    @property
    def group_seq(self) -> int:
        """Every group commit gets one (replication: ``changed_groups``)."""
        return self._groups.seq

    @property
    def subject_order(self) -> list[str]:
        """Subjects in creation order (replicas get owners in it)."""
        return self._subjects.order

    @property
    def held_next_ms(self) -> int | None:
        """After a pull: when the first entry it held back becomes visible (None: none held)."""
        return self._delivery.held_next_ms

    # ------------------------------------------------------------------ subjects (node/realtime/subjects.py)

    def create_subject(self, subject: str, *, owner: str = "", now_ms: int = 0) -> bool:
        """Register a subject; True if it is new. ``InvalidArgument`` for a bad name,
        ``Overloaded`` past ``subjects_max``."""
        return bool(self.create_subjects([subject], owner=owner, now_ms=now_ms))

    def create_subjects(self, subjects: Sequence[str], *, owner: str = "", now_ms: int = 0) -> list[str]:
        """Register subjects as one round on this thread (one index-folder fsync, one journal
        record); returns the new ones. Raises the first refusal (nothing is created then)."""
        self._check_open()
        for s in subjects:
            self._subjects.check(s)
        new = self.missing_subjects(subjects)
        if new:
            self._subjects.create_now([(s, owner) for s in new], now_ms=now_ms)
        return new

    def missing_subjects(self, subjects: Iterable[str]) -> list[str]:
        """The distinct names of ``subjects`` not known yet, in order (names not checked)."""
        return self._subjects.missing(subjects)

    def subjects_plan(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> SubjectWork:
        """Plan one creation round of ``(subject, owner)`` pairs (``SubjectRegistry.plan``);
        ``work.run`` then runs on any thread, ``subjects_finish`` on this one."""
        self._check_open()
        return self._subjects.plan(items, now_ms=now_ms)

    def subjects_finish(self, work: SubjectWork) -> None:
        """After ``work.run``: the round's subjects are known (names given back if it failed)."""
        self._subjects.finish(work, closed=self._closed)

    def subjects_abandon(self, work: SubjectWork) -> None:
        """A planned round that will not run: its names are free again."""
        self._subjects.abandon(work)

    def subjects(self) -> list[str]:
        return sorted(self._indexes.by_subject)

    def subject_owner(self, subject: str) -> str | None:
        """Who created the subject ("" not known; None: no such subject)."""
        return self._subjects.owner(subject)

    def subject_owners(self, first: int, count_max: int) -> list[tuple[str, str]]:
        """``(subject, owner)`` of subjects ``[first, first + count_max)`` in creation order."""
        return self._subjects.owners_from(first, count_max)

    def adopt_owners(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> None:
        """A replica takes its master's subjects and owners (``SubjectRegistry.adopt_owners``)."""
        self._check_open()
        self._subjects.adopt_owners(items, now_ms=now_ms)

    def owned_counts(self) -> dict[str, int]:
        """Subjects per owner (owners not known, "", are left out)."""
        return self._subjects.owned_counts()

    # ------------------------------------------------------------------ append

    def append(self, batch: Batch, *, now_ms: int,
               refused_subjects: dict[str, HourglassError] | None = None) -> BatchResult:
        """Store a batch; one answer per message (see module docstring, step 1; ``append.py``).

        A refused message changes nothing; the others go on. ``InvalidArgument`` for the
        whole call when the batch has more than ``batch_messages_max`` messages or more
        bytes than one frame holds. ``refused_subjects``: subjects the caller would not
        create (a quota), whose messages are refused with that error instead.
        """
        self._check_open()
        contiguous = self._indexed_upto == self.messages.end_offset  # else replay repairs a failed index write
        res = self._appender.append(batch, epoch=self.epoch, now_ms=now_ms, refused_subjects=refused_subjects or {})
        if contiguous:
            self._indexed_upto = self.messages.end_offset
        return res

    @property
    def appended_visible_ms(self) -> int:
        """After an append: when its first message becomes visible."""
        return self._appender.appended_visible_ms

    def write_bytes_bound(self, batch: Batch) -> int:
        """Disk bytes that ``append(batch)`` takes at most (``accept.write_bytes_bound``)."""
        return write_bytes_bound(batch)

    # ------------------------------------------------------------------ durability

    def flush(self, *, groups: bool = True, index_bytes_min: int = 0) -> None:
        """fsync the message log; then, once at least ``index_bytes_min`` log bytes were
        indexed since the last checkpoint (they only bound the replay at ``open``), the dirty
        indexes and the checkpoint; with ``groups``, commit changed group documents (and wait)."""
        self.flush_plan(index_bytes_min=index_bytes_min).run_and_finish()
        if groups:
            items = self.snapshot_groups(self.dirty_groups())
            if items:
                self.write_groups_async(items).result()

    def flush_key(self) -> tuple:
        """What a periodic flush writes: equal keys mean it would fsync nothing new (issue 28)."""
        return (self.epoch, self.messages.end_offset, self._indexed_upto, self.indexed_offset,
                bool(self._groups.dirty), any(ix.dirty for ix in self._indexes.by_subject.values()),
                self._groups.seq)

    def flush_plan(self, *, index_bytes_min: int = 0, fsyncs_max: int | None = None) -> SyncPlan:
        """``flush(groups=False)`` as a plan to ``run`` on a worker thread and ``finish`` on
        the loop: the checkpoint document is taken now and vouches only for index entries
        written before the plan's fsyncs. ``fsyncs_max``: index files and folders this
        checkpoint fsyncs at most (``IndexFiles.plan_sync``); None: all of them."""
        self._check_open()
        plan = SyncPlan()
        indexed = self._indexed_upto  # every message below it has its index entry written
        self.messages.plan_flush(plan)
        if indexed - self.indexed_offset >= index_bytes_min:
            left = self._indexes.plan_sync(plan, indexed, fsyncs_max)
            if left < indexed:
                self.counters["checkpoint_index_deferred"] += 1
            # never below the previous checkpoint: every entry below it was synced then
            indexed = max(left, self.indexed_offset)
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

    def _save_checkpoint(self, indexed: int, dedup_offset: int) -> None:
        doc = {"epoch": self.epoch, "indexed_offset": indexed, "dedup_offset": dedup_offset}
        if doc != self._ckpt_saved:
            plan = SyncPlan()
            plan.write_doc(self._gate, self._ckpt_path, doc)
            plan.run()
            self._ckpt_saved = doc
        self.indexed_offset = indexed

    # ------------------------------------------------------------------ group documents (node/realtime/groups.py)

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

    def dirty_groups(self) -> list[tuple[str, str]]:
        """Groups whose position changed since their document was last taken."""
        return self._groups.dirty_keys()

    def snapshot_groups(self, keys: Iterable[tuple[str, str]]) -> list[tuple[Group, dict]]:
        """Documents of the given groups that changed since they were last written."""
        return self._groups.snapshot(keys)

    def write_groups_async(self, items: list[tuple[Group, dict]]) -> Future:
        """Commit group documents as one offsets-log record (records in submission order); the
        in-memory state moves at once, the future completes when the record is fsynced."""
        return self._groups.write_async(items)

    def unpersist_groups(self, items: list[tuple[Group, dict]]) -> None:
        """A ``write_groups_async`` failed (or its outcome is unknown): the groups are dirty again."""
        self._groups.unpersist(items)

    # ------------------------------------------------------------------ consume (node/realtime/consume.py)

    def pull(self, subjects: Sequence[str], group: str, consumer_id: str, *, max_messages: int,
             tags: Sequence[str] = (), now_ms: int, start: str = START_EARLIEST,
             horizon_ms: int | None = None) -> tuple[Batch, np.ndarray]:
        """Up to ``max_messages`` messages of ``subjects`` for one consumer of ``group``, as
        ``(batch, handles)`` (``node/realtime/consume.py``, step 1).

        ``consumer_id`` only names the caller (handles belong to the group). ``start`` applies
        to a group seen for the first time. ``horizon_ms`` (at or after ``now_ms``): entries
        visible by then are handed out too (a lookahead pull: the client holds them until due). ``Overloaded`` when nothing can be handed out
        because a group's in-flight set is full while its subject has more entries.
        """
        self._check_open()
        if isinstance(subjects, str):
            subjects = [subjects]
        return self._delivery.pull(list(dict.fromkeys(subjects)), group, max_messages=max_messages, tags=tags,
                                   now_ms=now_ms, start=start, horizon_ms=horizon_ms)

    def pull_ahead(self, subjects: Sequence[str], group: str, consumer_id: str, *, max_messages: int,
                   tags: Sequence[str] = (), now_ms: int, lookahead_ms: int) -> tuple[Batch, np.ndarray]:
        """A lookahead pull's take (``lookahead_ms`` > 0; docs/api.md "Lookahead"): nothing until
        something is visible within a third of the lookahead, then everything visible within all
        of it (about two thirds of it per answer). Taking within the whole lookahead as soon as
        anything is there would answer every pull at once with the little that came within it
        since the last one when this node holds messages further ahead than the lookahead (the
        delay nodes' ``dispatch_lead_ms``): pulls at the consumer's pace instead of the
        messages'. One pass over the subjects (``gate_ms``): what is visible within the whole
        lookahead is read once, and handed out only if one of it is within the third.
        ``held_next_ms`` is left for the caller's wait, as by ``pull``."""
        self._check_open()
        if isinstance(subjects, str):
            subjects = [subjects]
        return self._delivery.pull(list(dict.fromkeys(subjects)), group, max_messages=max_messages, tags=tags,
                                   now_ms=now_ms, start=START_EARLIEST, horizon_ms=now_ms + lookahead_ms,
                                   gate_ms=now_ms + lookahead_ms // 3)

    def ack(self, subject: str, group: str, ranges, *, now_ms: int) -> int:
        """Drop handle ranges ``[lo, hi)`` from the group's in-flight set; returns how many
        handles were in flight (committed by ``persist_group``, ``write_groups_async``, ``flush``)."""
        self._check_open()
        ix = self._indexes.index(subject)
        g = self._groups.get(subject, group)
        if g is None:
            return 0
        return self._delivery.ack_pairs(g, ix, as_pairs(ranges), now_ms)

    def ack_many(self, group: str, items: Sequence[tuple[str, bytes]], *, now_ms: int) -> int:
        """``ack`` of several subjects' packed ranges (u64 LE ``[lo, hi)`` pairs per subject),
        decoded and checked as one array: ``InvalidArgument`` (nothing acked) for a malformed one."""
        self._check_open()
        if not items:
            return 0
        return self._delivery.ack_many(group, items, now_ms)

    def nack(self, subject: str, group: str, ranges, *, now_ms: int) -> tuple[Batch, np.ndarray]:
        """The in-flight messages of handle ranges (others ignored) as ``(batch, handles)``, their
        deadline restarted; the caller acks them once the retry copy (or dead letter) is stored."""
        self._check_open()
        return self._delivery.nack(subject, group, ranges, now_ms)

    def browse(self, subject: str, group: str, *, from_position: int, max_messages: int):
        """What ``group`` has not acked, read without consuming (``node/realtime/browse.py``)."""
        self._check_open()
        return browse(self._indexes, self._groups, self._delivery, subject, group, from_position=from_position,
                      max_messages=max_messages, scan_max=self.settings.pull_scan_entries_max)

    def lookup(self, subject: str, msg_id: str, *, around_ms: int = 0) -> Found:
        """Where ``msg_id`` is in ``subject`` and each group's state of it (``node/realtime/lookup.py``)."""
        self._check_open()
        return lookup(self._indexes, self._frames, self._groups, self._dedup, subject, msg_id, around_ms=around_ms,
                      scan_max=min(SCAN_ENTRIES_MAX, self.settings.pull_scan_entries_max))

    def group_rows(self, rows_max: int) -> tuple[list[dict], int]:
        """Per (subject, group): backlog, lag, in flight, redelivered (``node/realtime/group_status.py``)."""
        return group_rows(self._groups.by_key.values(), {s: ix.count for s, ix in self._indexes.by_subject.items()},
                          rows_max=rows_max)

    def lag(self, subject: str, group: str) -> int:
        """Entries of the subject this group has not acked (a group not seen yet: all of them)."""
        ix = self._indexes.index(subject)
        g = self._groups.get(subject, group)
        return ix.count if g is None else ix.count - g.next_pos + len(g.inflight)

    def unacked(self, subject: str) -> tuple[int | None, dict[str, tuple[int, bool]]]:
        """``(entries in the subject's index or None when unknown here, {consumer group:
        (unacked entries, idle)})``: what a drain waits for (``node/realtime/fence.py``)."""
        ix = self._indexes.by_subject.get(subject)
        if ix is None:
            return None, {}
        return ix.count, {name: (ix.count - g.next_pos + len(g.inflight), bool(g.idle))
                          for (s, name), g in self._groups.by_key.items() if s == subject}

    def committed(self, subject: str, group: str) -> int:
        """The group's lowest unacked position (0 for a group not seen yet)."""
        self._indexes.index(subject)
        g = self._groups.get(subject, group)
        return 0 if g is None else g.committed()

    def groups(self, subject: str) -> list[str]:
        self._indexes.index(subject)
        return self._groups.names(subject)

    # ------------------------------------------------------------------ retention (node/realtime/retention_work.py)

    def retention_plan(self, *, now_ms: int, slave_holds: dict[str, int] | None = None
                       ) -> tuple[RetentionWork, RetentionReport]:
        """Decide (``retention.decide``) and detach, on the caller's thread; the returned work
        runs on a worker thread (``RetentionWork.run``), then ``retention_finish`` on this one."""
        self._check_open()
        self._dedup.expire(now_ms)
        return self._retainer.plan(now_ms=now_ms, dedup_offset=self._dedup.oldest_offset(),
                                   indexed_offset=self.indexed_offset, slave_holds=slave_holds)

    def retention_finish(self, work: RetentionWork) -> None:
        """On the store's thread, after ``work.run``: swap compacted index files in."""
        self._retainer.finish(work, closed=self._closed, indexed_offset=self.indexed_offset)

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
        replay = index_frames(self.messages, self._indexes, self._dedup, self._subjects, self.settings, start,
                              start, now_ms)
        if replay.dedup_dropped:
            log.warning("dedup map full path=%s dedup_entries_max=%d entries_dropped=%d",
                        self.root, self.settings.dedup_entries_max, replay.dedup_dropped)
        self._indexed_upto = self.messages.end_offset
        self.counters["reindexed"] += replay.reindexed
        return replay.reindexed

    def truncate_log(self, cut: int) -> int:
        """Drop a divergent suffix of the message log (frames a new master never had): the
        log, the index entries pointing at or past ``cut``, their dedup entries and cached
        frames; groups are clamped to what their indexes still hold. Returns bytes dropped."""
        self._check_open()
        if cut >= self.messages.end_offset:
            return 0
        self._retainer.truncated()  # index compactions planned before this cut are abandoned
        for subject, keep in self._indexes.truncate(cut).items():
            self._groups.clamp(subject, keep)
        self._dedup.truncate(cut)
        self._frames.forget_from(cut)
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
        return self._groups.changed(since_seq)

    def group_doc(self, subject: str, group: str) -> dict | None:
        """The group's document as last committed to the offsets log (what a replica must hold)."""
        g = self._groups.get(subject, group)
        return None if g is None else g.persisted

    def group_written_seq(self, subject: str, group: str) -> int:
        """``group_seq`` of the group's last commit (0 if never committed by this store)."""
        return self._groups.changes.get((subject, group), 0)

    def apply_group_doc(self, doc: dict) -> None:
        """``apply_group_docs`` of one document."""
        self.apply_group_docs([doc])

    def apply_group_docs(self, docs: Sequence[dict]) -> None:
        """A replica takes its master's group documents: committed as given, as one record
        (so they survive a promotion), before the in-memory groups follow them."""
        self._check_open()
        self.create_subjects([doc["subject"] for doc in docs])  # one round for the ones not seen yet
        self._groups.apply_docs(docs, self._indexes.by_subject)
