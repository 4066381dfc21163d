"""The real-time node's subjects journal: which subjects exist, and who created each.

A new subject used to cost a rewrite of the whole ``subjects.json`` and two folder fsyncs,
on the event loop, one subject at a time (issue 27: 300 new subjects took 15 s, and every
other send waited behind them). Now the new subjects of a request, and of the requests that
arrive while a creation round runs, are created together (``SubjectWork``): one ``mkdir`` and
one empty index file per subject, **one** fsync of ``index/``, **one** appended journal record
and **one** fsync of the journal, on a worker thread.

File ``{root}/subjects.log``, append-only, one record per creation round, one line each::

    {crc32:08x} {json}\\n      json = {"ms": created_ms, "subjects": [[name, owner], ...]}

``crc32`` is ``zlib.crc32`` of the JSON bytes (lower-case hex). ``owner`` is the name of the
principal that created the subject (the token's name, ``anonymous`` on an open cluster);
``""`` when not known (a folder of the old layout, the dead-letter subject, subjects
configured with ``HOURGLASS_SUBJECTS``, a replica that saw the subject in its master's log
before the owner came, ``RealtimeStore.adopt_owners``). A subject named twice keeps the first
owner that is not ``""``.

Reading (``parse``): a last line with no newline, or a last line that fails its CRC, is a
torn tail (a crash during the append: that round was never acknowledged) and is cut at
open; a line that fails its CRC before the last one is ``CorruptRecord(path, offset)``.

Old layout: ``subjects.json`` (a checkpoint file, ``{"subjects": [...]}``) is read too; at
open its subjects not in the journal are appended as one record (owner ``""``), fsynced,
then the file is deleted (a crash in between reads both: the union is the same).

Invariants: a subject is in the journal, fsynced, before any message of it is appended
(the service awaits the creation round before it appends; ``RealtimeStore.append`` creates
synchronously when called directly), so an acknowledged message's subject survives a
crash. Index files of a round need no fsync of their own folder: a missing or empty index
file is rebuilt by replay, and the checkpoint that stops replay below their entries fsyncs
those folders first (``IndexFiles.plan_sync``).

``SubjectRegistry`` is the store's view: the known subjects (those with an index in
``IndexFiles``) and their owners, ``subjects_max`` counted with the rounds under way, and
the rule for an append's unknown subjects (``refuse_unknown``: created when
``auto_create_subjects`` allows, else refused per message).

Example::

    j, owners = SubjectsJournal.open(root)            # {"orders": "orders-service", ...}
    work = SubjectWork(root / "index", j, [("a", "t1"), ("b", "t1")], created_ms=now)
    work.run()                                        # worker thread: 2 mkdirs, 2 fsyncs in all
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster import status
from cluster.codec import OK, Batch, check_subject
from cluster.errors import CorruptRecord, HourglassError, InvalidArgument, Overloaded, UnknownSubject
from cluster.files import DATA_DIR_MODE, DATA_MODE
from node.realtime.index import ENTRIES_FILE, SubjectIndex
from node.realtime.indexfiles import IndexFiles
from node.store import checkpoint
from node.store.log import fsync_dir
from node.store.settings import RealtimeSettings

log = logging.getLogger("hourglass.realtime.subjects")

DLQ_SUBJECT = "hourglass.dlq"  # dead letters: always exists, created without asking
JOURNAL_NAME = "subjects.log"
LEGACY_NAME = "subjects.json"
RECORD_BYTES_MAX = 4 << 20  # one creation round: subjects_batch_max names of <= 255 bytes and their owners


def check_name(what: str, name: str, bytes_max: int) -> None:
    """A subject's or a group's name: non-empty, and the one subject rule (cluster/codec.py)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(what, "must be a non-empty string")
    check_subject(name, what, bytes_max)


