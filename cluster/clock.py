"""Clocks as an interface (trio's MockClock idea): cores take ``now_ms``; shells ask a Clock.

``SystemClock(offset_ms)`` is wall-clock UTC milliseconds plus an offset; the offset
lets tests inject clock skew into a real node process (``HOURGLASS_CLOCK_OFFSET_MS``),
and lets a node with ``allow_clock_control`` be moved forward to test long delays.
``FakeClock`` is for tests of shells that should not sleep.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms


class FakeClock:
    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a fake clock moves forward only")
        self._now += ms
