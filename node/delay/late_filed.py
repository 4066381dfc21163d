"""Records filed late that another member (or this one) already delivered: found by seq in the
whole dispatch log when the wheel is restored (a promotion, an open as master).

The problem. A member files a message under ``max(deliver_at_ms, persisted completed_ms)``
(``DelayCore.effective_times``). A slave that files a record only after its master delivered
it (a new replica catching up, a slave that was down) files it *overdue*, at the master's
completed_ms C, while the master delivered it under its own, earlier effective time E < C.
The dispatch records replayed when the wheel is restored start at the tick state's
``dispatch_offset``, the first record holding a message due at or after C: the record naming
the message (due E) is before it. Without more, the promoted store loads second C, finds the
record there, does not know it for delivered and fires it again (and counts it as pending).

The rule. When the wheel is restored from a tick state with ``completed_ms`` C, the messages
filed in the seconds it reloads first whose effective time is at or after C but whose due time
is before it (filed late: ``deliver_at_ms < effective_ms``), and that the replayed records do
not already name, are looked up by seq in the dispatch log, from the segment where records
dispatched at the earliest candidate's ``store_ms`` (when the master accepted it, less
``CLOCK_SLACK_MS`` for another term's clock) can start, to its end: a message is delivered
after it was accepted, and dispatch records are appended in ``dispatched_ms`` order. Each one
named is delivered: it enters the core's delivered-seq map under *this member's* effective time,
so the wheel skips it (``DelayCore.chunk``), the pending counts leave it out
(``recovery.count_pending``) and a lookup answers ``dispatched``.

Bounded: only the seconds ``[C, hi]`` are read (``hi``: the largest effective time this member
filed a late record under while following, C at an open), and the dispatch log is read once,
only when there is a candidate, from the candidates' acceptance on: at a master's restart the
candidates are its own records filed late since its last checkpoint (recent), for a slave that
filed late as old as the oldest message it filed overdue. A record the scan misses (a corrupt dispatch record on the way,
or one before the segment picked) fires again: a duplicate the real-time node's id window
hides, never a loss. A message that is not named in the dispatch log was not delivered, so it
fires: nothing acknowledged is lost.
"""

from __future__ import annotations

import logging

import numpy as np

from cluster.codec import KIND_MESSAGE, DispatchBatch
from cluster.errors import HourglassError
from node.delay import dispatch_find
from node.delay.core import DelayCore
from node.store.log import SegmentedLog
from node.store.schedule import ScheduleLog

log = logging.getLogger("hourglass.delay.store")


CLOCK_SLACK_MS = 60_000  # dispatch records this far before a candidate's store_ms are read too (clock skew between terms)


def _first_dispatched(log: SegmentedLog, base: int) -> int | None:
    """``dispatched_ms`` of the first record of the dispatch-log segment at ``base``."""
    try:
        body, _ = log.read(base)
        return int(DispatchBatch.decode(body).dispatched_ms)
    except (HourglassError, OSError):
        return None


def candidates(schedule: ScheduleLog, core: DelayCore, hi_ms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, effective_ms, store_ms) of the messages filed late in the seconds from
    ``completed_ms`` to ``hi_ms`` at or after ``completed_ms``, not known delivered yet."""
    c = core.completed_ms
    seqs, effs, dues = [], [], []
    for second in range(c // 1000, max(c, hi_ms) // 1000 + 1):
        for ref in schedule.load_second(second):
            b = ref.batch
            m = (b.kind == KIND_MESSAGE) & (b.effective_ms >= c) & (b.deliver_at_ms < b.effective_ms)
            if m.any():
                seqs.append(b.seq[m])
                effs.append(b.effective_ms[m])
                dues.append(b.store_ms[m])
    if not seqs:
        empty = np.zeros(0, np.int64)
        return np.zeros(0, np.uint64), empty, empty
    seq, eff, due = np.concatenate(seqs), np.concatenate(effs).astype(np.int64), np.concatenate(dues).astype(np.int64)
    if core.dispatched:
        known = np.fromiter(core.dispatched.keys(), np.uint64, len(core.dispatched))
        keep = ~np.isin(seq, known)
        seq, eff, due = seq[keep], eff[keep], due[keep]
    return seq, eff, due


def name_delivered(schedule: ScheduleLog, dispatch: SegmentedLog, core: DelayCore, hi_ms: int) -> int:
    """The rule of the module docs; returns how many late-filed messages were found delivered."""
    seq, eff, due = candidates(schedule, core, hi_ms)  # due: their store_ms
    if not len(seq) or dispatch.end_offset <= dispatch.start_offset:
        return 0
    bases = [b for b in dispatch.segment_bases() if b >= dispatch.start_offset]
    if not bases:
        return 0
    # a message is delivered after it was accepted: the records dispatched before the earliest
    # candidate's store_ms cannot name it (less a slack: another term's clock may be behind)
    key = int(due.min()) - CLOCK_SLACK_MS
    i = dispatch_find.start_segment(bases, lambda b: _first_dispatched(dispatch, b), key)
    found = np.zeros(len(seq), bool)
    try:
        for _, body in dispatch.iterate(max(bases[i], dispatch.start_offset)):
            d = DispatchBatch.decode(body)
            if d.n:
                found |= np.isin(seq, d.seq)
                if found.all():
                    break
    except (HourglassError, OSError) as e:  # what is not found fires again: a duplicate, never a loss
        log.warning("dispatch log read failed looking up late-filed records: %s", e)
    if found.any():
        core.note_dispatched(seq[found], eff[found])
    n = int(found.sum())
    if n:
        log.info("late-filed records found delivered in the dispatch log n=%d completed_ms=%d", n, core.completed_ms)
    return n


__all__ = ["candidates", "name_delivered"]