def encode_record(items: list[tuple[str, str]], *, created_ms: int) -> bytes:
    """One journal line for ``(subject, owner)`` pairs."""
    body = json.dumps({"ms": int(created_ms), "subjects": [[s, o] for s, o in items]},
                      separators=(",", ":"), ensure_ascii=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def parse(data: bytes, path: str = "subjects.log") -> tuple[dict[str, str], int]:
    """``(owners, good_bytes)`` of a journal's bytes: subject -> owner of its first record,
    and the length of the readable prefix (a torn tail past it). ``CorruptRecord`` for a
    damaged line that is not the last one."""
    owners: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            return owners, pos  # torn: the append of the last round did not finish
        line = data[pos:nl]
        items = _decode_line(line)
        if items is None:
            if nl + 1 >= len(data):
                return owners, pos  # the last line is damaged: torn tail
            raise CorruptRecord(path, pos, "subjects journal record fails its CRC")
        for s, o in items:
            if not owners.get(s):
                owners[s] = o
        pos = nl + 1
    return owners, pos


def _decode_line(line: bytes) -> list[tuple[str, str]] | None:
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        doc = json.loads(body)
        return [(str(s), str(o)) for s, o in doc["subjects"]]
    except (ValueError, KeyError, TypeError):
        return None


class SubjectsJournal:
    """The open journal file. ``append`` may run on any thread (one record at a time)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._lock = threading.Lock()
        self.records = 0  # appended by this process

    @classmethod
    def open(cls, root: Path) -> tuple["SubjectsJournal", dict[str, str]]:
        """Read (and repair) the journal, migrate ``subjects.json``; returns the journal and
        subject -> owner."""
        path = root / JOURNAL_NAME
        existed = path.exists()
        data = path.read_bytes() if existed else b""
        owners, good = parse(data, str(path))
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, DATA_MODE)
        j = cls(path, fd)
        if good < len(data):
            os.ftruncate(fd, good)
            os.fsync(fd)
            log.warning("subjects journal torn tail cut path=%s offset=%d bytes_dropped=%d", path, good,
                        len(data) - good)
        if not existed:
            fsync_dir(root)
        legacy = root / LEGACY_NAME
        doc = checkpoint.read(legacy)
        if doc is not None:
            old = [s for s in doc.get("subjects", []) if s not in owners]
            if old:
                j.append([(s, "") for s in old], created_ms=0)
                owners.update(dict.fromkeys(old, ""))
            legacy.unlink()
            fsync_dir(root)
            log.warning("subjects.json migrated to the subjects journal path=%s subjects=%d", path, len(old))
        return j, owners

    def append(self, items: list[tuple[str, str]], *, created_ms: int) -> None:
        """Append one record and fsync it."""
        line = encode_record(items, created_ms=created_ms)
        if len(line) > RECORD_BYTES_MAX:
            raise ValueError(f"subjects journal record of {len(line)} bytes exceeds {RECORD_BYTES_MAX}")
        with self._lock:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
            self.records += 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


@dataclass(slots=True)
class SubjectWork:
    """One creation round, planned on the store's thread (``RealtimeStore.subjects_plan``),
    ``run`` on a worker thread, then ``RealtimeStore.subjects_finish`` on the store's thread."""

    index_root: Path
    journal: SubjectsJournal
    items: list[tuple[str, str]]           # (subject, owner) to create, in request order
    created_ms: int
    refused: dict[str, Exception] = field(default_factory=dict)  # subject -> why not (subjects_max)
    # folders this round made (their index is empty): subject -> (folder, index file path),
    # built and hashed on the worker thread so that registering them on the loop costs no pathlib
    fresh: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    # the fresh subjects' index files, opened for appending on the worker thread: the store
    # takes them (``RealtimeStore.subjects_finish``), so a batch of many new subjects does not
    # open hundreds of files on the event loop (10 of 17 ms of a 300-subject append)
    fds: dict[str, int] = field(default_factory=dict)
    done: bool = False

    def close_fds(self) -> None:
        """Close the index files the store did not take."""
        while self.fds:
            _, fd = self.fds.popitem()
            os.close(fd)

    @property
    def names(self) -> list[str]:
        return [s for s, _ in self.items]

    def run(self) -> None:
        """Any thread: make each subject's folder and empty index file, fsync ``index/`` once,
        append and fsync one journal record."""
        if not self.items:
            self.done = True
            return
        for s, _ in self.items:
            d = self.index_root / s
            try:
                d.mkdir(mode=DATA_DIR_MODE)
            except FileExistsError:
                continue  # a leftover folder: IndexFiles.load adopts what it holds
            path = d / ENTRIES_FILE
            self.fds[s] = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, DATA_MODE)
            hash(d)  # pathlib caches it: the store's set of folders to fsync does not compute it on the loop
            self.fresh[s] = (d, path)
        fsync_dir(self.index_root)
        self.journal.append(self.items, created_ms=self.created_ms)
        self.done = True


