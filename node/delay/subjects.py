"""Pending messages per (bucket, subject): the counts behind the console's Schedule page per
subject (issue 31). Pure: no file, clock or thread.

What it owns: ``SubjectPending.by_bucket``, bucket start -> subject -> messages filed there and
not yet dispatched nor cancelled. It moves exactly where ``DelayCore.pending`` moves
(``DelayCore.pending_add``: filing, a dispatch record, a cancel whose bucket is retired) with the
same signs, split by each record's subject (the batch's subject column), and is made afresh
where the pending counts are (at open, at a promotion, after a bucket rebuild:
``node/delay/subject_tables.py`` recounts it from the per-bucket subject tables and the frames'
subject columns, never a payload).

Invariant: for every bucket, its subjects' counts are positive and sum to the bucket's pending
count (``check``; ``DelayStore.check_invariants`` also compares both with a recount from disk).

``summary`` bounds what a Status carries: the ``subjects_max`` subjects with most pending
messages (in every bucket but those a Status leaves out, from a running total per subject),
the rest summed under ``OTHER``, which no subject can be called (a subject starts with a
letter or digit, ``cluster.codec.subject_problem``).

**Per minute** (the console's minute view of one subject): for the buckets the Status's minute
view covers (``track``: at most ``pending_by_minute_buckets_max``, starting within
``pending_by_minute_horizon_ms``), ``minutes``: bucket start -> subject -> minute start ->
pending messages, moved by the same ``add`` calls at the minute of each record's effective
time; a bucket entering is counted once (``SubjectTables.minute_rows``: its subject table per
minute and, for the bucket holding ``completed_ms``, that minute's frames), one leaving is
forgotten. Invariant: a tracked bucket's minutes of a subject are positive and sum to that
subject's count in the bucket (``check``).

Worked example: bucket 0 holds ``{"a": 3, "b": 1}``, bucket 3_600_000 ``{"c": 2}``;
``summary(subjects_max=2)`` is ``{"a": 3, "c": 2, "(other)": 1}``, and
``of_subject("a", [0, 3_600_000])`` is ``{0: 3}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

OTHER = "(other)"


GROUPED_PY_MAX = 64  # records ``grouped`` sums in a dict; more go through numpy (bench: equal near 200)
GROUPED_BINS_MAX = 1 << 16  # (start, subject) keys ``grouped`` counts in bins rather than sorts


def grouped(starts: np.ndarray, subjects: Sequence[str], sidx: np.ndarray,
            sign: np.ndarray | int) -> list[tuple[int, str, int]]:
    """(start, subject, sum of ``sign``) per distinct (start, subject) of records whose starts
    (a bucket, a minute: any int64) are ``starts`` and subject indexes (into ``subjects``)
    ``sidx``: two ``np.unique`` over small integers, whatever the number of records."""
    n = len(starts)
    if not n:
        return []
    if n <= GROUPED_PY_MAX:  # a few records: a dict is cheaper than numpy's fixed cost per call
        sums: dict[tuple[int, int], int] = {}
        keys = zip(np.asarray(starts).tolist(), np.asarray(sidx).tolist())
        if isinstance(sign, (int, np.integer)):
            for k in keys:
                sums[k] = sums.get(k, 0) + 1
            w = int(sign)
            return [(b, subjects[k], v * w) for (b, k), v in sorted(sums.items())]
        for k, v in zip(keys, np.asarray(sign).tolist()):
            sums[k] = sums.get(k, 0) + int(v)
        return [(b, subjects[k], v) for (b, k), v in sorted(sums.items())]
    scalar = isinstance(sign, (int, np.integer))
    starts = np.asarray(starts)
    lo, hi = int(starts.min()), int(starts.max())
    nsub = len(subjects)
    if nsub == 1 and lo == hi:  # one of each
        return [(lo, subjects[0], n * int(sign) if scalar else int(np.sum(sign)))]
    if lo == hi:  # one start (a round within one minute or bucket: the usual case): by subject alone
        ub, key = [lo], np.asarray(sidx, np.int64)
    else:
        ub, binv = np.unique(starts, return_inverse=True)
        ub = ub.tolist()
        key = binv.reshape(-1).astype(np.int64) * nsub + np.asarray(sidx, np.int64)
    if len(ub) * nsub <= GROUPED_BINS_MAX:  # counted in bins: no sort
        counts = np.bincount(key, minlength=len(ub) * nsub)
        uk = np.flatnonzero(counts)
        sums = counts[uk] * int(sign) if scalar else \
            np.bincount(key, weights=np.asarray(sign, np.int64), minlength=len(counts))[uk].astype(np.int64)
    else:
        uk, kinv = np.unique(key, return_inverse=True)
        weights = np.broadcast_to(np.asarray(sign, np.int64), (n,))
        sums = np.bincount(kinv.reshape(-1), weights=weights, minlength=len(uk)).astype(np.int64)
    return [(ub[k // nsub], subjects[k % nsub], v) for k, v in zip(uk.tolist(), sums.tolist())]


MINUTE_MS = 60_000


def minute_of(start: int, t: int) -> int:
    """The start of the minute of bucket ``start`` holding ``t`` (a bucket's minutes count from
    its start, as its subject table's do)."""
    return start + (t - start) // MINUTE_MS * MINUTE_MS


def fit_minutes(rows: dict[int, int], total: int, *, now_minute: int) -> dict[int, int]:
    """Minute start -> count made to sum to ``total``: what ``rows`` lack is put in
    ``now_minute`` (due now), what they hold beyond it is taken from the earliest minutes; no
    minute is below 1. (The live counts are exact; this keeps a view whole should they not be.)"""
    out = {m: n for m, n in rows.items() if n > 0}
    rest = total - sum(out.values())
    if rest > 0:
        out[now_minute] = out.get(now_minute, 0) + rest
    for m in sorted(out):
        if rest >= 0:
            break
        d = min(-rest, out[m])
        out[m] -= d
        rest += d
    return {m: n for m, n in sorted(out.items()) if n > 0}


class SubjectPending:
    """bucket start -> subject -> pending messages (module docs), and per subject the sum over
    all buckets (``total``, kept as the rows move: a Status reads it without a pass over the
    buckets, 17,520 of them for two years of 1-hour buckets); per minute for the buckets
    tracked (``minutes``)."""

    def __init__(self, bucket_ms: int) -> None:
        self.bucket_ms = bucket_ms
        self.by_bucket: dict[int, dict[str, int]] = {}
        self.total: dict[str, int] = {}
        self.minutes: dict[int, dict[str, dict[int, int]]] = {}  # tracked bucket -> subject -> minute -> n

    def _bump(self, s: str, v: int) -> None:
        n = self.total.get(s, 0) + v
        if n > 0:
            self.total[s] = n
        else:
            self.total.pop(s, None)

    def add(self, starts: np.ndarray, subjects: Sequence[str], sidx: np.ndarray, sign: np.ndarray | int,
            effective_ms: np.ndarray | None = None) -> None:
        """Records with bucket ``starts`` and subject indexes ``sidx`` move by ``sign``;
        ``effective_ms`` (their times) moves the minutes of tracked buckets too. With buckets
        tracked, one ``grouped`` by minute makes both (a bucket's rows are its minutes' sums):
        this runs at every filing and dispatch round."""
        if not (self.minutes and effective_ms is not None and len(starts)):
            self._add_buckets(grouped(starts, subjects, sidx, sign))
            return
        starts = np.asarray(starts, np.int64)
        eff = np.asarray(effective_ms, np.int64)
        by_minute = grouped(starts + (eff - starts) // MINUTE_MS * MINUTE_MS, subjects, sidx, sign)
        bms = self.bucket_ms
        sums: dict[tuple[int, str], int] = {}
        for m, s, v in by_minute:
            k = (m - m % bms, s)
            sums[k] = sums.get(k, 0) + v
        self._add_buckets([(b, s, v) for (b, s), v in sums.items()])
        self._add_minutes([row for row in by_minute if row[0] - row[0] % bms in self.minutes])

    def _add_minutes(self, rows: list[tuple[int, str, int]]) -> None:
        bms = self.bucket_ms
        for m, s, v in rows:
            b = m - m % bms
            minutes = self.minutes[b]
            if s not in self.by_bucket.get(b, {}):  # as the bucket's count, none of its minutes
                minutes.pop(s, None)
                continue
            if not v:
                continue
            row = minutes.setdefault(s, {})
            n = row.get(m, 0) + v
            if n > 0:
                row[m] = n
            else:
                row.pop(m, None)
                if not row:
                    del minutes[s]

    def _add_buckets(self, rows) -> None:
        for b, s, v in rows:
            if not v:
                continue
            row = self.by_bucket.setdefault(b, {})
            old = row.get(s, 0)
            n = old + v
            if n > 0:  # as ``DelayCore.set_pending``: a count is never below 1
                row[s] = n
                self._bump(s, n - old)
            else:
                row.pop(s, None)
                self._bump(s, -old)
            if not row:
                del self.by_bucket[b]

    def drop_bucket(self, start: int) -> None:
        for s, n in self.by_bucket.pop(start, {}).items():
            self._bump(s, -n)
        if start in self.minutes:
            self.minutes[start] = {}

    def set_bucket(self, start: int, counts: dict[str, int]) -> None:
        self.drop_bucket(start)
        row = {s: n for s, n in counts.items() if n > 0}
        if row:
            self.by_bucket[start] = row
            for s, n in row.items():
                self._bump(s, n)

    def reset(self, by_bucket: dict[int, dict[str, int]]) -> None:
        self.by_bucket, self.total, self.minutes = {}, {}, {}
        for b, row in by_bucket.items():
            self.set_bucket(b, row)

    def track(self, start: int, rows: dict[str, dict[int, int]]) -> None:
        """Bucket ``start``'s minutes per subject from now on, from a count of them (``rows``:
        subject -> minute start -> pending; only the subjects the bucket counts are kept)."""
        have = self.by_bucket.get(start, {})
        self.minutes[start] = {s: kept for s, row in rows.items() if s in have
                               for kept in [{m: n for m, n in row.items() if n > 0}] if kept}

    def untrack(self, start: int) -> None:
        self.minutes.pop(start, None)

    def copy(self) -> "SubjectPending":
        out = SubjectPending(self.bucket_ms)
        out.by_bucket, out.total = dict(self.by_bucket), dict(self.total)
        out.minutes = {b: dict(rows) for b, rows in self.minutes.items()}
        return out

    def totals(self, buckets: Iterable[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in buckets:
            for s, n in self.by_bucket.get(b, {}).items():
                out[s] = out.get(s, 0) + n
        return out

    def summary(self, *, subjects_max: int, left_out: Iterable[int] = ()) -> dict[str, int]:
        """Subject -> pending in every bucket but ``left_out``: the ``subjects_max`` largest
        (ties by name), the rest as ``OTHER`` (absent when there is no rest)."""
        tot = dict(self.total)
        for s, n in self.totals(left_out).items():
            tot[s] = tot.get(s, 0) - n
        ranked = sorted(((s, n) for s, n in tot.items() if n > 0), key=lambda kv: (-kv[1], kv[0]))
        out = dict(ranked[:subjects_max])
        rest = sum(n for _, n in ranked[subjects_max:])
        if rest:
            out[OTHER] = rest
        return out

    def of_subject(self, subject: str, buckets: Iterable[int]) -> dict[int, int]:
        """Bucket start -> pending messages of ``subject`` (buckets where it has some)."""
        out = {}
        for b in buckets:
            n = self.by_bucket.get(b, {}).get(subject, 0)
            if n > 0:
                out[b] = n
        return out

    def minutes_of(self, subject: str, buckets: Iterable[int], *, completed_ms: int) -> dict[int, int]:
        """Minute start -> pending messages of ``subject`` in the tracked ``buckets``, each
        bucket's minutes summing to its count (``fit_minutes``: anything they lack is due now, in
        ``completed_ms``'s minute or the bucket's first)."""
        out: dict[int, int] = {}
        for b in buckets:
            if b not in self.minutes:
                continue
            n = self.by_bucket.get(b, {}).get(subject, 0)
            now = minute_of(b, min(max(b, completed_ms), b + self.bucket_ms - 1))
            out.update(fit_minutes(self.minutes[b].get(subject, {}), n, now_minute=now))
        return out

    def check(self, pending: dict[int, int]) -> None:
        """The module invariant against the bucket counts ``pending``."""
        for b, rows in self.minutes.items():
            have = self.by_bucket.get(b, {})
            for s, row in rows.items():
                assert row and all(n > 0 for n in row.values()), (b, s, row)
                assert sum(row.values()) == have.get(s, 0), (b, s, row, have.get(s))
            assert set(have) <= set(rows) or not have, (b, have, rows)
        for b, row in self.by_bucket.items():
            assert all(n > 0 for n in row.values()), (b, row)
            assert sum(row.values()) == pending.get(b, 0), (b, row, pending.get(b))
        for b, n in pending.items():
            assert n <= 0 or b in self.by_bucket, (b, n)
        assert self.total == {s: n for s, n in self.totals(list(self.by_bucket)).items() if n > 0}, self.total


__all__ = ["MINUTE_MS", "OTHER", "SubjectPending", "fit_minutes", "grouped", "minute_of"]
