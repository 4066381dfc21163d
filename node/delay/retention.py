"""Retention of a delay node's files: the decisions of ``node/store/retention.py`` applied
to a ``DelayStore``, in three steps so no file deletion runs on the event loop.

1. ``plan(store, now_ms, ...)`` (on the loop, cheap): decides with the pure rules and
   *detaches* what goes - segments and bucket folders renamed ``*.deleting`` (one rename
   each), id files renamed or queued for compaction - so the store, and a store reopened on
   the same folder, no longer sees them. Returns a ``Work`` and a ``Report`` (why the
   oldest kept thing is kept: metrics and logs).
2. ``Work.run()`` (worker thread): unlinks, removes folders, writes compacted id files.
3. ``finish(store, work)`` (on the loop): swaps compacted id files in by rename (skipped
   when the store was reopened meanwhile).

Crash safety: a rename is atomic; leftovers ``*.deleting`` are removed when the files
are opened (``SegmentedLog.open``, ``ScheduleLog``, ``IdIndex.open``) and half-written
``*.idx.tmp`` files too. A node killed at any point starts, and holds exactly what it
held or less of what was due to go.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from node.store import retention as R
from node.store.idindex import Compacted, build_compacted
from node.store.log import fsync_dir, unlink_segments

log = logging.getLogger("hourglass.delay.retention")

LOGS = ("messages", "dispatch")


@dataclass(slots=True)
class Report:
    """Why the oldest kept piece of each file set is kept (``held_by``) and its age."""

    held_by: dict[str, str] = field(default_factory=dict)       # "messages" | "dispatch" | "schedule" -> reason
    held_offset: dict[str, int] = field(default_factory=dict)   # segment base / bucket start of the oldest kept
    freed_files: int = 0


@dataclass(slots=True)
class Work:
    segments: dict[str, tuple[Path, list[Path]]] = field(default_factory=dict)
    buckets: list[Path] = field(default_factory=list)
    id_files: list[Path] = field(default_factory=list)
    compactions: list[tuple[int, tuple, np.ndarray]] = field(default_factory=list)
    built: list[tuple[int, Compacted]] = field(default_factory=list)
    schedule_root: Path | None = None
    ids_dir: Path | None = None
    freed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(any(p for _, p in self.segments.values()) or self.buckets or self.id_files or self.compactions)

    def run(self) -> None:
        """Any thread: the deletions and compactions planned on the loop."""
        for directory, paths in self.segments.values():
            self.freed_bytes += unlink_segments(directory, paths)
        if self.buckets:
            for p in self.buckets:
                self.freed_bytes += _tree_bytes(p)
            _remove_trees(self.schedule_root, self.buckets)
        if self.id_files:
            for p in self.id_files:
                self.freed_bytes += _file_blocks(p)
                p.unlink(missing_ok=True)
            _fsync_dir(self.ids_dir)
        for first_seq, (path, ent_off, used, _slots), gone in self.compactions:
            self.built.append((first_seq, build_compacted(path, ent_off, used, gone, first_seq=first_seq)))


def plan(store, *, now_ms: int, slave_holds: dict[str, dict[str, int]] | None = None,
         dedupe_window_ms: int, id_compact_ratio_min: float) -> tuple[Work, Report]:
    """Decide and detach (on the loop). ``slave_holds``: log name -> ``{holder: offset}``
    (a master's registered slaves; None for a node without replicas)."""
    work, report = Work(), Report()
    store.note_now(now_ms)  # a follower's only regular caller with a time (the healer's pacing)
    doc = store.persisted_doc
    if "iterate_offset" not in doc:
        return work, report  # no checkpoint yet: nothing is known durable
    holds_of = {"messages": {"checkpoint": int(doc["iterate_offset"])},
                "dispatch": {"checkpoint": int(doc.get("dispatch_offset", 0))}}
    for name in LOGS:
        holds = dict(holds_of[name])
        holds.update((slave_holds or {}).get(name, {}))
        lg = store.messages if name == "messages" else store.dispatch
        cut = R.segment_cut(lg.segment_bases(), lg.end_offset, holds)
        report.held_by[name], report.held_offset[name] = cut.held_by, cut.held_base
        paths = lg.detach_before(cut.offset)
        if paths:
            work.segments[name] = (lg.directory, paths)
            log.info("retention log=%s segments=%d new_start=%d held_by=%s", name, len(paths), lg.start_offset,
                     cut.held_by)
    completed = int(doc.get("completed_ms", -1))
    bms = store.settings.bucket_ms
    bc = R.bucket_cut(store.schedule.bucket_starts(), bms, completed)
    report.held_by["schedule"] = bc.held_by
    report.held_offset["schedule"] = bc.held_start if bc.held_start is not None else completed
    # a bucket whose missing records are still being fetched from a member stays (node/delay/heal.py):
    # they come back into it, and its lost.json is what remembers them across a restart
    drop = [b for b in bc.drop if b not in store.healer.missing or store.healer.missing[b].lost]
    if drop:
        work.buckets = store.schedule.detach_buckets(drop)
        work.schedule_root = store.schedule.root
        log.info("retention schedule buckets=%d first=%d last=%d", len(drop), drop[0], drop[-1])
    # id index: sealed files whose entries' buckets are done and past the dedupe window
    summaries = store.ids.sealed_bucket_counts()
    per_file = []
    gone_of: dict[int, np.ndarray] = {}
    for first_seq, used, starts, counts in summaries:
        gone_mask = R.id_entries_gone(starts, bucket_ms=bms, completed_ms=completed, now_ms=now_ms,
                                      dedupe_window_ms=dedupe_window_ms)
        gone_of[first_seq] = starts[gone_mask]
        per_file.append((first_seq, used, int(counts[gone_mask].sum())))
    for act in R.id_file_actions(per_file, compact_ratio_min=id_compact_ratio_min):
        if act.action == "delete":
            p = store.ids.detach_file(act.first_seq)
            if p is not None:
                work.id_files.append(p)
        else:
            src = store.ids.compact_source(act.first_seq)
            if src is not None:
                work.compactions.append((act.first_seq, src, gone_of[act.first_seq]))
    work.ids_dir = store.ids.directory
    return work, report


def finish(store, work: Work, *, same_store: bool) -> None:
    """On the loop, after ``run``: put compacted id files in place."""
    for first_seq, built in work.built:
        if same_store:
            try:
                store.ids.swap_compacted(first_seq, built)
            except FileNotFoundError:  # the folder was reopened meanwhile and removed the temp file
                pass
        else:
            built.tmp.unlink(missing_ok=True)


def _tree_bytes(p: Path) -> int:
    n = 0
    for q in p.rglob("*"):
        try:
            if q.is_file():
                n += q.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return n


def _file_blocks(p: Path) -> int:
    try:
        return p.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def _remove_trees(root: Path | None, paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    if root is not None and paths:
        _fsync_dir(root)


def _fsync_dir(path: Path | None) -> None:
    if path is not None:
        fsync_dir(path)


def disk_usage(root: Path) -> dict[str, int]:
    """Bytes allocated on disk (``st_blocks``) per top-level folder of a data folder (any
    thread): ``messages``, ``schedule``, ``ids``, ``dispatch``, ... and ``other`` for files."""
    out: dict[str, int] = {}
    for top in Path(root).iterdir():
        name = top.name if top.is_dir() else "other"
        n = 0
        if top.is_dir():
            for dirpath, _dirs, files in os.walk(top):
                for f in files:
                    try:
                        n += os.stat(os.path.join(dirpath, f)).st_blocks * 512
                    except FileNotFoundError:
                        pass
        else:
            n = _file_blocks(top)
        out[name] = out.get(name, 0) + n
    return out


def held_ages(store, report: Report, *, now_ms: int) -> dict[str, tuple[str, float]]:
    """log -> (held_by, seconds): how old the oldest kept segment is (by its last write),
    or for the schedule how far the oldest kept bucket's end lies behind ``completed_ms``."""
    out: dict[str, tuple[str, float]] = {}
    wall = time.time()
    for name in LOGS:
        if name not in report.held_by:
            continue
        lg = store.messages if name == "messages" else store.dispatch
        info = lg.segments_info()
        age = (wall * 1000 - info[0][2]) / 1000 if len(info) > 1 else 0.0
        out[name] = (report.held_by[name], age)
    if "schedule" in report.held_by:
        completed = int(store.persisted_doc.get("completed_ms", now_ms))
        start = report.held_offset["schedule"]
        out["schedule"] = (report.held_by["schedule"], max(0, completed - start - store.settings.bucket_ms) / 1000)
    return out
