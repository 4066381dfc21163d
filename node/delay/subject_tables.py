"""Per-bucket subject tables: what the delay node keeps on disk so that its pending counts per
(bucket, subject) (``node/delay/subjects.py``) are made again at open, at a promotion and after
a bucket rebuild without reading a message body (issue 31, the Schedule page per subject).

What it owns: per schedule bucket, the **filed** net counts (messages minus tombstones) per
(subject, minute of the bucket) of the bucket's first ``entries`` index entries, in memory for
the buckets being filed into or counted, and on disk in the bucket's folder as the file
``subject_counts`` (a checkpoint file: one line of JSON and a CRC line, ``node/store/checkpoint.py``;
``docs/format.md``, "Schedule log"):
``{"version": 1, "bucket_start_ms", "entries", "subjects": [...], "counts": [[subject index,
minute, n], ...]}``.

Why a table beside the bucket and not a subject in the 48-byte index entry: one frame holds
the part of a batch due in one second, whose records may have many subjects, so an entry has
no single subject to hold; the index format stays as it is. Why it is safe against a crash
between writes: a table says which entries it covers, and it is written (atomically: a temp
file renamed over it) by a checkpoint after the fsyncs of that checkpoint's index entries, so
it never covers an entry the index could lose. The entries after it (filed since) are counted
from their frames' subject and kind columns (``Batch.decode`` of the frame; no payload is
parsed). A table that fails its CRC, has another version or bucket, or covers more entries than
the index holds now (an index damaged and repaired) is not used: the whole bucket is counted
from its frames. A rebuilt bucket is a new folder without a table. So the table is only ever a
shortcut, and the counts are exact with or without it.

Cost bounds: a checkpoint writes the table of a bucket once ``subject_table_stale_entries_max``
entries were filed into it since the last write, at most ``subject_tables_per_checkpoint_max``
tables (the stalest first); a close writes every table behind. A restart thus reads the table
of each bucket still pending plus the frames of fewer than that many entries per bucket, and the
frames of the current bucket's minute holding ``completed_ms`` (the part of it before
``completed_ms`` is due now).

Pending per subject of one bucket (``bucket_counts``, the rules of ``recovery.count_pending``
split by subject): a bucket after ``completed_ms`` holds its whole table; the bucket holding it
the minutes after its minute from the table and, of that minute's frames, the records effective
at or after it; then every message delivered at or after ``completed_ms`` (``DelayCore.dispatched``,
from the dispatch log) is taken off its subject (its frame found by seq).

Worked example: a table of bucket 0 covering 3 entries holds ``{("a", 0): 2, ("a", 5): 1,
("b", 5): 4}``; a fourth entry (a frame of second 330 with one "b" message and one "b"
tombstone) adds nothing net. With ``completed_ms`` = 100_000 (minute 1) the bucket holds "a": 1
and "b": 4 (minute 0 is before completed_ms's minute; minute 1 has no frame).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from cluster.codec import KIND_CANCEL, Batch
from cluster.errors import CorruptRecord
from node.delay import recovery
from node.delay.subjects import grouped, minute_of
from node.store import checkpoint
from node.store.syncplan import DocGate, SyncPlan

log = logging.getLogger("hourglass.delay.subjects")

TABLE_NAME = "subject_counts"
TABLE_VERSION = 1
MINUTE_MS = 60_000
LOAD_TRIES_MAX = 3  # a frame read may rebuild the bucket (heal.py): count again at most so often


class _TableGate(DocGate):
    """A table's writes in order (``DocGate``); a bucket retired while a plan runs takes its
    folder with it: that write is skipped, not an error (the table went with its bucket)."""

    def write(self, ticket, path, doc) -> bool:
        try:
            return super().write(ticket, path, doc)
        except FileNotFoundError:
            return False


class _Table:
    __slots__ = ("entries", "written", "counts", "gate")

    def __init__(self) -> None:
        self.entries = 0   # index entries counted
        self.written = 0   # entries the file on disk covers
        self.counts: dict[tuple[str, int], int] = {}
        self.gate = _TableGate()

    def add(self, subject: str, minute: int, v: int) -> None:
        key = (subject, minute)
        n = self.counts.get(key, 0) + v
        if n:
            self.counts[key] = n
        else:
            self.counts.pop(key, None)

    def add_batch(self, b: Batch, minute: int) -> None:
        sign = np.where(b.kind == KIND_CANCEL, -1, 1)
        for _, s, v in grouped(np.zeros(b.n, np.int64), b.subjects, b.subject_idx, sign):
            self.add(s, minute, v)

    def doc(self, start: int) -> dict:
        names = sorted({s for s, _ in self.counts})
        at = {s: i for i, s in enumerate(names)}
        return {"version": TABLE_VERSION, "bucket_start_ms": start, "entries": self.entries, "subjects": names,
                "counts": [[at[s], m, n] for (s, m), n in sorted(self.counts.items())]}


def _from_doc(doc: dict, start: int, entries_max: int) -> _Table | None:
    """The table of a document read from disk, or None when it cannot be used (module docs)."""
    try:
        if doc.get("version") != TABLE_VERSION or int(doc["bucket_start_ms"]) != start:
            return None
        k = int(doc["entries"])
        if not 0 <= k <= entries_max:
            return None
        names = [str(s) for s in doc["subjects"]]
        t = _Table()
        for si, m, n in doc["counts"]:
            t.counts[(names[int(si)], int(m))] = int(n)
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    t.entries = t.written = k
    return t


class SubjectTables:
    """The subject tables of one store's schedule log (module docs)."""

    def __init__(self, schedule, settings) -> None:
        self.schedule = schedule
        self.bucket_ms = settings.bucket_ms
        self.stale_max = settings.subject_table_stale_entries_max
        self.writes_max = settings.subject_tables_per_checkpoint_max
        self.tables: dict[int, _Table] = {}
        self._rebuilds = schedule.rebuilds
        self.everything = False  # set by a close: its checkpoint writes every table behind
        self.counters = {"tables_written": 0, "tables_unusable": 0, "frames_counted": 0}

    def _fresh(self) -> None:
        """A bucket was rebuilt: its entries are new ones; every in-memory table is counted
        again when next needed (rebuilds are rare; a table on disk still covers its bucket
        unless that bucket is the rebuilt one, whose new folder has none)."""
        if self.schedule.rebuilds != self._rebuilds:
            self.tables.clear()
            self._rebuilds = self.schedule.rebuilds

    # -------------------------------------------------------------- loading

    def table(self, start: int, *, upto: int | None = None) -> _Table | None:
        """The table of bucket ``start`` covering its first ``upto`` entries (None: all of them);
        None when there is no such bucket."""
        self._fresh()
        t = self.tables.get(start)
        for _ in range(LOAD_TRIES_MAX):
            b = self.schedule.bucket(start, create=False)
            if b is None:
                self.tables.pop(start, None)
                return None
            want = b.entries if upto is None else upto
            if t is not None and t.entries == want:
                return t
            if t is None or t.entries > want:
                t = self._read(start, b, want)
            rebuilds = self.schedule.rebuilds
            try:
                self._count_entries(t, start, b, want)
            except CorruptRecord:
                if self.schedule.healer is None:
                    raise
            if self.schedule.rebuilds == rebuilds and t.entries == want:
                self.tables[start] = t
                return t
            self._fresh()
            t, upto = None, None  # the bucket was rebuilt under us: its entries changed
        log.warning("subject counts of a bucket could not be made bucket_start_ms=%d", start)
        return None

    def _read(self, start: int, b, entries_max: int) -> _Table:
        try:
            doc = checkpoint.read(b.path / TABLE_NAME)
        except (CorruptRecord, ValueError, OSError) as e:
            log.warning("subject table unusable path=%s reason=%s", b.path / TABLE_NAME, e)
            doc = None
        t = None if doc is None else _from_doc(doc, start, entries_max)
        if doc is not None and t is None:
            self.counters["tables_unusable"] += 1
            log.warning("subject table does not fit its bucket path=%s entries=%d", b.path / TABLE_NAME, entries_max)
        return t or _Table()

    def _count_entries(self, t: _Table, start: int, b, upto: int) -> None:
        e = b.entries_array(first=t.entries)[: max(0, upto - t.entries)]
        for off, size, second in zip(e["data_offset"].tolist(), e["frame_size"].tolist(), e["second"].tolist()):
            t.add_batch(self.schedule.frame(start, off, size).batch, second // 60)
            t.entries += 1
            self.counters["frames_counted"] += 1

    # -------------------------------------------------------------- filing

    def filed(self, batch: Batch, placed) -> None:
        """``batch`` was filed (``ScheduleLog.file`` answered ``placed``): its new records counted
        into their buckets' tables (one numpy pass), each new frame one index entry more."""
        self._fresh()
        if not placed.frames:
            return
        frames: dict[int, int] = {}
        for ref in placed.frames:
            frames[ref.bucket_start_ms] = frames.get(ref.bucket_start_ms, 0) + 1
        tables = {}
        for start, k in frames.items():
            b = self.schedule.bucket(start, create=False)
            t = self.tables.get(start)
            if b is not None and (t is None or t.entries != b.entries - k):
                t = self.table(start, upto=b.entries - k)
            if t is not None:
                tables[start] = t
        m = placed.filed
        bucket = placed.bucket_start_ms[m]
        minute = (batch.effective_ms[m] - bucket) // MINUTE_MS
        sign = np.where(batch.kind[m] == KIND_CANCEL, -1, 1)
        ub, binv = np.unique(bucket, return_inverse=True)
        slot = binv.reshape(-1).astype(np.int64) * (int(minute.max()) + 1) + minute
        span = int(minute.max()) + 1
        for sl, s, v in grouped(slot, batch.subjects, batch.subject_idx[m], sign):
            t = tables.get(int(ub[sl // span]))
            if t is not None:
                t.add(s, sl % span, v)
        for start, t in tables.items():
            t.entries += frames[start]

    # -------------------------------------------------------------- checkpoint

    def plan_write(self, plan: SyncPlan, *, completed_ms: int) -> None:
        """Write the stalest tables behind their buckets (after the schedule's fsyncs in ``plan``:
        the entries they cover are durable by then). Tables of buckets that ended before
        ``completed_ms`` are forgotten in memory (nothing pending is counted from them again).
        ``everything`` set (a close): every table behind is written."""
        self._fresh()
        due = []
        for start, t in list(self.tables.items()):
            if not self.schedule.exists(start):  # retired (never opened here: a closed bucket was flushed)
                del self.tables[start]
                continue
            behind = t.entries - t.written
            if behind and (self.everything or behind >= self.stale_max):
                due.append((-behind, start, t))
            elif start + self.bucket_ms <= completed_ms and not behind:
                del self.tables[start]
        due.sort(key=lambda x: (x[0], x[1]))
        for _, start, t in due if self.everything else due[: self.writes_max]:
            doc = t.doc(start)
            plan.write_doc(t.gate, self.schedule.bucket_path(start) / TABLE_NAME, doc)
            plan.on_done(lambda t=t, k=doc["entries"]: self._written(t, k))

    def _written(self, t: _Table, k: int) -> None:
        t.written = max(t.written, k)
        self.counters["tables_written"] += 1

    # -------------------------------------------------------------- pending per subject

    def bucket_counts(self, core, start: int) -> dict[str, int]:
        """Subject -> pending messages of bucket ``start`` (module docs), before the messages
        delivered at or after ``completed_ms`` are taken off (``recount``)."""
        return {s: sum(row.values()) for s, row in self.bucket_minutes(core, start).items()}

    def bucket_minutes(self, core, start: int) -> dict[str, dict[int, int]]:
        """``bucket_counts`` per minute: subject -> minute start -> pending messages."""
        c = core.completed_ms
        if start + self.bucket_ms <= c:
            return {}
        t = self.table(start)
        if t is None:
            return {}
        out: dict[str, dict[int, int]] = {}

        def add(s: str, minute: int, n: int) -> None:
            row = out.setdefault(s, {})
            row[start + minute * MINUTE_MS] = row.get(start + minute * MINUTE_MS, 0) + n
        if start >= c:
            for (s, m), n in t.counts.items():
                add(s, m, n)
            return out
        cm = (c - start) // MINUTE_MS
        for (s, m), n in t.counts.items():
            if m > cm:
                add(s, m, n)
        end_ms = min(start + (cm + 1) * MINUTE_MS, start + self.bucket_ms)
        for sec in range(c // 1000, end_ms // 1000):
            for ref in self.schedule.load_second(sec):
                b = ref.batch
                late = b.effective_ms >= c
                if not late.any():
                    continue
                sign = np.where(b.kind[late] == KIND_CANCEL, -1, 1)
                for _, s, v in grouped(np.zeros(int(late.sum()), np.int64), b.subjects, b.subject_idx[late], sign):
                    add(s, cm, v)
        return out

    def delivered_after(self, core, buckets: set[int] | None = None) -> list[tuple[int, str, int]]:
        """(bucket start, subject, effective time) of each message delivered at or after
        ``completed_ms`` (in ``buckets`` only, unless None): their frames are found by seq (a
        few: what was delivered ahead of ``completed_ms`` while an earlier message was in flight)."""
        c = core.completed_ms
        out = []
        for seq, eff in core.dispatched.items():
            if eff < c:
                continue
            start = eff - eff % self.bucket_ms
            if buckets is not None and start not in buckets:
                continue
            got = self.schedule.locate(eff, seq)
            if got is not None:
                ref, i = got
                out.append((start, ref.batch.subject(i), eff))
        return out

    def minute_rows(self, core, starts: Iterable[int]) -> dict[int, dict[str, dict[int, int]]]:
        """bucket start -> subject -> minute start -> pending messages, for buckets ``starts``
        (module docs; what was delivered at or after ``completed_ms`` taken off its minute)."""
        starts = list(starts)
        out = {s: self.bucket_minutes(core, s) for s in starts}
        for start, subject, eff in self.delivered_after(core, set(starts)):
            _take_one(out.setdefault(start, {}), start, subject, eff)
        return out

    def recount(self, core, starts: Iterable[int]) -> dict[int, dict[str, int]]:
        """bucket start -> subject -> pending messages, for buckets ``starts`` (module docs)."""
        return {b: {s: sum(row.values()) for s, row in rows.items()} for b, rows in self.minute_rows(core, starts).items()}

    # -------------------------------------------------------------- the store's pending counts

    def count_pending(self, core) -> None:
        """The pending counts made afresh, per bucket and per subject (at open, at a promotion),
        each bucket's counts per subject while the bucket count has it open; the minutes of the
        buckets tracked before (``SubjectPending.minutes``) and of the earliest pending bucket
        (the one ``completed_ms`` is in or before: its minute's frames are read here, once)."""
        rows: dict[int, dict[str, dict[int, int]]] = {}

        def each(start: int) -> None:
            rows[start] = self.bucket_minutes(core, start)
        tracked = set(core.subjects.minutes)
        core.counted(recovery.count_pending(self.schedule, core, each=each))
        for start, subject, eff in self.delivered_after(core, set(rows)):
            _take_one(rows.setdefault(start, {}), start, subject, eff)
        core.subjects.reset({b: {s: sum(row.values()) for s, row in r.items()} for b, r in rows.items()
                             if b in core.pending})
        for b in tracked | set(sorted(core.pending)[:1]):
            core.subjects.track(b, rows.get(b, {}) if b in core.pending else {})

    def recount_bucket(self, core, start: int) -> None:
        """Bucket ``start`` was rebuilt: its counts again (``recovery.recount_pending``)."""
        recovery.recount_pending(self.schedule, core, start)
        rows = self.minute_rows(core, [start]).get(start, {}) if start in core.pending else {}
        core.subjects.set_bucket(start, {s: sum(row.values()) for s, row in rows.items()})
        if start in core.subjects.minutes:
            core.subjects.track(start, rows)

    def track_minutes(self, core, starts: list[int]) -> None:
        """The buckets a minute view covers now (``starts``) have their minutes per subject kept
        (``SubjectPending.track``); the others' are forgotten. A bucket entering is counted once
        (``minute_rows``: its table, in memory while it is filed into; the frames of
        ``completed_ms``'s minute only for the bucket holding it, which ``count_pending`` tracks
        already)."""
        subjects = core.subjects
        for b in [b for b in subjects.minutes if b not in starts]:
            subjects.untrack(b)
        new = [b for b in starts if b not in subjects.minutes]
        if new:
            for b, rows in self.minute_rows(core, new).items():
                subjects.track(b, rows)

    def check(self, core) -> None:
        """Tests: the live counts per subject (and per minute, of the tracked buckets) equal a
        recount from disk."""
        core.subjects.check(core.pending)
        rows = self.minute_rows(core, core.pending)
        recount = {b: {s: n for s, row in r.items() for n in [sum(row.values())] if n} for b, r in rows.items()}
        assert {b: row for b, row in recount.items() if row} == core.subjects.by_bucket, \
            (recount, core.subjects.by_bucket)
        for b, live in core.subjects.minutes.items():
            want = {s: {m: n for m, n in row.items() if n} for s, row in rows.get(b, {}).items()}
            assert {s: row for s, row in want.items() if row} == live, (b, want, live)


def _take_one(rows: dict[str, dict[int, int]], start: int, subject: str, eff: int) -> None:
    """One delivered message of ``subject`` at ``eff`` (in bucket ``start``) off its minute."""
    row = rows.setdefault(subject, {})
    m = minute_of(start, eff)
    row[m] = row.get(m, 0) - 1


__all__ = ["TABLE_NAME", "TABLE_VERSION", "SubjectTables"]
