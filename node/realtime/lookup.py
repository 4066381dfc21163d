"""Where one message is on a real-time node and what each consumer group did with it
(``Consumer/Trace``, the real-time lookup; issue 31, the console's trace). Reads only.

**Finding it.** No id index is kept on the real-time side beyond the de-duplication window
(``node/realtime/dedup.py``: ``(subject, id) -> seq`` for ``dedup_window_ms``), so:

1. inside the window: its seq, then a binary search of the subject's consume index by the
   seq of the message each entry points at (seqs grow in log order, and so do positions):
   ``log2(entries)`` entry and frame reads;
2. outside it, with ``around_ms`` (when the delay node dispatched it, from the delay
   Lookup): a binary search by the store time of the entries' messages for the first one
   stored at or after ``around_ms - AROUND_SLACK_MS``, then a scan of at most ``scan_max``
   entries from there comparing ids (``scan_max``: the smaller of ``SCAN_ENTRIES_MAX`` and
   the node's ``pull_scan_entries_max``; it runs on the event loop, like a pull's scan);
3. outside it with no time: a scan of the newest ``scan_max`` entries.

Not found within these bounds: ``NotFound`` (it may still be there, older or in a busier
subject than the scan covers; the message says so).

**Per group** (every group of the subject on this node), from its position (``groups.py``):
``waiting`` at or after its ``next`` (never handed out), ``in_flight`` in its in-flight runs,
else done. A done message was acked unless a nack made a copy naming the group
(property ``hourglass.nacked_by``, ``node/realtime/nack.py``): a dead-letter copy in
``hourglass.dlq`` (``dead_lettered``) or a retry copy in the subject (``nacked``), found by
the same bounded time scan from the message's store time, matched on its origin id
(``hourglass.origin_id``) and, for a dead letter, ``dlq.subject``. A retry copy goes through
a delay node and may come back to another real-time group (its own id's hash) or after the
scan's reach: the group then reads ``acked``, the one answer that may be wrong, and the
docs (``docs/api.md``) say so. Nacks made before ``hourglass.nacked_by`` existed read the same.

Example: ``orders`` positions 0..9, id "a" at position 4 stored at 1000; group ``billing``
has next 10 and nothing in flight: ``acked``; group ``audit`` has next 5 and holds 4 in
flight: ``in_flight``; group ``mail`` has next 10 and ``hourglass.dlq`` holds "a~r1" with
origin "a", ``dlq.subject`` "orders", ``hourglass.nacked_by`` "mail": ``dead_lettered``,
copy "a~r1".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.errors import HourglassError, NotFound, UnknownSubject
from node.realtime.browse import unacked
from node.realtime.dedup import key_of
from node.realtime.nack import NACKED_BY, ORIGIN_ID
from node.realtime.subjects import DLQ_SUBJECT

SCAN_ENTRIES_MAX = 8192  # entries one lookup reads at most per subject scanned (with pull_scan_entries_max)
AROUND_SLACK_MS = 10_000  # a time scan starts this long before the time it is given (clocks, rounds)


@dataclass(frozen=True, slots=True)
class GroupState:
    group: str
    state: str  # waiting | in_flight | acked | nacked | dead_lettered
    copy_id: str = ""
    copy_subject: str = ""
    copy_ms: int = 0


@dataclass(frozen=True, slots=True)
class Found:
    position: int
    seq: int
    stored_ms: int
    attempts: int
    found_by: str  # window | scan
    groups: tuple[GroupState, ...]


class _Subject:
    """Read access to one subject's entries and their messages."""

    def __init__(self, indexes, frames, subject: str) -> None:
        self.ix = indexes.index(subject)
        self.fd = indexes.fd(self.ix)
        self.frames = frames

    @property
    def lo(self) -> int:
        return self.ix.base

    @property
    def hi(self) -> int:
        return self.ix.count

    def row(self, pos: int):
        """``(batch, index)`` of the message at ``pos``, or None (its frame is gone)."""
        e = self.ix.read(self.fd, pos, 1)
        if not len(e):
            return None
        try:
            return self.frames.get(int(e["offset"][0])), int(e["index"][0])
        except HourglassError:
            return None

    def first_at_or_after(self, key, value: int) -> int:
        """The first position whose message's ``key(batch, i)`` is at least ``value`` (keys
        non-decreasing in position order; an unreadable entry counts as below)."""
        lo, hi = self.lo, self.hi
        while lo < hi:
            mid = (lo + hi) // 2
            r = self.row(mid)
            if r is not None and key(*r) >= value:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def scan(self, start: int, n: int):
        """``(position, batch, index)`` for the readable messages of ``[start, start + n)``."""
        start = max(start, self.lo)
        n = min(n, self.hi - start)
        if n <= 0:
            return
        entries = self.ix.read(self.fd, start, n)
        for k in range(len(entries)):
            try:
                b = self.frames.get(int(entries["offset"][k]))
            except HourglassError:
                continue
            yield start + k, b, int(entries["index"][k])


