"""IndexFiles: every subject's consume index of a real-time node and the descriptors open on them.

One ``SubjectIndex`` (``node/realtime/index.py``) per known subject, under
``{root}/index/{subject}/``. This module owns what is about files rather than entries:

* a descriptor LRU: at most ``index_files_open_max`` index files stay open (a node with
  thousands of subjects would run out of descriptors). ``fd(ix)`` opens on demand; an
  evicted *dirty* index is closed without an fsync (its pages are in the page cache) and
  stays dirty: the checkpoint that vouches for its entries reopens and fsyncs it
  (``plan_sync``). Before issue 27 every evicted dirty fd was fsynced by the next periodic
  flush: a flood of new subjects cost one fsync per subject every 200 ms;
* ``plan_sync``: the fsyncs a checkpoint needs (dirty index files, index folders with a new
  subject or a renamed compacted file), capped at ``fsyncs_max``, oldest unsynced entries
  first; it tells how far the checkpoint may vouch;
* opening an index at recovery (``load``: torn tail cut, an interrupted compaction finished)
  and ``live_from`` (the first entry whose frame is still in the message log).

Invariants: ``ix.fd >= 0`` iff ``ix.subject`` is in ``open`` (most recently used last);
``len(open) <= open_max`` between calls (``fd(..., trim=False)`` lets a frame of many
subjects go past it until ``trim``); an index that is ``dirty`` is either open or will be
reopened and fsynced by the next checkpoint before it vouches for its entries.

Example::

    files = IndexFiles(root / "index", messages, open_max=1024)
    files.load("orders")                       # at open: cut the torn tail
    ix = files.index("orders")
    ix.append_run(files.fd(ix), raw)
    vouched = files.plan_sync(plan, indexed=messages.end_offset, fsyncs_max=None)
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from cluster.errors import DiskFull, UnknownSubject
from cluster.files import DATA_DIR_MODE, DATA_MODE
from node.realtime.index import SubjectIndex, open_files
from node.store.log import SegmentedLog, fsync_dir
from node.store.syncplan import SyncPlan

log = logging.getLogger("hourglass.realtime.store")


class IndexFiles:
    def __init__(self, root: Path, messages: SegmentedLog, *, open_max: int) -> None:
        self.root = root                       # {data}/index
        self.messages = messages
        self.open_max = open_max
        self.by_subject: dict[str, SubjectIndex] = {}
        self.open: OrderedDict[str, None] = OrderedDict()  # LRU of subjects with an open fd
        self.dirs_unsynced: set[Path] = set()  # index folders with a new file or rename not fsynced yet
        self.old_files: list[tuple[Path, Path]] = []  # (old file, its compacted replacement) to delete

    def index(self, subject: str) -> SubjectIndex:
        """The subject's index; ``UnknownSubject`` if there is none."""
        ix = self.by_subject.get(subject) if isinstance(subject, str) else None
        if ix is None:
            raise UnknownSubject(subject)
        return ix

    # ------------------------------------------------------------------ descriptors

    def fd(self, ix: SubjectIndex, *, trim: bool = True) -> int:
        """``ix``'s open descriptor (opened if needed, most recently used now). ``trim=False``:
        do not evict yet (a frame's or a round's many subjects; ``trim`` after them), so a
        frame of more subjects than ``open_max`` does not evict the descriptors it is about
        to use and reopen every one of them (issue 27: a 300-subject frame opened 300 files
        on the loop)."""
        if ix.fd >= 0:
            self.open.move_to_end(ix.subject)
            return ix.fd
        ix.fd = os.open(ix.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, DATA_MODE)
        self.open[ix.subject] = None
        if trim:
            self.trim()
        return ix.fd

    def adopt_fd(self, ix: SubjectIndex, fd: int) -> None:
        """A descriptor opened off the loop (a creation round) becomes ``ix``'s; no trim."""
        ix.fd = fd
        self.open[ix.subject] = None

    def trim(self, keep: int = 0) -> None:
        """Evict least recently used descriptors down to ``max(open_max, keep)``."""
        cap = max(self.open_max, keep)
        while len(self.open) > cap:
            old, _ = self.open.popitem(last=False)
            self.evict(self.by_subject[old])

    def evict(self, ix: SubjectIndex) -> None:
        """Close an fd, not fsynced here when dirty (see module docstring)."""
        if ix.fd >= 0 and ix.dirty:
            os.close(ix.fd)
            ix.fd = -1
            self.open.pop(ix.subject, None)
            return
        self.close_fd(ix)

    def close_fd(self, ix: SubjectIndex) -> None:
        """Close an fd, fsynced first if dirty."""
        if ix.fd < 0:
            return
        if ix.dirty:
            os.fsync(ix.fd)
            ix.dirty = False
        os.close(ix.fd)
        ix.fd = -1
        self.open.pop(ix.subject, None)

    def close_all(self) -> None:
        for s in list(self.open):
            self.close_fd(self.by_subject[s])

    def abandon(self) -> None:
        """Close every descriptor without an fsync (a store dropped without ``close``)."""
        for ix in self.by_subject.values():
            if ix.fd >= 0:
                os.close(ix.fd)
                ix.fd = -1
        self.open.clear()

    def append_frame(self, offset: int, runs: dict[int, bytes], subjects: Sequence[str], held_ms: int) -> None:
        """Write one frame's runs (``index.frame_runs``: subject number -> entries), one write
        each; ``held_ms``: the frame's latest ``visible_ms``. An index write that hits ENOSPC
        first drops every entry written for the frame, then raises ``DiskFull``."""
        by_subject = self.by_subject
        try:
            for k, raw in runs.items():
                ix = by_subject[subjects[k]]
                ix.append_run(self.fd(ix, trim=False), raw)
                if held_ms > ix.held_until:
                    ix.held_until = held_ms
        except DiskFull:
            for k in runs:
                ix = by_subject[subjects[k]]
                if ix.last_offset == offset:
                    fd = self.fd(ix)
                    ix.truncate(fd, ix.first_at_or_after(fd, offset))
            raise
        finally:
            self.trim()

    # ------------------------------------------------------------------ recovery and retention

    def load(self, subject: str) -> tuple[int | None, int]:
        """Open a subject's index and cut its torn tail (``SubjectIndex.repair_tail``); finish
        a compaction a crash interrupted (``index.open_files``, ``adopt_tail``). Returns the
        log offset re-indexing must start from (never below the log start) or None, and the
        number of older index files it finished."""
        d = self.root / subject
        d.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        base, path, older = open_files(d)
        ix = SubjectIndex(subject, path, base)
        self.by_subject[subject] = ix
        start, end = self.messages.start_offset, self.messages.end_offset
        rebuild = ix.repair_tail(end, start)
        if older:
            for old_base, old in older:
                ix.adopt_tail(self.fd(ix), old, old_base, end)
            for _, old in older:
                old.unlink()
            fsync_dir(d)
            log.warning("index compaction finished at open path=%s base=%d old_files=%d", path, base, len(older))
        self.advance_live_from(ix)
        return (None if rebuild is None else max(rebuild, start)), len(older)

    def advance_live_from(self, ix: SubjectIndex) -> None:
        """Move ``ix.live_from`` to the first entry whose frame is still in the message log."""
        start = self.messages.start_offset
        lo = max(ix.live_from, ix.base)
        if lo >= ix.count or int(ix.read(self.fd(ix), lo, 1)["offset"][0]) >= start:
            ix.live_from = lo
            return
        ix.live_from = ix.first_at_or_after(self.fd(ix), start, lo=lo)

    def truncate(self, cut: int) -> dict[str, int]:
        """Drop every entry pointing at or past log offset ``cut`` (fsynced); returns
        subject -> entries kept, for the indexes that lost some."""
        kept = {}
        for ix in self.by_subject.values():
            if ix.last_offset < cut:
                continue
            fd = self.fd(ix)
            keep = ix.first_at_or_after(fd, cut)
            ix.truncate(fd, keep)
            kept[ix.subject] = keep
        return kept

    # ------------------------------------------------------------------ checkpoint

    def plan_sync(self, plan: SyncPlan, indexed: int, fsyncs_max: int | None) -> int:
        """Plan the fsyncs a checkpoint at ``indexed`` needs: every dirty index file, and every
        unsynced index folder (a new subject's, or one where a compacted file was renamed).
        With ``fsyncs_max``, only that many, the subjects with the oldest unsynced entries
        first; returns the offset below the first entry left unsynced (``indexed`` when none
        was): the checkpoint vouches only below it, and replay at open re-indexes from there.

        A dirty index whose fd was evicted is opened here to be fsynced: a descriptor (not a
        path) keeps the plan on the same file if a compaction renames it meanwhile."""
        dirs = self.dirs_unsynced
        units: list[tuple[int, str]] = []  # (first unsynced entry's offset, subject); -1 = take now
        for s, ix in self.by_subject.items():
            if ix.dirty:
                units.append((ix.dirty_from, s))
        for d in dirs:
            ix = self.by_subject.get(d.name)
            if ix is None or not ix.dirty:  # a new, empty subject: no entry waits for it; else take it now
                units.append((indexed if ix is None or ix.count == ix.base else -1, d.name))
        if fsyncs_max is not None and len(units) + len(dirs) > fsyncs_max:  # at most this many fsyncs
            units.sort()
        else:
            fsyncs_max = None
        used = 0
        left = indexed
        for bound, s in units:
            folder = self.root / s
            ix = self.by_subject.get(s)
            n = (ix is not None and ix.dirty) + (folder in dirs)
            if fsyncs_max is not None and used + n > fsyncs_max and bound >= 0:
                left = min(left, bound)
                continue
            used += n
            if ix is not None and ix.dirty:
                if ix.fd >= 0:
                    plan.fsync(ix.fd)
                else:
                    fd = os.open(ix.path, os.O_RDONLY)
                    try:
                        plan.fsync(fd)  # duplicated by the plan
                    finally:
                        os.close(fd)
                ix.dirty = False
            if folder in dirs:
                dirs.discard(folder)
                plan.fsync_dir(folder)  # opened on the plan's thread
        return min(left, indexed)
