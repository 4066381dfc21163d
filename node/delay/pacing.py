"""When the delay node's two loops wait for company (issue 28, eleventh session): pure rules
over one millisecond clock, used by ``DelayNode._wheel_loop`` and ``DelayNode._file_linger``
(docs/design.md, "Dispatch rounds" and "Filing").

* A firing round waits for the spacing (``dispatch_round_interval_ms`` after the last) unless a
  held message would then leave less than ``urgent_ms`` before its due time: it never makes a
  message late, and in the steady state (due times entering the lead in order) it never fires
  early either.
* The filer waits up to ``file_linger_ms`` after a write for more writes to file with it,
  unless a record waiting is due within ``room_ms`` (the lead, the linger and a margin).
"""

from __future__ import annotations


def round_wait_ms(now_ms: float, next_round_ms: float, earliest_held_ms: float | None, urgent_ms: int) -> float:
    """How long the firing loop still waits before its next round (<= 0: fire now)."""
    wait = next_round_ms - now_ms
    if earliest_held_ms is not None:
        wait = min(wait, earliest_held_ms - urgent_ms - now_ms)
    return wait


def linger_wait_ms(now_ms: float, deadline_ms: float, earliest_unfiled_ms: float | None, room_ms: int) -> float:
    """How long the filer still waits for more writes (<= 0: file now). Nothing in memory
    (a replay reads the log): now."""
    if earliest_unfiled_ms is None:
        return 0.0
    return min(deadline_ms - now_ms, earliest_unfiled_ms - room_ms - now_ms)
