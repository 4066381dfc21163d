"""Lateness of fired messages over a sliding window (issue 31, the console's "lateness p50/p99
over the last hour"): fire time minus due time, as a bounded histogram. Pure: time comes in as
``now_ms``; no clock, no I/O.

What it owns: a ring of ``window_ms // slot_ms`` slots, each a histogram of the lateness
observed while it was current, over fixed bounds growing by ``RATIO`` (10 %) from 1 ms to
``LATENESS_MS_TOP`` (a day; anything later counts in the last bucket). Memory is
``slots x len(BOUNDS_MS)`` integers whatever the rate. A slot is cleared when the ring comes
back to it, so the window covers between ``window_ms - slot_ms`` and ``window_ms``.

A quantile is the upper bound of the bucket holding it: at most 10 % (and 1 ms) above the
true value, never below it (``tests/test_status_counts.py`` checks it against a sorted list).

Example: 99 messages 2 ms late and one 900 ms late in the last hour: p50 is the bound of the
bucket holding 2 ms (2 ms), p99 the same (the 99th of 100 is still 2 ms); a second message
900 ms late moves p99 to the bound holding 900 ms (<= 990 ms).
"""

from __future__ import annotations

import numpy as np

RATIO = 1.1
LATENESS_MS_TOP = 86_400_000
# upper bounds of the buckets: 0 ms, then 1 ms growing by RATIO (rounded up, each above the last)
BOUNDS_MS = np.unique(np.concatenate([[0], np.ceil(RATIO ** np.arange(0, int(np.log(LATENESS_MS_TOP) / np.log(RATIO)) + 2))])).astype(np.int64)


class LatenessWindow:
    def __init__(self, *, window_ms: int, slot_ms: int) -> None:
        assert window_ms > 0 and 0 < slot_ms <= window_ms, (window_ms, slot_ms)
        self.slot_ms = slot_ms
        self.slots = window_ms // slot_ms
        self.window_ms = self.slots * slot_ms
        self._counts = np.zeros((self.slots, len(BOUNDS_MS)), np.int64)
        self._slot_of = np.full(self.slots, -1, np.int64)  # the slot number each row holds

    def _row(self, now_ms: int) -> int:
        n = now_ms // self.slot_ms
        i = n % self.slots
        if self._slot_of[i] != n:
            self._counts[i] = 0
            self._slot_of[i] = n
        return i

    def observe(self, lateness_ms: np.ndarray, *, now_ms: int) -> None:
        """Messages fired at ``now_ms``, this late each (negative: counted as 0)."""
        if not len(lateness_ms):
            return
        idx = np.searchsorted(BOUNDS_MS, np.maximum(np.asarray(lateness_ms, np.int64), 0), side="left")
        idx = np.minimum(idx, len(BOUNDS_MS) - 1)
        self._counts[self._row(now_ms)] += np.bincount(idx, minlength=len(BOUNDS_MS))

    def histogram(self, now_ms: int) -> np.ndarray:
        n = now_ms // self.slot_ms
        live = (self._slot_of > n - self.slots) & (self._slot_of <= n)
        return self._counts[live].sum(axis=0)

    def summary(self, now_ms: int) -> dict:
        """``{"window_ms", "count", "p50_ms", "p99_ms"}`` (quantiles None with nothing fired)."""
        h = self.histogram(now_ms)
        total = int(h.sum())
        out = {"window_ms": self.window_ms, "count": total, "p50_ms": None, "p99_ms": None}
        if total:
            cum = np.cumsum(h)
            for name, q in (("p50_ms", 0.50), ("p99_ms", 0.99)):
                rank = max(1, int(np.ceil(q * total)))
                out[name] = int(BOUNDS_MS[int(np.searchsorted(cum, rank, side="left"))])
        return out


__all__ = ["BOUNDS_MS", "LatenessWindow"]
