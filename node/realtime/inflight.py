"""The in-flight handles of one consumer group of one subject, as ranges (pure: no I/O, no clock).

A pull hands out handles; until they are acked they are *in flight*, each with the time
it was (re)delivered. They are held as disjoint runs ``[lo, hi)`` sorted by ``lo``, each
with one ``pulled_at_ms``, never one object per handle: a pull of 500 consecutive
handles is one run, an ack of a range removes or splits runs.

Invariants (``check``): runs are non-empty, disjoint and sorted; ``count`` is the sum of
their lengths; ``t_floor`` is at most every run's ``pulled_at_ms`` (a lower bound kept so
that ``due`` is O(1) while nothing can have timed out).

Example::

    f = InflightRanges()
    f.add(0, 5, t)                    # handles 0..4 pulled at t
    f.remove([(1, 3)])                # -> 2 (acked 1 and 2); runs [0,1) and [3,5)
    f.take_due(t, 10, now_ms=t + timeout)   # -> [(0, 1), (3, 5)]: pulled at or before t, restarted
    f.committed(5)                    # -> 0: the lowest handle not yet acked
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

_NEVER = 1 << 62


class InflightRanges:
    __slots__ = ("lo", "hi", "t", "count", "t_floor")

    def __init__(self) -> None:
        self.lo: list[int] = []   # run starts, sorted
        self.hi: list[int] = []   # run ends (exclusive)
        self.t: list[int] = []    # pulled_at_ms of each run
        self.count = 0
        self.t_floor = _NEVER

    def __len__(self) -> int:
        return self.count

    def runs(self) -> list[list[int]]:
        """``[[lo, hi], ...]`` with adjacent runs merged (what a group file stores as pending)."""
        out: list[list[int]] = []
        for a, b in zip(self.lo, self.hi):
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
        return out

    def committed(self, next_pos: int) -> int:
        """The lowest handle not acked: the first run's start, else ``next_pos``."""
        return self.lo[0] if self.lo else next_pos

    def add(self, lo: int, hi: int, t: int) -> None:
        """Handles ``[lo, hi)`` handed out at ``t``; ``lo`` is above every handle held."""
        assert lo < hi and (not self.hi or lo >= self.hi[-1]), (lo, hi, self.hi[-1:])
        if self.hi and self.hi[-1] == lo and self.t[-1] == t:
            self.hi[-1] = hi
        else:
            self.lo.append(lo)
            self.hi.append(hi)
            self.t.append(t)
        self.count += hi - lo
        self.t_floor = min(self.t_floor, t)

    def add_runs(self, runs: Iterable[tuple[int, int]], t: int) -> None:
        for a, b in runs:
            self.add(a, b, t)

    def _cut(self, a: int, b: int, keep_t: int | None) -> list[tuple[int, int, int]]:
        """Remove ``[a, b)`` from the runs; return the removed pieces (lo, hi, t). With
        ``keep_t`` the pieces are put back with that time (a restarted deadline)."""
        lo, hi, t = self.lo, self.hi, self.t
        i = max(0, bisect_right(lo, a) - 1)
        removed: list[tuple[int, int, int]] = []
        new_lo: list[int] = []
        new_hi: list[int] = []
        new_t: list[int] = []
        j = i
        while j < len(lo) and lo[j] < b:
            x, y, tt = lo[j], hi[j], t[j]
            if y <= a:
                new_lo.append(x), new_hi.append(y), new_t.append(tt)
                j += 1
                continue
            if x < a:
                new_lo.append(x), new_hi.append(a), new_t.append(tt)
            p, q = max(x, a), min(y, b)
            removed.append((p, q, tt))
            if keep_t is not None:
                new_lo.append(p), new_hi.append(q), new_t.append(keep_t)
            if y > b:
                new_lo.append(b), new_hi.append(y), new_t.append(tt)
            j += 1
        if removed:
            lo[i:j], hi[i:j], t[i:j] = new_lo, new_hi, new_t
            n = sum(q - p for p, q, _ in removed)
            if keep_t is None:
                self.count -= n
            else:
                self.t_floor = min(self.t_floor, keep_t)
        if not lo:
            self.t_floor = _NEVER
        return removed

    def remove(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Drop handles in ``ranges`` (acked); returns how many were in flight."""
        n = 0
        lo, hi, t = self.lo, self.hi, self.t
        for a, b in ranges:
            a, b = int(a), int(b)
            i = bisect_right(lo, a) - 1
            if i >= 0 and lo[i] == a and hi[i] == b:  # the common ack: exactly one pulled run
                del lo[i], hi[i], t[i]
                self.count -= b - a
                n += b - a
                if not lo:
                    self.t_floor = _NEVER
                continue
            n += sum(q - p for p, q, _ in self._cut(a, b, None))
        return n

    def touch(self, ranges: Iterable[tuple[int, int]], t: int) -> list[tuple[int, int]]:
        """The in-flight parts of ``ranges``, their deadline restarted at ``t`` (nack)."""
        out: list[tuple[int, int]] = []
        for a, b in ranges:
            out += [(p, q) for p, q, _ in self._cut(int(a), int(b), t)]
        return out

    def take_due(self, cutoff: int, k: int, *, now_ms: int) -> list[tuple[int, int]]:
        """Up to ``k`` handles pulled at or before ``cutoff`` (timed out), oldest pull first
        (then lowest handle), as ranges; their deadline restarts at ``now_ms``."""
        if k <= 0 or self.t_floor > cutoff:
            return []
        due = sorted((tt, a, b) for a, b, tt in zip(self.lo, self.hi, self.t) if tt <= cutoff)
        if not due:
            self.t_floor = min(self.t, default=_NEVER)
            return []
        out: list[tuple[int, int]] = []
        for _, a, b in due:
            if k <= 0:
                break
            b = min(b, a + k)
            out.append((a, b))
            k -= b - a
        for a, b in out:
            self._cut(a, b, now_ms)
        self.t_floor = min(self.t, default=_NEVER)
        return out

    def truncate(self, end: int) -> None:
        """Forget handles at or above ``end`` (their index entries were cut)."""
        self._cut(end, 1 << 63, None)

    def check(self) -> None:
        assert len(self.lo) == len(self.hi) == len(self.t)
        assert all(a < b for a, b in zip(self.lo, self.hi))
        assert all(b <= c for b, c in zip(self.hi, self.lo[1:]))
        assert self.count == sum(b - a for a, b in zip(self.lo, self.hi))
        assert all(self.t_floor <= tt for tt in self.t)
