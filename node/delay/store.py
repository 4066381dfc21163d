"""DelayStore: the delay node's storage engine, message log to dispatch log.

Owns a data folder::

    {root}/messages/   SegmentedLog (WAL) of message and cancel records, in seq order
    {root}/schedule/   ScheduleLog: records filed by due-time bucket, per-second chains
    {root}/ids/        IdIndex: message id -> place in the schedule log
    {root}/dispatch/   SegmentedLog of Dispatched records (one per delivered message)
    {root}/checkpoint  epoch, iterate offset, tick state (atomic JSON)

Flow (every step takes ``now_ms`` from the caller; nothing here reads a clock):

1. ``accept`` validates, de-duplicates by id, gives each message a seq
   ``(epoch << 40) | counter`` and appends it to the message log. The caller makes
   it durable (``flush`` or a GroupCommitter) before acknowledging.
2. ``iterate`` files durable records into the schedule log and the id index, and
   offers each to the wheel (held if its second is already loaded).
3. ``poll_due`` loads seconds into the wheel ahead of time and returns what is due,
   marking it in flight. ``ack_dispatched`` appends to the dispatch log.
4. ``checkpoint`` flushes schedule, ids and dispatch log, then records the iterate
   offset and the tick state.

Invariants that make restart exact:

* ``completed_ms``: every message whose effective due time is before it has been
  dispatched (its Dispatched record is in the dispatch log). It is
  ``min(wheel cursor, effective time of anything fired but not acknowledged)``
  rounded down to a tick, and it steps back when a message is filed behind it
  (never below the persisted value, which a filed message's time never is).
* A message is filed under ``effective_ms = max(deliver_at_ms, persisted
  completed_ms)``, so a restart that reloads seconds from the persisted
  ``completed_ms`` sees every undispatched message (a past-due message that
  arrives late is not filed in a second that will never be reloaded).
* ``dispatch_offset`` in the tick state is the offset of the first Dispatched
  record whose effective time is ``>= completed_ms``: after a restart the records
  from there on name the messages already delivered in the reloaded seconds.
* replaying the message log after a crash skips what each bucket already holds
  (per-bucket seq high-water mark) and what the id index already holds.
"""

from __future__ import annotations

import heapq
import logging
import os
import struct
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from cluster.errors import AlreadyExists, InvalidArgument, NotFound, Overloaded, TooLate
from node.store import checkpoint, records
from node.store.idindex import IdIndex, IdLocation
from node.store.log import SegmentedLog
from node.store.records import SEQ_EPOCH_SHIFT, Dispatched, Limits, Message
from node.store.schedule import ScheduleLog
from node.wheel import TickState, TimingWheel, WheelEntry

log = logging.getLogger("hourglass.delay.store")



@dataclass(frozen=True, slots=True)
class StoreSettings:
    tick_ms: int = 10
    window_ms: int = 2000
    bucket_ms: int = 3_600_000
    message_segment_bytes: int = 64 * 1024 * 1024
    dispatch_segment_bytes: int = 16 * 1024 * 1024
    schedule_segment_bytes: int = 256 * 1024 * 1024
    wheel_entries_max: int = 2_000_000
    unfiled_max: int = 1_000_000          # accepted but not yet iterated into the schedule log
    inflight_max: int = 100_000           # fired but not yet acknowledged by the real-time side
    seconds_load_max: int = 64            # seconds loaded from disk per poll (catch-up is gradual)
    id_slots: int = 1 << 20
    id_entries_max: int = 4 << 20
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class Accepted:
    msg_id: str
    seq: int
    deliver_at_ms: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Due:
    """A message to dispatch now."""

    seq: int
    effective_ms: int
    message: Message


@dataclass(frozen=True, slots=True)
class LookupResult:
    status: str  # "pending" | "cancelled" | "dispatched" | "in_flight"
    msg_id: str
    seq: int
    deliver_at_ms: int
    subject: str


