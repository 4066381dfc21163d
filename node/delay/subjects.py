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

Worked example: bucket 0 holds ``{"a": 3, "b": 1}``, bucket 3_600_000 ``{"c": 2}``;
``summary(subjects_max=2)`` is ``{"a": 3, "c": 2, "(other)": 1}``, and
``of_subject("a", [0, 3_600_000])`` is ``{0: 3}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

OTHER = "(other)"


def grouped(starts: np.ndarray, subjects: Sequence[str], sidx: np.ndarray,
            sign: np.ndarray | int) -> list[tuple[int, str, int]]:
    """(start, subject, sum of ``sign``) per distinct (start, subject) of records whose starts
    (a bucket, a minute: any int64) are ``starts`` and subject indexes (into ``subjects``)
    ``sidx``: two ``np.unique`` over small integers, whatever the number of records."""
    n = len(starts)
    if not n:
        return []
    weights = np.broadcast_to(np.asarray(sign, np.int64), (n,))
    if len(subjects) == 1 and int(starts.min()) == int(starts.max()):  # the usual case: one of each
        return [(int(starts[0]), subjects[0], int(weights.sum()))]
    ub, binv = np.unique(starts, return_inverse=True)
    nsub = len(subjects)
    key = binv.reshape(-1).astype(np.int64) * nsub + np.asarray(sidx, np.int64)
    uk, kinv = np.unique(key, return_inverse=True)
    sums = np.bincount(kinv.reshape(-1), weights=weights, minlength=len(uk)).astype(np.int64)
    return [(int(ub[k // nsub]), subjects[k % nsub], v) for k, v in zip(uk.tolist(), sums.tolist())]


class SubjectPending:
    """bucket start -> subject -> pending messages (module docs), and per subject the sum over
    all buckets (``total``, kept as the rows move: a Status reads it without a pass over the
    buckets, 17,520 of them for two years of 1-hour buckets)."""

    def __init__(self) -> None:
        self.by_bucket: dict[int, dict[str, int]] = {}
        self.total: dict[str, int] = {}

    def _bump(self, s: str, v: int) -> None:
        n = self.total.get(s, 0) + v
        if n > 0:
            self.total[s] = n
        else:
            self.total.pop(s, None)

    def add(self, starts: np.ndarray, subjects: Sequence[str], sidx: np.ndarray, sign: np.ndarray | int) -> None:
        for b, s, v in grouped(starts, subjects, sidx, sign):
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

    def set_bucket(self, start: int, counts: dict[str, int]) -> None:
        self.drop_bucket(start)
        row = {s: n for s, n in counts.items() if n > 0}
        if row:
            self.by_bucket[start] = row
            for s, n in row.items():
                self._bump(s, n)

    def reset(self, by_bucket: dict[int, dict[str, int]]) -> None:
        self.by_bucket, self.total = {}, {}
        for b, row in by_bucket.items():
            self.set_bucket(b, row)

    def copy(self) -> "SubjectPending":
        out = SubjectPending()
        out.by_bucket, out.total = dict(self.by_bucket), dict(self.total)
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

    def check(self, pending: dict[int, int]) -> None:
        """The module invariant against the bucket counts ``pending``."""
        for b, row in self.by_bucket.items():
            assert all(n > 0 for n in row.values()), (b, row)
            assert sum(row.values()) == pending.get(b, 0), (b, row, pending.get(b))
        for b, n in pending.items():
            assert n <= 0 or b in self.by_bucket, (b, n)
        assert self.total == {s: n for s, n in self.totals(list(self.by_bucket)).items() if n > 0}, self.total


__all__ = ["OTHER", "SubjectPending", "grouped"]
