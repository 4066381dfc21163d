"""DelayStore: the delay node's storage engine, message log to dispatch log, batch by batch.

Owns a data folder::

    {root}/messages/   SegmentedLog (WAL): one frame per accepted batch (a ``cluster.codec.Batch``)
    {root}/schedule/   ScheduleLog: one frame per (batch, due second), per-second frame chains
    {root}/ids/        IdIndex: message id hash -> schedule frame holding it
    {root}/dispatch/   SegmentedLog of ``DispatchBatch`` records (one per delivered group)
    {root}/checkpoint  epoch, iterate offset, tick state (atomic JSON)
    {root}/voided.json, refiled.json   seqs cut off the log, records filed below the high-water marks

This module is the **shell**: it reads and writes those files and asks the pure core what
to do. Who owns what (``docs/design.md``, "The delay node's modules"):

* ``node/delay/core.py``: ``DelayCore``, the decisions (seqs, the filing rule, wheel and ``completed_ms``,
  delivered seqs, in-flight units, pending counts, voided seqs, checkpoint documents);
* ``node/delay/ingest.py``: the duplicate rules of ``accept``, what waits to be filed,
  disk bounds;
* ``node/delay/loading.py``: seconds of the schedule log loaded into the wheel;
* ``node/delay/recovery.py``: opening the folder, ``RecoveryReport``;
* ``node/delay/lookup.py``: an id's newest record (duplicates, ``lookup``, ``cancel``);
* ``node/delay/heal.py`` / ``salvage.py``: rebuilding a damaged schedule bucket.

The unit of work is the batch (``shared/ARCHITECTURE.md``, "Hot path"). Every step
takes ``now_ms`` from the caller and nothing here, in the core or in the healer reads a
clock to decide (``promote`` and a bucket rebuild time their steps with ``perf_counter``
for their log lines, nothing more); no step makes a Python object per message: per-message
work is numpy, ``bytes.join`` or one comprehension over a hash function.

1. ``accept(batch)`` validates the whole batch with numpy, hashes its ids (xxh3,
   one pass over the C function), finds possible duplicates with one vectorised probe
   of the id index plus the not-yet-filed frames, gives the new records contiguous seqs
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

Invariants that make restart exact: ``node/delay/core.py`` (asserted where they hold by construction;
``iterate`` asserts that the iterate offset never passes the durable offset).
"""

from __future__ import annotations

import logging
import os
import struct
import time  # promote() step timings for its log line only
import uuid
from pathlib import Path

import numpy as np

from cluster.codec import KIND_CANCEL, OUTCOME_DEAD_LETTER, OUTCOME_OK, Batch
from cluster.errors import NotFound, TooLate
from cluster.wire import BatchResult
from node.delay import cuts, diskbounds, ingest, late_filed, lookup, recovery
from node.delay.core import DelayCore
from node.delay.inflight import DueBatch, InFlight
from node.delay.heal import BucketHealer
from node.delay.ingest import Retired, Unfiled
from node.delay.loading import LOAD_STEP_FRAMES, SecondLoader
from node.delay.lookup import LookupResult
from node.delay.subject_tables import SubjectTables
from node.store import checkpoint, records
from node.store.idindex import IdLocation, key_hashes
from node.store.log import HEADER_SIZE as LOG_HEADER_SIZE
from node.store.records import SEQ_EPOCH_SHIFT, Message
from node.store.schedule import FrameRef
from node.store.settings import StoreSettings
from node.store.syncplan import DocGate, SyncPlan
from node.wheel import TickState, TimingWheel

log = logging.getLogger("hourglass.delay.store")

