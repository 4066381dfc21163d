"""Reading a subject without consuming it (``Consumer/Browse``; issue 31, the console's Dead
letters page): what one consumer group has not acknowledged, from a position on, with no
handle handed out and no group moved.

A position is a handle (``node/realtime/index.py``): the subject's index holds positions
``[base, count)``; below ``base`` retention took them. For the group, a position is not
acknowledged when it is at or after the group's ``next`` (never handed out) or in its
in-flight runs; positions below its committed one, and the others between, were acked. A
group not opened yet has acknowledged nothing.

Bounded: at most ``max_messages`` messages, and at most ``scan_max`` positions looked at in
one call (acked positions between are skipped, not read); ``next_position`` says where to go
on. Pure apart from the index read and the frames (``Delivery.gather``).

Example: ``orders`` holds positions 0..9; group ``billing`` acked 0..3 and 6, holds 4..5 in
flight, was never handed 7..9. ``browse(from=0, max=10)`` gives positions 4, 5, 7, 8, 9 and
``next_position`` 10.
"""

from __future__ import annotations

import numpy as np

from node.realtime.inflight import InflightRanges


def unacked(positions: np.ndarray, next_pos: int, inflight: InflightRanges) -> np.ndarray:
    """Which of ``positions`` (sorted) the group has not acknowledged."""
    keep = positions >= next_pos
    if inflight.lo:
        lo = np.asarray(inflight.lo, np.int64)
        hi = np.asarray(inflight.hi, np.int64)
        i = np.searchsorted(lo, positions, side="right") - 1
        inside = (i >= 0) & (positions < hi[np.maximum(i, 0)])
        keep |= inside
    return keep


def browse(indexes, groups, delivery, subject: str, group: str, *, from_position: int, max_messages: int,
           scan_max: int):
    """``(batch, positions, next_position, end_position)``; ``UnknownSubject`` for no such subject."""
    ix = indexes.index(subject)
    g = groups.get(subject, group)
    lo = max(int(from_position), ix.base, g.committed() if g is not None else 0)
    hi = min(ix.count, lo + max(0, scan_max))
    if lo >= hi or max_messages <= 0:
        return None, np.zeros(0, np.uint64), max(lo, min(int(from_position), ix.count)), ix.count
    positions = np.arange(lo, hi, dtype=np.int64)
    if g is not None:
        positions = positions[unacked(positions, g.next_pos, g.inflight)]
    if len(positions) > max_messages:
        positions = positions[:max_messages]
        nxt = int(positions[-1]) + 1
    else:
        nxt = hi
    if not len(positions):
        return None, np.zeros(0, np.uint64), nxt, ix.count
    fd = indexes.fd(ix)
    entries = np.concatenate([ix.read(fd, a, b - a) for a, b in _runs(positions)])
    batch, handles = delivery.gather(entries, positions)
    return batch, handles, nxt, ix.count


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as ``[a, b)`` runs (one index read each)."""
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(positions)]))
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts.tolist(), ends.tolist())]


__all__ = ["browse", "unacked"]
