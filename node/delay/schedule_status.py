"""What a delay node's ``Admin/Status`` says about its schedule (issue 31, the console's
Schedule page; docs/console.md, "Node-side support"):

* ``bucket_ms`` and ``pending_by_bucket``: bucket start (ms, as a string: JSON keys) -> messages
  filed there and not yet dispatched or cancelled (``DelayCore.pending``, kept at filing,
  dispatch and cancel and recounted from the schedule index on recovery and promotion), the
  earliest ``status_buckets_max`` buckets;
* ``pending_by_minute``: minute start -> pending messages of the buckets starting within
  ``pending_by_minute_horizon_ms`` (``node/delay/minutes.py``: from the per-second index, each
  bucket's minutes summing to its pending count);
* ``lateness``: p50/p99 of fire time minus due time over ``lateness_window_ms``
  (``node/delay/lateness.py``), with how many messages fired in the window.

A slave reports its own view: its store files what it replicated and counts it, and fires
nothing (lateness empty); its counts are taken as of the master's last checkpoint that it
holds (``PendingMinutes.follower_pending``: what is due by that ``completed_ms`` was fired).
The lateness window lives in memory: it starts empty after a restart.
"""

from __future__ import annotations

from node.delay.lateness import LatenessWindow
from node.delay.minutes import PendingMinutes


class ScheduleStatus:
    def __init__(self, settings) -> None:
        self.buckets_max = settings.status_buckets_max
        self.horizon_ms = settings.pending_by_minute_horizon_ms
        self.minutes = PendingMinutes(buckets_max=settings.pending_by_minute_buckets_max)
        self.lateness = LatenessWindow(window_ms=settings.lateness_window_ms, slot_ms=settings.lateness_slot_ms)

    def stats(self, store, *, now_ms: int) -> dict:
        pending = store.pending_by_bucket()
        if store.follower:
            pending = self.minutes.follower_pending(store, pending)
        shown = sorted(pending)[: self.buckets_max]
        return {"bucket_ms": store.settings.bucket_ms,
                "pending_by_bucket": {str(b): pending[b] for b in shown},
                "pending_buckets_left_out": len(pending) - len(shown),
                "pending_by_minute": {str(m): n for m, n in
                                      self.minutes.counts(store, pending, now_ms=now_ms,
                                                          horizon_ms=self.horizon_ms).items()},
                "lateness": self.lateness.summary(now_ms)}


__all__ = ["ScheduleStatus"]