class DelayStore:
    def __init__(self, root: Path, settings: StoreSettings, now_ms: int, *, bump_epoch: bool = True,
                 follower: bool = False) -> None:
        self.root = root
        self.settings = settings
        self.now_ms = now_ms  # the latest time a caller gave (HealedStore.now_ms)
        rec = recovery.recover(root, settings, now_ms, bump_epoch=bump_epoch, follower=follower)
        self.messages, self.dispatch, self.schedule, self.ids = rec.messages, rec.dispatch, rec.schedule, rec.ids
        self.core = rec.core
        self.recovery = rec.report
        self.iterate_offset = rec.iterate_offset
        self.durable_offset = self.messages.end_offset  # recovered bytes are what survived
        self.refiled = rec.refiled  # records filed below the id index's seqs after a cut (cuts.py)
        self._ckpt_path = root / "checkpoint"
        self._voided_path = root / "voided.json"
        self._gate = DocGate()
        self.unfiled = Unfiled()
        self.loader = SecondLoader(self.schedule, self.core)
        self.subject_tables = SubjectTables(self.schedule, settings)  # counts per subject (subject_tables.py)
        self.wheel_changed = False  # set when a filed message entered the wheel (the shell wakes its loop)
        # derived data heals itself (node/delay/heal.py): a schedule bucket failing a check is
        # rebuilt from the message log; the ones the wheel loads first are checked before serving
        self.healer = BucketHealer(self)
        self.healer.counters["id_files_rebuilt"] = len(self.ids.rebuilt_files)
        self.schedule.healer = self.healer.rebuild
        self.healer.check_soon(ahead_ms=settings.verify_ahead_ms)
        if not follower:  # filed late, delivered before the replayed dispatch records (late_filed.py)
            late_filed.name_delivered(self.schedule, self.dispatch, self.core, self.core.completed_ms)
        self.subject_tables.count_pending(self.core)
        self._save_checkpoint()  # the new epoch is durable before any seq of it is used
        self.recovery.records_refiled = self.iterate(limit=None)  # replay: file everything the crash left unfiled
        if not follower:
            self._late_filed_after_replay(self.recovery.records_refiled)
            self._bump_past_filed_seqs()
        self.recovery.epoch = self.epoch
        log.info("delay store opened path=%s recovery=%s", root, self.recovery)

    @classmethod
    def open(cls, root: str | os.PathLike, settings: StoreSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True, follower: bool = False) -> "DelayStore":
        """``follower``: open as a slave (files only what the master's checkpoint covers,
        keeps no wheel); ``promote`` turns it into the master in place."""
        return cls(Path(root), settings or StoreSettings(), now_ms, bump_epoch=bump_epoch, follower=follower)

    def _bump_past_filed_seqs(self) -> None:
        """A promoted slave holds records of the old master's epochs: never reuse their seqs."""
        last = self.ids.last_seq()
        if last >= 0 and (last >> SEQ_EPOCH_SHIFT) >= self.epoch:
            self.core.set_epoch((last >> SEQ_EPOCH_SHIFT) + 1)
            self._save_checkpoint()

    def note_now(self, now_ms: int) -> None:
        """A caller's time: ``now_ms`` is the latest one given, to any call that takes one (the
        healer paces a rebuild that a read runs into by it; nothing here reads a clock)."""
        self.now_ms = max(self.now_ms, now_ms)

    # ------------------------------------------------------------------ the core's state, read-only

    epoch = property(lambda self: self.core.epoch)

    @property
    def completed_ms(self) -> int:
        return self.core.completed_ms

    @completed_ms.setter
    def completed_ms(self, value: int) -> None:  # tests set the live value as a race leaves it
        self.core.completed_ms = value

    persisted_completed_ms = property(lambda self: self.core.persisted_completed_ms)
    persisted_doc = property(lambda self: self.core.persisted_doc)
    last_checkpoint = property(lambda self: self.core.last_checkpoint)
    wheel = property(lambda self: self.core.wheel)
    counters = property(lambda self: self.core.counters)
    voided = property(lambda self: self.core.voided)
    refile_seq_max = property(lambda self: self.core.refile_seq_max)
    follower = property(lambda self: self.core.follower)
    replicated = property(lambda self: self.core.replicated)
    inflight = property(lambda self: self.core.inflight)
    pending_in_wheel = property(lambda self: len(self.core.wheel))
    loaded_until_ms = property(lambda self: self.core.wheel.loaded_until_ms)

    def pending_by_bucket(self) -> dict[int, int]:
        """Bucket start ms -> messages filed there and not yet dispatched or cancelled."""
        return {b: n for b, n in self.core.pending.items() if n > 0}

    def voided_mask(self, seq: np.ndarray) -> np.ndarray | None:
        """Which of these seqs were cut off the message log (None: none ever were)."""
        return self.core.voided_mask(seq) if self.core.voided else None

    def delivered_recently(self) -> dict[int, int]:
        """seq -> effective_ms of the delivered messages the core remembers (``HealedStore``)."""
        return self.core.dispatched

    def check_invariants(self) -> None:
        """Assert the store's invariants (tests, after each step): the core's, the iterate
        offset at most the durable offset, and pending counts equal to a recount from the
        schedule log."""
        self.core.check_invariants()
        assert self.iterate_offset <= self.durable_offset, (self.iterate_offset, self.durable_offset)
        recount = recovery.count_pending(self.schedule, self.core)
        assert recount == self.pending_by_bucket(), (recount, self.pending_by_bucket())
        self.subject_tables.check(self.core)

    def bucket_rebuilt(self, start: int, *, late: Batch | None, cancelled: np.ndarray | None) -> None:
        """Bucket ``start`` was rebuilt (node/delay/heal.py). ``late``: records a member gave
        back that the wheel passed while they were missing, filed again in the bucket (the
        filing rule) and handed to the wheel here (overdue: they fire at once); ``cancelled``:
        targets of tombstones the rebuild brought back, taken out of the wheel."""
        core = self.core
        if not core.follower:
            if cancelled is not None and len(cancelled):
                core.wheel.cancel(cancelled)
            chunk = None if late is None else core.chunk(FrameRef(-1, -1, 0, late), reload=False, cancelled=cancelled)
            if core.offer(chunk, filed=False):
                self.wheel_changed = True
        self.subject_tables.recount_bucket(core, start)

    # ------------------------------------------------------------------ ingest

    def accept(self, batch: Batch | list[Message], *, now_ms: int) -> BatchResult:
        """Validate and append a batch; one answer per message in the returned arrays.

        A refused message changes nothing; the others go on. Not durable until the
        caller's group commit (or ``flush_messages``) covers ``messages.end_offset``."""
        self.note_now(now_ms)
        if isinstance(batch, list):
            batch = records.batch_from_messages(batch)
        with self.schedule.memo():
            got = ingest.admit(batch, now_ms=now_ms, settings=self.settings, unfiled=self.unfiled,
                               probe=self.ids.probe, find=self._find, next_seqs=self.core.next_seqs,
                               new_id=lambda: uuid.uuid4().hex, counters=self.core.counters)
        for part, hashes in got.frames:
            (off,) = self.messages.append([part.encode()])
            self.unfiled.append(off, self.messages.end_offset, part, hashes)
        return got.result

    def write_bytes_bound(self, batch: Batch) -> int:
        """Disk bytes that accepting ``batch`` and filing it take at most (``diskbounds``)."""
        return diskbounds.write_bytes_bound(self, batch)

    def unfiled_bytes_bound(self) -> int:
        """Disk bytes that filing what is accepted and not filed yet will take at most."""
        return diskbounds.unfiled_bytes_bound(self)

    def cancel_bytes_bound(self, msg_id: str) -> int:
        """``write_bytes_bound`` of the tombstone ``cancel(msg_id)`` appends and files."""
        return diskbounds.cancel_bytes_bound(self, msg_id)

    def flush_messages(self) -> int:
        """fsync the message log (tests and tools; the service uses a GroupCommitter)."""
        self.messages.flush()
        self.durable_offset = self.messages.end_offset
        return self.durable_offset

    # ------------------------------------------------------------------ lookup and cancel

    def _find(self, msg_id: str) -> tuple[Message | Retired, int | None] | None:
        return lookup.find(self, msg_id)

    def lookup(self, msg_id: str) -> LookupResult:
        return lookup.lookup(self, msg_id)

    def cancel(self, msg_id: str, *, now_ms: int, extra: bytes = b"") -> int:
        """Append a tombstone for a pending message and drop it from the wheel.

        Returns the cancelled seq. ``NotFound`` for an unknown id, ``TooLate`` once the
        message was dispatched or is being dispatched. Cancelling twice is answered
        with the first tombstone's result (idempotent). Durable after ``flush``.
        """
        self.note_now(now_ms)
        found = self._find(msg_id)
        if found is None:
            raise NotFound(f"no message with id {msg_id!r}")
        m, eff = found
        if isinstance(m, Retired):
            raise TooLate(f"message {msg_id!r} was dispatched or cancelled (its record has expired)")
        if m.kind == KIND_CANCEL:
            return struct.unpack("<Q", m.payload)[0]
        if self.core.status(m.seq, eff) in ("dispatched", "in_flight"):
            raise TooLate(f"message {msg_id!r} was already dispatched")
        if eff is None:  # not filed yet: the tombstone is filed right after it, in the same second
            eff = max(m.deliver_at_ms, self.persisted_completed_ms)
        seqs = self.core.next_seqs(1)
        tomb = Batch.build(m.subject, [struct.pack("<Q", m.seq)], [msg_id], [eff], seq=seqs, store_ms=now_ms,
                           kind=KIND_CANCEL, extras=[extra] if extra else None)  # extra: a move (drain.py)
        (off,) = self.messages.append([tomb.encode()])
        self.unfiled.append(off, self.messages.end_offset, tomb, key_hashes([msg_id.encode()]))
        self.core.wheel.cancel(np.array([m.seq], np.uint64))
        self.core.unfiled_cancels.add(m.seq)  # until the tombstone is filed (_file): see DelayCore.chunk
        self.core.counters["cancelled"] += 1
        return m.seq

    # ------------------------------------------------------------------ iterator (filing)

    def iterate(self, limit: int | None) -> int:
        """File durable batches from the message log into the schedule log; returns records filed.

        A follower files only up to the master's checkpointed iterate offset, under the
        master's checkpointed completed_ms (see ``follow``)."""
        end = self.durable_offset
        if self.follower:
            end = min(end, self.replicated["iterate_offset"] if self.replicated else self.iterate_offset)
        n = 0
        unfiled = self.unfiled
        while self.iterate_offset < end and (limit is None or n < limit):
            # every durable batch still in memory, filed together: one frame per due second
            # for all of them, one id-index write
            take = []
            offset = self.iterate_offset
            for u in unfiled.frames:
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
                    unfiled.popleft()
                self.iterate_offset = offset
                continue
            # not in memory (replay after a restart, replicated bytes): read the log
            for off, body in self.messages.iterate(self.iterate_offset, end):
                b = Batch.decode(body)
                self._file(b, key_hashes(b.id_bytes_list()))
                self.iterate_offset = off + LOG_HEADER_SIZE + len(body)
                n += b.n
                if unfiled and unfiled.frames[0].offset == self.iterate_offset:
                    break
                if limit is not None and n >= limit:
                    break
            while unfiled and unfiled.frames[0].offset < self.iterate_offset:  # filed from the log
                unfiled.popleft()
        assert self.iterate_offset <= self.durable_offset, (self.iterate_offset, self.durable_offset)
        self.core.counters["filed"] += n
        return n

    def _file(self, batch: Batch, hashes: np.ndarray) -> None:
        core = self.core
        if core.voided and core.unvoid(batch.seq[core.voided_mask(batch.seq)]):
            cuts.save_voided(self._voided_path, self.core)
        is_cancel = batch.kind == KIND_CANCEL
        eff = core.effective_times(batch, is_cancel)
        if is_cancel.any():
            lookup.cancels_beside_targets(self, batch, is_cancel, eff)
            gone = is_cancel & lookup.buckets_retired(self, eff)
            if gone.any():
                # their messages' bucket is retired (docs/design.md, "Cancel"): filing them would
                # create it again under the id index's old offsets. The message is gone with it
                core.cancels_retired(batch.cancel_targets()[gone], eff[gone], (batch.subjects, batch.subject_idx[gone]))
                keep = np.flatnonzero(~gone)
                batch, hashes, eff, is_cancel = batch.take(keep), hashes[keep], eff[keep], is_cancel[keep]
                if not batch.n:
                    return
        batch = batch.replace(effective_ms=eff.astype(np.int64))
        soon = None if self.follower else core.wheel.loaded_until_ms + self.settings.cache_ahead_ms
        force = self.refiled.mask(batch, refile_seq_max=core.refile_seq_max, index=self.ids)
        placed = self.schedule.file(batch, cache_before_ms=soon, force=force)
        self.subject_tables.filed(batch, placed)
        seq = batch.seq
        last_ids = self.ids.last_seq()
        new = seq > np.uint64(last_ids) if last_ids >= 0 else np.ones(batch.n, bool)
        if force is not None:
            self.refiled.note(batch, force & placed.filed, placed)
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
        if core.filed(batch, is_cancel, placed.filed, placed.frames):
            self.wheel_changed = True

    # ------------------------------------------------------------------ wheel and dispatch

    @property
    def _loading(self):
        """The second half loaded into the wheel, if any (``SecondLoader.current``)."""
        return self.loader.current

    def next_due_ms(self) -> int | None:
        """When the earliest held message is due (the shell sleeps until then)."""
        return self.core.wheel.next_due_ms()

    def wheel_wake_ms(self) -> int | None:
        """When the wheel next has work that nothing will wake the shell for: the earliest
        held message's due time, or the time the next second becomes loadable (``window_ms``
        before it starts; loading it also moves the cursor and ``completed_ms``), whichever
        is first. Filing into a loaded second, a release and a settled dispatch round wake
        the shell on their own (``wheel_changed``, the dispatch slots). ``None`` when
        neither is known (a full wheel with nothing held cannot happen: it waits on
        dispatch). A second half loaded or a catch-up with seconds still loadable wants the
        next poll a tick after the cursor at the latest, as the loop always polled."""
        return self.core.wake_ms(loading=self.loader.current is not None)

    def dispatch_lag_ms(self, now_ms: int) -> int:
        """How far dispatching is behind ``now_ms``: ``now_ms - completed_ms``, except that a
        wheel at rest (nothing in flight, nothing held due by ``now_ms``, the seconds up to
        it loaded) is not behind, even though its loop last moved ``completed_ms`` up to
        ``wheel_idle_wait_ms_max`` ago."""
        self.note_now(now_ms)
        return self.core.lag_ms(now_ms, loading=self.loader.current is not None)

    def poll_due(self, *, now_ms: int) -> list[DueBatch]:
        """Load seconds ahead, advance the wheel to ``now_ms``; return what is due as one
        in-flight unit (empty list when nothing is due or ``inflight_max`` is reached)."""
        self.note_now(now_ms)
        core = self.core
        if core.inflight >= self.settings.inflight_max:
            return []
        self.loader.load()
        fired = core.wheel.advance(now_ms)
        # a catch-up may need more seconds than one load allowed
        while not fired and core.wheel.cursor_ms <= now_ms and core.wheel.seconds_to_load(1):
            loaded = core.wheel.loaded_until_ms
            self.loader.load(step_frames=None)
            if core.wheel.loaded_until_ms == loaded:
                break  # no progress (a bucket that failed its checks again): the next poll tries again
            fired = core.wheel.advance(now_ms)
        out = core.unit_of(fired)
        core.advance_completed()
        return out

    def ack_dispatched(self, unit: int, idx, *, now_ms: int, outcome: int = OUTCOME_OK) -> int:
        """Record messages ``idx`` of an in-flight unit as delivered (or dead-lettered): one
        dispatch record. Returns how many were recorded (already settled ones are skipped, an
        index repeated counts once)."""
        self.note_now(now_ms)
        got = self.core.dispatch_record(unit, idx, now_ms=now_ms, outcome=outcome)
        if got is None:
            return 0
        live, rec = got
        # written before the unit is settled: a full disk (DiskFull) leaves them in flight,
        # and the caller gives them back to the wheel
        (off,) = self.dispatch.append([rec.encode()])
        return self.core.acked(unit, live, rec, off, dead_letter=outcome == OUTCOME_DEAD_LETTER)

    def release(self, unit: int, idx) -> None:
        """Give messages ``idx`` of an in-flight unit back to the wheel (dispatch failed, retried)."""
        held = self.core.release(unit, idx)
        if held is None:
            return
        if not held:  # cannot happen (their seconds are loaded); never drop a message silently
            log.error("released messages not taken back by the wheel unit=%d", unit)
        self.wheel_changed = True

    def unit_batch(self, unit: int) -> Batch | None:
        return self.core.flight.batch(unit)

    def tick_state(self) -> TickState:
        return self.core.tick_state(self.dispatch.end_offset)

    def replication_doc(self) -> dict[str, int]:
        """What a master ships to its slaves with every fetch answer: its last **durable**
        checkpoint, never its live tick state (``DelayCore.replication_doc`` says why)."""
        return self.core.replication_doc(self.dispatch.end_offset)

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
        self.subject_tables.plan_write(plan, completed_ms=self.persisted_completed_ms)
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
        got = self.core.checkpoint_doc(iterate_offset=self.iterate_offset, dispatch_end_offset=self.dispatch.end_offset,
                                       log_end=self.messages.end_offset)
        if got is not None:
            doc, persisted = got
            plan.write_doc(self._gate, self._ckpt_path, doc)
            plan.on_done(persisted)

    # ------------------------------------------------------------------ replication (follower side)

    def follow(self, master_checkpoint: dict | None = None) -> None:
        """Become (or stay) a follower; ``master_checkpoint`` is the master's last checkpoint
        (iterate_offset, completed_ms, dispatch_offset), shipped with its tick state."""
        self.core.follow(master_checkpoint, durable_offset=self.durable_offset)

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
           records from ``dispatch_offset`` on name what was delivered, and the whole dispatch
           log what this slave filed late, after the old master had delivered it:
           ``late_filed.py``): it aligns to the wall clock in ``poll_due`` (behind: catch-up;
           ahead: it waits);
        4. the buckets the wheel loads first verified (heal.py), pending counts rebuilt;
        5. the rest of the replicated log filed as a master files it, under the restored
           ``completed_ms``. Voided seqs (divergent suffixes truncated while following)
           stay voided: they live in ``voided.json`` and memory, not in the checkpoint."""
        if not self.follower:
            raise AssertionError("promote() of a store that is already the master")
        self.note_now(now_ms)
        core = self.core
        t = {"t0": time.perf_counter()}
        self.iterate(limit=None)
        self.checkpoint()
        t["file_checkpoint"] = time.perf_counter()
        ck = checkpoint.read(self._ckpt_path) or {}
        core.follower = False
        core.replicated = None
        # the term's epoch from the election (unique in the group: two terms that never saw each
        # other's records still never issue the same seq), and never below what this store used
        core.epoch = max(max(core.epoch, int(ck.get("epoch", 0))) + 1, store_epoch)
        last = self.ids.last_seq()
        if last >= 0 and (last >> SEQ_EPOCH_SHIFT) >= core.epoch:
            core.epoch = (last >> SEQ_EPOCH_SHIFT) + 1
        core.counter = 0
        core.flight = InFlight()
        recovery.restore_tick(core, self.dispatch, ck, now_ms)
        self.healer.wheel_restarted()  # missing records the old wheel passed are due again
        self._save_checkpoint()  # the new epoch is durable before any seq of it is used
        t["epoch_wheel"] = time.perf_counter()
        self.healer.check_soon(ahead_ms=self.settings.verify_ahead_ms)
        t["verify"] = time.perf_counter()
        # records this slave filed late, after the master had delivered them: the replayed dispatch
        # records do not name them (late_filed.py); the whole dispatch log is searched for them
        late_filed.name_delivered(self.schedule, self.dispatch, core, max(core.completed_ms, core.late_filed_max_ms))
        core.late_filed_max_ms = -1
        t["late_filed"] = time.perf_counter()
        self.subject_tables.count_pending(core)
        t["pending"] = time.perf_counter()
        self._late_filed_after_replay(self.iterate(limit=None))
        self._bump_past_filed_seqs()
        t["file_rest"] = time.perf_counter()
        steps = list(t)
        return {k: round((t[k] - t[steps[i - 1]]) * 1000, 1) for i, k in enumerate(steps) if i}

    def _late_filed_after_replay(self, filed: int) -> None:
        """Records filed just now, as a master, behind the restored tick state may be ones the
        old master delivered (late_filed.py): found in the dispatch log, the counts are made
        again. Nothing has loaded their seconds into the wheel yet."""
        if filed and late_filed.name_delivered(self.schedule, self.dispatch, self.core, self.core.completed_ms):
            self.subject_tables.count_pending(self.core)

    def appended(self) -> None:
        """Replicated bytes were appended and fsynced: they are durable here."""
        self.durable_offset = self.messages.end_offset

    def truncate_messages(self, cut: int) -> int:
        """Drop a divergent message-log suffix (records the new master never had); the records
        it held are voided. Returns the records voided (``cuts.truncate_messages``)."""
        return cuts.truncate_messages(self, cut)

    def truncate_dispatch(self, cut: int) -> int:
        """Drop a divergent dispatch-log suffix; returns the bytes dropped (``cuts.truncate_dispatch``)."""
        return cuts.truncate_dispatch(self, cut)

    def close(self) -> None:
        self.flush_messages()
        self.iterate(limit=None)
        self.subject_tables.everything = True  # a close leaves every subject table written
        self.checkpoint()
        self._gate.close()
        self.schedule.close()
        self.ids.close()
        self.dispatch.close()
        self.messages.close()


__all__ = ["LOAD_STEP_FRAMES", "DelayStore", "DueBatch", "IdLocation", "LookupResult", "StoreSettings"]