class SubjectRegistry:
    """The known subjects of a store and their owners; plans, finishes and abandons creation
    rounds (``SubjectWork``). A subject is known once its index is in ``indexes``; names of
    rounds planned and not finished count against ``subjects_max`` (``creating``)."""

    def __init__(self, root: Path, journal: SubjectsJournal, owners: dict[str, str], indexes: IndexFiles,
                 settings: RealtimeSettings) -> None:
        self.index_root = root / "index"
        self.journal = journal
        self.owners = owners                      # subject -> who created it ("" unknown)
        self.indexes = indexes
        self.settings = settings
        self.creating: set[str] = set()           # subjects of planned rounds not finished yet
        self.order: list[str] = list(owners)      # creation order: replicas get owners in it

    def check(self, subject: str) -> None:
        check_name("subject", subject, self.settings.limits.subject_bytes_max)

    def missing(self, subjects: Iterable[str]) -> list[str]:
        """The distinct names of ``subjects`` not known yet, in order (names not checked)."""
        known = self.indexes.by_subject
        return [s for s in dict.fromkeys(subjects) if s not in known]

    def create_now(self, items: list[tuple[str, str]], *, now_ms: int) -> None:
        """Create ``(subject, owner)`` pairs as one round on this thread (one journal record);
        raises the first refusal (nothing is created then)."""
        work = self.plan(items, now_ms=now_ms)
        if work.refused:
            self.abandon(work)
            raise next(iter(work.refused.values()))
        try:
            work.run()
        finally:
            self.finish(work, closed=False)

    def plan(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> SubjectWork:
        """Plan one creation round of ``(subject, owner)`` pairs: names already known or being
        created are skipped, a bad name or one past ``subjects_max`` (counting rounds under
        way) goes to ``work.refused``; the rest are reserved until ``finish`` or ``abandon``."""
        known = self.indexes.by_subject
        work = SubjectWork(self.index_root, self.journal, [], now_ms)
        room = self.settings.subjects_max - len(known) - len(self.creating)
        seen: set[str] = set()
        for s, owner in items:
            if s in known or s in self.creating or s in seen:
                continue
            seen.add(s)
            try:
                self.check(s)
                if room <= 0:
                    raise Overloaded(f"{len(known) + len(self.creating)} subjects "
                                     f"(subjects_max={self.settings.subjects_max})")
            except HourglassError as e:
                work.refused[s] = e
                continue
            room -= 1
            work.items.append((s, owner))
        self.creating.update(work.names)
        return work

    def finish(self, work: SubjectWork, *, closed: bool) -> None:
        """After ``work.run``: the round's subjects are known (their index folders fsynced by
        the next checkpoint, before it vouches for their entries). A round that did not
        finish (``run`` raised) only gives its names back."""
        self.creating.difference_update(work.names)
        try:
            if work.done and not closed:
                self._adopt(work)
        finally:
            work.close_fds()

    def _adopt(self, work: SubjectWork) -> None:
        indexes = self.indexes
        adopted = 0
        for s, owner in work.items:
            if s in indexes.by_subject:
                continue
            if s not in self.owners:
                self.order.append(s)
            if not self.owners.get(s):
                self.owners[s] = owner
            fresh = work.fresh.get(s)
            if fresh is not None:  # the round made the folder and an empty file: nothing to repair
                folder, path = fresh  # built (and hashed) on the worker thread: no pathlib work here
                ix = SubjectIndex(s, path, 0)
                indexes.by_subject[s] = ix
                fd = work.fds.pop(s, -1)
                if fd >= 0:  # opened off the loop: the first append writes at once
                    indexes.adopt_fd(ix, fd)
                    adopted += 1
            else:
                folder = self.index_root / s
                indexes.load(s)  # adopts a leftover file, cut as at open
            indexes.dirs_unsynced.add(folder)
        # keep every descriptor the round opened: the request that asked appends to them next
        indexes.trim(keep=adopted)

    def abandon(self, work: SubjectWork) -> None:
        """A planned round that will not run: its names are free again."""
        self.creating.difference_update(work.names)
        work.close_fds()

    def refuse_unknown(self, batch: Batch, codes: np.ndarray, errors: dict[int, str],
                       refused: dict[str, HourglassError], *, now_ms: int) -> None:
        """An append's unknown subjects: create them (when allowed: ``auto_create_subjects``,
        the dead-letter subject) as one round; the messages of the others, and of names the
        round refused, get the refusal's code in ``codes`` / ``errors``."""
        known = self.indexes.by_subject
        unknown = [(k, s) for k, s in enumerate(batch.subjects) if s not in known]
        if not unknown:
            return
        why: dict[int, HourglassError] = {}
        create: list[tuple[int, str]] = []
        for k, s in unknown:
            if not (codes[batch.subject_idx == k] == OK).any():
                continue
            if s in refused:
                why[k] = refused[s]
            elif not (self.settings.auto_create_subjects or s == DLQ_SUBJECT):
                why[k] = UnknownSubject(s)
            else:
                create.append((k, s))
        if create:
            work = self.plan([(s, "") for _, s in create], now_ms=now_ms)
            try:
                work.run()
            finally:
                self.finish(work, closed=False)
            why.update({k: work.refused[s] for k, s in create if s in work.refused})
        for k, e in why.items():
            mine = np.flatnonzero((batch.subject_idx == k) & (codes == OK))
            codes[mine] = status.to_code(e)
            errors.update(dict.fromkeys(mine.tolist(), str(e)))

    def owner(self, subject: str) -> str | None:
        return self.owners.get(subject) if subject in self.indexes.by_subject else None

    def owners_from(self, first: int, count_max: int) -> list[tuple[str, str]]:
        return [(s, self.owners.get(s, "")) for s in self.order[first:first + count_max]]

    def adopt_owners(self, items: Sequence[tuple[str, str]], *, now_ms: int) -> None:
        """A replica takes its master's subjects and owners: missing subjects are created and
        owners it did not know are recorded, as one journal record (one fsync)."""
        known = self.indexes.by_subject
        new = [(s, o) for s, o in items if s not in known]
        named = [(s, o) for s, o in items if o and s in known and not self.owners.get(s)]
        if new:
            for s, _ in new:
                self.check(s)
            self.create_now(new, now_ms=now_ms)
        if named:
            self.journal.append(named, created_ms=now_ms)
            self.owners.update(named)

    def owned_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        known = self.indexes.by_subject
        for s, o in self.owners.items():
            if o and s in known:
                out[o] = out.get(o, 0) + 1
        return out
