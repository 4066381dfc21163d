"""What a delay node's ``Admin/Status`` says about its schedule (issue 31, the console's
Schedule page; docs/console.md, "Node-side support"):

* ``bucket_ms`` and ``pending_by_bucket``: bucket start (ms, as a string: JSON keys) -> messages
  filed there and not yet dispatched or cancelled (``DelayCore.pending``, kept at filing,
  dispatch and cancel and recounted from the schedule index on recovery and promotion), the
  earliest ``status_buckets_max`` buckets;
* ``pending_by_minute``: minute start -> pending messages of the buckets starting within
  ``pending_by_minute_horizon_ms`` (``node/delay/minutes.py``: from the per-second index, each
  bucket's minutes summing to its pending count);
* ``pending_subjects``: subject -> pending messages in the buckets shown (a running total per subject), the
  ``status_subjects_max`` largest, the rest summed under ``"(other)"`` (``node/delay/subjects.py``);
* ``pending_by_subject``, only when the Status request names a subject (``StatusRequest.subject``):
  ``{"<subject>": {"<bucket start ms>": n}}`` over the buckets shown: one subject per request
  keeps a Status small (the cluster page polls it) whatever the number of subjects and buckets;
* ``pending_by_subject_minute``, with ``pending_by_subject``: ``{"<subject>": {"<minute start ms>":
  n}}`` over the buckets of ``pending_by_minute`` (the console's minute view of one subject):
  counts per (bucket, subject, minute) the node keeps for those buckets only (``SubjectPending.minutes``,
  moved at filing, dispatch and cancel; a bucket entering the view is counted once from its
  subject table, ``SubjectTables.track_minutes``), each bucket's minutes summing to the
  subject's count there; nothing is read per Status once a bucket is in;
* ``subject_tables``: what the subject tables did since open (tables written, tables found
  unusable and counted from frames instead, frames counted);
* ``lateness``: p50/p99 of fire time minus due time over ``lateness_window_ms``
  (``node/delay/lateness.py``), with how many messages fired in the window.

A slave reports its own view: its store files what it replicated and counts it, and fires
nothing (lateness empty); its counts are taken as of the master's last checkpoint that it
holds (``PendingMinutes.follower_pending``: what is due by that ``completed_ms`` was fired).
The lateness window lives in memory: it starts empty after a restart. A slave's counts per
subject in the bucket holding ``completed_ms`` are those of the minutes after its minute (its
subject table, ``node/delay/subject_tables.py``); what its bucket count holds beyond them (due
within that minute) is put under ``"(other)"``: reading that minute's frames at every Status
would cost a slave more than the page is worth.
"""

from __future__ import annotations

from node.delay.lateness import LatenessWindow
from node.delay.minutes import MINUTE_MS, PendingMinutes
from node.delay.subjects import OTHER, SubjectPending, minute_of


class ScheduleStatus:
    def __init__(self, settings) -> None:
        self.buckets_max = settings.status.buckets_max
        self.subjects_max = settings.status.subjects_max
        self.horizon_ms = settings.status.pending_by_minute_horizon_ms
        self.minutes = PendingMinutes(buckets_max=settings.status.pending_by_minute_buckets_max)
        self.lateness = LatenessWindow(window_ms=settings.status.lateness_window_ms,
                                       slot_ms=settings.status.lateness_slot_ms)

    def stats(self, store, *, now_ms: int, subject: str = "") -> dict:
        pending = store.pending_by_bucket()
        subjects = store.core.subjects
        if store.follower:
            pending = self.minutes.follower_pending(store, pending)
            subjects = self.follower_subjects(store, pending)
        shown = sorted(pending)[: self.buckets_max]
        # the buckets of the minute view (PendingMinutes.counts takes the same) keep their
        # minutes per subject (subject_tables.track_minutes: counted once as one enters)
        near = sorted(b for b, n in pending.items() if n > 0 and b < now_ms + self.horizon_ms)[: self.minutes.buckets_max]
        store.subject_tables.track_minutes(store.core, near)
        per_subject = {}
        if subject:
            per_subject = {"pending_by_subject": {subject: {str(b): n for b, n in
                                                            subjects.of_subject(subject, shown).items()}},
                           "pending_by_subject_minute": {subject: {str(m): n for m, n in
                                                                   self.subject_minutes(store, subject, near).items()}}}
        left_out = sorted(pending)[self.buckets_max:]
        return {"pending_subjects": subjects.summary(subjects_max=self.subjects_max, left_out=left_out),
                **per_subject,
                "bucket_ms": store.settings.bucket_ms,
                "pending_by_bucket": {str(b): pending[b] for b in shown},
                "pending_buckets_left_out": len(pending) - len(shown),
                "pending_by_minute": {str(m): n for m, n in
                                      self.minutes.counts(store, pending, now_ms=now_ms,
                                                          horizon_ms=self.horizon_ms).items()},
                "lateness": self.lateness.summary(now_ms), "subject_tables": dict(store.subject_tables.counters)}

    @staticmethod
    def subject_minutes(store, subject: str, near: list[int]) -> dict[int, int]:
        """Minute start -> pending messages of ``subject`` in the buckets ``near`` (module docs).
        A master's minutes of a bucket sum to the subject's count there; a slave shows the
        minutes after its master's ``completed_ms``'s minute (the rest is what the master fired
        or is firing, ``follower_subjects``)."""
        core = store.core
        c = core.completed_ms
        if not store.follower:
            return core.subjects.minutes_of(subject, near, completed_ms=c)
        out: dict[int, int] = {}
        for b in near:
            for m, n in core.subjects.minutes.get(b, {}).get(subject, {}).items():
                if m > minute_of(b, c) and n > 0:
                    out[m] = n
        return dict(sorted(out.items()))

    @staticmethod
    def follower_subjects(store, pending: dict[int, int]) -> SubjectPending:
        """A slave's counts per subject for its ``pending`` (module docs)."""
        core = store.core
        c, bms = core.completed_ms, store.settings.bucket_ms
        out = core.subjects.copy()
        for b in [b for b in out.by_bucket if b not in pending]:  # done: the master fired them
            out.drop_bucket(b)
        now_bucket = c - c % bms
        if now_bucket in pending:
            t = store.subject_tables.table(now_bucket)
            cm = (c - now_bucket) // MINUTE_MS
            row: dict[str, int] = {}
            for (s, m), n in ({} if t is None else t.counts).items():
                if m > cm:
                    row[s] = row.get(s, 0) + n
            row = {s: n for s, n in row.items() if n > 0}
            rest = pending[now_bucket] - sum(row.values())
            if rest > 0:
                row[OTHER] = row.get(OTHER, 0) + rest
            out.set_bucket(now_bucket, row)
        return out


__all__ = ["ScheduleStatus"]