def _same_content(a: Message, b: Message) -> bool:
    """A re-send of the same message: same content and the same due time, absolute or
    relative (a retry of ``delay_ms=d`` arrives later, so its absolute time moved by exactly
    the time between the two arrivals)."""
    if (a.subject, a.payload, a.tags, a.properties) != (b.subject, b.payload, b.tags, b.properties):
        return False
    return a.deliver_at_ms == b.deliver_at_ms or a.deliver_at_ms - a.store_ms == b.deliver_at_ms - b.store_ms


class DelayStore:
    def __init__(self, root: Path, settings: StoreSettings, now_ms: int, *, bump_epoch: bool = True,
                 follower: bool = False) -> None:
        self.root = root
        self.settings = settings
        root.mkdir(parents=True, exist_ok=True)
        self.messages = SegmentedLog.open(root / "messages", segment_bytes_max=settings.message_segment_bytes)
        self.dispatch = SegmentedLog.open(root / "dispatch", segment_bytes_max=settings.dispatch_segment_bytes)
        self.schedule = ScheduleLog(root / "schedule", bucket_ms=settings.bucket_ms,
                                    data_segment_bytes=settings.schedule_segment_bytes)
        self.ids = IdIndex.open(root / "ids", slots_count=settings.id_slots, entries_max=settings.id_entries_max)
        self._ckpt_path = root / "checkpoint"
        ck = checkpoint.read(self._ckpt_path) or {}
        self.epoch = int(ck.get("epoch", 0)) + (1 if bump_epoch else 0)
        self._counter = 0
        self.iterate_offset = int(ck.get("iterate_offset", self.messages.start_offset))
        if self.iterate_offset > self.messages.end_offset:
            log.warning("iterate offset past log end path=%s iterate_offset=%d end=%d",
                        self.messages.directory, self.iterate_offset, self.messages.end_offset)
            self.iterate_offset = self.messages.end_offset
        self.durable_offset = self.messages.end_offset  # recovered bytes are what survived
        if "completed_ms" in ck:
            self.completed_ms = int(ck["completed_ms"])
            dispatch_offset = max(int(ck["dispatch_offset"]), self.dispatch.start_offset)
            state = TickState(self.epoch, self.completed_ms // settings.tick_ms - 1, 0, dispatch_offset)
            self.wheel = TimingWheel.restore(state, tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                             entries_max=settings.wheel_entries_max)
        else:
            self.completed_ms = now_ms - now_ms % settings.tick_ms
            dispatch_offset = self.dispatch.end_offset
            self.wheel = TimingWheel(tick_ms=settings.tick_ms, window_ms=settings.window_ms,
                                     start_ms=self.completed_ms, entries_max=settings.wheel_entries_max)
        self.wheel.epoch = self.epoch
        self._restored_completed_ms = self.completed_ms
        self.persisted_completed_ms = self.completed_ms
        # messages delivered at or after completed_ms (reloaded seconds must skip them)
        self._dispatched: dict[int, int] = {}
        self._dispatch_trail: deque[tuple[int, int]] = deque()  # (effective_ms, offset) in log order
        if dispatch_offset < self.dispatch.end_offset:
            for off, body in self.dispatch.iterate(dispatch_offset):
                d = records.decode_dispatched(body)
                self._dispatched[d.seq] = d.deliver_at_ms
                self._dispatch_trail.append((d.deliver_at_ms, off))
        self._inflight: dict[int, int] = {}  # seq -> effective_ms
        self._inflight_heap: list[tuple[int, int]] = []  # (effective_ms, seq), lazily pruned
        self._unfiled: dict[str, tuple[int, int]] = {}  # msg_id -> (seq, message-log offset)
        self.counters = {"accepted": 0, "duplicates": 0, "filed": 0, "dispatched": 0, "cancelled": 0,
                         "dead_lettered": 0}
        self._voided_path = root / "voided.json"
        self.voided: list[tuple[int, int]] = [tuple(r) for r in (checkpoint.read(self._voided_path) or {}).get(
            "ranges", [])]
        # follower (slave) mode: the master's checkpoint, replicated (see follow())
        self.follower = follower
        self.replicated: dict | None = ck.get("replicated") if follower else None
        self._pending = self._count_pending()
        self._save_checkpoint()  # the new epoch is durable before any seq of it is used
        self.iterate(limit=None)  # replay: file everything the crash left unfiled
        # a promoted slave holds records of the old master's epochs: never reuse their seqs
        last = self.ids.last_seq()
        if last >= 0 and (last >> SEQ_EPOCH_SHIFT) >= self.epoch:
            self.epoch = (last >> SEQ_EPOCH_SHIFT) + 1
            self.wheel.epoch = self.epoch
            self._save_checkpoint()

    @classmethod
    def open(cls, root: str | os.PathLike, settings: StoreSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True, follower: bool = False) -> "DelayStore":
        """``follower``: open as a slave (files only what the master's checkpoint covers,
        keeps no wheel); a promotion closes it and opens it again as a master."""
        return cls(Path(root), settings or StoreSettings(), now_ms, bump_epoch=bump_epoch, follower=follower)

    # ------------------------------------------------------------------ pending counts (metrics)

    def _count_pending(self) -> dict[int, int]:
        """Messages filed and not dispatched nor cancelled, by bucket start, read from the
        schedule index files of buckets not yet completed (kind byte and rel_ms of each
        40-byte entry, sliced in C: about 50 ms per million entries)."""
        out: dict[int, int] = {}
        c = self.completed_ms
        for start in self.schedule.bucket_starts():
            if start + self.settings.bucket_ms <= c:
                continue
            try:
                raw = (self.schedule.root / f"{start:018d}" / "index").read_bytes()
            except FileNotFoundError:
                continue
            raw = raw[: len(raw) - len(raw) % 40]
            if start < c:  # the current bucket: only entries at or after completed_ms
                rel = memoryview(raw).cast("I")[8::10]
                kinds = raw[36::40]
                threshold = c - start
                n = sum((1 if kinds[i] == records.KIND_MESSAGE else -1) for i, r in enumerate(rel) if r >= threshold)
            else:
                kinds = raw[36::40]
                n = kinds.count(records.KIND_MESSAGE) - kinds.count(records.KIND_CANCEL)
            out[start] = n
        for eff in self._dispatched.values():
            if eff >= c:
                b = self.schedule.bucket_start(eff)
                out[b] = out.get(b, 0) - 1
        return {b: n for b, n in out.items() if n > 0}

    def pending_by_bucket(self) -> dict[int, int]:
        """Bucket start ms -> messages filed there and not yet dispatched or cancelled."""
        return {b: n for b, n in self._pending.items() if n > 0}

    def _pending_add(self, effective_ms: int, n: int) -> None:
        b = self.schedule.bucket_start(effective_ms)
        v = self._pending.get(b, 0) + n
        if v > 0:
            self._pending[b] = v
        else:
            self._pending.pop(b, None)

    # ------------------------------------------------------------------ ingest

    def _next_seq(self) -> int:
        seq = records.make_seq(self.epoch, self._counter)
        self._counter += 1
        return seq

    def accept(self, batch: list[Message], *, now_ms: int) -> list[Accepted | Exception]:
        """Validate and append; one result per message (an exception object for a rejected one).

        A rejected message changes nothing; others in the batch go on. Not durable
        until ``flush`` (or the caller's group commit) covers ``messages.end_offset``.
        """
        out: list[Accepted | Exception] = []
        bodies: list[bytes] = []
        pending: list[tuple[int, str, int]] = []  # (index in out, msg_id, seq)
        batch_ids: dict[str, int] = {}
        if len(self._unfiled) + len(batch) > self.settings.unfiled_max:
            raise Overloaded(f"{len(self._unfiled)} messages wait to be filed (unfiled_max="
                             f"{self.settings.unfiled_max})")
        for m in batch:
            try:
                msg_id = m.msg_id or uuid.uuid4().hex
                m = Message(seq=0, store_ms=now_ms, deliver_at_ms=max(0, m.deliver_at_ms), msg_id=msg_id,
                            subject=m.subject, payload=bytes(m.payload), tags=tuple(m.tags),
                            properties=tuple(m.properties), attempts=m.attempts)
                records.validate_message(m, now_ms=now_ms, limits=self.settings.limits)
                prior = self._find(msg_id) if msg_id not in batch_ids else None
                if msg_id in batch_ids:
                    raise AlreadyExists(f"id {msg_id!r} appears twice in one batch")
                if prior is not None:
                    if prior.kind == records.KIND_CANCEL or not _same_content(prior, m):
                        raise AlreadyExists(f"id {msg_id!r} was used for another message")
                    self.counters["duplicates"] += 1
                    out.append(Accepted(msg_id, prior.seq, prior.deliver_at_ms, duplicate=True))
                    continue
                seq = self._next_seq()
                body = records.encode(Message(seq=seq, store_ms=now_ms, deliver_at_ms=m.deliver_at_ms,
                                              msg_id=msg_id, subject=m.subject, payload=m.payload, tags=m.tags,
                                              properties=m.properties, attempts=m.attempts))
                batch_ids[msg_id] = seq
                pending.append((len(out), msg_id, seq))
                out.append(Accepted(msg_id, seq, m.deliver_at_ms))
                bodies.append(body)
            except (InvalidArgument, AlreadyExists) as e:
                out.append(e)
        if bodies:
            offsets = self.messages.append(bodies)
            for (_, msg_id, seq), off in zip(pending, offsets):
                self._unfiled[msg_id] = (seq, off)
            self.counters["accepted"] += len(bodies)
        return out

    def flush_messages(self) -> int:
        """fsync the message log (tests and tools; the service uses a GroupCommitter)."""
        self.messages.flush()
        self.durable_offset = self.messages.end_offset
        return self.durable_offset

    # ------------------------------------------------------------------ id lookups

    def _find(self, msg_id: str) -> Message | None:
        """The newest record (message or tombstone) with this id, or None."""
        hit = self._unfiled.get(msg_id)
        if hit is not None:
            body, _ = self.messages.read(hit[1])
            return records.decode(body)
        for loc in self.ids.get_all(msg_id):
            if self._voided(loc.seq):
                continue
            body = self.schedule.read(loc.bucket_start_ms, loc.data_offset, loc.frame_size)
            if records.peek_id(body) == msg_id:
                return records.decode(body)
        return None

    def _effective_of(self, msg_id: str, seq: int) -> int | None:
        for loc in self.ids.get_all(msg_id):
            if loc.seq == seq:
                raw = self.schedule.bucket(loc.bucket_start_ms).data.read_at(loc.data_offset, loc.frame_size)
                return struct.unpack_from("<q", raw)[0]
        return None

    def lookup(self, msg_id: str) -> LookupResult:
        found = self._find(msg_id)
        if found is None:
            raise NotFound(f"no message with id {msg_id!r}")
        if found.kind == records.KIND_CANCEL:
            (target,) = struct.unpack("<Q", found.payload)
            return LookupResult("cancelled", msg_id, target, found.deliver_at_ms, found.subject)
        return LookupResult(self._status(found), msg_id, found.seq, found.deliver_at_ms, found.subject)

    def _status(self, m: Message) -> str:
        if m.seq in self._inflight:
            return "in_flight"
        if m.seq in self._dispatched:
            return "dispatched"
        if m.msg_id in self._unfiled:
            return "pending"
        eff = self._effective_of(m.msg_id, m.seq)
        if eff is not None and eff < self.completed_ms:
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
        if found.kind == records.KIND_CANCEL:
            return struct.unpack("<Q", found.payload)[0]
        status = self._status(found)
        if status in ("dispatched", "in_flight"):
            raise TooLate(f"message {msg_id!r} was already dispatched")
        if msg_id in self._unfiled:
            # not filed yet: the tombstone is filed right after it, in the same second
            effective = max(found.deliver_at_ms, self.persisted_completed_ms)
        else:
            effective = self._effective_of(msg_id, found.seq)
            if effective is None:
                raise NotFound(f"no schedule entry for {msg_id!r}")
        seq = self._next_seq()
        body = records.encode(Message(seq=seq, store_ms=now_ms, deliver_at_ms=effective, msg_id=msg_id,
                                      subject=found.subject, payload=struct.pack("<Q", found.seq),
                                      kind=records.KIND_CANCEL))
        (off,) = self.messages.append([body])
        self._unfiled[msg_id] = (seq, off)
        self.wheel.cancel_seq(found.seq)
        self.counters["cancelled"] += 1
        return found.seq

    # ------------------------------------------------------------------ iterator

    def iterate(self, limit: int | None = 10_000) -> int:
        """File durable records from the message log into the schedule log; returns count.

        A follower files only up to the master's checkpointed iterate offset, under the
        master's checkpointed completed_ms (see ``follow``), so that every message the
        master had not dispatched is filed at or after the completed_ms a promotion
        restores from."""
        end = self.durable_offset
        if self.follower:
            end = min(end, self.replicated["iterate_offset"] if self.replicated else self.iterate_offset)
        if self.iterate_offset >= end:
            return 0
        n = 0
        last_ids_seq = self.ids.last_seq()
        for off, body in self.messages.iterate(self.iterate_offset, end):
            kind, seq, deliver_at_ms, _ = records.peek_header(body)
            msg_id = records.peek_id(body)
            if kind == records.KIND_CANCEL:
                effective = deliver_at_ms  # the cancelled message's effective time
                (ref_seq,) = struct.unpack_from("<Q", body, len(body) - 8)
            else:
                effective = max(deliver_at_ms, self.persisted_completed_ms)
                ref_seq = seq
            placed = self.schedule.append(body, seq=seq, ref_seq=ref_seq, effective_ms=effective, kind=kind)
            if placed is not None and seq > last_ids_seq:
                bucket_start, data_off, fsize = placed
                self.ids.put(msg_id, IdLocation(bucket_start, data_off, fsize, seq))
                last_ids_seq = seq
            elif placed is None and seq > last_ids_seq:
                # filed before a crash but not indexed: find its place again
                loc = self._locate_filed(msg_id, seq, effective)
                if loc is not None:
                    self.ids.put(msg_id, loc)
                    last_ids_seq = seq
            if placed is not None:
                self._pending_add(effective, -1 if kind == records.KIND_CANCEL else 1)
            if self.follower:
                pass  # a follower keeps no wheel: it is rebuilt from the schedule log on promotion
            elif kind == records.KIND_CANCEL:
                self.wheel.cancel_seq(ref_seq)
            elif placed is not None and seq not in self._dispatched:
                bucket_start, data_off, fsize = placed
                if self.wheel.add(WheelEntry(effective, seq, str(seq), (bucket_start, data_off, fsize))):
                    if effective < self.completed_ms:
                        # filed behind the wheel (effective >= persisted completed_ms): completed_ms
                        # steps back so a checkpoint cannot skip it before it is dispatched
                        self.completed_ms = effective - effective % self.settings.tick_ms
            hit = self._unfiled.get(msg_id)
            if hit is not None and hit[0] == seq:
                del self._unfiled[msg_id]
            n += 1
            self.iterate_offset = off + 12 + len(body)
            if limit is not None and n >= limit:
                break
        self.counters["filed"] += n
        return n

    def _locate_filed(self, msg_id: str, seq: int, effective: int) -> IdLocation | None:
        bucket = self.schedule.bucket(self.schedule.bucket_start(effective))
        second = (effective - bucket.start_ms) // 1000
        for e in bucket.chain(second):
            if e.seq == seq:
                return IdLocation(bucket.start_ms, e.data_offset, e.frame_size, seq)
        return None

    # ------------------------------------------------------------------ wheel and dispatch

    def _load_seconds(self) -> None:
        for second in self.wheel.seconds_to_load(self.settings.seconds_load_max):
            chain = self.schedule.load_second(second)
            voided = self._voided
            cancelled = {e.ref_seq for e in chain if e.kind == records.KIND_CANCEL and not voided(e.seq)}
            entries = [
                WheelEntry(e.deliver_at_ms, e.seq, str(e.seq), (e.bucket_start_ms, e.data_offset, e.frame_size))
                for e in chain
                if e.kind == records.KIND_MESSAGE and e.seq not in cancelled and e.seq not in self._dispatched
                and not voided(e.seq)
                and e.deliver_at_ms >= self._restored_completed_ms and e.seq not in self._inflight
            ]
            self.wheel.load_second(second, entries)

    def poll_due(self, *, now_ms: int, limit: int | None = None) -> list[Due]:
        """Load seconds ahead, advance the wheel to ``now_ms``; return due messages (now in flight)."""
        if len(self._inflight) >= self.settings.inflight_max:
            return []
        self._load_seconds()
        fired = self.wheel.advance(now_ms)
        # a catch-up may need more seconds than one load allowed
        while not fired and self.wheel.cursor_ms <= now_ms and self.wheel.seconds_to_load(1):
            self._load_seconds()
            fired = self.wheel.advance(now_ms)
            if self.wheel.cursor_ms > now_ms:
                break
        out: list[Due] = []
        for e in fired:
            bucket_start, data_off, fsize = e.ref
            body = self.schedule.read(bucket_start, data_off, fsize)
            self._inflight[e.seq] = e.deliver_at_ms
            heapq.heappush(self._inflight_heap, (e.deliver_at_ms, e.seq))
            out.append(Due(e.seq, e.deliver_at_ms, records.decode(body)))
        self._advance_completed()
        return out

    def ack_dispatched(self, items: list[tuple[int, int]], *, now_ms: int,
                       outcome: int = Dispatched.OK) -> None:
        """Record (seq, effective_ms) pairs as delivered (or dead-lettered)."""
        if not items:
            return
        bodies = [records.encode_dispatched(Dispatched(seq, eff, now_ms, outcome)) for seq, eff in items]
        offsets = self.dispatch.append(bodies)
        for (seq, eff), off in zip(items, offsets):
            self._inflight.pop(seq, None)
            self._dispatched[seq] = eff
            self._dispatch_trail.append((eff, off))
            self._pending_add(eff, -1)
        self.counters["dead_lettered" if outcome == Dispatched.DEAD_LETTER else "dispatched"] += len(items)
        self._advance_completed()

    def release(self, seqs: list[int]) -> None:
        """Give fired messages back to the wheel (dispatch failed, will be retried)."""
        for seq in seqs:
            eff = self._inflight.pop(seq, None)
            if eff is None:
                continue
            # reload it from disk on the next poll: it stays in the schedule log
            entry = self._wheel_entry_for(seq, eff)
            if entry is not None:
                self.wheel.add(entry)
        self._advance_completed()

    def _wheel_entry_for(self, seq: int, effective: int) -> WheelEntry | None:
        bucket = self.schedule.bucket(self.schedule.bucket_start(effective))
        for e in bucket.chain((effective - bucket.start_ms) // 1000):
            if e.seq == seq:
                return WheelEntry(effective, seq, str(seq), (bucket.start_ms, e.data_offset, e.frame_size))
        return None

    def _advance_completed(self) -> None:
        c = self.wheel.cursor_ms
        heap, inflight = self._inflight_heap, self._inflight
        if len(heap) > 2 * len(inflight) + 1024:  # stale entries below the top: rebuild
            heap[:] = [(e, q) for q, e in inflight.items()]
            heapq.heapify(heap)
        while heap and inflight.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # acknowledged or released since
        if heap:
            c = min(c, heap[0][0])
        c -= c % self.settings.tick_ms  # always a whole tick: exactly what a checkpoint persists
        if c > self.completed_ms:
            self.completed_ms = c
        # completed_ms may step back (see iterate), never below the persisted value: keep the
        # dispatch records a restart from the persisted value needs
        floor = self.persisted_completed_ms
        trail = self._dispatch_trail
        while trail and trail[0][0] < floor:
            trail.popleft()
        if len(self._dispatched) > 4 * max(1024, len(trail)):
            self._dispatched = {s: e for s, e in self._dispatched.items() if e >= floor}

    def tick_state(self) -> TickState:
        offset = self._dispatch_trail[0][1] if self._dispatch_trail else self.dispatch.end_offset
        return TickState(self.epoch, self.completed_ms // self.settings.tick_ms - 1, 0, offset)

    @property
    def pending_in_wheel(self) -> int:
        return len(self.wheel)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ durability

    def checkpoint(self) -> None:
        """Flush schedule, ids and dispatch log, then persist iterate offset and tick state."""
        self.schedule.flush()
        self.ids.flush()
        self.dispatch.flush()
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        if self.follower and self.replicated is None:
            return  # nothing from a master yet: keep the checkpoint as it is
        if self.follower and self.replicated is not None:
            # a follower persists the master's tick state with its own iterate offset:
            # a promotion restores the wheel from exactly what the master had completed
            r = self.replicated
            completed = int(r["completed_ms"])
            dispatch_offset = min(int(r["dispatch_offset"]), self.dispatch.end_offset)
            checkpoint.write_atomic(self._ckpt_path, {
                "version": 1, "epoch": self.epoch, "iterate_offset": self.iterate_offset,
                "completed_ms": completed, "dispatch_offset": dispatch_offset,
                "tick": completed // self.settings.tick_ms - 1, "replicated": r,
            })
            return
        st = self.tick_state()
        completed = (st.tick + 1) * self.settings.tick_ms
        checkpoint.write_atomic(self._ckpt_path, {
            "version": 1, "epoch": self.epoch, "iterate_offset": self.iterate_offset,
            "completed_ms": completed, "dispatch_offset": st.dispatch_offset, "tick": st.tick,
        })
        self.persisted_completed_ms = completed
        self.last_checkpoint = {"iterate_offset": self.iterate_offset, "completed_ms": completed,
                                "dispatch_offset": st.dispatch_offset}

    # ------------------------------------------------------------------ replication (follower side)

    def follow(self, master_checkpoint: dict | None = None) -> None:
        """Become (or stay) a follower; ``master_checkpoint`` is the master's last checkpoint
        (iterate_offset, completed_ms, dispatch_offset), shipped with its tick state."""
        self.follower = True
        self._inflight.clear()
        self._inflight_heap.clear()
        if master_checkpoint is not None:
            self.replicated = dict(master_checkpoint)
            self.persisted_completed_ms = self.completed_ms = int(master_checkpoint["completed_ms"])

    def appended(self) -> None:
        """Replicated bytes were appended and fsynced: they are durable here."""
        self.durable_offset = self.messages.end_offset

    def _voided(self, seq: int) -> bool:
        for lo, hi in self.voided:
            if lo <= seq < hi:
                return True
        return False

    def truncate_messages(self, cut: int) -> int:
        """Drop a divergent message-log suffix (records the new master never had). Records
        already filed stay in the schedule log but their seqs are voided (persisted), so
        they are never loaded, found or counted. Returns bytes dropped."""
        if cut >= self.messages.end_offset:
            return 0
        seqs = [records.peek_header(body)[1] for _, body in self.messages.iterate(cut)]
        if seqs:
            # seqs of one store epoch grow with the log: the suffix is one range per epoch
            for ep in sorted({q >> SEQ_EPOCH_SHIFT for q in seqs}):
                lo = min(q for q in seqs if q >> SEQ_EPOCH_SHIFT == ep)
                self.voided.append((lo, (ep + 1) << SEQ_EPOCH_SHIFT))
            checkpoint.write_atomic(self._voided_path, {"ranges": [list(r) for r in self.voided]})
        dropped = self.messages.truncate(cut)
        self.messages.flush()
        self.iterate_offset = min(self.iterate_offset, cut)
        self.durable_offset = min(self.durable_offset, cut)
        self._unfiled = {k: v for k, v in self._unfiled.items() if v[1] < cut}
        log.warning("message log truncated to %d (divergent suffix, %d bytes, %d records voided)",
                    cut, dropped, len(seqs))
        return dropped

    def truncate_dispatch(self, cut: int) -> int:
        if cut >= self.dispatch.end_offset:
            return 0
        dropped = self.dispatch.truncate(cut)
        self.dispatch.flush()
        log.warning("dispatch log truncated to %d (divergent suffix, %d bytes)", cut, dropped)
        return dropped

    def close(self) -> None:
        self.flush_messages()
        self.iterate(limit=None)
        self.checkpoint()
        self.schedule.close()
        self.ids.close()
        self.dispatch.close()
        self.messages.close()
