"""DelayCore: the delay store's decisions, with no file, socket, thread or clock.

``DelayStore`` (node/delay/store.py) is the shell: it opens the files, reads and writes them
and asks this core what to do. The core owns the state that decides:

* the seqs of the current store epoch (``next_seqs``), the filing rule (``effective_times``, ``filed``);
* the timing wheel and ``completed_ms`` (``advance_completed``, ``behind``): what was
  delivered, what a checkpoint may claim, the tick state and the checkpoint documents;
* the delivered-seq map (``dispatched``), fed by dispatch records (``note_dispatched``,
  ``replayed``), pruned behind the persisted ``completed_ms``;
* the in-flight units (``fire``, ``acked``, ``release``; held in node/delay/inflight.py) and
  the pending counts per bucket (and per subject: node/delay/subjects.py);
* voided seq ranges (a divergent suffix cut off), cancels not filed yet, which messages of a
  frame the wheel may hold (``chunk``), the status of a record.

Time always comes in as ``now_ms``. Effects go out as values: ``fire`` returns the unit to
dispatch, ``dispatch_record`` the record the shell appends before ``acked`` settles it,
``checkpoint_doc`` the document the shell writes (and what becomes true once it is durable).

Invariants that make restart exact:

* ``completed_ms``: every message whose effective due time is before it has been
  dispatched (it is in a dispatch record). It is ``min(wheel cursor, earliest due time held
  in the wheel, effective time of anything in flight)`` rounded down to a tick. A message filed behind it steps it back,
  never back past the last durable checkpoint (asserted in ``behind``): the filing rule
  puts the message at or after ``persisted_completed_ms``. Two steps may go further, and
  are not asserted: a checkpoint whose document was taken before such a message was filed
  finishes (``checkpoint_plan`` runs off the loop) while the message is in flight, and
  records a bucket rebuild hands back late, clamped into their bucket (heal.py).
* A message is filed under ``effective_ms = max(deliver_at_ms, persisted completed_ms)``,
  so a restart that reloads seconds from the persisted ``completed_ms`` sees every
  undispatched message.
* ``dispatch_offset`` in the tick state is the offset of the first dispatch record
  holding a message whose effective time is ``>= completed_ms``: after a restart the
  records from there on name the messages already delivered in the reloaded seconds.
* Replaying the message log after a crash skips what each bucket already holds
  (per-bucket seq high-water mark) and what the id index already holds.
* Pending counts add up: every bucket's count is positive (asserted), and equals a recount
  from the schedule index (``DelayStore.check_invariants``); ``inflight`` is the sum of the
  units' live messages (asserted). (The shell asserts that the iterate offset never passes
  the durable offset, ``DelayStore.iterate``.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from cluster.codec import KIND_CANCEL, KIND_MESSAGE, Batch, DispatchBatch
from cluster.errors import Overloaded
from node.delay import voided
from node.delay.inflight import DueBatch, InFlight
from node.delay.subjects import SubjectPending
from node.store import records
from node.store.records import SEQ_COUNTER_MAX
from node.store.schedule import FrameRef
from node.store.settings import StoreSettings
from node.wheel import Chunk, TickState, TimingWheel

DISPATCHED_PRUNE_STEP = 4096  # delivered seqs forgotten per dispatch record at most (prune_dispatched)


class DelayCore:
    """The decisions of one delay store (module docs). ``restore_tick`` must run before the
    wheel is used (the shell's recovery does it)."""

    def __init__(self, settings: StoreSettings, *, epoch: int, follower: bool) -> None:
        self.settings = settings
        self.epoch = epoch
        self.counter = 0
        self.follower = follower
        self.flight = InFlight()
        self.unfiled_cancels: set[int] = set()  # seqs cancelled whose tombstones are not filed yet
        self.voided: list[tuple[int, int]] = []  # [lo, hi) seq ranges cut off (voided.json)
        # the largest seq a truncation ever cut: filing's high-water marks (per bucket, id index)
        # assume seqs grow along the log, which a cut and a refetch can break; records at or
        # below it are checked one by one instead (``DelayStore._file``)
        self.refile_seq_max = -1
        self.pending: dict[int, int] = {}  # bucket start -> messages filed, not dispatched nor cancelled
        self.subjects = SubjectPending(settings.bucket_ms)  # the same split by subject (node/delay/subjects.py)
        # the completed_ms the pending counts were made from (``counted``): a message due before
        # it was never counted, so its tombstone takes nothing off (``cancelled_counts``)
        self.pending_from_ms = -1
        self.counters = {"accepted": 0, "duplicates": 0, "filed": 0, "dispatched": 0, "cancelled": 0,
                         "dead_lettered": 0}
        self.persisted_doc: dict = {}  # the last checkpoint known durable: retention deletes only what it covers
        self.replicated: dict | None = None  # a follower's copy of the master's checkpoint (``follow``)
        # the largest effective time a follower filed a message under later than its due time
        # (overdue: maybe delivered by the master already; node/delay/late_filed.py); -1: none
        self.late_filed_max_ms = -1

    # ------------------------------------------------------------------ seqs

    def next_seqs(self, k: int) -> np.ndarray:
        if self.counter + k - 1 > SEQ_COUNTER_MAX:
            raise Overloaded("sequence space of this epoch is exhausted; restart the node")
        base = records.make_seq(self.epoch, self.counter)
        self.counter += k
        return np.arange(base, base + k, dtype=np.uint64)

    # ------------------------------------------------------------------ tick state

    def restore_tick(self, ck: dict, *, dispatch_offset: int, now_ms: int) -> None:
        """Wheel and ``completed_ms`` from a checkpoint document ``ck`` (its ``completed_ms``,
        or none: start at ``now_ms``); ``dispatch_offset``: where the dispatch records naming
        what was delivered since start (the shell then feeds them to ``replayed``)."""
        settings = self.settings
        if "completed_ms" in ck:
            self.completed_ms = int(ck["completed_ms"])
            state = TickState(self.epoch, self.completed_ms // settings.tick_ms - 1, 0, dispatch_offset)
            self.wheel = TimingWheel.restore(state, tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                             entries_max=settings.wheel_entries_max)
        else:
            self.completed_ms = now_ms - now_ms % settings.tick_ms
            self.wheel = TimingWheel(tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                     start_ms=self.completed_ms, entries_max=settings.wheel_entries_max)
        self.wheel.epoch = self.epoch
        self.persisted_doc = {k: ck[k] for k in ("iterate_offset", "completed_ms", "dispatch_offset") if k in ck}
        self.restored_completed_ms = self.completed_ms
        self.persisted_completed_ms = self.completed_ms
        # messages delivered at or after completed_ms (reloaded seconds must skip them)
        self.dispatched: dict[int, int] = {}
        self.dispatched_eff_max = -1  # largest effective time in dispatched
        # the seqs put into dispatched, per dispatch record, in order: (max effective_ms, seqs),
        # so that entries below the floor leave a few records at a time (prune_dispatched)
        self._dispatched_added: deque[tuple[int, list[int]]] = deque()
        self.dispatch_trail: deque[tuple[int, int]] = deque()  # (max effective_ms, offset) per record

    def replayed(self, offset: int, d: DispatchBatch) -> None:
        """A dispatch record read back at restore (offset ``offset``)."""
        self.note_dispatched(d.seq, d.effective_ms)
        self.dispatch_trail.append((int(d.effective_ms.max()) if d.n else 0, offset))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.wheel.epoch = epoch

    def behind(self, low: int, *, filed: bool = True) -> None:
        """Something due at ``low`` entered the wheel behind ``completed_ms``: it steps back so
        a checkpoint cannot skip it before it is dispatched. ``filed``: a record just filed,
        whose time the filing rule put at or after the persisted value, so the step back never
        passes the last durable checkpoint (asserted). Records a bucket rebuild hands back late
        (heal.py) are clamped into their bucket and may be older."""
        if low < self.completed_ms:
            self.completed_ms = low - low % self.settings.tick_ms
            assert not filed or self.completed_ms >= self.persisted_completed_ms, \
                (self.completed_ms, self.persisted_completed_ms)

    def advance_completed(self) -> None:
        c = self.wheel.cursor_ms
        low = self.flight.low_ms()  # the earliest effective time in flight
        if not self.follower:
            # an overdue entry held behind the cursor (filed or released behind it, not fired
            # yet) is not delivered: completed_ms never passes it (as tick_state), or lookup
            # answered 'dispatched' and cancel TooLate for a message that had not fired
            held = self.wheel.next_due_ms()
            if held is not None and held < c:
                c = held
        if low is not None:
            c = min(c, low)
        c -= c % self.settings.tick_ms  # always a whole tick: exactly what a checkpoint persists
        if c > self.completed_ms or (low is not None and low < self.completed_ms):
            # up as the wheel and the deliveries go on; down when a message fires behind it (a
            # second loaded behind the cursor: simulation seed 18 lost two that way, completed_ms
            # passed them while they were in flight and the next checkpoint skipped them)
            self.completed_ms = c
        # keep the dispatch records a restart from the persisted value needs
        floor = self.persisted_completed_ms
        trail = self.dispatch_trail
        while trail and trail[0][0] < floor:
            trail.popleft()
        self.prune_dispatched(floor)

    def note_dispatched(self, seq: np.ndarray, effective_ms: np.ndarray) -> None:
        if not len(seq):
            return
        seqs = seq.tolist()
        self.dispatched.update(zip(seqs, effective_ms.tolist()))
        eff_max = int(effective_ms.max())
        self.dispatched_eff_max = max(self.dispatched_eff_max, eff_max)
        self._dispatched_added.append((eff_max, seqs))

    def prune_dispatched(self, floor: int) -> None:
        """Forget delivered seqs due before ``floor`` (a restart from the persisted tick state
        never reloads them), at most ``DISPATCHED_PRUNE_STEP`` per call: the work is spread
        over the dispatch records as they come, never one pass over the whole map on the
        event loop (at 20,000 msgs/s that pass held the loop ~10 ms every few seconds)."""
        added, pop, budget = self._dispatched_added, self.dispatched.pop, DISPATCHED_PRUNE_STEP
        while added and added[0][0] < floor and budget > 0:
            _, seqs = added.popleft()
            for s in seqs:
                pop(s, None)
            budget -= len(seqs)

    def dispatched_seqs(self, effective_ms: np.ndarray) -> np.ndarray | None:
        """Seqs delivered that could be among records due at ``effective_ms`` (None: none can).
        Delivered messages are due before the wheel cursor, and a second is loaded before
        anything in it fires, so on a running master this is None; after a restart the
        reloaded seconds may hold messages delivered before the crash."""
        if not self.dispatched or int(effective_ms.min()) > self.dispatched_eff_max:
            return None
        return np.fromiter(self.dispatched.keys(), np.uint64, len(self.dispatched))

    def tick_state(self, dispatch_end_offset: int) -> TickState:
        offset = self.dispatch_trail[0][1] if self.dispatch_trail else dispatch_end_offset
        completed = self.completed_ms
        if not self.follower:
            # an overdue entry held behind completed_ms (added or loaded behind the cursor, not
            # fired yet) is not delivered: the state never claims its tick (as TimingWheel.state)
            earliest = self.wheel.next_due_ms()
            if earliest is not None and earliest < completed:
                completed = earliest
        return TickState(self.epoch, completed // self.settings.tick_ms - 1, 0, offset)

    # ------------------------------------------------------------------ checkpoint documents

    def checkpoint_doc(self, *, iterate_offset: int, dispatch_end_offset: int,
                       log_end: int) -> tuple[dict, Callable[[], None]] | None:
        """The checkpoint document to write now and what to note once it is durable (None:
        nothing to write, a follower with nothing from a master yet)."""
        tick_ms = self.settings.tick_ms
        if self.follower and self.replicated is None:
            return None  # nothing from a master yet: keep the checkpoint as it is
        if self.follower:
            # a follower persists the master's tick state with its own iterate offset:
            # a promotion restores the wheel from exactly what the master had completed
            r = self.replicated
            completed = int(r["completed_ms"])
            dispatch_offset = min(int(r["dispatch_offset"]), dispatch_end_offset)
            doc = {"version": 2, "epoch": self.epoch, "iterate_offset": iterate_offset,
                   "completed_ms": completed, "dispatch_offset": dispatch_offset,
                   "tick": completed // tick_ms - 1, "replicated": r}
            return doc, lambda: setattr(self, "persisted_doc", doc)
        st = self.tick_state(dispatch_end_offset)
        completed = (st.tick + 1) * tick_ms
        # log_end: the message log's end when the document was taken. completed_ms may rest on
        # any record before it: a tombstone appended (not filed yet) takes its message out of
        # the wheel at once. A slave takes the document only once it holds the log that far.
        done = {"iterate_offset": iterate_offset, "completed_ms": completed, "dispatch_offset": st.dispatch_offset,
                "log_end": log_end}

        def persisted() -> None:
            self.persisted_completed_ms = completed
            self.last_checkpoint = done
            self.persisted_doc = done
        return {"version": 2, "epoch": self.epoch, "tick": st.tick, **done}, persisted

    def replication_doc(self, dispatch_end_offset: int) -> dict[str, int]:
        """What a master ships to its slaves with every fetch answer (``DelayStore.follow`` on theirs):
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
            keys = ("iterate_offset", "completed_ms", "dispatch_offset", "log_end")
            return {k: int(doc[k]) for k in keys if k in doc}
        st = self.tick_state(dispatch_end_offset)  # nothing persisted yet (never on a store that opened)
        return {"iterate_offset": 0, "completed_ms": (st.tick + 1) * self.settings.tick_ms,
                "dispatch_offset": st.dispatch_offset}

    def follow(self, master_checkpoint: dict | None, *, durable_offset: int) -> None:
        """Become (or stay) a follower under the master's last checkpoint (``DelayStore.follow``)."""
        self.follower = True
        self.flight.clear()
        if master_checkpoint is not None:
            if int(master_checkpoint.get("log_end", -1)) > durable_offset:
                # its completed_ms may rest on records this replica does not hold yet (a
                # tombstone: chaos meta-pause seed 7): the previous document stands until then
                return
            self.replicated = dict(master_checkpoint)
            self.persisted_completed_ms = self.completed_ms = int(master_checkpoint["completed_ms"])

    def own_doc(self, log_end: int) -> dict | None:
        """A follower's tick state before any document of the current master: what it restored
        at open (its own, from its last term as master), as a replicated document; None when
        it is the master or has none."""
        if not self.follower or "completed_ms" not in self.persisted_doc:
            return None
        r = {k: int(v) for k, v in self.persisted_doc.items()}
        r.setdefault("log_end", log_end)
        return r

    def forget_cut_cancels(self, cut: int, cut_batches: list[Batch], *, log_end: int) -> tuple[bool, bool]:
        """The replicated tick state may rest on the suffix being cut: a tombstone there took its
        message out of the old master's wheel, and its completed_ms passed the message. The
        tombstone goes; the message stays (it is before the cut) and must be loaded again at a
        promotion: completed_ms goes back below every cut tombstone's message. Returns (the
        replicated document changed: the caller persists it, completed_ms was lowered).

        A follower with no document from the current master yet holds the tick state it
        restored at open: its own, from its last term as master, which rests on its suffix as
        much (chaos meta-pause seed 18: its own tombstones were cut and a promotion took their
        messages for delivered). Lowered, that becomes the document it persists."""
        r = self.replicated
        own = r is None
        if own:
            r = self.own_doc(log_end)
            if r is None:
                return False, False
        if int(r.get("log_end", r.get("iterate_offset", 0))) <= cut:
            return False, False
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
        if own:
            # adopted even when not lowered: its iterate offset is cut back, and the follower
            # checkpoint written from it replaces the own one, whose iterate offset a restart
            # would otherwise read inside the new master's bytes
            self.replicated = r
        return True, lowered

    # ------------------------------------------------------------------ in flight

    def fire(self, now_ms: int) -> list[DueBatch]:
        """Advance the wheel to ``now_ms`` (its seconds loaded by the shell): what is due, as one unit."""
        return self.unit_of(self.wheel.advance(now_ms))

    def unit_of(self, fired) -> list[DueBatch]:
        if not fired:
            return []
        # in due order: a real-time node holds a subject at its first message not due yet
        b = Batch.gather([(f.ref.batch, f.idx) for f in fired], due_order=True)
        return [self.flight.add(b)]

    @property
    def inflight(self) -> int:
        """Messages in flight (fired, not acknowledged nor released)."""
        return self.flight.count

    def dispatch_record(self, unit: int, idx, *, now_ms: int, outcome: int) -> tuple[np.ndarray, DispatchBatch] | None:
        """The dispatch record of messages ``idx`` of a unit not settled yet (None: none are):
        the shell appends it, then calls ``acked``."""
        got = self.flight.live(unit, idx)
        if got is None:
            return None
        u, idx = got
        b = u.batch  # three columns, not a take: the record carries no blob (ids, payloads)
        return idx, DispatchBatch(b.seq[idx], b.effective_ms[idx], b.deliver_at_ms[idx], now_ms, outcome)

    def acked(self, unit: int, idx: np.ndarray, rec: DispatchBatch, offset: int, *, dead_letter: bool) -> int:
        """The dispatch record ``rec`` of a unit's messages ``idx`` is appended at ``offset``."""
        b, idx = self.flight.settle_indexes(unit, idx)
        self.note_dispatched(rec.seq, rec.effective_ms)
        self.dispatch_trail.append((int(rec.effective_ms.max()), offset))
        self.pending_add(rec.effective_ms, -1, (b.subjects, b.subject_idx[idx]))
        self.counters["dead_lettered" if dead_letter else "dispatched"] += rec.n
        self.advance_completed()
        return rec.n

    def release(self, unit: int, idx) -> bool | None:
        """Give messages ``idx`` of a unit back to the wheel: whether the wheel took them
        (None: none were in flight)."""
        b = self.flight.settle(unit, idx)
        if b is None:
            return None
        ref = FrameRef(-1, -1, 0, b)  # held in memory only: the schedule log still has them
        held = self.wheel.add(Chunk(b.effective_ms.copy(), b.seq.copy(), np.arange(b.n, dtype=np.int32), ref))
        self.advance_completed()
        return bool(held)

    def status(self, seq: int, eff: int | None) -> str:
        """in_flight | dispatched | pending, of a message record with seq ``seq`` filed under
        ``eff`` (None: not filed yet)."""
        if self.flight.contains(seq):
            return "in_flight"
        if seq in self.dispatched:
            return "dispatched"
        # behind the persisted value, a message that is not in flight was delivered (its entry in
        # dispatched is pruned there). completed_ms alone is not enough: it steps back below the
        # persisted value while an older message is in flight (advance_completed), and a cancel
        # then took a message already at the real-time node for pending (chaos meta-pause seed 7
        # on 02f403d: received after the cancel was acknowledged)
        if eff is not None and eff < max(self.completed_ms, self.persisted_completed_ms):
            return "dispatched"
        return "pending"

    def wake_ms(self, *, loading: bool) -> int | None:
        """See ``DelayStore.wheel_wake_ms``; ``loading``: a second is half loaded."""
        w = self.wheel
        nxt = w.next_due_ms()
        if loading or w.seconds_to_load(1):
            soon = w.cursor_ms + self.settings.tick_ms
            return soon if nxt is None else min(nxt, soon)
        if len(w) >= w.entries_max:
            return nxt
        loadable = w.loaded_until_ms - w.window_ms
        return loadable if nxt is None else min(nxt, loadable)

    def lag_ms(self, now_ms: int, *, loading: bool) -> int:
        """See ``DelayStore.dispatch_lag_ms``."""
        w = self.wheel
        nxt = w.next_due_ms()
        if not self.inflight and not loading and w.loaded_until_ms > now_ms and (nxt is None or nxt > now_ms):
            return 0
        return max(0, now_ms - self.completed_ms)

    # ------------------------------------------------------------------ the wheel's view of a frame

    def chunk(self, ref: FrameRef, *, reload: bool, cancelled: np.ndarray | None = None,
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
        if self.unfiled_cancels:
            # cancels answered whose tombstones are not filed yet: a second loaded (or a message
            # filed) before its tombstone must not bring the message into the wheel
            mask &= ~np.isin(seq, np.fromiter(self.unfiled_cancels, np.uint64, len(self.unfiled_cancels)))
        if self.voided:
            mask &= ~self.voided_mask(seq)
        delivered = self.dispatched_seqs(b.effective_ms)
        if delivered is not None:
            mask &= ~np.isin(seq, delivered)
        if reload:
            mask &= b.effective_ms >= self.restored_completed_ms
            flying = self.flight.seqs()
            if flying is not None:
                mask &= ~np.isin(seq, flying)
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

    def effective_times(self, batch: Batch, is_cancel: np.ndarray) -> np.ndarray:
        """The filing rule: a message is filed under ``max(deliver_at_ms, persisted
        completed_ms)``, a tombstone under its own time (its message's, where that member
        filed it: the shell moves it beside its target, ``lookup.cancels_beside_targets``)."""
        return np.where(is_cancel, batch.deliver_at_ms, np.maximum(batch.deliver_at_ms, self.persisted_completed_ms))

    def filed(self, batch: Batch, is_cancel: np.ndarray, placed: np.ndarray, frames: list[FrameRef]) -> bool:
        """``batch`` (effective times set) was written into the schedule log: ``placed`` says
        which records are new there, ``frames`` are its new frames. Counts them, and on a master
        hands them to the wheel and takes what its tombstones cancel out of it. True when the
        wheel took something (the shell wakes its loop)."""
        if placed.any():
            eff = batch.effective_ms[placed]
            tomb = is_cancel[placed]
            sign = np.where(tomb, -self.cancelled_counts(eff), 1)
            self.pending_add(eff, sign, (batch.subjects, batch.subject_idx[placed]))
        if self.follower:
            late = placed & ~is_cancel & (batch.deliver_at_ms < batch.effective_ms)
            if late.any():
                self.late_filed_max_ms = max(self.late_filed_max_ms, int(batch.effective_ms[late].max()))
            return False  # a follower keeps no wheel: it is rebuilt from the schedule log on promotion
        targets = None
        if is_cancel.any():
            targets = batch.cancel_targets()[is_cancel]
            self.wheel.cancel(targets)  # messages filed by an earlier call
            if self.unfiled_cancels:
                self.unfiled_cancels.difference_update(int(t) for t in targets.tolist())
        changed = False
        for ref in frames:
            # and in this very call; filed behind the wheel (effective >= persisted completed_ms):
            # completed_ms steps back so a checkpoint cannot skip it before it is dispatched
            changed |= self.offer(self.chunk(ref, reload=False, cancelled=targets))
        return changed

    def cancels_retired(self, targets: np.ndarray, effective_ms: np.ndarray, subjects=None) -> None:
        """Tombstones that are not filed: their messages' bucket (at ``effective_ms``) is retired,
        the messages went with it (``DelayStore._file``). Their messages count as pending no more,
        and are out of the wheel (already: no bucket is retired while it holds one)."""
        self.pending_add(effective_ms, -self.cancelled_counts(effective_ms), subjects)
        if self.follower:
            return
        self.wheel.cancel(targets)
        if self.unfiled_cancels:
            self.unfiled_cancels.difference_update(int(t) for t in targets.tolist())

    def offer(self, chunk: Chunk | None, *, filed: bool = True) -> bool:
        """A chunk to the wheel (``filed``: of records just filed, see ``behind``): True when
        it took entries (``completed_ms`` steps back for one behind it)."""
        if chunk is None or not self.wheel.add(chunk):
            return False
        self.behind(int(chunk.due_ms.min()), filed=filed)
        return True

    # ------------------------------------------------------------------ voided seqs (node/delay/voided.py)

    def voided_mask(self, seq: np.ndarray) -> np.ndarray:
        return voided.mask(self.voided, seq)

    def is_voided(self, seq: int) -> bool:
        return voided.contains(self.voided, seq)

    def void(self, seqs: np.ndarray) -> None:
        """Seqs cut off the message log: voided."""
        self.voided.extend(voided.ranges_of(seqs))
        self.refile_seq_max = max(self.refile_seq_max, int(seqs.max()))

    def unvoid(self, seq: np.ndarray) -> bool:
        """Records with these seqs are in the message log again: not voided any more. True
        when the ranges changed (the shell persists them)."""
        self.voided, changed = voided.without(self.voided, seq)
        return changed

    # ------------------------------------------------------------------ pending counts

    def counted(self, pending: dict[int, int]) -> None:
        """Pending counts made afresh from the schedule log (``recovery.count_pending``, at open
        and at a promotion): the messages filed at or after ``completed_ms``, not delivered."""
        self.pending = pending
        self.pending_from_ms = self.completed_ms

    def cancelled_counts(self, effective_ms: np.ndarray) -> np.ndarray:
        """Of tombstones filed at ``effective_ms`` (their messages'), which take one off the
        pending counts (1) or nothing (0). A message is counted from its filing, or from the last
        fresh count if it was filed by then; that count left out every message due before the
        completed_ms it was made from (delivered or cancelled). A tombstone a crash left unfiled
        for such a message is filed by the replay, and took another message's count with it."""
        return (effective_ms >= self.pending_from_ms).astype(np.int64)

    def pending_add(self, effective_ms: np.ndarray, sign: np.ndarray | int, subjects=None) -> None:
        """``subjects``: (subject table, subject index per record) of the records: the same
        counts split by subject (``self.subjects``)."""
        if not len(effective_ms):
            return
        bms = self.settings.bucket_ms
        if subjects is not None:
            self.subjects.add(effective_ms - effective_ms % bms, subjects[0], subjects[1], sign, effective_ms)
        lo, hi = int(effective_ms.min()), int(effective_ms.max())
        if lo - lo % bms == hi - hi % bms:  # the usual case: one bucket
            items = [(lo - lo % bms, len(effective_ms) * sign if isinstance(sign, int) else int(np.sum(sign)))]
        else:
            starts = effective_ms - effective_ms % bms
            weights = np.broadcast_to(np.asarray(sign, np.int64), starts.shape)
            uniq, inv = np.unique(starts, return_inverse=True)
            items = zip(uniq.tolist(), np.bincount(inv, weights=weights).astype(np.int64).tolist())
        for b, n in items:
            self.set_pending(b, self.pending.get(b, 0) + n)
            if b not in self.pending:  # as the bucket's count, none of its subjects' is below 1
                self.subjects.drop_bucket(b)

    def set_pending(self, start: int, n: int) -> None:
        if n > 0:
            self.pending[start] = n
        else:
            self.pending.pop(start, None)

    def dispatched_in(self, lo_ms: int, hi_ms: int) -> int:
        """Delivered messages remembered with an effective time in ``[lo_ms, hi_ms)``."""
        return sum(1 for eff in self.dispatched.values() if lo_ms <= eff < hi_ms)

    def check_invariants(self) -> None:
        """The cheap invariants of the module docs, all at once: tests call it after each step,
        with no checkpoint plan outstanding and no bucket rebuilt late (module docs)."""
        assert self.follower or self.completed_ms >= self.persisted_completed_ms, \
            (self.completed_ms, self.persisted_completed_ms)
        assert all(n > 0 for n in self.pending.values()), self.pending
        self.flight.check()


__all__ = ["DelayCore", "DueBatch"]
