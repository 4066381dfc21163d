"""Pending messages by minute, for the buckets that start within a horizon (issue 31, the
console's "next 60 minutes by minute" view), from the per-second schedule index: no message
body is read.

What it owns: per bucket near the head of the schedule, the net records (messages minus
tombstones) filed per second of the bucket, read from the bucket's index (``messages`` and
``cancels`` of each entry, ``node/store/schedule_bucket.py``). The index of a bucket only
grows while it is the same file, so a later look reads only the entries added since
(one ``pread``); a rebuilt bucket (``ScheduleLog.rebuilds`` moved, or fewer entries than
read) is read again whole. At most ``buckets_max`` buckets are kept.

The counts themselves are a pure function (``minute_counts``) of those per-second counts,
the store's ``completed_ms``, the delivered messages it remembers, and the bucket's pending
count (``DelayCore.pending``, kept exact at filing, dispatch and cancel, and recounted on
recovery). Invariant: the minutes of a bucket sum to its pending count. Records of seconds
at or before ``completed_ms``'s second are due now (fired, in flight, or being loaded): what
the pending count holds beyond the later seconds is put in the minute of ``completed_ms``.

Worked example: a 1 h bucket starting at 0, completed_ms 90_500 (second 90), pending 7. The
index holds 3 net records at second 30, 4 at second 90, 2 at second 130 and 1 at second
200; one message due at 200_000 was delivered early (it is in ``dispatched``). Seconds after
90: minute 120_000 holds 2, minute 180_000 holds 1 - 1 = 0. The rest, 7 - 2 = 5, is due now:
minute 60_000 (completed_ms's) holds 5. Result ``{60_000: 5, 120_000: 2}``.
"""

from __future__ import annotations

import numpy as np

MINUTE_MS = 60_000


def minute_counts(net_by_second: np.ndarray, *, start_ms: int, completed_ms: int, pending: int,
                  delivered_ms: np.ndarray) -> dict[int, int]:
    """Minute start (ms) -> pending messages of one bucket starting at ``start_ms``.

    ``net_by_second[i]``: messages minus tombstones filed in second ``i`` of the bucket;
    ``delivered_ms``: effective times of delivered messages the store remembers (any; those
    of this bucket after ``completed_ms``'s second are taken off); ``pending``: the bucket's
    pending count. The result sums to ``pending``: what the later seconds do not hold is due
    now (``completed_ms``'s minute); should the index show more than is pending (a count it
    cannot explain), the excess is taken from the earliest minutes, and no minute is negative."""
    seconds = len(net_by_second)
    first_s = max(0, (completed_ms - start_ms) // 1000 + 1) if completed_ms >= start_ms else 0
    net = np.asarray(net_by_second, np.int64).copy()
    net[: min(first_s, seconds)] = 0
    if len(delivered_ms):
        d = np.asarray(delivered_ms, np.int64)
        d = d[(d >= start_ms + first_s * 1000) & (d < start_ms + seconds * 1000)]
        if len(d):
            np.subtract.at(net, (d - start_ms) // 1000, 1)
    minutes = -(-seconds // 60)
    padded = np.zeros(minutes * 60, np.int64)
    padded[:seconds] = net
    per_minute = np.maximum(padded.reshape(minutes, 60).sum(axis=1), 0)
    now_minute = max(0, (completed_ms - start_ms) // MINUTE_MS) if completed_ms >= start_ms else 0
    now_minute = min(now_minute, minutes - 1)
    rest = pending - int(per_minute.sum())
    if rest >= 0:
        per_minute[now_minute] += rest
    else:  # the index shows more than is pending: take the difference from the earliest minutes
        take = -rest
        for i in range(minutes):
            d = min(take, int(per_minute[i]))
            per_minute[i] -= d
            take -= d
            if not take:
                break
    return {start_ms + i * MINUTE_MS: int(n) for i, n in enumerate(per_minute.tolist()) if n > 0}


class _Seen:
    __slots__ = ("bucket", "rebuilds", "entries", "net")

    def __init__(self, bucket, rebuilds: int, seconds: int) -> None:
        self.bucket, self.rebuilds, self.entries = bucket, rebuilds, 0
        self.net = np.zeros(seconds, np.int64)


class PendingMinutes:
    """Per-second net counts of the buckets near the head, read from their index as it grows
    (module docs). ``schedule``: the store's ``ScheduleLog``."""

    def __init__(self, *, buckets_max: int) -> None:
        assert buckets_max >= 1
        self.buckets_max = buckets_max
        self._seen: dict[int, _Seen] = {}

    def net_by_second(self, schedule, start_ms: int) -> np.ndarray | None:
        b = schedule.bucket(start_ms, create=False)
        if b is None:
            self._seen.pop(start_ms, None)
            return None
        seen = self._seen.get(start_ms)
        if seen is None or seen.bucket is not b or seen.rebuilds != schedule.rebuilds or b.entries < seen.entries:
            seen = _Seen(b, schedule.rebuilds, b.seconds)
            self._seen[start_ms] = seen
            while len(self._seen) > self.buckets_max:
                self._seen.pop(min(self._seen))
        if b.entries > seen.entries:
            e = b.entries_array(first=seen.entries)
            sec = e["second"].astype(np.int64)
            ok = sec < len(seen.net)  # the index's own checks refuse others; never index past the end
            np.add.at(seen.net, sec[ok], e["messages"].astype(np.int64)[ok] - e["cancels"].astype(np.int64)[ok])
            seen.entries += len(e)
        return seen.net

    def follower_pending(self, store, pending: dict[int, int]) -> dict[int, int]:
        """A follower's pending counts as of its master's last checkpoint: a follower files what
        it replicates (its counts go up, and down for tombstones) but fires nothing, so what the
        master dispatched stays counted. Buckets that end by ``completed_ms`` (the master's, as
        replicated) are done; the bucket holding it counts the seconds after its second, from
        the index; later buckets are exact."""
        c = store.core.completed_ms
        bms = store.settings.bucket_ms
        out = {b: n for b, n in pending.items() if b + bms > c}
        now_bucket = c - c % bms
        if c >= 0 and now_bucket in out:
            net = self.net_by_second(store.schedule, now_bucket)
            n = 0 if net is None else max(0, int(net[(c - now_bucket) // 1000 + 1:].sum()))
            if n:
                out[now_bucket] = n
            else:
                del out[now_bucket]
        return out

    def counts(self, store, pending: dict[int, int], *, now_ms: int, horizon_ms: int) -> dict[int, int]:
        """Minute start -> pending messages, for every bucket with pending messages (``pending``:
        bucket start -> count) that starts before ``now_ms + horizon_ms`` (whole buckets: each
        sums to its pending count)."""
        core = store.core
        bms = store.settings.bucket_ms
        c = core.completed_ms
        end = now_ms + horizon_ms
        starts = sorted(s for s, n in pending.items() if n > 0 and s < end)[: self.buckets_max]
        for gone in [s for s in self._seen if s not in starts]:
            del self._seen[gone]
        if not starts:
            return {}
        lo = starts[0]
        floor = max(c, lo)
        delivered = np.zeros(0, np.int64) if core.dispatched_eff_max < floor else \
            np.fromiter((eff for eff in core.dispatched.values() if eff >= floor), np.int64)
        out: dict[int, int] = {}
        for s in starts:
            net = self.net_by_second(store.schedule, s)
            if net is None:
                net = np.zeros(bms // 1000, np.int64)
            out.update(minute_counts(net, start_ms=s, completed_ms=c, pending=pending[s], delivered_ms=delivered))
        return out


__all__ = ["MINUTE_MS", "PendingMinutes", "minute_counts"]
