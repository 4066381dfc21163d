"""Retention of a real-time node, the file side: what ``retention.decide`` chose, carried out.

``node/realtime/retention.py`` holds the rules (pure). ``Retainer`` applies them to the
store's files in three steps, so that no unlink, copy or fsync runs on the event loop:

1. ``plan`` (store's thread): take the groups' holds (the frame offset of each group's
   committed position, cached per group), decide, and detach: segments that go are renamed
   ``*.deleting`` (a store reopened on the folder never sees them), the frame cache forgets
   them, each subject's ``live_from`` moves past their entries, groups found idle are
   logged once, and index files worth compacting are planned (``Compaction``).
2. ``RetentionWork.run`` (any thread): unlink the detached segments (oldest first), copy
   the live entries of each index to compact to ``entries.{base}.tmp`` (fsynced), delete
   old index files whose replacement is durable.
3. ``finish`` (store's thread): copy the entries appended since the copy, rename the file
   to ``entries.{base}`` (the switch; handles stay the same); its folder is fsynced by the
   next checkpoint plan and the old file deleted by the next retention work. A compaction
   is abandoned when the index moved under it (reopened, truncated, another file).

A segment's age counts from when it was sealed: the ``store_ms`` of the first frame of the
next segment, remembered per segment base (``sealed_ms``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from node.realtime import retention as RR
from node.realtime.frames import FrameCache
from node.realtime.groups import ConsumerGroups
from node.realtime.index import ENTRY_SIZE, TMP_SUFFIX, copy_entries, index_path
from node.realtime.indexfiles import IndexFiles
from node.store.log import SegmentedLog, fsync_dir, unlink_segments
from node.store.settings import RealtimeSettings

log = logging.getLogger("hourglass.realtime.store")


@dataclass(slots=True)
class Compaction:
    subject: str
    src: Path            # the index file when planned
    src_base: int
    new_base: int        # the subject's live_from: entries below it are dead
    upto: int            # entries [new_base, upto) are copied by the worker
    tmp: Path
    truncations: int     # Retainer.truncations when planned (a divergent-suffix cut abandons it)
    copied: bool = False


@dataclass(slots=True)
class RetentionReport:
    held_by: str = ""      # why the oldest kept segment is kept (retention.decide)
    held_base: int = 0
    held_age_ms: int = 0   # how long ago the oldest kept segment was sealed (0: it is the active one)
    idle_groups: int = 0


@dataclass(slots=True)
class RetentionWork:
    """What ``plan`` detached: run on a worker thread (``run``), then ``finish`` on the
    store's thread (``RealtimeStore.retention_finish``)."""

    directory: Path
    segments: list[Path] = field(default_factory=list)
    compactions: list[Compaction] = field(default_factory=list)
    old_files: list[tuple[Path, Path]] = field(default_factory=list)  # (old index file, the file replacing it)
    freed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.segments or self.compactions or self.old_files)

    def run(self) -> None:
        """Any thread: unlink detached segments (oldest first), copy the live entries of
        indexes to compact, delete old index files once their replacement is durable."""
        self.freed_bytes += unlink_segments(self.directory, self.segments)
        for old, new in self.old_files:
            try:
                fd = os.open(new, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsync_dir(new.parent)
                self.freed_bytes += old.stat().st_blocks * 512
                old.unlink()
                fsync_dir(new.parent)
            except FileNotFoundError:
                pass
        for c in self.compactions:
            try:
                copy_entries(c.src, c.src_base, c.tmp, c.new_base, c.upto)
                c.copied = True
            except OSError as e:  # ENOSPC, or the store was reopened and removed the files
                log.error("index compaction failed path=%s error=%s", c.tmp, e)
                c.tmp.unlink(missing_ok=True)


class Retainer:
    """See module docstring. Synchronous, not thread-safe (``RetentionWork.run`` aside)."""

    def __init__(self, messages: SegmentedLog, indexes: IndexFiles, groups: ConsumerGroups, frames: FrameCache,
                 settings: RealtimeSettings, counters: dict[str, int]) -> None:
        self.messages = messages
        self.indexes = indexes
        self.groups = groups
        self.frames = frames
        self.settings = settings
        self.counters = counters  # the store's: groups_idled, segments_deleted, index_compactions
        self.sealed_ms: dict[int, int] = {}  # segment base -> when it was sealed
        self.compacting: set[str] = set()    # subjects with a compaction under way
        self.truncations = 0                 # divergent-suffix cuts so far (``truncated``)

    def truncated(self) -> None:
        """A divergent suffix was cut: compactions planned before are abandoned, cached holds
        may point at other frames now."""
        self.truncations += 1
        for g in self.groups.by_key.values():
            g.hold = (-1, -1)

    def plan(self, *, now_ms: int, dedup_offset: int | None, indexed_offset: int,
             slave_holds: dict[str, int] | None) -> tuple[RetentionWork, RetentionReport]:
        """Decide (``retention.decide``) and detach (module docstring, step 1)."""
        work, report = RetentionWork(self.messages.directory), RetentionReport()
        end = self.messages.end_offset
        indexes = self.indexes
        positions, by_key = [], {}
        for (subject, name), g in self.groups.by_key.items():
            ix = indexes.by_subject[subject]
            if g.active_ms is None:
                g.active_ms = now_ms
            c = g.committed()
            hold = None
            if ix.live_from <= c < ix.count:
                if g.hold[0] != c:
                    g.hold = (c, int(ix.read(indexes.fd(ix), c, 1)["offset"][0]))
                hold = g.hold[1]
            key = f"{subject}/{name}"
            by_key[key] = g
            positions.append(RR.GroupPosition(key, hold, g.active_ms))
        s = self.settings
        decision = RR.decide(self.segments_sealed(now_ms), end, positions, now_ms=now_ms,
                             retention_ms=s.retention_ms, retention_bytes=s.retention_bytes,
                             group_idle_ms_max=s.group_idle_ms_max, dedup_offset=dedup_offset,
                             indexed_offset=indexed_offset, slave_holds=slave_holds)
        for key in decision.idle:
            g = by_key[key]
            if not g.idle:
                g.idle = True
                self.counters["groups_idled"] += 1
                log.warning("consumer group idle: no longer holds data back subject=%s group=%s idle_ms=%d "
                            "group_idle_ms_max=%d committed=%d", g.subject, g.name, now_ms - g.active_ms,
                            s.group_idle_ms_max, g.committed())
        report.idle_groups = len(decision.idle)
        cut = decision.cut
        report.held_by, report.held_base = cut.held_by, cut.held_base
        paths = self.messages.detach_before(cut.offset)
        start = self.messages.start_offset
        if paths:
            work.segments = paths
            self.counters["segments_deleted"] += len(paths)
            for b in [b for b in self.sealed_ms if b < start]:
                del self.sealed_ms[b]
            self.frames.forget_below(start)
            for ix in indexes.by_subject.values():
                indexes.advance_live_from(ix)
            log.info("retention log=messages segments=%d new_start=%d held_by=%s path=%s", len(paths), start,
                     cut.held_by, self.messages.directory)
        sealed = self.sealed_ms.get(self.messages.segment_bases()[0])
        report.held_age_ms = 0 if sealed is None else max(0, now_ms - sealed)
        for ix in indexes.by_subject.values():
            if ix.subject not in self.compacting and RR.compact_index(
                    ix.base, ix.count, ix.live_from, entries_min=s.index_compact_entries_min):
                final = index_path(ix.path.parent, ix.live_from)
                work.compactions.append(Compaction(ix.subject, ix.path, ix.base, ix.live_from, ix.count,
                                                   final.with_name(final.name + TMP_SUFFIX), self.truncations))
                self.compacting.add(ix.subject)
        work.old_files, indexes.old_files = indexes.old_files, []
        return work, report

    def segments_sealed(self, now_ms: int) -> list[tuple[int, int, int]]:
        """``(base, size, sealed_ms)`` of every segment; a segment was sealed by the append
        that starts the next one (its ``store_ms``); the active one is ``now_ms``."""
        info = self.messages.segments_info()
        end = self.messages.end_offset
        out = []
        for (base, size, _), nxt in zip(info, info[1:] + [None]):
            ms = self.sealed_ms.get(base)
            if ms is None:
                if nxt is None or nxt[0] >= end:
                    out.append((base, size, now_ms))
                    continue
                b = self.frames.peek(nxt[0])
                ms = self.sealed_ms[base] = int(b.store_ms[0]) if b.n else now_ms
            out.append((base, size, ms))
        return out

    def finish(self, work: RetentionWork, *, closed: bool, indexed_offset: int) -> None:
        """After ``work.run`` (module docstring, step 3)."""
        indexes = self.indexes
        for c in work.compactions:
            self.compacting.discard(c.subject)
            ix = indexes.by_subject.get(c.subject)
            if (not c.copied or closed or ix is None or ix.path != c.src or ix.count < c.upto
                    or c.truncations != self.truncations):
                c.tmp.unlink(missing_ok=True)
                continue
            try:
                tail = os.pread(indexes.fd(ix), (ix.count - c.upto) * ENTRY_SIZE, (c.upto - ix.base) * ENTRY_SIZE)
                fd = os.open(c.tmp, os.O_WRONLY | os.O_APPEND)
                try:
                    view = memoryview(tail)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                final = index_path(ix.path.parent, c.new_base)
                os.replace(c.tmp, final)
            except OSError as e:
                log.error("index compaction abandoned path=%s error=%s", c.tmp, e)
                c.tmp.unlink(missing_ok=True)
                continue
            indexes.evict(ix)  # a dirty old fd is fsynced (then closed) by the next flush plan
            old = ix.path
            ix.path, ix.base = final, c.new_base
            ix.trusted_from = max(ix.trusted_from, c.new_base)
            indexes.fd(ix)
            ix.dirty_from = indexed_offset  # nothing in the new file is synced yet: vouch for none of it
            ix.dirty = True  # the copied tail is fsynced before the next checkpoint
            indexes.dirs_unsynced.add(final.parent)
            indexes.old_files.append((old, final))
            self.counters["index_compactions"] += 1
            log.info("index compacted path=%s base=%d entries_dropped=%d entries=%d", final, c.new_base,
                     c.new_base - c.src_base, ix.count - c.new_base)
