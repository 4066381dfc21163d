"""DelayStore: the delay node's storage engine, message log to dispatch log, batch by batch.

Owns a data folder::

    {root}/messages/   SegmentedLog (WAL): one frame per accepted batch (a ``cluster.codec.Batch``)
    {root}/schedule/   ScheduleLog: one frame per (batch, due second), per-second frame chains
    {root}/ids/        IdIndex: message id hash -> schedule frame holding it
    {root}/dispatch/   SegmentedLog of ``DispatchBatch`` records (one per delivered group)
    {root}/checkpoint  epoch, iterate offset, tick state (atomic JSON)

The unit of work is the batch (``shared/ARCHITECTURE.md``, "Hot path"). Every step
takes ``now_ms`` from the caller; no rule here reads a clock (``promote`` times its steps
for its log line, and the bucket healer, node/delay/heal.py, paces itself by the monotonic
clock), and no step makes a
Python object per message: per-message work is numpy, ``bytes.join`` or one
comprehension over a hash function.

1. ``accept(batch)`` validates the whole batch with numpy, hashes its ids (xxh3,
   one pass over the C function), finds possible duplicates with one vectorised probe
   of the id index plus the not-yet-filed map, gives the new records contiguous seqs
   ``(epoch << 40) | counter`` and appends them as **one frame**. The caller makes it
   durable (a ``GroupCommitter``) before acknowledging. The decoded batch and its id
   hashes stay in memory until filed (``unfiled_max`` records at most).
2. ``iterate`` files durable batches: one schedule frame per due second (from the
   batch in memory, no re-read and no re-decode), one id-index write per batch, and
   offers each new frame to the wheel as one chunk.
3. ``poll_due`` loads seconds into the wheel ahead of time (one read per frame, or
   none: recently filed frames are cached) and returns what is due as **one batch**
   (an in-flight *unit*). ``ack_dispatched(unit, idx)`` appends one dispatch record
   for the delivered part; ``release(unit, idx)`` gives a part back to the wheel.
4. ``checkpoint`` flushes schedule, ids and dispatch log, then records the iterate
   offset and the tick state.

Invariants that make restart exact (unchanged from the per-message design):

* ``completed_ms``: every message whose effective due time is before it has been
  dispatched (it is in a dispatch record). It is ``min(wheel cursor, effective time of
  anything in flight)`` rounded down to a tick, and it steps back when a message is
  filed behind it (never below the persisted value, which a filed message's time never is).
* A message is filed under ``effective_ms = max(deliver_at_ms, persisted completed_ms)``,
  so a restart that reloads seconds from the persisted ``completed_ms`` sees every
  undispatched message.
* ``dispatch_offset`` in the tick state is the offset of the first dispatch record
  holding a message whose effective time is ``>= completed_ms``: after a restart the
  records from there on name the messages already delivered in the reloaded seconds.
* Replaying the message log after a crash skips what each bucket already holds
  (per-bucket seq high-water mark) and what the id index already holds.
"""

from __future__ import annotations

import logging
import os
import struct
import time  # promote() step timings only: no rule here reads a clock
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.codec import COLUMN_BYTES, KIND_CANCEL, KIND_MESSAGE, OUTCOME_DEAD_LETTER, OUTCOME_OK, Batch, DispatchBatch
from cluster.errors import NotFound, Overloaded, TooLate
from cluster.files import DATA_DIR_MODE, remove_leftover_temps
from cluster.wire import BatchResult
from node.delay.heal import BucketHealer, id_entries
from node.store import checkpoint, records
from node.store.diskspace import FILE_BLOCK_BYTES
from node.store.idindex import ENTRY_SIZE as ID_ENTRY_SIZE
from node.store.idindex import IdIndex, IdLocation, key_hash, key_hashes
from node.store.log import HEADER_SIZE as LOG_HEADER_SIZE
from node.store.log import SegmentedLog
from node.store.records import BATCH_HEADER_SIZE, SEQ_COUNTER_MAX, SEQ_EPOCH_SHIFT, Message
from node.store.schedule import ENTRY_SIZE as SCHEDULE_ENTRY_SIZE
from node.store.schedule import FILE_SORTED_RUNS_MAX, HEADS_HEADER_SIZE, FrameRef, ScheduleLog
from node.store.settings import StoreSettings
from node.store.syncplan import DocGate, SyncPlan
from node.wheel import Chunk, TickState, TimingWheel

log = logging.getLogger("hourglass.delay.store")

ALREADY_EXISTS = 4  # hourglass.v1.Code
LOAD_STEP_FRAMES = 64  # filed frames merged per poll while a second is loaded (_load_seconds)
LOAD_RESTARTS_MAX = 2  # second loads started over (bucket rebuilt meanwhile) in one poll at most
DISPATCHED_PRUNE_STEP = 4096  # delivered seqs forgotten per dispatch record at most (_prune_dispatched)


@dataclass(frozen=True, slots=True)
class LookupResult:
    status: str  # "pending" | "cancelled" | "dispatched" | "in_flight"
    msg_id: str
    seq: int
    deliver_at_ms: int
    subject: str


@dataclass(frozen=True, slots=True)
class Retired:
    """What ``_find`` answers for an id whose bucket retention deleted (delivered or
    cancelled; ``seq`` from the id index)."""

    seq: int


@dataclass(slots=True)
class _SecondLoad:
    """A second being loaded into the wheel a few frames at a time (``_load_seconds``)."""

    second: int
    rebuilds: int                       # ScheduleLog.rebuilds when its chain was walked
    head: int                           # the chain's newest entry then: later ones are taken at the end
    todo: list[tuple[int, int, int]]    # (entry, data_offset, frame_size) not merged yet, oldest first
    parts: list[Batch] = field(default_factory=list)
    cancels: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DueBatch:
    """Messages to dispatch now: one in-flight unit (``batch.effective_ms`` = schedule time)."""

    unit: int
    batch: Batch


@dataclass(slots=True)
class _Unit:
    batch: Batch
    live: np.ndarray  # bool: not yet acknowledged or released


@dataclass(frozen=True, slots=True)
class _Unfiled:
    offset: int
    end: int
    batch: Batch
    hashes: np.ndarray


def _same_content(a: Message, b: Message) -> bool:
    """A re-send of the same message: same content and the same due time, absolute or
    relative (a retry of ``delay_ms=d`` arrives later, so its absolute time moved by exactly
    the time between the two arrivals)."""
    if (a.subject, a.payload, a.tags, a.properties) != (b.subject, b.payload, b.tags, b.properties):
        return False
    return a.deliver_at_ms == b.deliver_at_ms or a.deliver_at_ms - a.store_ms == b.deliver_at_ms - b.store_ms


def _split_frames(batch: Batch, bytes_max: int) -> list[Batch]:
    """Cut a batch so that no frame's payload bytes exceed ``bytes_max`` (one message may)."""
    if len(batch.payloads) <= bytes_max:
        return [batch]
    ends = batch.payload_end.astype(np.int64)
    out, start = [], 0
    while start < batch.n:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + bytes_max, side="right"))
        stop = max(stop, start + 1)
        out.append(batch.take(slice(start, stop)))
        start = stop
    return out


# the disk watermark's bound of a write (``DelayStore.write_bytes_bound``)
FILES_PER_WRITE = 8       # message segment (and a new one), schedule data segment, index and heads, id file
FILES_PER_BUCKET = 4      # a new schedule bucket: its folder, data segment, index and heads files
BUCKETS_LOOKED_UP_MAX = 64  # a batch due in more buckets than this counts every one of them as new


REFILED_MAX = 1_000_000  # records filed below the high-water marks after cuts, remembered by id (refiled.json)


