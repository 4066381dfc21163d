"""Finding a message id's newest record in a delay store: duplicates, ``lookup``, ``cancel``.

A record is found, newest first, in:

1. the frames accepted and not filed yet (``Unfiled``: a scan of their id-hash arrays);
2. ``refiled`` (records filed below the id index's seqs after a cut: ``refiled.json``);
3. the id index (``IdIndex.get_all``: every location of the id's hash), each location
   confirmed on the schedule frame it names (the 8-byte hash may collide).

Voided seqs (cut off the log) are never found. An id whose bucket retention deleted after
everything in it was delivered (``completed_ms`` of the last durable checkpoint past its
end) answers ``Retired``: known for the dedupe window, its record gone.

Reads only (the schedule log, the message log; for a dispatched message its dispatch record,
``node/delay/dispatch_find.py``); the status of what is found is the core's
rule (``DelayCore.status``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cluster.codec import KIND_CANCEL, Batch
from cluster.errors import NotFound
from node.delay.dispatch_find import dispatched_at
from node.delay.ingest import Retired
from node.store import records
from node.store.idindex import key_hash
from node.store.records import SEQ_EPOCH_SHIFT, Message

if TYPE_CHECKING:
    from node.delay.store import DelayStore


@dataclass(frozen=True, slots=True)
class LookupResult:
    status: str  # "pending" | "cancelled" | "dispatched" | "in_flight"
    msg_id: str
    seq: int
    deliver_at_ms: int
    subject: str
    # the trace (issue 31): when the record was accepted, the time it is filed under (0: not
    # filed yet), when a cancel was accepted, and the store epoch of the seq (which term)
    accepted_ms: int = 0
    effective_ms: int = 0
    cancelled_ms: int = 0
    store_epoch: int = 0
    # dispatched: when its dispatch record was written (0: not found within the bound,
    # node/delay/dispatch_find.py) and whether it went to the dead letters
    dispatched_ms: int = 0
    dead_lettered: bool = False


def find(store: "DelayStore", msg_id: str) -> tuple[Message | Retired, int | None] | None:
    """The newest record (message or tombstone) with this id and its effective time (None
    while not filed), or None."""
    core, schedule = store.core, store.schedule
    hit = store.unfiled.lookup(key_hash(msg_id))
    if hit is not None:
        b = store.unfiled.batch_at(hit[1])
        if b is None:
            body, _ = store.messages.read(hit[1])
            b = Batch.decode(body)
        at = np.flatnonzero(b.seq == hit[0])
        if len(at) and b.id(int(at[0])) == msg_id:
            return records.message_at(b, int(at[0])), None
    refiled = store.refiled.get(msg_id)
    fallback = None
    if refiled is not None and not core.is_voided(refiled.seq) and schedule.exists(refiled.bucket_start_ms):
        got = schedule.find(refiled.bucket_start_ms, refiled.data_offset, refiled.frame_size, refiled.seq)
        if got is not None and got[0].batch.id(got[1]) == msg_id:
            m = records.message_at(got[0].batch, got[1])
            if m.kind == KIND_CANCEL:
                return m, int(got[0].batch.effective_ms[got[1]])  # a tombstone answers for its message
            fallback = m, int(got[0].batch.effective_ms[got[1]])
    for loc in store.ids.get_all(msg_id):
        if core.is_voided(loc.seq):
            continue
        if _bucket_retired(store, loc.bucket_start_ms):
            # delivered or cancelled, its bucket deleted; the id is kept for the dedupe window
            # (the record is gone, so the id cannot be confirmed on it: a hash collision of two
            # ids inside the window would be answered as a duplicate)
            return Retired(loc.seq), None
        got = schedule.find(loc.bucket_start_ms, loc.data_offset, loc.frame_size, loc.seq)
        if got is not None and got[0].batch.id(got[1]) == msg_id:
            ref, i = got
            return records.message_at(ref.batch, i), int(ref.batch.effective_ms[i])
    return fallback


def _bucket_retired(store: "DelayStore", start_ms: int) -> bool:
    """Retention deleted bucket ``start_ms`` (everything in it was delivered or cancelled; the
    last durable checkpoint's ``completed_ms`` is past its end). Nothing is filed there again."""
    done = int(store.persisted_doc.get("completed_ms", -1))
    return start_ms + store.settings.bucket_ms <= done and not store.schedule.exists(start_ms)


def buckets_retired(store: "DelayStore", effective_ms: np.ndarray) -> np.ndarray:
    """Which of these effective times fall in a retired bucket (``_bucket_retired``)."""
    bms = store.settings.bucket_ms
    starts = effective_ms - effective_ms % bms
    out = np.zeros(len(starts), bool)
    done = int(store.persisted_doc.get("completed_ms", -1))
    for s in np.unique(starts[starts + bms <= done]).tolist():
        if _bucket_retired(store, int(s)):
            out |= starts == s
    return out


def lookup(store: "DelayStore", msg_id: str) -> LookupResult:
    """``DelayStore.lookup``: the status of an id's newest record."""
    found = find(store, msg_id)
    if found is None:
        raise NotFound(f"no message with id {msg_id!r}")
    m, eff = found
    if isinstance(m, Retired):
        raise NotFound(f"message {msg_id!r} (seq {m.seq}) was dispatched or cancelled and its record has "
                       f"expired (retention)")
    if m.kind == KIND_CANCEL:
        (target,) = struct.unpack("<Q", m.payload)
        return LookupResult("cancelled", msg_id, target, m.deliver_at_ms, m.subject, effective_ms=eff or 0,
                            cancelled_ms=m.store_ms, store_epoch=target >> SEQ_EPOCH_SHIFT)
    st = store.core.status(m.seq, eff)
    fired = dispatched_at(store.dispatch, m.seq, eff) if st == "dispatched" and eff is not None else None
    return LookupResult(st, msg_id, m.seq, m.deliver_at_ms, m.subject,
                        accepted_ms=m.store_ms, effective_ms=eff or 0, store_epoch=m.seq >> SEQ_EPOCH_SHIFT,
                        dispatched_ms=fired.dispatched_ms if fired else 0,
                        dead_lettered=fired.dead_lettered if fired else False)


def located(store: "DelayStore", msg_id: str, seq: int) -> int | None:
    """The effective time this member filed record ``seq`` (id ``msg_id``) under, or None."""
    locs = list(store.ids.get_all(msg_id))
    refiled = store.refiled.get(msg_id)
    if refiled is not None:
        locs.append(refiled)
    for loc in locs:
        if loc.seq != seq or not store.schedule.exists(loc.bucket_start_ms):
            continue
        got = store.schedule.find(loc.bucket_start_ms, loc.data_offset, loc.frame_size, loc.seq)
        if got is not None and got[0].batch.id(got[1]) == msg_id:
            return int(got[0].batch.effective_ms[got[1]])
    return None


def cancels_beside_targets(store: "DelayStore", batch: Batch, is_cancel: np.ndarray, eff: np.ndarray) -> None:
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
        got = located(store, batch.id(i), t)
        if got is not None:
            eff[i] = got
