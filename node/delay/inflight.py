"""In-flight units: the messages a delay store fired and has not settled yet.

``DelayCore`` (node/delay/core.py) holds one ``InFlight``. A unit is what one ``fire`` hands
out (``DueBatch``): a batch in due order and, per message, whether it is still live (not
acknowledged nor released). A message settles once: an index repeated in one call, or named
again in a later call, is skipped. No file, clock or thread here.

Invariant (asserted in ``check``): ``count`` is the number of live messages over all units,
never negative; a unit with no live message left is dropped.

Example: ``add`` of a batch of 3 -> unit 1, ``count`` 3; ``settle(1, [0, 0, 2])`` returns
messages 0 and 2, ``count`` 1; ``settle(1, [0])`` returns None (settled already).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.codec import Batch


@dataclass(frozen=True, slots=True)
class DueBatch:
    """Messages to dispatch now: one in-flight unit (``batch.effective_ms`` = schedule time)."""

    unit: int
    batch: Batch


@dataclass(slots=True)
class _Unit:
    batch: Batch
    live: np.ndarray  # bool: not yet acknowledged or released


class InFlight:
    """The in-flight units of one delay store (module docs)."""

    def __init__(self) -> None:
        self.units: dict[int, _Unit] = {}
        self.counter = 0  # the last unit id handed out
        self.count = 0  # live messages over all units

    def add(self, b: Batch) -> DueBatch:
        """A new unit of every message of ``b``."""
        self.counter += 1
        self.units[self.counter] = _Unit(b, np.ones(b.n, bool))
        self.count += b.n
        return DueBatch(self.counter, b)

    def live(self, unit: int, idx) -> tuple[_Unit, np.ndarray] | None:
        """The unit and those of messages ``idx`` still live in it, each once (None: none are)."""
        u = self.units.get(unit)
        if u is None:
            return None
        idx = _indexes(idx)
        idx = idx[u.live[idx]]
        if not len(idx):
            return None
        return u, idx

    def settle(self, unit: int, idx) -> Batch | None:
        """Messages ``idx`` of a unit leave flight: those that were live (None: none were)."""
        got = self.settle_indexes(unit, idx)
        return None if got is None else got[0].take(got[1])

    def settle_indexes(self, unit: int, idx) -> tuple[Batch, np.ndarray] | None:
        """``settle`` as the unit's batch and the positions in it that left flight, each once
        (None: none were live): an acknowledgement needs two columns of them, not a copy of
        their payloads."""
        got = self.live(unit, idx)
        if got is None:
            return None
        u, idx = got
        u.live[idx] = False
        self.count -= len(idx)
        assert self.count >= 0, self.count
        if not u.live.any():
            del self.units[unit]
        return u.batch, idx

    def clear(self) -> None:
        """Every unit forgotten (unit ids go on growing)."""
        self.units.clear()
        self.count = 0

    def batch(self, unit: int) -> Batch | None:
        u = self.units.get(unit)
        return None if u is None else u.batch

    def low_ms(self) -> int | None:
        """The earliest effective time of a live message (None: nothing in flight)."""
        low = None
        for u in self.units.values():
            live = u.batch.effective_ms[u.live]
            if len(live):
                m = int(live.min())
                low = m if low is None else min(low, m)
        return low

    def contains(self, seq: int) -> bool:
        return any(bool((u.batch.seq[u.live] == seq).any()) for u in self.units.values())

    def seqs(self) -> np.ndarray | None:
        """The seqs of every live message (None: no unit)."""
        if not self.units:
            return None
        return np.concatenate([u.batch.seq[u.live] for u in self.units.values()])

    def check(self) -> None:
        assert self.count == sum(int(u.live.sum()) for u in self.units.values()), self.count


def _indexes(idx) -> np.ndarray:
    """Indexes into a unit, each once: an index repeated in one call settles its message once
    (it was recorded twice in the dispatch log and lowered ``count`` twice)."""
    a = np.asarray(idx, np.int64)
    if len(a) < 2 or bool((a[1:] > a[:-1]).all()):  # the usual case: ascending already (a sort costs more)
        return a
    return np.unique(a)


__all__ = ["DueBatch", "InFlight"]