class DelayStore:
    def __init__(self, root: Path, settings: StoreSettings, now_ms: int, *, bump_epoch: bool = True,
                 follower: bool = False) -> None:
        self.root = root
        self.settings = settings
        root.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        remove_leftover_temps(root)  # a checkpoint write a crash cut short (cluster/files.py)
        self.messages = SegmentedLog.open(root / "messages", segment_bytes_max=settings.message_segment_bytes)
        self.dispatch = SegmentedLog.open(root / "dispatch", segment_bytes_max=settings.dispatch_segment_bytes)
        self.schedule = ScheduleLog(root / "schedule", bucket_ms=settings.bucket_ms,
                                    data_segment_bytes=settings.schedule_segment_bytes,
                                    cache_bytes_max=settings.schedule_cache_bytes_max)
        # derived from the schedule log: a file with a corrupt header is rebuilt from it
        self.ids = IdIndex.open(root / "ids", slots_count=settings.id_slots, entries_max=settings.id_entries_max,
                                rebuild=lambda lo, hi: id_entries(self.schedule, lo, hi))
        self._ckpt_path = root / "checkpoint"
        self._gate = DocGate()
        ck = checkpoint.read(self._ckpt_path) or {}
        self.epoch = int(ck.get("epoch", 0)) + (1 if bump_epoch else 0)
        self._counter = 0
        self.iterate_offset = int(ck.get("iterate_offset", self.messages.start_offset))
        if self.iterate_offset > self.messages.end_offset:
            log.warning("iterate offset past log end path=%s iterate_offset=%d end=%d",
                        self.messages.directory, self.iterate_offset, self.messages.end_offset)
            self.iterate_offset = self.messages.end_offset
        elif not self.messages.is_boundary(max(self.iterate_offset, self.messages.start_offset)):
            # a checkpoint taken before a cut, the range since filled by another term's bytes:
            # file from the record that holds it (records filed before are not filed twice)
            back = self.messages.boundary_at_or_before(self.iterate_offset)
            log.warning("iterate offset %d is not a record boundary here; filing from %d", self.iterate_offset, back)
            self.iterate_offset = back
        self.durable_offset = self.messages.end_offset  # recovered bytes are what survived
        self._restore_tick_state(ck, now_ms)
        self._units: dict[int, _Unit] = {}
        self._loading: _SecondLoad | None = None  # a second being loaded into the wheel
        self._unit_counter = 0
        self._inflight_count = 0
        self._unfiled: deque[_Unfiled] = deque()
        self._unfiled_count = 0
        self._unfiled_cancels: set[int] = set()  # seqs cancelled whose tombstones are not filed yet
        self.counters = {"accepted": 0, "duplicates": 0, "filed": 0, "dispatched": 0, "cancelled": 0,
                         "dead_lettered": 0}
        self._voided_path = root / "voided.json"
        vdoc = checkpoint.read(self._voided_path) or {}
        self.voided: list[tuple[int, int]] = [tuple(r) for r in vdoc.get("ranges", [])]
        # the largest seq a truncation ever cut: filing's high-water marks (per bucket, id index)
        # assume seqs grow along the log, which a cut and a refetch can break (the new master's
        # suffix may hold an older term's records after this log filed a newer term's). Records
        # at or below it are checked one by one instead (``_file``).
        self.refile_seq_max: int = int(vdoc.get("refile_seq_max", max((hi - 1 for _, hi in self.voided), default=-1)))
        # records filed that way cannot go into the id index (its seqs only grow): id -> location
        self._refiled_path = root / "refiled.json"
        self.refiled: dict[str, IdLocation] = {
            k: IdLocation(*v) for k, v in ((checkpoint.read(self._refiled_path) or {}).get("ids", {})).items()}
        self.wheel_changed = False  # set when a filed message entered the wheel (the shell wakes its loop)
        # follower (slave) mode: the master's checkpoint, replicated (see follow())
        self.follower = follower
        self.replicated: dict | None = ck.get("replicated") if follower else None
        if self.replicated is not None:
            mark = int(self.replicated.get("iterate_offset", 0))
            if mark > self.messages.end_offset or not self.messages.is_boundary(mark):
                # not where a record of this log starts (a document persisted before the
                # seed-8 fix): file no further than this replica's own filed offset until the
                # master's next document
                log.warning("replicated iterate offset %d is not a record boundary here; using %d",
                            mark, self.iterate_offset)
                self.replicated["iterate_offset"] = self.iterate_offset
        self._pending: dict[int, int] = {}  # counted below; a rebuild meanwhile counts its bucket
        # derived data heals itself (node/delay/heal.py): a schedule bucket failing a check is
        # rebuilt from the message log; the ones the wheel loads first are checked before serving
        self.healer = BucketHealer(self)
        self.healer.counters["id_files_rebuilt"] = len(self.ids.rebuilt_files)
        self.schedule.healer = self.healer.rebuild
        self.healer.check_soon(ahead_ms=settings.verify_ahead_ms)
        self._pending = self._count_pending()
        self._save_checkpoint()  # the new epoch is durable before any seq of it is used
        self.iterate(limit=None)  # replay: file everything the crash left unfiled
        if not follower:
            self._bump_past_filed_seqs()

    def _restore_tick_state(self, ck: dict, now_ms: int) -> None:
        """Wheel, completed_ms and the delivered-seq map from a checkpoint document (at open,
        and at a promotion from the master's replicated tick state)."""
        settings = self.settings
        if "completed_ms" in ck:
            self.completed_ms = int(ck["completed_ms"])
            dispatch_offset = max(int(ck["dispatch_offset"]), self.dispatch.start_offset)
            if not self.dispatch.is_boundary(min(dispatch_offset, self.dispatch.end_offset)):
                # another term's offset inside this log's own divergent dispatch suffix, not cut
                # yet (chaos meta-pause seed 28: a promotion failed on "header checksum
                # mismatch"): start at the record before it. Its records name messages this
                # member delivered itself, so reading more of them loses nothing
                back = self.dispatch.boundary_at_or_before(dispatch_offset)
                log.warning("dispatch offset %d is not a record boundary here; reading from %d",
                            dispatch_offset, back)
                dispatch_offset = back
            state = TickState(self.epoch, self.completed_ms // settings.tick_ms - 1, 0, dispatch_offset)
            self.wheel = TimingWheel.restore(state, tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                             entries_max=settings.wheel_entries_max)
        else:
            self.completed_ms = now_ms - now_ms % settings.tick_ms
            dispatch_offset = self.dispatch.end_offset
            self.wheel = TimingWheel(tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                     start_ms=self.completed_ms, entries_max=settings.wheel_entries_max)
        self.wheel.epoch = self.epoch
        # the last checkpoint known durable: retention deletes only what it covers
        self.persisted_doc: dict = {k: ck[k] for k in ("iterate_offset", "completed_ms", "dispatch_offset") if k in ck}
        self._restored_completed_ms = self.completed_ms
        self.persisted_completed_ms = self.completed_ms
        # messages delivered at or after completed_ms (reloaded seconds must skip them)
        self._dispatched: dict[int, int] = {}
        self._dispatched_eff_max = -1  # largest effective time in _dispatched
        # the seqs put into _dispatched, per dispatch record, in order: (max effective_ms, seqs),
        # so that entries below the floor leave a few records at a time (_prune_dispatched)
        self._dispatched_added: deque[tuple[int, list[int]]] = deque()
        self._dispatch_trail: deque[tuple[int, int]] = deque()  # (max effective_ms, offset) per record
        if dispatch_offset < self.dispatch.end_offset:
            for off, body in self.dispatch.iterate(dispatch_offset):
                d = DispatchBatch.decode(body)
                self._note_dispatched(d.seq, d.effective_ms)
                if d.n:
                    self._dispatched_eff_max = max(self._dispatched_eff_max, int(d.effective_ms.max()))
                self._dispatch_trail.append((int(d.effective_ms.max()) if d.n else 0, off))

    def _bump_past_filed_seqs(self) -> None:
        """A promoted slave holds records of the old master's epochs: never reuse their seqs."""
        last = self.ids.last_seq()
        if last >= 0 and (last >> SEQ_EPOCH_SHIFT) >= self.epoch:
            self.epoch = (last >> SEQ_EPOCH_SHIFT) + 1
            self.wheel.epoch = self.epoch
            self._save_checkpoint()

    @classmethod
    def open(cls, root: str | os.PathLike, settings: StoreSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True, follower: bool = False) -> "DelayStore":
        """``follower``: open as a slave (files only what the master's checkpoint covers,
        keeps no wheel); ``promote`` turns it into the master in place."""
        return cls(Path(root), settings or StoreSettings(), now_ms, bump_epoch=bump_epoch, follower=follower)

    # ------------------------------------------------------------------ pending counts (metrics)

    def _count_pending(self) -> dict[int, int]:
        """Messages filed and not dispatched nor cancelled, by bucket start, from the
        schedule index (one read per bucket, counts per frame)."""
        out: dict[int, int] = {}
        c = self.completed_ms
        for start in self.schedule.bucket_starts():
            if start + self.settings.bucket_ms <= c:
                continue
            n = self._filed_pending(start, c)
            if n is not None:
                out[start] = n
        for eff in self._dispatched.values():
            if eff >= c:
                b = self.schedule.bucket_start(eff)
                out[b] = out.get(b, 0) - 1
        return {b: n for b, n in out.items() if n > 0}

    def _filed_pending(self, start: int, c: int) -> int | None:
        """Messages minus tombstones filed in bucket ``start`` and due at or after ``c`` (None:
        no such bucket): whole seconds after ``c``'s from the index, ``c``'s own second exactly."""
        b = self.schedule.bucket(start, create=False)
        if b is None:
            return None
        e = b.entries_array()
        n = 0
        if start < c:  # the current bucket: whole seconds after completed_ms's, its own second exactly
            for ref in self.schedule.load_second(c // 1000):
                late = ref.batch.effective_ms >= c
                cancels = ref.batch.kind == KIND_CANCEL
                n += int(np.count_nonzero(late & ~cancels)) - int(np.count_nonzero(late & cancels))
            b = self.schedule.bucket(start, create=False)  # the load may have rebuilt it
            e = b.entries_array() if b is not None else e[:0]
            e = e[e["second"].astype(np.int64) * 1000 + start > c - c % 1000]
        return n + int(e["messages"].astype(np.int64).sum() - e["cancels"].astype(np.int64).sum())

    def _recount_pending(self, start: int) -> None:
        """The pending count of one bucket again (it was rebuilt: records may have gone or come back)."""
        c = self.completed_ms
        n = self._filed_pending(start, c) or 0
        end = start + self.settings.bucket_ms
        n -= sum(1 for eff in self._dispatched.values() if max(c, start) <= eff < end)
        if n > 0:
            self._pending[start] = n
        else:
            self._pending.pop(start, None)

    def _rebuilt(self, start: int, *, late: Batch | None, cancelled: np.ndarray | None) -> None:
        """Bucket ``start`` was rebuilt (node/delay/heal.py). ``late``: records a member gave
        back that the wheel passed while they were missing, filed again in the bucket (the
        filing rule) and handed to the wheel here (overdue: they fire at once); ``cancelled``:
        targets of tombstones the rebuild brought back, taken out of the wheel."""
        if not self.follower:
            if cancelled is not None and len(cancelled):
                self.wheel.cancel(cancelled)
            chunk = None if late is None else self._chunk(FrameRef(-1, -1, 0, late), reload=False,
                                                           cancelled=cancelled)
            if chunk is not None and self.wheel.add(chunk):
                self.wheel_changed = True
                low = int(chunk.due_ms.min())
                if low < self.completed_ms:  # as in _file: a checkpoint must not skip them
                    self.completed_ms = low - low % self.settings.tick_ms
        self._recount_pending(start)

    def pending_by_bucket(self) -> dict[int, int]:
        """Bucket start ms -> messages filed there and not yet dispatched or cancelled."""
        return {b: n for b, n in self._pending.items() if n > 0}

    def _pending_add(self, effective_ms: np.ndarray, sign: np.ndarray | int) -> None:
        if not len(effective_ms):
            return
        bms = self.settings.bucket_ms
        lo, hi = int(effective_ms.min()), int(effective_ms.max())
        if lo - lo % bms == hi - hi % bms:  # the usual case: one bucket
            items = [(lo - lo % bms, len(effective_ms) * sign if isinstance(sign, int) else int(np.sum(sign)))]
        else:
            starts = effective_ms - effective_ms % bms
            weights = np.broadcast_to(np.asarray(sign, np.int64), starts.shape)
            uniq, inv = np.unique(starts, return_inverse=True)
            items = zip(uniq.tolist(), np.bincount(inv, weights=weights).astype(np.int64).tolist())
        for b, n in items:
            v = self._pending.get(b, 0) + n
            if v > 0:
                self._pending[b] = v
            else:
                self._pending.pop(b, None)

    # ------------------------------------------------------------------ ingest

    def _next_seqs(self, k: int) -> np.ndarray:
        if self._counter + k - 1 > SEQ_COUNTER_MAX:
            raise Overloaded("sequence space of this epoch is exhausted; restart the node")
        base = records.make_seq(self.epoch, self._counter)
        self._counter += k
        return np.arange(base, base + k, dtype=np.uint64)

    def accept(self, batch: Batch | list[Message], *, now_ms: int) -> BatchResult:
        """Validate and append a batch; one answer per message in the returned arrays.

        A refused message changes nothing; the others go on. Not durable until the
        caller's group commit (or ``flush_messages``) covers ``messages.end_offset``."""
        if isinstance(batch, list):
            batch = records.batch_from_messages(batch)
        n = batch.n
        res = BatchResult.sized(n)
        if not n:
            return res
        if self._unfiled_count + n > self.settings.unfiled_max:
            raise Overloaded(f"{self._unfiled_count} messages wait to be filed (unfiled_max="
                             f"{self.settings.unfiled_max})")
        id_ends = batch.id_end.astype(np.int64)
        if bool((np.diff(id_ends, prepend=0) == 0).any()):  # ids the server makes (rare: the SDK names them)
            ids = [i or uuid.uuid4().hex for i in batch.id_list()]
            made = Batch.build(batch.subject_list(), batch.payload_list(), ids, batch.deliver_at_ms)
            batch = batch.replace(ids=made.ids, id_end=made.id_end)
        codes, reasons = batch.validate(now_ms=now_ms, limits=self.settings.limits)
        for i, reason in reasons.items():
            res.refuse(i, int(codes[i]), reason)
        ok = codes == 0
        id_bytes = batch.id_bytes_list()
        hashes = key_hashes(id_bytes)
        # an id twice in one batch: the first stands, the others are refused
        order = np.argsort(hashes, kind="stable")
        twice = np.zeros(n, bool)
        twice[order[1:][hashes[order][1:] == hashes[order][:-1]]] = True
        for i in np.flatnonzero(twice & ok).tolist():
            res.refuse(i, ALREADY_EXISTS, f"id {batch.id(i)!r} appears twice in one batch")
            ok[i] = False
        # ids seen before (candidates: the 8-byte hash may collide; confirmed on the record)
        cand = self.ids.probe(hashes, id_bytes)
        if self._unfiled:  # accepted and not filed yet (not in the id index): one isin, nothing per message
            cand |= np.isin(hashes, np.concatenate([u.hashes for u in self._unfiled]))
        with self.schedule.memo():
            self._confirm_duplicates(batch, np.flatnonzero(cand & ok), ok, res, now_ms)
        keep = np.flatnonzero(ok)
        if not len(keep):
            return res
        seqs = self._next_seqs(len(keep))
        stored = batch.take(keep)
        stored = stored.replace(seq=seqs, store_ms=now_ms, effective_ms=stored.deliver_at_ms)
        kept_hashes = hashes[keep]
        start = 0
        for part in _split_frames(stored, self.settings.frame_bytes_max):
            (off,) = self.messages.append([part.encode()])
            part_hashes = kept_hashes[start:start + part.n]
            start += part.n
            self._unfiled.append(_Unfiled(off, self.messages.end_offset, part, part_hashes))
        self._unfiled_count += len(keep)
        res.seqs[keep] = seqs
        res.deliver_at_ms[keep] = stored.deliver_at_ms
        self.counters["accepted"] += len(keep)
        return res

    def _confirm_duplicates(self, batch: Batch, which: np.ndarray, ok: np.ndarray, res: BatchResult,
                            now_ms: int) -> None:
        """Messages ``which`` of ``batch`` whose ids may have been seen: confirmed on the record
        (answered as duplicates, or refused), and taken out of ``ok``."""
        for i in which.tolist():
            found = self._find(batch.id(i))
            if found is None:
                continue
            prior, _eff = found
            if isinstance(prior, Retired):  # delivered or cancelled, inside the dedupe window
                ok[i] = False
                self.counters["duplicates"] += 1
                res.seqs[i], res.deliver_at_ms[i], res.duplicates[i] = prior.seq, batch.deliver_at_ms[i], 1
                continue
            mine = records.message_at(batch, i)
            mine = Message(seq=0, store_ms=now_ms, deliver_at_ms=mine.deliver_at_ms, msg_id=mine.msg_id,
                           subject=mine.subject, payload=mine.payload, tags=mine.tags, properties=mine.properties)
            ok[i] = False
            if prior.kind == KIND_CANCEL:
                res.refuse(i, ALREADY_EXISTS, f"id {mine.msg_id!r} was cancelled; a cancelled id cannot be reused")
                continue
            if not _same_content(prior, mine):
                res.refuse(i, ALREADY_EXISTS, f"id {mine.msg_id!r} was used for another message")
                continue
            self.counters["duplicates"] += 1
            res.seqs[i], res.deliver_at_ms[i], res.duplicates[i] = prior.seq, prior.deliver_at_ms, 1

    def write_bytes_bound(self, batch: Batch) -> int:
        """Disk bytes that accepting ``batch`` and filing it take at most: what the disk
        watermark admits or refuses before ``accept`` (node/store/diskspace.py). Its
        message-log frames (plain layout, one log header per ``frame_bytes_max`` part); its
        schedule-log copy (at most one frame per due second and due-ordered run, each with its
        own headers, subject table and index entry); one id-index entry per message and the
        allocation steps the id index takes for them (behind what waits to be filed); the
        heads file of each bucket that does not exist yet; and one partly used block per file."""
        n = batch.n
        if not n:
            return 0
        body = records.encoded_bytes_max(batch)
        framing = LOG_HEADER_SIZE + BATCH_HEADER_SIZE + records.subject_table_bytes(batch)
        parts = 1 + len(batch.payloads) // self.settings.frame_bytes_max
        due = batch.deliver_at_ms.astype(np.int64)
        runs = 1 + int(np.count_nonzero(np.diff(due) < 0))
        seconds = len(np.unique(due // 1000))
        frames = min(n, seconds * min(runs, FILE_SORTED_RUNS_MAX))
        return (body + parts * framing                                   # message log
                + body + frames * (framing + SCHEDULE_ENTRY_SIZE)       # schedule log
                + n * ID_ENTRY_SIZE + self.ids.allocation_bytes(self._unfiled_count + n)
                + self._new_buckets_bytes(due) + FILES_PER_WRITE * FILE_BLOCK_BYTES)

    def _new_buckets_bytes(self, due_ms: np.ndarray) -> int:
        """What creating the schedule buckets of these due times takes, for those not on disk
        yet: a folder and three files each, the heads file allocated whole."""
        bms = self.settings.bucket_ms
        eff = np.maximum(due_ms, self.persisted_completed_ms)  # filed under its effective time (``_file``)
        starts = np.unique(eff - eff % bms).tolist()
        new = len(starts) if len(starts) > BUCKETS_LOOKED_UP_MAX else \
            sum(1 for b in starts if not self.schedule.exists(b))
        return new * (HEADS_HEADER_SIZE + 4 * (bms // 1000) + FILES_PER_BUCKET * FILE_BLOCK_BYTES)

    def unfiled_bytes_bound(self) -> int:
        """Disk bytes that filing what is accepted and not filed yet will take at most (its
        message-log frames are written already): what a disk reading begun now cannot show yet
        (``DiskBudget.reading_started``). Per record at most one schedule frame with its headers,
        a subject table of the longest subject and an index entry, plus its id entry and the id
        index's allocation steps, new buckets; the frames' bodies are at most the message-log bytes."""
        n = self._unfiled_count
        if not n and self.iterate_offset >= self.messages.end_offset:
            return 0
        framing = (LOG_HEADER_SIZE + BATCH_HEADER_SIZE + 2 + self.settings.limits.subject_bytes_max
                   + SCHEDULE_ENTRY_SIZE)
        due = np.concatenate([u.batch.deliver_at_ms for u in self._unfiled]).astype(np.int64) \
            if self._unfiled else np.zeros(0, np.int64)
        return (max(0, self.messages.end_offset - self.iterate_offset) + n * (framing + ID_ENTRY_SIZE)
                + self.ids.allocation_bytes(n) + self._new_buckets_bytes(due) + FILES_PER_WRITE * FILE_BLOCK_BYTES)

    def cancel_bytes_bound(self, msg_id: str) -> int:
        """``write_bytes_bound`` of the tombstone ``cancel(msg_id)`` appends and files."""
        limits = self.settings.limits
        framing = LOG_HEADER_SIZE + BATCH_HEADER_SIZE + 2 + limits.subject_bytes_max
        body = BATCH_HEADER_SIZE + 2 + limits.subject_bytes_max + COLUMN_BYTES + 8 + len(msg_id.encode())
        return (2 * (body + framing) + SCHEDULE_ENTRY_SIZE + ID_ENTRY_SIZE
                + self.ids.allocation_bytes(self._unfiled_count + 1) + FILES_PER_WRITE * FILE_BLOCK_BYTES)

    def flush_messages(self) -> int:
        """fsync the message log (tests and tools; the service uses a GroupCommitter)."""
        self.messages.flush()
        self.durable_offset = self.messages.end_offset
        return self.durable_offset

    # ------------------------------------------------------------------ id lookups (slow path)

    def _unfiled_batch(self, offset: int) -> Batch:
        for u in self._unfiled:
            if u.offset == offset:
                return u.batch
        body, _ = self.messages.read(offset)
        return Batch.decode(body)

    def _unfiled_lookup(self, h: int) -> tuple[int, int] | None:
        """(seq, message-log offset) of the newest record with id hash ``h`` that was accepted
        and is not filed yet (so not in the id index), or None. The records waiting to be
        filed are few (filing follows each group commit): a scan of their hash arrays costs
        less than keeping a map with one entry per message on the ingest path."""
        hh = np.uint64(h)
        for u in reversed(self._unfiled):
            at = np.flatnonzero(u.hashes == hh)
            if len(at):
                return int(u.batch.seq[int(at[-1])]), u.offset
        return None

    def _find(self, msg_id: str) -> tuple[Message, int | None] | None:
        """The newest record (message or tombstone) with this id and its effective time
        (None while not filed), or None."""
        hit = self._unfiled_lookup(key_hash(msg_id))
        if hit is not None:
            b = self._unfiled_batch(hit[1])
            at = np.flatnonzero(b.seq == hit[0])
            if len(at) and b.id(int(at[0])) == msg_id:
                return records.message_at(b, int(at[0])), None
        refiled = self.refiled.get(msg_id)
        fallback = None
        if refiled is not None and not self._voided(refiled.seq) and self.schedule.exists(refiled.bucket_start_ms):
            got = self.schedule.find(refiled.bucket_start_ms, refiled.data_offset, refiled.frame_size, refiled.seq)
            if got is not None and got[0].batch.id(got[1]) == msg_id:
                m = records.message_at(got[0].batch, got[1])
                if m.kind == KIND_CANCEL:
                    return m, int(got[0].batch.effective_ms[got[1]])  # a tombstone answers for its message
                fallback = m, int(got[0].batch.effective_ms[got[1]])
        for loc in self.ids.get_all(msg_id):
            if self._voided(loc.seq):
                continue
            if self._bucket_retired(loc.bucket_start_ms):
                # delivered or cancelled, its bucket deleted; the id is kept for the dedupe window
                # (the record is gone, so the id cannot be confirmed on it: a hash collision of two
                # ids inside the window would be answered as a duplicate)
                return Retired(loc.seq), None
            got = self.schedule.find(loc.bucket_start_ms, loc.data_offset, loc.frame_size, loc.seq)
            if got is not None and got[0].batch.id(got[1]) == msg_id:
                ref, i = got
                return records.message_at(ref.batch, i), int(ref.batch.effective_ms[i])
        return fallback

    def _bucket_retired(self, start_ms: int) -> bool:
        done = int(self.persisted_doc.get("completed_ms", -1))
        return start_ms + self.settings.bucket_ms <= done and not self.schedule.exists(start_ms)

    def lookup(self, msg_id: str) -> LookupResult:
        found = self._find(msg_id)
        if found is None:
            raise NotFound(f"no message with id {msg_id!r}")
        m, eff = found
        if isinstance(m, Retired):
            raise NotFound(f"message {msg_id!r} (seq {m.seq}) was dispatched or cancelled and its record has "
                           f"expired (retention)")
        if m.kind == KIND_CANCEL:
            (target,) = struct.unpack("<Q", m.payload)
            return LookupResult("cancelled", msg_id, target, m.deliver_at_ms, m.subject)
        return LookupResult(self._status(m, eff), msg_id, m.seq, m.deliver_at_ms, m.subject)

    def _in_flight(self, seq: int) -> bool:
        return any(bool((u.batch.seq[u.live] == seq).any()) for u in self._units.values())

    def _status(self, m: Message, eff: int | None) -> str:
        if self._in_flight(m.seq):
            return "in_flight"
        if m.seq in self._dispatched:
            return "dispatched"
        # behind the persisted value, a message that is not in flight was delivered (its entry in
        # _dispatched is pruned there). completed_ms alone is not enough: it steps back below the
        # persisted value while an older message is in flight (_advance_completed), and a cancel
        # then took a message already at the real-time node for pending (chaos meta-pause seed 7
        # on 02f403d: received after the cancel was acknowledged)
        if eff is not None and eff < max(self.completed_ms, self.persisted_completed_ms):
            return "dispatched"
        return "pending"

    # ------------------------------------------------------------------ cancel

    def cancel(self, msg_id: str, *, now_ms: int) -> int:
        """Append a tombstone for a pending message and drop it from the wheel.

        Returns the cancelled seq. ``NotFound`` for an unknown id, ``TooLate`` once the
        message was dispatched or is being dispatched. Cancelling twice is answered
        with the first tombstone's result (idempotent). Durable after ``flush``.
        """
        found = self._find(msg_id)
        if found is None:
            raise NotFound(f"no message with id {msg_id!r}")
        m, eff = found
        if isinstance(m, Retired):
            raise TooLate(f"message {msg_id!r} was dispatched or cancelled (its record has expired)")
        if m.kind == KIND_CANCEL:
            return struct.unpack("<Q", m.payload)[0]
        if self._status(m, eff) in ("dispatched", "in_flight"):
            raise TooLate(f"message {msg_id!r} was already dispatched")
        if eff is None:  # not filed yet: the tombstone is filed right after it, in the same second
            eff = max(m.deliver_at_ms, self.persisted_completed_ms)
        seqs = self._next_seqs(1)
        tomb = Batch.build(m.subject, [struct.pack("<Q", m.seq)], [msg_id], [eff], seq=seqs, store_ms=now_ms,
                           kind=KIND_CANCEL)
        (off,) = self.messages.append([tomb.encode()])
        h = key_hashes([msg_id.encode()])
        self._unfiled.append(_Unfiled(off, self.messages.end_offset, tomb, h))
        self._unfiled_count += 1
        self.wheel.cancel(np.array([m.seq], np.uint64))
        self._unfiled_cancels.add(m.seq)  # until the tombstone is filed (_file): see _chunk
        self.counters["cancelled"] += 1
        return m.seq

    # ------------------------------------------------------------------ iterator (filing)

    def iterate(self, limit: int | None = 10_000) -> int:
        """File durable batches from the message log into the schedule log; returns records filed.

        A follower files only up to the master's checkpointed iterate offset, under the
        master's checkpointed completed_ms (see ``follow``)."""
        end = self.durable_offset
        if self.follower:
            end = min(end, self.replicated["iterate_offset"] if self.replicated else self.iterate_offset)
        n = 0
        while self.iterate_offset < end and (limit is None or n < limit):
            # every durable batch still in memory, filed together: one frame per due second
            # for all of them, one id-index write
            take: list[_Unfiled] = []
            offset = self.iterate_offset
            for u in self._unfiled:
                if u.offset != offset or u.end > end or (limit is not None and n + u.batch.n > limit and take):
                    break
                take.append(u)
                offset = u.end
                n += u.batch.n
            if take:
                if len(take) == 1:
                    self._file(take[0].batch, take[0].hashes)
                else:
                    self._file(Batch.concat([u.batch for u in take]), np.concatenate([u.hashes for u in take]))
                for _ in take:
                    self._unfiled.popleft()
                self._unfiled_count -= sum(u.batch.n for u in take)
                self.iterate_offset = offset
                continue
            # not in memory (replay after a restart, replicated bytes): read the log
            for off, body in self.messages.iterate(self.iterate_offset, end):
                b = Batch.decode(body)
                self._file(b, key_hashes(b.id_bytes_list()))
                self.iterate_offset = off + 12 + len(body)
                n += b.n
                if self._unfiled and self._unfiled[0].offset == self.iterate_offset:
                    break
                if limit is not None and n >= limit:
                    break
            while self._unfiled and self._unfiled[0].offset < self.iterate_offset:  # filed from the log
                gone = self._unfiled.popleft()
                self._unfiled_count -= gone.batch.n
        self.counters["filed"] += n
        return n

    def _file(self, batch: Batch, hashes: np.ndarray) -> None:
        if self.voided:
            self._unvoid(batch.seq[self._voided_mask(batch.seq)])
        is_cancel = batch.kind == KIND_CANCEL
        eff = np.where(is_cancel, batch.deliver_at_ms, np.maximum(batch.deliver_at_ms, self.persisted_completed_ms))
        if is_cancel.any():
            self._cancels_beside_targets(batch, is_cancel, eff)
        batch = batch.replace(effective_ms=eff.astype(np.int64))
        soon = None if self.follower else self.wheel.loaded_until_ms + self.settings.cache_ahead_ms
        force = self._refile_mask(batch)
        placed = self.schedule.file(batch, cache_before_ms=soon, force=force)
        seq = batch.seq
        last_ids = self.ids.last_seq()
        new = seq > np.uint64(last_ids) if last_ids >= 0 else np.ones(batch.n, bool)
        if force is not None:
            self._note_refiled(batch, force & placed.filed, placed)
        if new.any():
            bucket, off, size = placed.bucket_start_ms.copy(), placed.data_offset.copy(), placed.frame_size.copy()
            for i in np.flatnonzero(new & ~placed.filed).tolist():
                # filed before a crash but not indexed: find its frame again
                got = self.schedule.locate(int(eff[i]), int(seq[i]))
                if got is None:
                    new[i] = False
                    continue
                ref = got[0]
                bucket[i], off[i], size[i] = ref.bucket_start_ms, ref.data_offset, ref.frame_size
            put = np.flatnonzero(new)
            self.ids.put_many(hashes[put], bucket[put], off[put], size[put], seq[put])
        filed = placed.filed
        if filed.any():
            self._pending_add(eff[filed], np.where(is_cancel[filed], -1, 1))
        if self.follower:
            return  # a follower keeps no wheel: it is rebuilt from the schedule log on promotion
        targets = None
        if is_cancel.any():
            targets = batch.cancel_targets()[is_cancel]
            self.wheel.cancel(targets)  # messages filed by an earlier call
            if self._unfiled_cancels:
                self._unfiled_cancels.difference_update(int(t) for t in targets.tolist())
        for ref in placed.frames:
            chunk = self._chunk(ref, reload=False, cancelled=targets)  # and in this very call
            if chunk is None:
                continue
            if self.wheel.add(chunk):
                self.wheel_changed = True
                low = int(chunk.due_ms.min())
                if low < self.completed_ms:
                    # filed behind the wheel (effective >= persisted completed_ms): completed_ms
                    # steps back so a checkpoint cannot skip it before it is dispatched
                    self.completed_ms = low - low % self.settings.tick_ms

    def _cancels_beside_targets(self, batch: Batch, is_cancel: np.ndarray, eff: np.ndarray) -> None:
        """A tombstone is filed in the second of its message on **this** member (``eff`` is
        changed in place). Its time is the message's effective time on the member that answered
        the cancel, and a loaded second applies only the tombstones it holds. A member that filed
        the message under another floor holds it elsewhere: a slave that filed it after the
        master had cancelled it and moved past it (a higher floor), or the master itself after a
        promotion. There the tombstone never met the message and the message fired after an
        acknowledged cancel (``tests/test_failover_store.py``). Cancels are rare: one id lookup each."""
        targets = batch.cancel_targets()
        for i in np.flatnonzero(is_cancel).tolist():
            t = int(targets[i])
            here = np.flatnonzero((batch.seq == np.uint64(t)) & ~is_cancel)
            if len(here):  # the message is filed in this very call
                eff[i] = eff[int(here[0])]
                continue
            got = self._located(batch.id(i), t)
            if got is not None:
                eff[i] = got

    def _located(self, msg_id: str, seq: int) -> int | None:
        """The effective time this member filed record ``seq`` (id ``msg_id``) under, or None."""
        locs = list(self.ids.get_all(msg_id))
        refiled = self.refiled.get(msg_id)
        if refiled is not None:
            locs.append(refiled)
        for loc in locs:
            if loc.seq != seq or not self.schedule.exists(loc.bucket_start_ms):
                continue
            got = self.schedule.find(loc.bucket_start_ms, loc.data_offset, loc.frame_size, loc.seq)
            if got is not None and got[0].batch.id(got[1]) == msg_id:
                return int(got[0].batch.effective_ms[got[1]])
        return None

    def _dispatched_seqs(self, effective_ms: np.ndarray) -> np.ndarray | None:
        """Seqs delivered that could be among records due at ``effective_ms`` (None: none can).
        Delivered messages are due before the wheel cursor, and a second is loaded before
        anything in it fires, so on a running master this is None; after a restart the
        reloaded seconds may hold messages delivered before the crash."""
        if not self._dispatched or int(effective_ms.min()) > self._dispatched_eff_max:
            return None
        return np.fromiter(self._dispatched.keys(), np.uint64, len(self._dispatched))

    def _chunk(self, ref: FrameRef, *, reload: bool, cancelled: np.ndarray | None = None,
               order: np.ndarray | None = None) -> Chunk | None:
        """The wheel chunk of a frame: its messages not cancelled, voided, delivered or in flight,
        in the frame's order or in ``order`` (a permutation of the frame: by due time)."""
        b = ref.batch
        mask = b.kind == KIND_MESSAGE
        if not mask.any():
            return None
        seq = b.seq
        if cancelled is not None and len(cancelled):
            mask &= ~np.isin(seq, cancelled)
        if self._unfiled_cancels:
            # cancels answered whose tombstones are not filed yet: a second loaded (or a message
            # filed) before its tombstone must not bring the message into the wheel
            mask &= ~np.isin(seq, np.fromiter(self._unfiled_cancels, np.uint64, len(self._unfiled_cancels)))
        if self.voided:
            mask &= ~self._voided_mask(seq)
        delivered = self._dispatched_seqs(b.effective_ms)
        if delivered is not None:
            mask &= ~np.isin(seq, delivered)
        if reload:
            mask &= b.effective_ms >= self._restored_completed_ms
            if self._units:
                mask &= ~np.isin(seq, np.concatenate([u.batch.seq[u.live] for u in self._units.values()]))
        if order is not None:
            idx = order if mask.all() else order[mask[order]]
            if not len(idx):
                return None
            return Chunk(b.effective_ms[idx], seq[idx], idx.astype(np.int32), ref)
        if mask.all():
            return Chunk(b.effective_ms, seq, np.arange(b.n, dtype=np.int32), ref)
        idx = np.flatnonzero(mask)
        if not len(idx):
            return None
        return Chunk(b.effective_ms[idx], seq[idx], idx.astype(np.int32), ref)

    def _voided_mask(self, seq: np.ndarray) -> np.ndarray:
        out = np.zeros(len(seq), bool)
        for lo, hi in self.voided:
            out |= (seq >= np.uint64(lo)) & (seq < np.uint64(hi))
        return out

    def _voided(self, seq: int) -> bool:
        return any(lo <= seq < hi for lo, hi in self.voided)

    # ------------------------------------------------------------------ wheel and dispatch

    def _load_seconds(self, *, step_frames: int | None = LOAD_STEP_FRAMES) -> None:
        """Load the next seconds into the wheel, at most ``step_frames`` filed frames per call
        (None: no limit), so that loading a busy second (hundreds of frames, 20,000 messages)
        is spread over several polls instead of holding the event loop for ~10 ms once a
        second (seen as a lateness spike; a second is loaded ``window_ms`` ahead, so there is
        time). The frames of one second become **one** batch (one chunk) whose entries are
        ordered by due time through the chunk's index (an argsort): the messages are not
        moved at load; each firing round gathers only what it fires.

        A second being loaded (``_loading``) walks its frame chain once, merges the frames
        oldest first a step at a time, and at the end takes the frames filed into it since
        the walk (the chain's newer entries) before the wheel gets it. A bucket rebuilt
        meanwhile (healing) restarts the second."""
        budget = step_frames
        seconds = restarts = 0
        while restarts <= LOAD_RESTARTS_MAX:  # past it: the next poll tries again (each rebuild is logged)
            ld = self._loading
            if ld is None:
                if seconds >= self.settings.seconds_load_max:
                    return
                nxt = self.wheel.seconds_to_load(1)
                if not nxt:
                    return
                second = nxt[0]
                entries = self.schedule.second_entries(second)
                if not entries:
                    self.wheel.load_second(second, [])
                    seconds += 1
                    continue
                ld = self._loading = _SecondLoad(second, self.schedule.rebuilds, entries[0][0], entries[::-1])
            if budget is None:
                take, ld.todo = ld.todo, []
            else:
                take, ld.todo = ld.todo[:budget], ld.todo[budget:]
                budget -= len(take)
            if not self._merge_frames(ld, take):
                self._loading = None  # the bucket was rebuilt (healing): its offsets moved, start over
                restarts += 1
                continue
            if ld.todo:
                return
            self._loading = None
            if self.schedule.rebuilds != ld.rebuilds or self.wheel.seconds_to_load(1) != [ld.second]:
                restarts += 1  # the bucket was rebuilt (offsets moved) or the wheel moved on: start over
                continue
            if not self._merge_frames(ld, self.schedule.second_entries(ld.second, newer_than=ld.head)[::-1]):
                restarts += 1
                continue
            merged = Batch.concat(ld.parts)
            targets = np.concatenate(ld.cancels) if ld.cancels else None
            chunk = self._chunk(FrameRef(-1, -1, 0, merged), reload=True, cancelled=targets,
                                order=np.argsort(merged.effective_ms, kind="stable"))
            self.wheel.load_second(ld.second, [] if chunk is None else [chunk])
            seconds += 1
            if budget is not None and budget <= 0:
                return

    def _merge_frames(self, ld: "_SecondLoad", entries: list[tuple[int, int, int]]) -> bool:
        """Frames ``entries`` (oldest first) of the second being loaded: one merged part, and
        the targets of their (not voided) cancel records. False when a frame was corrupt and
        its bucket got rebuilt (the load must start over)."""
        if not entries:
            return True
        if self.schedule.rebuilds != ld.rebuilds:
            return False
        refs = self.schedule.frames_of(self.schedule.bucket_start(ld.second * 1000), entries)
        if refs is None:
            return False
        batches = [r.batch for r in refs]
        for b in batches:
            cancels = b.kind == KIND_CANCEL
            if bool(cancels.any()):
                ld.cancels.append(b.cancel_targets()[cancels & ~self._voided_mask(b.seq)])
        ld.parts.append(Batch.concat(batches))
        return True

    def next_due_ms(self) -> int | None:
        """When the earliest held message is due (the shell sleeps until then)."""
        return self.wheel.next_due_ms()

    def wheel_wake_ms(self) -> int | None:
        """When the wheel next has work that nothing will wake the shell for: the earliest
        held message's due time, or the time the next second becomes loadable (``window_ms``
        before it starts; loading it also moves the cursor and ``completed_ms``), whichever
        is first. Filing into a loaded second, a release and a settled dispatch round wake
        the shell on their own (``wheel_changed``, the dispatch slots). ``None`` when
        neither is known (a full wheel with nothing held cannot happen: it waits on
        dispatch). A second half loaded (``_loading``) or a catch-up with seconds still
        loadable wants the next poll a tick after the cursor at the latest, as the loop always
        polled."""
        w = self.wheel
        nxt = w.next_due_ms()
        if self._loading is not None or w.seconds_to_load(1):
            soon = w.cursor_ms + self.settings.tick_ms
            return soon if nxt is None else min(nxt, soon)
        if len(w) >= w.entries_max:
            return nxt
        loadable = w.loaded_until_ms - w.window_ms
        return loadable if nxt is None else min(nxt, loadable)

    def dispatch_lag_ms(self, now_ms: int) -> int:
        """How far dispatching is behind ``now_ms``: ``now_ms - completed_ms``, except that a
        wheel at rest (nothing in flight, nothing held due by ``now_ms``, the seconds up to
        it loaded) is not behind, even though its loop last moved ``completed_ms`` up to
        ``wheel_idle_wait_ms_max`` ago."""
        w = self.wheel
        nxt = w.next_due_ms()
        if not self._inflight_count and self._loading is None and w.loaded_until_ms > now_ms \
                and (nxt is None or nxt > now_ms):
            return 0
        return max(0, now_ms - self.completed_ms)

    def poll_due(self, *, now_ms: int) -> list[DueBatch]:
        """Load seconds ahead, advance the wheel to ``now_ms``; return what is due as one
        in-flight unit (empty list when nothing is due or ``inflight_max`` is reached)."""
        if self._inflight_count >= self.settings.inflight_max:
            return []
        self._load_seconds()
        fired = self.wheel.advance(now_ms)
        # a catch-up may need more seconds than one load allowed
        while not fired and self.wheel.cursor_ms <= now_ms and self.wheel.seconds_to_load(1):
            loaded = self.wheel.loaded_until_ms
            self._load_seconds(step_frames=None)
            if self.wheel.loaded_until_ms == loaded:
                break  # no progress (a bucket that failed its checks again): the next poll tries again
            fired = self.wheel.advance(now_ms)
        out: list[DueBatch] = []
        if fired:
            b = Batch.gather([(f.ref.batch, f.idx) for f in fired])
            due = b.deliver_at_ms
            if len(due) > 1 and (due[1:] < due[:-1]).any():  # in due order: a real-time node holds a
                b = b.take(np.argsort(due, kind="stable"))   # subject at its first message not due yet
            self._unit_counter += 1
            self._units[self._unit_counter] = _Unit(b, np.ones(b.n, bool))
            self._inflight_count += b.n
            out.append(DueBatch(self._unit_counter, b))
        self._advance_completed()
        return out

    def _settle(self, unit: int, idx: np.ndarray) -> Batch | None:
        u = self._units.get(unit)
        if u is None:
            return None
        idx = np.asarray(idx, np.int64)
        idx = idx[u.live[idx]]
        if not len(idx):
            return None
        u.live[idx] = False
        self._inflight_count -= len(idx)
        if not u.live.any():
            del self._units[unit]
        return u.batch.take(idx)

    def ack_dispatched(self, unit: int, idx, *, now_ms: int, outcome: int = OUTCOME_OK) -> int:
        """Record messages ``idx`` of an in-flight unit as delivered (or dead-lettered): one
        dispatch record. Returns how many were recorded (already settled ones are skipped)."""
        u = self._units.get(unit)
        if u is None:
            return 0
        idx = np.asarray(idx, np.int64)
        idx = idx[u.live[idx]]
        if not len(idx):
            return 0
        b = u.batch.take(idx)
        rec = DispatchBatch(b.seq, b.effective_ms, b.deliver_at_ms, now_ms, outcome)
        # written before the unit is settled: a full disk (DiskFull) leaves them in flight,
        # and the caller gives them back to the wheel
        (off,) = self.dispatch.append([rec.encode()])
        self._settle(unit, idx)
        self._note_dispatched(b.seq, b.effective_ms)
        self._dispatch_trail.append((int(b.effective_ms.max()), off))
        self._pending_add(b.effective_ms, -1)
        self.counters["dead_lettered" if outcome == OUTCOME_DEAD_LETTER else "dispatched"] += b.n
        self._advance_completed()
        return b.n

    def release(self, unit: int, idx) -> None:
        """Give messages ``idx`` of an in-flight unit back to the wheel (dispatch failed, retried)."""
        b = self._settle(unit, idx)
        if b is None:
            return
        ref = FrameRef(-1, -1, 0, b)  # held in memory only: the schedule log still has them
        held = self.wheel.add(Chunk(b.effective_ms.copy(), b.seq.copy(), np.arange(b.n, dtype=np.int32), ref))
        if not held:  # cannot happen (their seconds are loaded); never drop a message silently
            log.error("released messages not taken back by the wheel count=%d", b.n)
        self.wheel_changed = True
        self._advance_completed()

    def unit_batch(self, unit: int) -> Batch | None:
        u = self._units.get(unit)
        return None if u is None else u.batch

    def _advance_completed(self) -> None:
        c = self.wheel.cursor_ms
        low = None  # the earliest effective time in flight
        for u in self._units.values():
            live = u.batch.effective_ms[u.live]
            if len(live):
                m = int(live.min())
                low = m if low is None else min(low, m)
        if low is not None:
            c = min(c, low)
        c -= c % self.settings.tick_ms  # always a whole tick: exactly what a checkpoint persists
        if c > self.completed_ms or (low is not None and low < self.completed_ms):
            # up as the wheel and the deliveries go on; down when a message fires behind it (a
            # second loaded behind the cursor: simulation seed 18 lost two that way, completed_ms
            # passed them while they were in flight and the next checkpoint skipped them)
            self.completed_ms = c
        # completed_ms may step back (see _file), never below the persisted value: keep the
        # dispatch records a restart from the persisted value needs
        floor = self.persisted_completed_ms
        trail = self._dispatch_trail
        while trail and trail[0][0] < floor:
            trail.popleft()
        self._prune_dispatched(floor)

    def _note_dispatched(self, seq: np.ndarray, effective_ms: np.ndarray) -> None:
        if not len(seq):
            return
        seqs = seq.tolist()
        self._dispatched.update(zip(seqs, effective_ms.tolist()))
        eff_max = int(effective_ms.max())
        self._dispatched_eff_max = max(self._dispatched_eff_max, eff_max)
        self._dispatched_added.append((eff_max, seqs))

    def _prune_dispatched(self, floor: int) -> None:
        """Forget delivered seqs due before ``floor`` (a restart from the persisted tick state
        never reloads them), at most ``DISPATCHED_PRUNE_STEP`` per call: the work is spread
        over the dispatch records as they come, never one pass over the whole map on the
        event loop (at 20,000 msgs/s that pass held the loop ~10 ms every few seconds)."""
        added, pop, budget = self._dispatched_added, self._dispatched.pop, DISPATCHED_PRUNE_STEP
        while added and added[0][0] < floor and budget > 0:
            _, seqs = added.popleft()
            for s in seqs:
                pop(s, None)
            budget -= len(seqs)

    def tick_state(self) -> TickState:
        offset = self._dispatch_trail[0][1] if self._dispatch_trail else self.dispatch.end_offset
        completed = self.completed_ms
        if not self.follower:
            # an overdue entry held behind completed_ms (added or loaded behind the cursor, not
            # fired yet) is not delivered: the state never claims its tick (as TimingWheel.state)
            earliest = self.wheel.next_due_ms()
            if earliest is not None and earliest < completed:
                completed = earliest
        return TickState(self.epoch, completed // self.settings.tick_ms - 1, 0, offset)

    def replication_doc(self) -> dict[str, int]:
        """What a master ships to its slaves with every fetch answer (``follow`` on their side):
        its last **durable** checkpoint, never its live tick state.

        A slave files under this ``completed_ms`` and a promotion restores the wheel from it.
        The live value runs ahead of what the master filed under (its persisted value): a
        record the master filed behind the wheel after its last answer (a late retry) has an
        effective time below the live value, and a member that restored the live value took
        the master's own copy of it for delivered once it was promoted itself (chaos seed 29,
        finding 8, ``docs/replication.md``). With the persisted value every member's effective
        time for a record is at least the master's, and a persisted ``completed_ms`` above a
        record's time on the master means the master delivered it: a promotion reloads what it
        must, as a restart of the master does (a checkpoint interval more to load)."""
        doc = self.persisted_doc
        if all(k in doc for k in ("iterate_offset", "completed_ms", "dispatch_offset")):
            return {k: int(doc[k]) for k in ("iterate_offset", "completed_ms", "dispatch_offset", "log_end") if k in doc}
        st = self.tick_state()  # nothing persisted yet (never on a store that opened: see __init__)
        return {"iterate_offset": 0, "completed_ms": (st.tick + 1) * self.settings.tick_ms,
                "dispatch_offset": st.dispatch_offset}

    @property
    def pending_in_wheel(self) -> int:
        return len(self.wheel)

    @property
    def inflight(self) -> int:
        return self._inflight_count

    # ------------------------------------------------------------------ durability

    def checkpoint(self) -> None:
        """Flush schedule, ids and dispatch log, then persist iterate offset and tick state."""
        self.checkpoint_plan().run_and_finish()

    def checkpoint_plan(self) -> SyncPlan:
        """``checkpoint`` as a plan: the document is taken now, so it records only what was
        filed and dispatched before the plan's fsyncs; ``run`` it on a worker thread, then
        ``finish`` it on the loop (the persisted tick state moves only then)."""
        plan = SyncPlan()
        self.schedule.plan_flush(plan)
        self.ids.plan_flush(plan)
        self.dispatch.plan_flush(plan)
        self._plan_checkpoint_doc(plan)
        return plan

    def checkpoint_key(self) -> tuple:
        """Everything a checkpoint records or flushes except the clock: equal keys mean that
        nothing was appended, filed, dispatched, cancelled, rebuilt or indexed in between, so
        a new checkpoint would only move ``completed_ms`` (the shell then writes one every
        ``checkpoint_idle_interval_ms`` instead of every ``checkpoint_interval_ms``). A
        ``completed_ms`` that only the clock moved costs a restart or a promotion an empty
        stretch of seconds to load again: nothing was due in it, or it would have been
        dispatched, and a dispatch changes the key."""
        r = self.replicated
        rep = None if r is None else tuple(sorted((k, v) for k, v in r.items() if k not in ("completed_ms", "tick")))
        return (self.epoch, self.follower, self.messages.end_offset, self.iterate_offset, self.dispatch.end_offset,
                tuple(self.counters.values()), self.schedule.rebuilds, self.ids.dirty(), rep)

    def _save_checkpoint(self) -> None:
        """The checkpoint document alone (the epoch bump at open, before any seq of it)."""
        plan = SyncPlan()
        self._plan_checkpoint_doc(plan)
        plan.run_and_finish()

    def _plan_checkpoint_doc(self, plan: SyncPlan) -> None:
        if self.follower and self.replicated is None:
            return  # nothing from a master yet: keep the checkpoint as it is
        if self.follower:
            # a follower persists the master's tick state with its own iterate offset:
            # a promotion restores the wheel from exactly what the master had completed
            r = self.replicated
            completed = int(r["completed_ms"])
            dispatch_offset = min(int(r["dispatch_offset"]), self.dispatch.end_offset)
            doc = {"version": 2, "epoch": self.epoch, "iterate_offset": self.iterate_offset,
                   "completed_ms": completed, "dispatch_offset": dispatch_offset,
                   "tick": completed // self.settings.tick_ms - 1, "replicated": r}
            plan.write_doc(self._gate, self._ckpt_path, doc)
            plan.on_done(lambda: setattr(self, "persisted_doc", doc))
            return
        st = self.tick_state()
        completed = (st.tick + 1) * self.settings.tick_ms
        # log_end: the message log's end when the document was taken. completed_ms may rest on
        # any record before it: a tombstone appended (not filed yet) takes its message out of
        # the wheel at once. A slave takes the document only once it holds the log that far.
        done = {"iterate_offset": self.iterate_offset, "completed_ms": completed, "dispatch_offset": st.dispatch_offset,
                "log_end": self.messages.end_offset}
        plan.write_doc(self._gate, self._ckpt_path, {"version": 2, "epoch": self.epoch, "tick": st.tick, **done})

        def persisted() -> None:
            self.persisted_completed_ms = completed
            self.last_checkpoint = done
            self.persisted_doc = done
        plan.on_done(persisted)

    # ------------------------------------------------------------------ replication (follower side)

    def follow(self, master_checkpoint: dict | None = None) -> None:
        """Become (or stay) a follower; ``master_checkpoint`` is the master's last checkpoint
        (iterate_offset, completed_ms, dispatch_offset), shipped with its tick state."""
        self.follower = True
        self._units.clear()
        self._inflight_count = 0
        if master_checkpoint is not None:
            if int(master_checkpoint.get("log_end", -1)) > self.durable_offset:
                # its completed_ms may rest on records this replica does not hold yet (a
                # tombstone: chaos meta-pause seed 7): the previous document stands until then
                return
            self.replicated = dict(master_checkpoint)
            self.persisted_completed_ms = self.completed_ms = int(master_checkpoint["completed_ms"])

    def epoch_floor(self) -> int:
        """The highest store epoch this store has used or holds seqs of: a new term's epoch is
        above it (the election hands out one above every term's, ``store_epoch_min``)."""
        ck = checkpoint.read(self._ckpt_path) or {}
        last = self.ids.last_seq()
        return max(self.epoch, int(ck.get("epoch", 0)), (last >> SEQ_EPOCH_SHIFT) if last >= 0 else 0)

    def promote(self, now_ms: int, store_epoch: int = 0) -> dict[str, int]:
        """Turn this follower into the master in place (no close, no reopen): what a close
        and an open as master did, once. Returns the milliseconds of each step (logged).

        1. file what the master's checkpoint covered and persist the follower checkpoint
           (the master's tick state with this replica's iterate offset), as a close did;
        2. the new epoch, once: past this store's and past every seq already filed (the
           old master's), durable before any seq of it is issued;
        3. the wheel restored from that tick state (``completed_ms``, the dispatch-log
           records from ``dispatch_offset`` on name what was delivered): it aligns to the
           wall clock in ``poll_due`` (behind: catch-up; ahead: it waits);
        4. the buckets the wheel loads first verified (heal.py), pending counts rebuilt;
        5. the rest of the replicated log filed as a master files it, under the restored
           ``completed_ms``. Voided seqs (divergent suffixes truncated while following)
           stay voided: they live in ``voided.json`` and memory, not in the checkpoint."""
        if not self.follower:
            raise AssertionError("promote() of a store that is already the master")
        t = {"t0": time.perf_counter()}
        self.iterate(limit=None)
        self.checkpoint()
        t["file_checkpoint"] = time.perf_counter()
        ck = checkpoint.read(self._ckpt_path) or {}
        self.follower = False
        self.replicated = None
        # the term's epoch from the election (unique in the group: two terms that never saw each
        # other's records still never issue the same seq), and never below what this store used
        self.epoch = max(max(self.epoch, int(ck.get("epoch", 0))) + 1, store_epoch)
        last = self.ids.last_seq()
        if last >= 0 and (last >> SEQ_EPOCH_SHIFT) >= self.epoch:
            self.epoch = (last >> SEQ_EPOCH_SHIFT) + 1
        self._counter = 0
        self._units.clear()
        self._unit_counter = 0
        self._inflight_count = 0
        self._restore_tick_state(ck, now_ms)
        self.healer.wheel_restarted()  # missing records the old wheel passed are due again
        self._save_checkpoint()  # the new epoch is durable before any seq of it is used
        t["epoch_wheel"] = time.perf_counter()
        self.healer.check_soon(ahead_ms=self.settings.verify_ahead_ms)
        t["verify"] = time.perf_counter()
        self._pending = self._count_pending()
        t["pending"] = time.perf_counter()
        self.iterate(limit=None)
        self._bump_past_filed_seqs()
        t["file_rest"] = time.perf_counter()
        steps = list(t)
        return {k: round((t[k] - t[steps[i - 1]]) * 1000, 1) for i, k in enumerate(steps) if i}

    def appended(self) -> None:
        """Replicated bytes were appended and fsynced: they are durable here."""
        self.durable_offset = self.messages.end_offset

    def truncate_messages(self, cut: int) -> int:
        """Drop a divergent message-log suffix (records the new master never had). Records
        already filed stay in the schedule log but their seqs are voided (persisted), so
        they are never loaded, found or counted. Returns the records voided.

        A voided range is exactly the seqs cut (``[min, max]`` per store epoch, never "to the
        end of the epoch"), and a record that comes back into the log (the same bytes fetched
        again from the new master) is filed and un-voided (``_unvoid``): voiding describes
        what the log does not hold, nothing more."""
        if cut >= self.messages.end_offset:
            return 0
        cut_batches = [Batch.decode(body) for _, body in self.messages.iterate(cut)]
        cols = [b.seq for b in cut_batches]
        seqs = np.concatenate(cols) if cols else np.zeros(0, np.uint64)
        tick_state_lowered = self._forget_cut_cancels(cut, cut_batches)
        if len(seqs):
            # seqs of one store epoch grow with the log: the suffix is one range per epoch
            epochs = seqs >> np.uint64(SEQ_EPOCH_SHIFT)
            for ep in np.unique(epochs).tolist():
                mine = seqs[epochs == ep]
                self.voided.append((int(mine.min()), int(mine.max()) + 1))
            self.refile_seq_max = max(self.refile_seq_max, int(seqs.max()))
            self._save_voided()
        dropped = self.messages.truncate(cut)
        self.messages.flush()
        self.iterate_offset = min(self.iterate_offset, cut)
        self.durable_offset = min(self.durable_offset, cut)
        kept = [u for u in self._unfiled if u.offset < cut]
        self._unfiled = deque(kept)
        self._unfiled_count = sum(u.batch.n for u in kept)
        if tick_state_lowered:
            self.checkpoint()
        log.warning("message log truncated to %d (divergent suffix, %d bytes, %d records voided)",
                    cut, dropped, len(seqs))
        return len(seqs)

    def _forget_cut_cancels(self, cut: int, cut_batches: list[Batch]) -> bool:
        """The replicated tick state may rest on the suffix being cut: a tombstone there took its
        message out of the old master's wheel, and its completed_ms passed the message. The
        tombstone goes; the message stays (it is before the cut) and must be loaded again at a
        promotion: completed_ms goes back below every cut tombstone's message. True when the
        replicated document changed (the caller persists it).

        A follower with no document from the current master yet holds the tick state it
        restored at open: its own, from its last term as master, which rests on its suffix as
        much (chaos meta-pause seed 18: its own tombstones were cut and a promotion took their
        messages for delivered). Lowered, that becomes the document it persists."""
        r = self.replicated
        own = r is None
        if own:
            r = self._own_doc()
            if r is None:
                return False
        if int(r.get("log_end", r.get("iterate_offset", 0))) <= cut:
            return False
        r["log_end"] = cut
        # a follower files up to the document's iterate offset: past the cut it would point
        # into the new master's bytes, maybe inside a record (chaos meta-pause seed 8, third
        # session: "record ends past end of segment" while filing, and at every restart)
        r["iterate_offset"] = min(int(r["iterate_offset"]), cut)
        low = None
        for b in cut_batches:
            tomb = b.kind == KIND_CANCEL
            if tomb.any():
                t = int(b.deliver_at_ms[tomb].min())  # the message's time on the cancelling master
                low = t if low is None else min(low, t)
        lowered = low is not None and low < int(r["completed_ms"])
        if lowered:
            r["completed_ms"] = low - low % self.settings.tick_ms
            self.persisted_completed_ms = self.completed_ms = int(r["completed_ms"])
            log.warning("a cut tombstone's message is due again: replicated completed_ms back to %d", r["completed_ms"])
        if own:
            # adopted even when not lowered: its iterate offset is cut back, and the follower
            # checkpoint written from it replaces the own one, whose iterate offset a restart
            # would otherwise read inside the new master's bytes
            self.replicated = r
        return True  # persisted by the caller once the log is cut

    def _own_doc(self) -> dict | None:
        """A follower's tick state before any document of the current master: what it restored
        at open (its own, from its last term as master), as a replicated document; None when
        it is the master or has none."""
        if not self.follower or "completed_ms" not in self.persisted_doc:
            return None
        r = {k: int(v) for k, v in self.persisted_doc.items()}
        r.setdefault("log_end", self.messages.end_offset)
        return r

    def _save_voided(self) -> None:
        checkpoint.write_atomic(self._voided_path, {"ranges": [list(r) for r in self.voided],
                                                    "refile_seq_max": self.refile_seq_max})

    def _refile_mask(self, batch: Batch) -> np.ndarray | None:
        """Records at or below ``refile_seq_max`` that this store has not filed: the high-water
        marks would skip them (they are below a cut newer term's seqs); they are filed
        anyway. A record filed before (the same seq under its id) is not filed twice."""
        if self.refile_seq_max < 0:
            return None
        seq = batch.seq
        cand = np.flatnonzero(seq <= np.uint64(self.refile_seq_max))
        if not len(cand):
            return None
        force = np.zeros(batch.n, bool)
        for i in cand.tolist():
            s_i = int(seq[i])
            known = self.refiled.get(batch.id(i))
            if (known is None or known.seq != s_i) and not any(loc.seq == s_i for loc in self.ids.get_all(batch.id(i))):
                force[i] = True
        return force if force.any() else None

    def _note_refiled(self, batch: Batch, which: np.ndarray, placed) -> None:
        """Remember where records filed below the high-water marks went (``_find`` reads them)."""
        for i in np.flatnonzero(which).tolist():
            self.refiled[batch.id(i)] = IdLocation(int(placed.bucket_start_ms[i]), int(placed.data_offset[i]),
                                                   int(placed.frame_size[i]), int(batch.seq[i]))
        if len(self.refiled) > REFILED_MAX:  # bounded: the oldest buckets' entries go first
            for k in sorted(self.refiled, key=lambda k: self.refiled[k].bucket_start_ms)[:len(self.refiled) - REFILED_MAX]:
                del self.refiled[k]
        checkpoint.write_atomic(self._refiled_path, {"ids": {k: [v.bucket_start_ms, v.data_offset, v.frame_size, v.seq]
                                                             for k, v in self.refiled.items()}})

    def _unvoid(self, seq: np.ndarray) -> None:
        """Records with these seqs are in the message log again: not voided any more."""
        if not self.voided or not len(seq):
            return
        s = np.sort(seq)
        out: list[tuple[int, int]] = []
        changed = False
        for lo, hi in self.voided:
            a, b = np.searchsorted(s, np.uint64(lo)), np.searchsorted(s, np.uint64(hi))
            if a == b:
                out.append((lo, hi))
                continue
            changed = True
            inner = [int(x) for x in s[a:b].tolist()]
            start = lo
            for x in inner:
                if x > start:
                    out.append((start, x))
                start = max(start, x + 1)
            if start < hi:
                out.append((start, hi))
        if changed:
            self.voided = out
            self._save_voided()

    def truncate_dispatch(self, cut: int) -> int:
        if cut >= self.dispatch.end_offset:
            return 0
        dropped = self.dispatch.truncate(cut)
        self.dispatch.flush()
        # the tick state's dispatch offset (the old master's, replicated, and the checkpoint
        # made of it) may point into the cut bytes; once the new master's bytes fill that range
        # it would point into the middle of a record ("header checksum mismatch" at promotion,
        # chaos meta-pause seeds 20 and 22, and the evidence at 10:10:02): it goes back
        # to the cut (reading more dispatch records there only names more as delivered)
        # A follower with no document of the current master yet holds its own (seed 18): the same
        r = self.replicated if self.replicated is not None else self._own_doc()
        if r is not None and int(r.get("dispatch_offset", 0)) > cut:
            r["dispatch_offset"] = cut
            self.replicated = r
            self.checkpoint()
        if int(self.persisted_doc.get("dispatch_offset", 0)) > cut and self.follower:
            self.checkpoint()
        log.warning("dispatch log truncated to %d (divergent suffix, %d bytes)", cut, dropped)
        return dropped

    def close(self) -> None:
        self.flush_messages()
        self.iterate(limit=None)
        self.checkpoint()
        self._gate.close()
        self.schedule.close()
        self.ids.close()
        self.dispatch.close()
        self.messages.close()


__all__ = ["DelayStore", "DueBatch", "IdLocation", "LookupResult", "StoreSettings"]
