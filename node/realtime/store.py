"""RealtimeStore: the real-time node's storage engine (message log, consume index, groups).

Owns a data folder::

    {root}/messages/                     SegmentedLog of message records (records.encode, kind=message)
    {root}/index/{subject}/entries       consume index of one subject: fixed 32-byte entries
    {root}/groups/{subject}/{group}.json position of one consumer group (checkpoint.write_atomic)
    {root}/subjects.json                 known subjects (checkpoint.write_atomic)
    {root}/checkpoint                    epoch, indexed_offset, dedup_offset (checkpoint.write_atomic)

Index entry (little-endian, 32 bytes, ``<QIIqQ``)::

    u64 offset       message-log offset of the record's frame
    u32 frame_size   header + body bytes (what ``SegmentedLog.read_at`` needs)
    u32 entry_crc    zlib.crc32 of pack("<QIqQ", offset, frame_size, store_ms, tags_mask)
    i64 store_ms     when this node accepted the message
    u64 tags_mask    OR over the message's tags of 1 << (zlib.crc32(tag.encode()) & 63)

The position of an entry in its file (byte offset / 32) is the message's *handle*:
what ``pull`` hands out and ``ack`` takes back. Handles of a subject are dense and
start at 0.

Group file (JSON)::

    {"version": 1, "subject": s, "group": g, "start": "earliest"|"latest",
     "committed": c,     # lowest position not yet acked (everything below is done)
     "next": n,          # first position never handed out
     "pending": [[a, b], ...]}   # in flight at flush time, as [a, b) runs; subset of [c, n)

Positions in ``[committed, next)`` not in ``pending`` were acked (or skipped by a tag
filter), so a clean close/reopen never redelivers an acked message even when acks
came out of order. ``subjects.json`` is ``{"subjects": [...]}``; the checkpoint is
``{"epoch", "indexed_offset", "dedup_offset"}``.

Flow (every call takes ``now_ms``; nothing here reads a clock, starts a thread or awaits):

1. ``append`` validates (the message is due now: ``deliver_at_ms`` is kept as given but
   not checked against the delay horizon), de-duplicates by (subject, id) inside
   ``dedup_window_ms``, gives each message a seq ``(epoch << 40) | counter``, appends
   the records to the message log and, right after, their entries to each subject's
   index (page cache; durable after ``flush``).
2. ``pull`` first redelivers this group's in-flight handles whose ack deadline passed
   (``now_ms >= pulled_at_ms + ack_timeout_ms``), oldest pull first, then hands out new
   positions from the group's ``next``. In-flight handles are owned by the group, not
   by a consumer, so consumers of one group never get the same handle at once.
   A tag filter skips entries whose mask shares no bit with the requested tags; a
   skipped entry counts as acked *for this group* (a group should keep one filter).
   The mask may match falsely (64 bits), so the client checks tags exactly.
   A group seen for the first time starts at the beginning of the subject's index
   (``start="earliest"``, the default) or at its current end (``"latest"``); the
   group file is written at once so the choice survives a restart.
3. ``ack`` drops handles from the in-flight set; ``nack`` returns their deliveries
   (and restarts their ack deadline) for the service to re-send, which then acks.
4. ``flush`` fsyncs the message log, then the dirty index files, writes changed group
   files, and last the checkpoint with ``indexed_offset`` = the log end before the fsyncs.

Invariants:

* every message record below ``indexed_offset`` has its entry in its subject index on
  disk; an index holds an entry for a record iff the record's offset is <= the last
  entry's offset in that file (entries are appended in log order), which lets replay
  skip what is already indexed without a set of seqs;
* a group's ``committed <= next <= entries in the index``; ``in-flight ⊆ [committed, next)``;
* RAM holds nothing per stored message except the dedup map (bounded by time and
  ``dedup_entries_max``) and in-flight handles (``inflight_per_group_max`` per group).

Recovery (``open``): the SegmentedLog truncates its own torn tail. Each index file
loses a partial trailing entry, then trailing entries that fail their CRC (torn page)
or point past the message-log end; a CRC failure in the middle of an index is
reported as ``CorruptRecord`` on read. Records from ``min(indexed_offset,
dedup_offset)`` on are replayed: missing entries re-indexed (from the start of the
last surviving entry of a subject whose tail failed its CRC), and records with
``store_ms > now_ms - dedup_window_ms`` put back in the dedup map. Group positions
come from their files; the in-flight deadlines do not survive, so handles that were
pending at the last flush (and everything handed out after it) are redelivered at
once: delivery is at-least-once. Acks after the last flush are lost by a crash, not by
``close`` (which flushes).

Example::

    st = RealtimeStore.open(root, now_ms=t)
    st.append([Message(0, 0, t, "id-1", "orders", b"x", tags=("eu",))], now_ms=t)
    st.flush()
    [d] = st.pull("orders", "billing", "c1", max_messages=10, now_ms=t)   # d.handle == 0
    st.ack("orders", "billing", [d.handle], now_ms=t)                     # -> 1
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import uuid
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.errors import Closed, CorruptRecord, HourglassError, InvalidArgument, Overloaded, PayloadTooLarge, \
    UnknownSubject
from node.store import checkpoint, records
from node.store.log import HEADER_SIZE, RECORD_BYTES_MAX_DEFAULT, SegmentedLog, fsync_dir
from node.store.records import SEQ_COUNTER_MAX, SEQ_EPOCH_SHIFT, Limits, Message

log = logging.getLogger("hourglass.realtime.store")

DLQ_SUBJECT = "hourglass.dlq"

ENTRY = struct.Struct("<QIIqQ")
ENTRY_SIZE = ENTRY.size  # 32
_ENTRY_CRC = struct.Struct("<QIqQ")
ENTRIES_FILE = "entries"
GROUP_FILE_VERSION = 1
START_EARLIEST = "earliest"
START_LATEST = "latest"
_DUE_NOW_MS = -(1 << 62)  # pulled_at of handles restored from disk: due for redelivery at once
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_REINDEX_BUFFER_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class RealtimeSettings:
    segment_bytes: int = 64 * 1024 * 1024
    dedup_window_ms: int = 600_000          # de-duplicate by (subject, message id) within this window
    dedup_entries_max: int = 2_000_000      # dedup map size; a full map makes append answer Overloaded
    ack_timeout_ms: int = 30_000            # a pulled, unacked message is redelivered after this
    inflight_per_group_max: int = 100_000   # in-flight handles per group; pull answers Overloaded when full
    pull_max: int = 1000                    # max_messages above this is clamped
    auto_create_subjects: bool = True
    max_attempts: int = 16                  # nack: after this many attempts -> dead letter (used by the service)
    limits: Limits = field(default_factory=Limits)
    subjects_max: int = 10_000              # known subjects (each costs a little RAM and an index file)
    groups_max: int = 100_000               # consumer groups over all subjects
    pull_scan_entries_max: int = 65_536     # index entries one pull may examine (tag filters skip entries)
    index_files_open_max: int = 256         # open index file descriptors (LRU)


@dataclass(frozen=True, slots=True)
class Stored:
    msg_id: str
    seq: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Delivery:
    handle: int      # position in the subject's consume index
    message: Message


def tags_mask(tags: Iterable[str]) -> int:
    """The 64-bit bloom mask of a tag set (see module docstring)."""
    mask = 0
    for t in tags:
        mask |= 1 << (zlib.crc32(t.encode()) & 63)
    return mask


def encode_entry(offset: int, frame_size: int, store_ms: int, mask: int) -> bytes:
    crc = zlib.crc32(_ENTRY_CRC.pack(offset, frame_size, store_ms, mask))
    return ENTRY.pack(offset, frame_size, crc, store_ms, mask)


def _entry_ok(raw: bytes | memoryview, pos: int) -> bool:
    offset, size, crc, store_ms, mask = ENTRY.unpack_from(raw, pos)
    return zlib.crc32(_ENTRY_CRC.pack(offset, size, store_ms, mask)) == crc


def _check_name(what: str, name: str, bytes_max: int) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(what, "must be a non-empty string")
    if len(name.encode()) > bytes_max:
        raise InvalidArgument(what, f"{len(name.encode())} bytes exceeds {bytes_max}")
    if not records.SUBJECT_RE.match(name):
        raise InvalidArgument(what, f"{name[:64]!r} does not match {records.SUBJECT_RE.pattern}")


def _runs(handles: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for h in sorted(handles):
        if out and out[-1][1] == h:
            out[-1][1] = h + 1
        else:
            out.append([h, h + 1])
    return out


def _write_group_files(jobs: list[tuple[Path, str, dict]]) -> None:
    for d, name, doc in jobs:
        if not d.exists():
            d.mkdir(parents=True)
            fsync_dir(d.parent)
        checkpoint.write_atomic(d / f"{name}.json", doc)


class _SubjectIndex:
    """One subject's consume index file; RAM: its entry count and last entry's offset."""

    __slots__ = ("subject", "path", "count", "last_offset", "fd", "dirty")

    def __init__(self, subject: str, path: Path) -> None:
        self.subject = subject
        self.path = path
        self.count = 0
        self.last_offset = -1  # message-log offset of the last entry; -1 when empty
        self.fd = -1
        self.dirty = False     # written since the last fsync


class _Group:
    """A consumer group of one subject."""

    __slots__ = ("subject", "name", "start", "next_pos", "inflight", "persisted", "dirty")

    def __init__(self, subject: str, name: str, start: str, next_pos: int) -> None:
        self.subject = subject
        self.name = name
        self.start = start
        self.next_pos = next_pos
        # handle -> pulled_at_ms, in order of (re)delivery: the front is the first to time out
        self.inflight: OrderedDict[int, int] = OrderedDict()
        self.persisted: dict | None = None
        self.dirty = True

    def committed(self) -> int:
        return min(self.inflight, default=self.next_pos)

    def doc(self) -> dict:
        return {"version": GROUP_FILE_VERSION, "subject": self.subject, "group": self.name, "start": self.start,
                "committed": self.committed(), "next": self.next_pos, "pending": _runs(self.inflight)}


class RealtimeStore:
    """See module docstring. Synchronous, not thread-safe."""

    def __init__(self, root: Path, settings: RealtimeSettings, now_ms: int, *, bump_epoch: bool) -> None:
        self.root = root
        self.settings = settings
        root.mkdir(parents=True, exist_ok=True)
        (root / "index").mkdir(exist_ok=True)
        (root / "groups").mkdir(exist_ok=True)
        record_bytes_max = max(RECORD_BYTES_MAX_DEFAULT, settings.limits.payload_bytes_max + (1 << 20))
        self.messages = SegmentedLog.open(root / "messages", segment_bytes_max=settings.segment_bytes,
                                          record_bytes_max=record_bytes_max)
        self._closed = False
        self._group_writer: ThreadPoolExecutor | None = None
        self._ckpt_path = root / "checkpoint"
        ck = checkpoint.read(self._ckpt_path) or {}
        self.epoch = int(ck.get("epoch", 0)) + (1 if bump_epoch else 0)
        self._counter = 0
        start, end = self.messages.start_offset, self.messages.end_offset
        self.indexed_offset = min(max(int(ck.get("indexed_offset", start)), start), end)
        dedup_offset = min(max(int(ck.get("dedup_offset", start)), start), end)
        self._ckpt_saved: dict | None = None
        self._save_checkpoint(self.indexed_offset, dedup_offset)  # the epoch is durable before any seq uses it
        self.counters = {"appended": 0, "duplicates": 0, "delivered": 0, "redelivered": 0, "acked": 0,
                         "skipped_by_tag": 0, "reindexed": 0}

        self._subjects: dict[str, _SubjectIndex] = {}
        self._open_fds: OrderedDict[str, None] = OrderedDict()  # LRU of subjects with an open index fd
        self._groups: dict[tuple[str, str], _Group] = {}
        # dedup: (subject, id) -> (seq, store_ms); order: (store_ms, key, seq, log offset) in append order
        self._dedup: dict[tuple[str, str], tuple[int, int]] = {}
        self._dedup_order: deque[tuple[int, tuple[str, str], int, int]] = deque()
        # replication: every group file write gets a seq; (subject, group) -> seq of its last write, oldest first
        self.group_seq = 0
        self._group_changes: OrderedDict[tuple[str, str], int] = OrderedDict()

        doc = checkpoint.read(root / "subjects.json") or {}
        reindex_from = self.indexed_offset
        for s in doc.get("subjects", []):
            rebuild = self._load_index(s)
            if rebuild is not None:
                reindex_from = min(reindex_from, rebuild)
        if DLQ_SUBJECT not in self._subjects:
            self._create_subject(DLQ_SUBJECT)
        self._replay(reindex_from, dedup_offset, now_ms)
        self._load_groups()
        self._indexed_upto = self.messages.end_offset
        self.flush()

    @classmethod
    def open(cls, root: str | os.PathLike, settings: RealtimeSettings | None = None, *, now_ms: int,
             bump_epoch: bool = True) -> "RealtimeStore":
        return cls(Path(root), settings or RealtimeSettings(), now_ms, bump_epoch=bump_epoch)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        for s in list(self._open_fds):
            self._close_fd(self._subjects[s])
        if self._group_writer is not None:
            self._group_writer.shutdown(wait=True)
        self.messages.close()
        self._closed = True

    def __del__(self) -> None:
        # dropped without close() (a crash simulation): give the index descriptors back
        if getattr(self, "_closed", True):
            return
        try:
            for ix in getattr(self, "_subjects", {}).values():
                if ix.fd >= 0:
                    os.close(ix.fd)
                    ix.fd = -1
            if self._group_writer is not None:
                self._group_writer.shutdown(wait=False)
        except Exception:
            pass

    def __enter__(self) -> "RealtimeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("real-time store is closed")

    # ------------------------------------------------------------------ recovery

    def _load_index(self, subject: str) -> int | None:
        """Open a subject's index and cut its torn tail. Returns a message-log offset replay
        must start from when entries that may be below ``indexed_offset`` were dropped."""
        d = self.root / "index" / subject
        d.mkdir(parents=True, exist_ok=True)
        ix = _SubjectIndex(subject, d / ENTRIES_FILE)
        self._subjects[subject] = ix
        ix.path.touch(exist_ok=True)
        size = ix.path.stat().st_size
        count = size // ENTRY_SIZE
        log_end = self.messages.end_offset
        crc_dropped = False
        keep = count
        last = None
        with open(ix.path, "rb") as f:
            while keep > 0:
                f.seek((keep - 1) * ENTRY_SIZE)
                raw = f.read(ENTRY_SIZE)
                if not _entry_ok(raw, 0):
                    crc_dropped = True
                    keep -= 1
                    continue
                offset, frame_size, _, _, _ = ENTRY.unpack(raw)
                if offset + frame_size > log_end:
                    keep -= 1
                    continue
                last = (offset, frame_size)
                break
        if keep * ENTRY_SIZE != size:
            with open(ix.path, "r+b") as f:
                f.truncate(keep * ENTRY_SIZE)
                os.fsync(f.fileno())
            log.warning("index torn tail truncated path=%s offset=%d bytes_dropped=%d",
                        ix.path, keep * ENTRY_SIZE, size - keep * ENTRY_SIZE)
        ix.count = keep
        ix.last_offset = last[0] if last else -1
        if crc_dropped:
            return last[0] + last[1] if last else self.messages.start_offset
        return None

    def _replay(self, reindex_from: int, dedup_offset: int, now_ms: int) -> None:
        """Re-index records missing from their subject index and rebuild the dedup map."""
        last_seq, dropped = self._index_records(reindex_from, dedup_offset, now_ms)
        if dropped:
            log.warning("dedup map full at recovery path=%s dedup_entries_max=%d entries_dropped=%d",
                        self.root, self.settings.dedup_entries_max, dropped)
        if self.counters["reindexed"]:
            log.info("re-indexed path=%s from_offset=%d entries=%d", self.messages.directory, reindex_from,
                     self.counters["reindexed"])
        if last_seq is None and self.messages.end_offset > self.messages.start_offset:
            last_off = max((ix.last_offset for ix in self._subjects.values()), default=-1)
            if last_off >= 0:
                last_seq = records.peek_header(self.messages.read(last_off)[0])[1]
        if last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT > self.epoch:
            # a replica's log holds seqs of its masters' epochs: stay above all of them
            self.epoch = (last_seq >> SEQ_EPOCH_SHIFT) + 1
            self._save_checkpoint(self.indexed_offset, dedup_offset)
        elif last_seq is not None and last_seq >> SEQ_EPOCH_SHIFT == self.epoch:
            self._counter = (last_seq & SEQ_COUNTER_MAX) + 1  # bump_epoch=False: never reuse a seq

    def _index_records(self, reindex_from: int, dedup_offset: int, now_ms: int) -> tuple[int | None, int]:
        """Index records from ``reindex_from`` on that their subject index lacks, and put records
        from ``dedup_offset`` on back in the dedup map. Returns (last seq seen, dedup entries dropped)."""
        start = min(reindex_from, dedup_offset)
        cutoff = now_ms - self.settings.dedup_window_ms
        buffers: dict[str, list[bytes]] = {}
        last_seq = None
        dropped = 0
        for off, body in self.messages.iterate(start):
            m = records.decode(body)
            last_seq = m.seq
            if m.kind != records.KIND_MESSAGE:
                continue
            if off >= reindex_from:
                ix = self._subjects.get(m.subject)
                if ix is None:
                    self._create_subject(m.subject)
                    ix = self._subjects[m.subject]
                if off > ix.last_offset:
                    buf = buffers.setdefault(m.subject, [])
                    buf.append(encode_entry(off, HEADER_SIZE + len(body), m.store_ms, tags_mask(m.tags)))
                    ix.last_offset = off
                    self.counters["reindexed"] += 1
                    if len(buf) >= _REINDEX_BUFFER_ENTRIES:
                        self._write_entries(ix, buf)
                        buf.clear()
            if off >= dedup_offset and m.store_ms > cutoff:
                key = (m.subject, m.msg_id)
                self._dedup[key] = (m.seq, m.store_ms)
                self._dedup_order.append((m.store_ms, key, m.seq, off))
                if len(self._dedup_order) > self.settings.dedup_entries_max:
                    self._pop_dedup()
                    dropped += 1
        for s, buf in buffers.items():
            if buf:
                self._write_entries(self._subjects[s], buf)
        return last_seq, dropped

    def _load_groups(self) -> None:
        for sd in sorted((self.root / "groups").iterdir()):
            if not sd.is_dir():
                continue
            ix = self._subjects.get(sd.name)
            if ix is None:
                log.warning("group folder of unknown subject ignored path=%s", sd)
                continue
            for p in sorted(sd.glob("*.json")):
                g = self._group_from_doc(sd.name, p.stem, checkpoint.read(p), ix)
                self._groups[(g.subject, g.name)] = g
                self._note_group_write(g)

    @staticmethod
    def _group_from_doc(subject: str, name: str, doc: dict, ix: _SubjectIndex) -> _Group:
        g = _Group(subject, name, doc.get("start", START_EARLIEST), 0)
        g.next_pos = min(int(doc.get("next", doc.get("committed", 0))), ix.count)
        committed = min(int(doc.get("committed", 0)), g.next_pos)
        for a, b in doc.get("pending", []):
            for h in range(max(a, committed), min(b, g.next_pos)):
                g.inflight[h] = _DUE_NOW_MS
        g.persisted = doc
        g.dirty = False
        return g

    def _note_group_write(self, g: _Group) -> None:
        self.group_seq += 1
        key = (g.subject, g.name)
        self._group_changes[key] = self.group_seq
        self._group_changes.move_to_end(key)

    # ------------------------------------------------------------------ index files

    def _fd(self, ix: _SubjectIndex) -> int:
        if ix.fd >= 0:
            self._open_fds.move_to_end(ix.subject)
            return ix.fd
        ix.fd = os.open(ix.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._open_fds[ix.subject] = None
        while len(self._open_fds) > self.settings.index_files_open_max:
            old, _ = self._open_fds.popitem(last=False)
            self._close_fd(self._subjects[old])
        return ix.fd

    def _close_fd(self, ix: _SubjectIndex) -> None:
        if ix.fd < 0:
            return
        if ix.dirty:
            os.fsync(ix.fd)
            ix.dirty = False
        os.close(ix.fd)
        ix.fd = -1
        self._open_fds.pop(ix.subject, None)

    def _write_entries(self, ix: _SubjectIndex, entries: list[bytes]) -> None:
        fd = self._fd(ix)
        view = memoryview(b"".join(entries))
        while view:
            n = os.write(fd, view)
            view = view[n:]
        ix.count += len(entries)
        ix.dirty = True

    def _read_entries(self, ix: _SubjectIndex, pos: int, n: int) -> list[tuple[int, int, int, int]]:
        """(offset, frame_size, store_ms, tags_mask) of entries [pos, pos + n)."""
        n = min(n, ix.count - pos)
        if n <= 0:
            return []
        raw = os.pread(self._fd(ix), n * ENTRY_SIZE, pos * ENTRY_SIZE)
        if len(raw) != n * ENTRY_SIZE:
            raise CorruptRecord(str(ix.path), len(raw) + pos * ENTRY_SIZE, "index file shorter than expected")
        out = []
        for i in range(n):
            offset, size, crc, store_ms, mask = ENTRY.unpack_from(raw, i * ENTRY_SIZE)
            if zlib.crc32(_ENTRY_CRC.pack(offset, size, store_ms, mask)) != crc:
                raise CorruptRecord(str(ix.path), (pos + i) * ENTRY_SIZE, "index entry checksum mismatch")
            out.append((offset, size, store_ms, mask))
        return out

    def _message_at(self, ix: _SubjectIndex, offset: int, size: int) -> Message:
        return records.decode(self.messages.read_at(offset, size))

    # ------------------------------------------------------------------ subjects

    def create_subject(self, subject: str) -> bool:
        """Register a subject; True if it is new. ``InvalidArgument`` for a bad name."""
        self._check_open()
        _check_name("subject", subject, self.settings.limits.subject_bytes_max)
        if subject in self._subjects:
            return False
        self._create_subject(subject)
        return True

    def _create_subject(self, subject: str) -> None:
        if len(self._subjects) >= self.settings.subjects_max:
            raise Overloaded(f"{len(self._subjects)} subjects (subjects_max={self.settings.subjects_max})")
        self._load_index(subject)  # creates index/{subject}/entries; adopts a leftover file, cut as at open
        fsync_dir(self.root / "index")
        checkpoint.write_atomic(self.root / "subjects.json", {"subjects": sorted(self._subjects)})

    def subjects(self) -> list[str]:
        return sorted(self._subjects)

    def _index(self, subject: str) -> _SubjectIndex:
        ix = self._subjects.get(subject) if isinstance(subject, str) else None
        if ix is None:
            raise UnknownSubject(subject)
        return ix

    # ------------------------------------------------------------------ append

    def _next_seq(self) -> int:
        seq = records.make_seq(self.epoch, self._counter)
        self._counter += 1
        return seq

    def _prepare(self, m: Message, now_ms: int) -> Message:
        """The record to store for a producer's message (seq still 0), or InvalidArgument."""
        if not isinstance(m, Message):
            raise InvalidArgument("message", f"expected a Message, got {type(m).__name__}")
        if m.kind != records.KIND_MESSAGE:
            raise InvalidArgument("kind", "a real-time node stores messages only")
        if not isinstance(m.deliver_at_ms, int) or not _I64_MIN <= m.deliver_at_ms <= _I64_MAX:
            raise InvalidArgument("deliver_at_ms", "must be a 64-bit integer")
        if not isinstance(m.attempts, int) or not 0 <= m.attempts <= 0xFFFF:
            raise InvalidArgument("attempts", "must be an integer in [0, 65535]")
        try:
            stored = Message(seq=0, store_ms=now_ms, deliver_at_ms=m.deliver_at_ms,
                             msg_id=m.msg_id or uuid.uuid4().hex, subject=m.subject, payload=m.payload,
                             tags=tuple(m.tags), properties=tuple(tuple(p) for p in m.properties),
                             attempts=m.attempts)
            # the message is due now: deliver_at_ms is kept, but the delay horizon does not apply
            records.validate_message(dataclasses.replace(stored, deliver_at_ms=now_ms), now_ms=now_ms,
                                     limits=self.settings.limits)
        except (TypeError, ValueError) as e:
            raise InvalidArgument("message", str(e)) from None
        return dataclasses.replace(stored, payload=bytes(stored.payload))

    def _expire_dedup(self, now_ms: int) -> None:
        cutoff = now_ms - self.settings.dedup_window_ms
        order = self._dedup_order
        while order and order[0][0] <= cutoff:
            self._pop_dedup()

    def _pop_dedup(self) -> None:
        _, key, seq, _ = self._dedup_order.popleft()
        if self._dedup.get(key, (None,))[0] == seq:
            del self._dedup[key]

    def append(self, batch: Sequence[Message], *, now_ms: int) -> list[Stored | Exception]:
        """Store messages; one result per message: ``Stored`` or the exception that rejected it.

        A rejected message changes nothing; the others go on. A message whose (subject, id)
        was stored within ``dedup_window_ms`` answers ``Stored(duplicate=True)`` with the
        first copy's seq and is not stored again. Durable after ``flush`` (or after the
        caller's group commit of ``messages``: replay re-indexes what the indexes lack).
        """
        self._check_open()
        self._expire_dedup(now_ms)
        window_ms = self.settings.dedup_window_ms
        out: list[Stored | Exception | None] = []
        bodies: list[bytes] = []
        pending: list[tuple[int, Message]] = []  # (index in out, stored message)
        batch_keys: dict[tuple[str, str], int] = {}
        for m in batch:
            try:
                rec = self._prepare(m, now_ms)
                key = (rec.subject, rec.msg_id)
                if key in batch_keys:
                    self.counters["duplicates"] += 1
                    out.append(Stored(rec.msg_id, batch_keys[key], duplicate=True))
                    continue
                prior = self._dedup.get(key)
                if prior is not None and now_ms - prior[1] < window_ms:
                    self.counters["duplicates"] += 1
                    out.append(Stored(rec.msg_id, prior[0], duplicate=True))
                    continue
                if len(self._dedup) + len(batch_keys) >= self.settings.dedup_entries_max:
                    raise Overloaded(f"dedup map holds {len(self._dedup)} ids "
                                     f"(dedup_entries_max={self.settings.dedup_entries_max})")
                if rec.subject not in self._subjects:
                    if not (self.settings.auto_create_subjects or rec.subject == DLQ_SUBJECT):
                        raise UnknownSubject(rec.subject)
                    self._create_subject(rec.subject)
                rec = dataclasses.replace(rec, seq=self._next_seq())
                body = records.encode(rec)
                if len(body) > self.messages.record_bytes_max:
                    raise PayloadTooLarge("message", f"{len(body)} bytes encoded exceeds "
                                                     f"{self.messages.record_bytes_max}")
                batch_keys[key] = rec.seq
                pending.append((len(out), rec))
                bodies.append(body)
                out.append(None)
            except HourglassError as e:
                out.append(e)
        if bodies:
            # if an index write ever failed, the flush point stays before it and replay repairs it
            contiguous = self._indexed_upto == self.messages.end_offset
            offsets = self.messages.append(bodies)
            per_subject: dict[str, list[bytes]] = {}
            for (i, rec), off, body in zip(pending, offsets, bodies):
                per_subject.setdefault(rec.subject, []).append(
                    encode_entry(off, HEADER_SIZE + len(body), now_ms, tags_mask(rec.tags)))
                self._subjects[rec.subject].last_offset = off
                key = (rec.subject, rec.msg_id)
                self._dedup[key] = (rec.seq, now_ms)
                self._dedup_order.append((now_ms, key, rec.seq, off))
                out[i] = Stored(rec.msg_id, rec.seq)
            for s, entries in per_subject.items():
                self._write_entries(self._subjects[s], entries)
            if contiguous:
                self._indexed_upto = self.messages.end_offset
            self.counters["appended"] += len(bodies)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        """fsync the message log and the indexes, write changed group files, then the checkpoint."""
        self._check_open()
        indexed = self._indexed_upto  # every record below it has its index entry written
        self.messages.flush()
        for ix in self._subjects.values():
            if ix.dirty:
                os.fsync(self._fd(ix))
                ix.dirty = False
        for g in self._groups.values():
            if g.dirty:
                doc = g.doc()
                if doc != g.persisted:
                    self._write_group(g, doc)
                g.dirty = False
        dedup_offset = self._dedup_order[0][3] if self._dedup_order else indexed
        self._save_checkpoint(indexed, dedup_offset)

    def persist_group(self, subject: str, group: str) -> bool:
        """Write one group's file now if it changed (an acknowledged ack survives a crash).
        True if a file was written. The service batches many acks into one write per group
        with ``snapshot_groups`` + ``write_groups_async`` instead."""
        self._check_open()
        items = self.snapshot_groups([(subject, group)])
        if items:
            self.write_groups_async(items).result()
        return bool(items)

    def _save_checkpoint(self, indexed: int, dedup_offset: int) -> None:
        doc = {"epoch": self.epoch, "indexed_offset": indexed, "dedup_offset": dedup_offset}
        if doc != self._ckpt_saved:
            checkpoint.write_atomic(self._ckpt_path, doc)
            self._ckpt_saved = doc
        self.indexed_offset = indexed

    def _write_group(self, g: _Group, doc: dict) -> None:
        self.write_groups_async([(g, doc)]).result()

    def write_groups_async(self, items: list[tuple["_Group", dict]]) -> Future:
        """Write group files on the one group-writer thread, in submission order (so a newer
        document of a group never lands before an older one). The in-memory state moves at
        once; the returned future completes when the files are fsynced."""
        jobs = []
        for g, doc in items:
            g.persisted = doc
            self._note_group_write(g)
            jobs.append((self.root / "groups" / g.subject, g.name, doc))
        if self._group_writer is None:
            self._group_writer = ThreadPoolExecutor(1, thread_name_prefix="group-writer")
        return self._group_writer.submit(_write_group_files, jobs)

    def snapshot_groups(self, keys: Iterable[tuple[str, str]]) -> list[tuple["_Group", dict]]:
        """Documents of the given groups that changed since they were last written."""
        out = []
        for key in keys:
            g = self._groups.get(key)
            if g is None or not g.dirty:
                continue
            doc = g.doc()
            g.dirty = False
            if doc != g.persisted:
                out.append((g, doc))
        return out

    # ------------------------------------------------------------------ consume

    def _group(self, subject: str, group: str, ix: _SubjectIndex, start: str) -> _Group:
        g = self._groups.get((subject, group))
        if g is not None:
            return g
        _check_name("group", group, self.settings.limits.subject_bytes_max)
        if start not in (START_EARLIEST, START_LATEST):
            raise InvalidArgument("start", f"must be {START_EARLIEST!r} or {START_LATEST!r}")
        if len(self._groups) >= self.settings.groups_max:
            raise Overloaded(f"{len(self._groups)} consumer groups (groups_max={self.settings.groups_max})")
        g = _Group(subject, group, start, ix.count if start == START_LATEST else 0)
        self._write_group(g, g.doc())  # the start position survives a restart
        g.dirty = False
        self._groups[(subject, group)] = g
        return g

    def pull(self, subject: str, group: str, consumer_id: str, *, max_messages: int, tags: Sequence[str] = (),
             now_ms: int, start: str = START_EARLIEST) -> list[Delivery]:
        """Up to ``max_messages`` deliveries for one consumer of ``group`` (see module docstring).

        ``consumer_id`` only names the caller (handles belong to the group). ``start`` applies
        when the group is first seen. ``Overloaded`` when the group's in-flight set is full
        and nothing is due for redelivery.
        """
        self._check_open()
        ix = self._index(subject)
        if not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidArgument("max_messages", "must be a positive integer")
        max_messages = min(max_messages, self.settings.pull_max)
        tags = list(tags)
        for t in tags:
            if not isinstance(t, str) or not t:
                raise InvalidArgument("tags", "a tag filter holds non-empty strings")
        want = tags_mask(tags)
        g = self._group(subject, group, ix, start)
        out: list[Delivery] = []

        timeout = self.settings.ack_timeout_ms
        due: list[int] = []
        for h, pulled_at in g.inflight.items():
            if len(due) >= max_messages or now_ms < pulled_at + timeout:
                break
            due.append(h)
        for h in due:
            offset, size, _, _ = self._read_entries(ix, h, 1)[0]
            out.append(Delivery(h, self._message_at(ix, offset, size)))
            g.inflight.move_to_end(h)
            g.inflight[h] = now_ms
        self.counters["redelivered"] += len(due)

        room = self.settings.inflight_per_group_max - len(g.inflight)
        scan_left = self.settings.pull_scan_entries_max
        moved = False
        while len(out) < max_messages and room > 0 and scan_left > 0 and g.next_pos < ix.count:
            n = min(scan_left, max(max_messages - len(out), 64), 4096)
            entries = self._read_entries(ix, g.next_pos, n)
            for offset, size, _store_ms, mask in entries:
                if len(out) >= max_messages or room <= 0:
                    break
                h = g.next_pos
                g.next_pos += 1
                scan_left -= 1
                moved = True
                if want and not mask & want:
                    self.counters["skipped_by_tag"] += 1
                    continue
                out.append(Delivery(h, self._message_at(ix, offset, size)))
                g.inflight[h] = now_ms
                room -= 1
                self.counters["delivered"] += 1
        if moved or due:
            g.dirty = True
        if not out and room <= 0 and g.next_pos < ix.count:
            raise Overloaded(f"group {group!r} of {subject!r} has {len(g.inflight)} messages in flight "
                             f"(inflight_per_group_max={self.settings.inflight_per_group_max})")
        return out

    def ack(self, subject: str, group: str, handles: Iterable[int], *, now_ms: int) -> int:
        """Drop handles from the group's in-flight set; returns how many were in flight.
        The group file is written by ``persist_group`` or ``flush``."""
        self._check_open()
        self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return 0
        n = 0
        for h in handles:
            if g.inflight.pop(h, None) is not None:
                n += 1
        if n:
            g.dirty = True
            self.counters["acked"] += n
        return n

    def nack(self, subject: str, group: str, handles: Iterable[int], *, now_ms: int) -> list[Delivery]:
        """The in-flight deliveries for ``handles`` (unknown ones ignored), their ack deadline
        restarted so they are not redelivered while the caller re-sends them; the caller
        acks them once the retry copy (or the dead letter) is stored."""
        self._check_open()
        ix = self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return []
        out: list[Delivery] = []
        seen: set[int] = set()
        for h in handles:
            if h in seen or h not in g.inflight:
                continue
            seen.add(h)
            offset, size, _, _ = self._read_entries(ix, h, 1)[0]
            out.append(Delivery(h, self._message_at(ix, offset, size)))
            g.inflight.move_to_end(h)
            g.inflight[h] = now_ms
        return out

    def lag(self, subject: str, group: str) -> int:
        """Entries of the subject this group has not acked (a group not seen yet: all of them)."""
        ix = self._index(subject)
        g = self._groups.get((subject, group))
        if g is None:
            return ix.count
        return ix.count - g.next_pos + len(g.inflight)

    def committed(self, subject: str, group: str) -> int:
        """The group's lowest unacked position (0 for a group not seen yet)."""
        self._index(subject)
        g = self._groups.get((subject, group))
        return 0 if g is None else g.committed()

    def groups(self, subject: str) -> list[str]:
        self._index(subject)
        return sorted(name for (s, name) in self._groups if s == subject)

    # ------------------------------------------------------------------ replication (node/replication/realtime.py)

    def index_appended(self, *, now_ms: int) -> int:
        """A replica appended records to ``messages`` (``append_raw``): index them and put
        them in the dedup map, exactly as ``open`` replays a log. Returns entries added."""
        self._check_open()
        start = self._indexed_upto
        end = self.messages.end_offset
        if start >= end:
            return 0
        self._expire_dedup(now_ms)
        before = self.counters["reindexed"]
        _, dropped = self._index_records(start, start, now_ms)
        if dropped:
            log.warning("dedup map full path=%s dedup_entries_max=%d entries_dropped=%d",
                        self.root, self.settings.dedup_entries_max, dropped)
        self._indexed_upto = end
        return self.counters["reindexed"] - before

    def truncate_log(self, cut: int) -> int:
        """Drop a divergent suffix of the message log (records a new master never had): the
        log, the index entries pointing at or past ``cut``, their dedup entries; groups are
        clamped to what their indexes still hold. Returns bytes dropped."""
        self._check_open()
        if cut >= self.messages.end_offset:
            return 0
        for ix in self._subjects.values():
            if ix.last_offset < cut:
                continue
            lo, hi = 0, ix.count  # entries are in log order: first entry with offset >= cut
            while lo < hi:
                mid = (lo + hi) // 2
                if self._read_entries(ix, mid, 1)[0][0] < cut:
                    lo = mid + 1
                else:
                    hi = mid
            fd = self._fd(ix)
            os.ftruncate(fd, lo * ENTRY_SIZE)
            os.fsync(fd)
            ix.dirty = False
            ix.count = lo
            ix.last_offset = self._read_entries(ix, lo - 1, 1)[0][0] if lo else -1
            for g in self._groups.values():
                if g.subject == ix.subject and g.next_pos > lo:
                    g.next_pos = lo
                    for h in [h for h in g.inflight if h >= lo]:
                        del g.inflight[h]
                    g.dirty = True
        while self._dedup_order and self._dedup_order[-1][3] >= cut:
            _, key, seq, _ = self._dedup_order.pop()
            if self._dedup.get(key, (None,))[0] == seq:
                del self._dedup[key]
        dropped = self.messages.truncate(cut)
        self.messages.flush()
        self._indexed_upto = min(self._indexed_upto, cut)
        self._save_checkpoint(min(self.indexed_offset, cut),
                              self._dedup_order[0][3] if self._dedup_order else self._indexed_upto)
        log.warning("message log truncated to %d (divergent suffix, %d bytes)", cut, dropped)
        return dropped

    def changed_groups(self, since_seq: int) -> list[tuple[str, str]]:
        """Groups whose file was written after ``since_seq`` (all of them for -1), oldest first."""
        out = []
        for key in reversed(self._group_changes):
            if self._group_changes[key] <= since_seq:
                break
            out.append(key)
        out.reverse()
        return out

    def group_doc(self, subject: str, group: str) -> dict | None:
        """The group's document as last written to its file (what a replica must hold)."""
        g = self._groups.get((subject, group))
        return None if g is None else g.persisted

    def group_written_seq(self, subject: str, group: str) -> int:
        """``group_seq`` of the group's last file write (0 if never written by this store)."""
        return self._group_changes.get((subject, group), 0)

    def apply_group_doc(self, doc: dict) -> None:
        """A replica takes its master's group document: the file is written as given (so it
        survives a promotion), the in-memory group follows it."""
        self._check_open()
        subject, name = doc["subject"], doc["group"]
        _check_name("group", name, self.settings.limits.subject_bytes_max)
        if subject not in self._subjects:
            _check_name("subject", subject, self.settings.limits.subject_bytes_max)
            self._create_subject(subject)
        g = self._group_from_doc(subject, name, doc, self._subjects[subject])
        if (subject, name) not in self._groups and len(self._groups) >= self.settings.groups_max:
            raise Overloaded(f"{len(self._groups)} consumer groups (groups_max={self.settings.groups_max})")
        self._write_group(g, doc)
        self._groups[(subject, name)] = g
