"""ConsumerGroups: the consumer groups of a real-time node, their documents and their commits.

A group is ``(subject, name)``: a position in the subject's consume index (``next``, the
first handle never handed out) and its in-flight handles (``node/realtime/inflight.py``).
Pulls, acks and nacks (``node/realtime/consume.py``) move them; this module owns the
registry, the group document and the commits to the offsets log
(``node/realtime/offsets.py``, one record and one fsync per round however many groups).

Group document (JSON; one per changed group in each record of the offsets log)::

    {"version": 1, "subject": s, "group": g, "start": "earliest"|"latest",
     "committed": c,     # lowest position not yet acked (everything below is done)
     "next": n,          # first position never handed out
     "pending": [[a, b], ...]}   # in flight at flush time, as [a, b) runs; subset of [c, n)

Positions in ``[committed, next)`` not in ``pending`` were acked (or skipped by a tag
filter), so a clean close/reopen never redelivers an acked message even when acks came
out of order. In-flight deadlines do not survive: handles pending in a document come back
due at once (``from_doc``).

Replication: every commit gets a store-local ``seq``; ``changes`` keeps, oldest first, the
seq of each group's last commit, so a master ships the groups changed after a slave's seq.

Invariants: ``committed <= next <= entries in the index``; in-flight ⊆ ``[committed, next)``
and holds at most ``inflight_per_group_max`` handles; a group is in ``dirty`` iff its
position moved since its document was last taken (``snapshot``); at most ``groups_max``
groups.

Example::

    groups = ConsumerGroups(offsets, settings, counters)
    g = groups.open_group("orders", "billing", ix, START_EARLIEST)  # committed at once
    g.inflight.add(0, 10, now_ms); groups.mark_dirty(g)
    groups.write_async(groups.snapshot(groups.dirty_keys())).result()
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.errors import InvalidArgument, Overloaded
from node.realtime.index import SubjectIndex
from node.realtime.inflight import InflightRanges
from node.realtime.offsets import OffsetsLog
from node.realtime.subjects import check_name
from node.store.settings import RealtimeSettings

log = logging.getLogger("hourglass.realtime.store")

GROUP_FILE_VERSION = 1
START_EARLIEST = "earliest"
START_LATEST = "latest"
DUE_NOW_MS = -(1 << 62)  # pulled_at of handles restored from disk: due for redelivery at once

GroupKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Resume:
    """A group's position after a pull, ack or nack found it idle or behind what retention
    kept (``resume_of``); ``ConsumerGroups.resume`` applies it."""

    was_idle: bool
    live_from: int  # the subject's first entry whose frame is still on disk
    skip: bool      # the position is below ``live_from``: handles below it go, ``next`` moves up to it


def resume_of(*, idle: bool, committed: int, live_from: int) -> Resume | None:
    """The position decision of a group's activity (pure): None while it was active and its
    committed position is still on disk; else it resumes, skipping what retention deleted.

    Example: an idle group committed at 40, entries from 100 on disk -> ``Resume(True, 100,
    True)``; an active one at 120 -> None; an idle one at 120 -> ``Resume(True, 100, False)``."""
    if not idle and committed >= live_from:
        return None
    return Resume(idle, live_from, committed < live_from)


class Group:
    """A consumer group of one subject."""

    __slots__ = ("subject", "name", "start", "next_pos", "inflight", "persisted", "dirty", "active_ms", "idle",
                 "hold", "redelivered")

    def __init__(self, subject: str, name: str, start: str, next_pos: int) -> None:
        self.subject = subject
        self.name = name
        self.start = start
        self.next_pos = next_pos
        self.inflight = InflightRanges()
        self.persisted: dict | None = None
        self.dirty = True
        self.active_ms: int | None = None  # last pull/ack/nack (None: not known yet, counts from the next retention)
        self.idle = False                  # retention found it idle past group_idle_ms_max: it holds nothing
        self.hold: tuple[int, int] = (-1, -1)  # (committed, frame offset of its entry), cached for retention
        self.redelivered = 0  # handles handed out again since this node opened the group (Status)

    def committed(self) -> int:
        return self.inflight.committed(self.next_pos)

    def doc(self) -> dict:
        return {"version": GROUP_FILE_VERSION, "subject": self.subject, "group": self.name, "start": self.start,
                "committed": self.committed(), "next": self.next_pos, "pending": self.inflight.runs()}

    @staticmethod
    def from_doc(subject: str, name: str, doc: dict, ix: SubjectIndex) -> "Group":
        """The group a document describes, clamped to what ``ix`` holds; pending handles due now."""
        g = Group(subject, name, doc.get("start", START_EARLIEST), 0)
        g.next_pos = min(int(doc.get("next", doc.get("committed", 0))), ix.count)
        committed = min(int(doc.get("committed", 0)), g.next_pos)
        for a, b in doc.get("pending", []):
            lo, hi = max(int(a), committed), min(int(b), g.next_pos)
            if lo < hi:
                g.inflight.add(lo, hi, DUE_NOW_MS)
        g.persisted = doc
        g.dirty = False
        return g


class ConsumerGroups:
    """See module docstring. Synchronous, not thread-safe (commits finish on the offsets thread)."""

    def __init__(self, offsets: OffsetsLog, settings: RealtimeSettings, counters: dict[str, int]) -> None:
        self.offsets = offsets
        self.settings = settings
        self.counters = counters  # the store's: groups_resumed, resumed_skipped_messages
        self.by_key: dict[GroupKey, Group] = {}
        self.seq = 0  # every commit of a document gets one (replication)
        self.dirty: set[GroupKey] = set()  # changed since their last snapshot
        self.changes: OrderedDict[GroupKey, int] = OrderedDict()  # key -> seq of its last commit, oldest first

    def get(self, subject: str, name: str) -> Group | None:
        return self.by_key.get((subject, name))

    def names(self, subject: str) -> list[str]:
        return sorted(name for (s, name) in self.by_key if s == subject)

    def load(self, docs: dict[GroupKey, dict], indexes: dict[str, SubjectIndex]) -> int:
        """At open: the groups of the offsets log's documents. Returns how many were ignored
        (their subject is not known)."""
        ignored = 0
        for (subject, name), doc in sorted(docs.items()):
            ix = indexes.get(subject)
            if ix is None:
                log.warning("group of unknown subject ignored path=%s subject=%s group=%s",
                            self.offsets.directory, subject, name)
                ignored += 1
                continue
            g = Group.from_doc(subject, name, doc, ix)
            self.by_key[(g.subject, g.name)] = g
            self.note_write(g)
        return ignored

    def open_group(self, subject: str, name: str, ix: SubjectIndex, start: str) -> Group:
        """The group, created (and its start position committed, so the choice survives a
        restart) when seen for the first time."""
        g = self.by_key.get((subject, name))
        if g is not None:
            return g
        check_name("group", name, self.settings.limits.subject_bytes_max)
        if start not in (START_EARLIEST, START_LATEST):
            raise InvalidArgument("start", f"must be {START_EARLIEST!r} or {START_LATEST!r}")
        if len(self.by_key) >= self.settings.groups_max:
            raise Overloaded(f"{len(self.by_key)} consumer groups (groups_max={self.settings.groups_max})")
        g = Group(subject, name, start, ix.count if start == START_LATEST else ix.live_from)
        self.write_async([(g, g.doc())]).result()
        g.dirty = False
        self.by_key[(subject, name)] = g
        return g

    def touch(self, g: Group, ix: SubjectIndex, now_ms: int) -> None:
        """A pull, ack or nack of the group: it is active; if it was idle, or is behind the
        first entry still on disk, it resumes there (``resume_of`` decides, ``resume`` applies)."""
        g.active_ms = now_ms
        r = resume_of(idle=g.idle, committed=g.committed(), live_from=ix.live_from)
        if r is not None:
            self.resume(g, ix, r)

    def resume(self, g: Group, ix: SubjectIndex, r: Resume) -> None:
        """Apply ``r``: an idle group is back; what retention deleted meanwhile is skipped,
        its position moves to ``r.live_from`` (the first entry whose frame is still on disk)."""
        g.idle = False
        skipped = 0
        if r.skip:
            skipped = g.inflight.remove([(0, r.live_from)]) + max(0, r.live_from - g.next_pos)
            g.next_pos = max(g.next_pos, r.live_from)
            self.mark_dirty(g)
        self.counters["groups_resumed"] += 1
        self.counters["resumed_skipped_messages"] += skipped
        log.warning("consumer group active again subject=%s group=%s was_idle=%s skipped_messages=%d position=%d "
                    "path=%s", g.subject, g.name, r.was_idle, skipped, g.committed(), ix.path)

    def clamp(self, subject: str, keep: int) -> None:
        """The subject's index was cut to ``keep`` entries (a divergent suffix)."""
        for g in self.by_key.values():
            if g.subject == subject and g.next_pos > keep:
                g.next_pos = keep
                g.inflight.truncate(keep)
                self.mark_dirty(g)

    # ------------------------------------------------------------------ documents and commits

    def mark_dirty(self, g: Group) -> None:
        g.dirty = True
        self.dirty.add((g.subject, g.name))

    def dirty_keys(self) -> list[GroupKey]:
        return list(self.dirty)

    def note_write(self, g: Group) -> None:
        self.seq += 1
        key = (g.subject, g.name)
        self.changes[key] = self.seq
        self.changes.move_to_end(key)

    def snapshot(self, keys: Iterable[GroupKey]) -> list[tuple[Group, dict]]:
        """Documents of the given groups that changed since they were last written."""
        out = []
        for key in keys:
            g = self.by_key.get(key)
            if g is None or not g.dirty:
                continue
            doc = g.doc()
            g.dirty = False
            self.dirty.discard(key)
            if doc != g.persisted:
                out.append((g, doc))
        return out

    def write_async(self, items: list[tuple[Group, dict]]) -> Future:
        """Commit documents as one offsets-log record; the in-memory state moves at once, the
        future completes once the record is fsynced."""
        for g, _ in items:
            self.note_write(g)
        docs = []
        for g, doc in items:
            g.persisted = doc
            docs.append(doc)
        return self.offsets.commit(docs)

    def unpersist(self, items: list[tuple[Group, dict]]) -> None:
        """A commit failed (or its outcome is unknown): the groups are dirty again."""
        for g, _ in items:
            g.persisted = None
            self.mark_dirty(g)

    def changed(self, since_seq: int) -> list[GroupKey]:
        """Groups whose document was committed after ``since_seq`` (all of them for -1), oldest first."""
        out = []
        for key in reversed(self.changes):
            if self.changes[key] <= since_seq:
                break
            out.append(key)
        out.reverse()
        return out

    def apply_docs(self, docs: Sequence[dict], indexes: dict[str, SubjectIndex]) -> None:
        """A replica takes its master's documents (their subjects exist): committed as given,
        as one record (so they survive a promotion), before the in-memory groups follow."""
        items = []
        new: set[GroupKey] = set()
        for doc in docs:
            subject, name = doc["subject"], doc["group"]
            check_name("group", name, self.settings.limits.subject_bytes_max)
            if (subject, name) not in self.by_key:
                new.add((subject, name))
            if new and len(self.by_key) + len(new) > self.settings.groups_max:
                raise Overloaded(f"{len(self.by_key)} consumer groups (groups_max={self.settings.groups_max})")
            items.append((Group.from_doc(subject, name, doc, indexes[subject]), doc))
        if not items:
            return
        self.write_async(items).result()
        for g, _ in items:
            self.by_key[(g.subject, g.name)] = g
