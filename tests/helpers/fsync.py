"""An fsync held on a gate: what a slow or stuck disk looks like to a group commit."""

from __future__ import annotations

import threading

from node.store.log import SegmentedLog

GUARD_S = 10  # the held fsync goes on after this even if nobody releases it (a hang fails instead)


def held_fsync(log: SegmentedLog, error: OSError | None = None, *,
               guard_s: float = GUARD_S) -> tuple[threading.Event, threading.Event]:
    """Make ``log.flush`` wait for ``release`` (set ``in_fsync`` first), then fsync, or raise
    ``error``; ``del log.flush`` puts the real one back."""
    release, in_fsync = threading.Event(), threading.Event()
    real_flush = log.flush

    def flush():
        in_fsync.set()
        release.wait(guard_s)
        if error is not None:
            raise error
        real_flush()
    log.flush = flush
    return release, in_fsync
