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

    def seconds_until(self, at_ms: int) -> float:
        """Seconds from now until ``now_ms()`` reaches ``at_ms`` (<= 0: it has)."""


def wall_ms() -> int:
    """Wall-clock milliseconds since the epoch: the one helper for code that is given no
    ``Clock`` (SDK, CLI, chaos tools); nodes read time through ``SystemClock``."""
    return time.time_ns() // 1_000_000


class SystemClock:
    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def seconds_until(self, at_ms: int) -> float:
        return (at_ms - self.offset_ms) / 1000 - time.time()  # to the sub-millisecond, not from now_ms()


class FakeClock:
    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def seconds_until(self, at_ms: int) -> float:
        return (at_ms - self._now) / 1000

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a fake clock moves forward only")
        self._now += ms