def _seq(b, i) -> int:
    return int(b.seq[i])


def _stored(b, i) -> int:
    return int(b.store_ms[i])


def find(indexes, frames, dedup_map, subject: str, msg_id: str, *, around_ms: int, scan_max: int):
    """``(position, batch, index, found_by)`` of ``msg_id`` in ``subject``; ``NotFound``."""
    sub = _Subject(indexes, frames, subject)
    seq = dedup_map.get(key_of(subject, msg_id))
    if seq is not None:
        pos = sub.first_at_or_after(_seq, int(seq))
        r = sub.row(pos) if pos < sub.hi else None
        if r is not None and _seq(*r) == int(seq) and r[0].id(r[1]) == msg_id:
            return pos, r[0], r[1], "window"
    if around_ms > 0:
        start = sub.first_at_or_after(_stored, around_ms - AROUND_SLACK_MS)
    else:
        start = sub.hi - scan_max
    for pos, b, i in sub.scan(start, scan_max):
        if b.id(i) == msg_id and b.subject(i) == subject:
            return pos, b, i, "scan"
    raise NotFound(f"message {msg_id!r} not found in subject {subject!r} on this node (looked at the "
                   f"de-duplication window and {scan_max} entries "
                   + (f"from {around_ms - AROUND_SLACK_MS} ms" if around_ms > 0 else "at the end") + ")")


def nack_copies_of(indexes, frames, subject: str, msg_id: str, *, from_ms: int, scan_max: int
                   ) -> dict[str, GroupState]:
    """Group -> the newest copy a nack of that group made of ``msg_id``: dead letters in
    ``hourglass.dlq`` (naming ``subject``) win over retry copies in ``subject``."""
    out: dict[str, GroupState] = {}
    for where, state in ((subject, "nacked"), (DLQ_SUBJECT, "dead_lettered")):
        try:
            sub = _Subject(indexes, frames, where)
        except UnknownSubject:
            continue
        start = sub.first_at_or_after(_stored, from_ms)
        for _, b, i in sub.scan(start, scan_max):
            cid = b.id(i)
            if not cid.startswith(msg_id[:100] + "~r"):
                continue  # cheap test first: copies are named {origin}~r{attempts}
            props = dict(b.extra(i)[1])
            if props.get(ORIGIN_ID) != msg_id or NACKED_BY not in props:
                continue
            if where == DLQ_SUBJECT and props.get("dlq.subject") != subject:
                continue
            out[props[NACKED_BY]] = GroupState(props[NACKED_BY], state, cid, where, int(b.store_ms[i]))
    return out


def group_state(g, position: int) -> str:
    """waiting | in_flight | done of ``position`` for group ``g`` (``groups.Group``)."""
    if position >= g.next_pos:
        return "waiting"
    if unacked(np.array([position], np.int64), g.next_pos, g.inflight)[0]:
        return "in_flight"
    return "done"


def lookup(indexes, frames, groups, dedup_map, subject: str, msg_id: str, *, around_ms: int,
           scan_max: int) -> Found:
    """See the module docstring. ``UnknownSubject``, ``NotFound``."""
    pos, b, i, how = find(indexes, frames, dedup_map, subject, msg_id, around_ms=around_ms, scan_max=scan_max)
    stored = int(b.store_ms[i])
    names = groups.names(subject)
    copies = nack_copies_of(indexes, frames, subject, msg_id, from_ms=stored, scan_max=scan_max) if names else {}
    states = []
    for name in sorted(names):
        g = groups.get(subject, name)
        st = group_state(g, pos)
        if st == "done":
            states.append(copies.get(name) or GroupState(name, "acked"))
        else:
            states.append(GroupState(name, st))
    return Found(pos, int(b.seq[i]), stored, int(b.attempts[i]), how, tuple(states))


__all__ = ["AROUND_SLACK_MS", "SCAN_ENTRIES_MAX", "Found", "GroupState", "find", "group_state", "lookup",
           "nack_copies_of"]
