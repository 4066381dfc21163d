"""Ingest rules of the delay store: what ``accept`` decides, and what waits to be filed.

Pure: no file is read or written here. ``DelayStore.accept`` (the shell) asks
``admit`` which messages of a batch are new, duplicates or refused, given a way to find
an id's newest record (``find``: the id index, the schedule log, the records not filed
yet); it then appends the returned frames to the message log and queues them in
``Unfiled`` until the iterator files them.

Duplicate rules (a producer retries, an id is the message's name):

* an id twice in one batch: the first stands, the others are refused (``ALREADY_EXISTS``);
* an id seen before with the same content and due time (absolute, or relative: a retry of
  ``delay_ms=d`` arrives later, so its absolute time moved by exactly the time between the
  arrivals): answered as a duplicate with the first seq, nothing appended;
* an id whose record was delivered or cancelled and deleted by retention (``Retired``),
  inside the dedupe window: a duplicate too;
* an id used for another message, or cancelled: refused.

Ids the server names (a message without one) come from ``new_id``: the shell passes
``uuid4``, a test a counter.

``write_bytes_bound`` and friends: the disk watermark's bound of what a write takes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cluster.codec import COLUMN_BYTES, KIND_CANCEL, Batch
from cluster.errors import Overloaded
from cluster.wire import BatchResult
from node.store import records
from node.store.diskspace import FILE_BLOCK_BYTES
from node.store.idindex import ENTRY_SIZE as ID_ENTRY_SIZE
from node.store.idindex import key_hashes
from node.store.log import HEADER_SIZE as LOG_HEADER_SIZE
from node.store.records import BATCH_HEADER_SIZE, Message
from node.store.schedule import ENTRY_SIZE as SCHEDULE_ENTRY_SIZE
from node.store.schedule import FILE_SORTED_RUNS_MAX, HEADS_HEADER_SIZE
from node.store.settings import StoreSettings

ALREADY_EXISTS = 4  # hourglass.v1.Code

# the disk watermark's bound of a write (``write_bytes_bound``)
FILES_PER_WRITE = 8       # message segment (and a new one), schedule data segment, index and heads, id file
FILES_PER_BUCKET = 4      # a new schedule bucket: its folder, data segment, index and heads files
BUCKETS_LOOKED_UP_MAX = 64  # a batch due in more buckets than this counts every one of them as new


@dataclass(frozen=True, slots=True)
class Retired:
    """What a lookup answers for an id whose bucket retention deleted (delivered or
    cancelled; ``seq`` from the id index)."""

    seq: int


@dataclass(frozen=True, slots=True)
class Admitted:
    """``admit``'s answer: one result per message, and the frames to append (each with its
    records' id hashes); empty when nothing is new."""

    result: BatchResult
    frames: list[tuple[Batch, np.ndarray]]


def same_content(a: Message, b: Message) -> bool:
    """A re-send of the same message: same content and the same due time, absolute or
    relative (module docs)."""
    if (a.subject, a.payload, a.tags, a.properties) != (b.subject, b.payload, b.tags, b.properties):
        return False
    return a.deliver_at_ms == b.deliver_at_ms or a.deliver_at_ms - a.store_ms == b.deliver_at_ms - b.store_ms


def split_frames(batch: Batch, bytes_max: int) -> list[Batch]:
    """Cut a batch so that no frame's payload bytes exceed ``bytes_max`` (one message may)."""
    if len(batch.payloads) <= bytes_max:
        return [batch]
    ends = batch.payload_end.astype(np.int64)
    out, start = [], 0
    while start < batch.n:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + bytes_max, side="right"))
        stop = max(stop, start + 1)
        out.append(batch.take(slice(start, stop)))
        start = stop
    return out


def admit(batch: Batch, *, now_ms: int, settings: StoreSettings, unfiled: "Unfiled",
          probe: Callable[[np.ndarray, list[bytes]], np.ndarray],
          find: Callable[[str], tuple[Message | Retired, int | None] | None],
          next_seqs: Callable[[int], np.ndarray], new_id: Callable[[], str],
          counters: dict[str, int]) -> Admitted:
    """Decide a batch (module docs). ``probe``: which id hashes the id index may hold;
    ``find``: an id's newest record; ``next_seqs``: seqs for the new records."""
    n = batch.n
    res = BatchResult.sized(n)
    if not n:
        return Admitted(res, [])
    if unfiled.count + n > settings.unfiled_max:
        raise Overloaded(f"{unfiled.count} messages wait to be filed (unfiled_max={settings.unfiled_max})")
    id_ends = batch.id_end.astype(np.int64)
    if bool((np.diff(id_ends, prepend=0) == 0).any()):  # ids the server makes (rare: the SDK names them)
        ids = [i or new_id() for i in batch.id_list()]
        made = Batch.build(batch.subject_list(), batch.payload_list(), ids, batch.deliver_at_ms)
        batch = batch.replace(ids=made.ids, id_end=made.id_end)
    codes, reasons = batch.validate(now_ms=now_ms, limits=settings.limits)
    for i, reason in reasons.items():
        res.refuse(i, int(codes[i]), reason)
    ok = codes == 0
    id_bytes = batch.id_bytes_list()
    hashes = key_hashes(id_bytes)
    # an id twice in one batch: the first stands, the others are refused
    order = np.argsort(hashes, kind="stable")
    twice = np.zeros(n, bool)
    twice[order[1:][hashes[order][1:] == hashes[order][:-1]]] = True
    for i in np.flatnonzero(twice & ok).tolist():
        res.refuse(i, ALREADY_EXISTS, f"id {batch.id(i)!r} appears twice in one batch")
        ok[i] = False
    # ids seen before (candidates: the 8-byte hash may collide; confirmed on the record)
    cand = probe(hashes, id_bytes)
    if unfiled:  # accepted and not filed yet (not in the id index)
        cand |= unfiled.holds(hashes)
    for i in np.flatnonzero(cand & ok).tolist():
        found = find(batch.id(i))
        if found is not None:
            ok[i] = False
            _answer_seen(batch, i, found[0], res, now_ms, counters)
    keep = np.flatnonzero(ok)
    if not len(keep):
        return Admitted(res, [])
    seqs = next_seqs(len(keep))
    stored = batch.take(keep)
    stored = stored.replace(seq=seqs, store_ms=now_ms, effective_ms=stored.deliver_at_ms)
    kept_hashes = hashes[keep]
    frames, start = [], 0
    for part in split_frames(stored, settings.frame_bytes_max):
        frames.append((part, kept_hashes[start:start + part.n]))
        start += part.n
    res.seqs[keep] = seqs
    res.deliver_at_ms[keep] = stored.deliver_at_ms
    counters["accepted"] += len(keep)
    return Admitted(res, frames)


def _answer_seen(batch: Batch, i: int, prior: Message | Retired, res: BatchResult, now_ms: int,
                 counters: dict[str, int]) -> None:
    """Message ``i`` of ``batch`` has an id seen before (``prior``, confirmed on the record):
    answered as a duplicate, or refused."""
    if isinstance(prior, Retired):  # delivered or cancelled, inside the dedupe window
        counters["duplicates"] += 1
        res.seqs[i], res.deliver_at_ms[i], res.duplicates[i] = prior.seq, batch.deliver_at_ms[i], 1
        return
    mine = records.message_at(batch, i)
    mine = Message(seq=0, store_ms=now_ms, deliver_at_ms=mine.deliver_at_ms, msg_id=mine.msg_id,
                   subject=mine.subject, payload=mine.payload, tags=mine.tags, properties=mine.properties)
    if prior.kind == KIND_CANCEL:
        res.refuse(i, ALREADY_EXISTS, f"id {mine.msg_id!r} was cancelled; a cancelled id cannot be reused")
        return
    if not same_content(prior, mine):
        res.refuse(i, ALREADY_EXISTS, f"id {mine.msg_id!r} was used for another message")
        return
    counters["duplicates"] += 1
    res.seqs[i], res.deliver_at_ms[i], res.duplicates[i] = prior.seq, prior.deliver_at_ms, 1


# ---------------------------------------------------------------------- accepted, not filed yet


@dataclass(frozen=True, slots=True)
class UnfiledFrame:
    offset: int
    end: int
    batch: Batch
    hashes: np.ndarray
    first_due_ms: int  # its earliest deliver_at_ms (the filer's linger: ``Unfiled.earliest_due_ms``)


class Unfiled:
    """Frames appended to the message log and not filed yet, in log order, with their decoded
    batches and id hashes (``unfiled_max`` records at most): filing takes them from memory,
    and an id lookup finds them before the id index does."""

    def __init__(self) -> None:
        self.frames: deque[UnfiledFrame] = deque()
        self.count = 0  # records
        # id hash -> records waiting with it (a cancel shares its target's id): what ``holds``
        # answers from, kept as frames come and go; a send asks about its ids whatever the
        # number of frames waiting (the filer lingers: several calls' frames wait together)
        self._hash_counts: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.frames)

    def append(self, offset: int, end: int, batch: Batch, hashes: np.ndarray) -> None:
        first = int(batch.deliver_at_ms.min()) if batch.n else 0
        self.frames.append(UnfiledFrame(offset, end, batch, hashes, first))
        self.count += batch.n
        self._tally(hashes)

    def earliest_due_ms(self) -> int | None:
        """The earliest due time of a record accepted and not filed yet (None: none)."""
        return min((u.first_due_ms for u in self.frames), default=None)

    def popleft(self) -> UnfiledFrame:
        u = self.frames.popleft()
        self.count -= u.batch.n
        counts = self._hash_counts
        for h in u.hashes.tolist():
            left = counts[h] - 1
            if left:
                counts[h] = left
            else:
                del counts[h]
        return u

    def cut(self, offset: int) -> None:
        """Forget the frames at or after ``offset`` (the log was truncated there)."""
        kept = [u for u in self.frames if u.offset < offset]
        self.frames = deque(kept)
        self.count = sum(u.batch.n for u in kept)
        self._hash_counts = {}
        for u in kept:
            self._tally(u.hashes)

    def _tally(self, hashes: np.ndarray) -> None:
        counts = self._hash_counts
        for h in hashes.tolist():
            counts[h] = counts.get(h, 0) + 1

    def holds(self, hashes: np.ndarray) -> np.ndarray:
        """For each of ``hashes``: whether a record waiting has that id hash (an ``isin`` over
        every waiting frame's hashes, without joining and sorting them at each send)."""
        return np.fromiter(map(self._hash_counts.__contains__, hashes.tolist()), bool, len(hashes))

    def due_ms(self) -> np.ndarray:
        return np.concatenate([u.batch.deliver_at_ms for u in self.frames]).astype(np.int64) \
            if self.frames else np.zeros(0, np.int64)

    def batch_at(self, offset: int) -> Batch | None:
        for u in self.frames:
            if u.offset == offset:
                return u.batch
        return None

    def lookup(self, h: int) -> tuple[int, int] | None:
        """(seq, message-log offset) of the newest record with id hash ``h``, or None: the
        hash counts say whether one waits; only then are the waiting frames' hash arrays
        scanned, newest first (a lookup by id, a cancel, a duplicate's confirmation)."""
        if int(h) not in self._hash_counts:
            return None
        hh = np.uint64(h)
        for u in reversed(self.frames):
            at = np.flatnonzero(u.hashes == hh)
            if len(at):
                return int(u.batch.seq[int(at[-1])]), u.offset
        return None


# ---------------------------------------------------------------------- disk bounds


def write_bytes_bound(batch: Batch, *, settings: StoreSettings, id_allocation_bytes: int,
                      new_buckets_bytes: int) -> int:
    """Disk bytes that accepting ``batch`` and filing it take at most: what the disk
    watermark admits or refuses before ``accept`` (node/store/diskspace.py). Its
    message-log frames (plain layout, one log header per ``frame_bytes_max`` part); its
    schedule-log copy (at most one frame per due second and due-ordered run, each with its
    own headers, subject table and index entry); one id-index entry per message and the
    allocation steps the id index takes for them (``id_allocation_bytes``); the heads file
    of each bucket that does not exist yet (``new_buckets_bytes``); and one partly used
    block per file."""
    n = batch.n
    body = records.encoded_bytes_max(batch)
    framing = LOG_HEADER_SIZE + BATCH_HEADER_SIZE + records.subject_table_bytes(batch)
    parts = 1 + len(batch.payloads) // settings.frame_bytes_max
    due = batch.deliver_at_ms.astype(np.int64)
    runs = 1 + int(np.count_nonzero(np.diff(due) < 0))
    seconds = len(np.unique(due // 1000))
    frames = min(n, seconds * min(runs, FILE_SORTED_RUNS_MAX))
    return (body + parts * framing                                   # message log
            + body + frames * (framing + SCHEDULE_ENTRY_SIZE)       # schedule log
            + n * ID_ENTRY_SIZE + id_allocation_bytes
            + new_buckets_bytes + FILES_PER_WRITE * FILE_BLOCK_BYTES)


def bucket_starts_of(due_ms: np.ndarray, *, persisted_completed_ms: int, bucket_ms: int) -> list[int] | None:
    """The schedule buckets these due times are filed in (under their effective time); None
    when there are more than ``BUCKETS_LOOKED_UP_MAX`` (each then counts as new)."""
    eff = np.maximum(due_ms, persisted_completed_ms)
    starts = np.unique(eff - eff % bucket_ms).tolist()
    return None if len(starts) > BUCKETS_LOOKED_UP_MAX else starts


def new_buckets_bytes(count: int, bucket_ms: int) -> int:
    """What creating ``count`` schedule buckets takes: a folder and three files each, the
    heads file allocated whole."""
    return count * (HEADS_HEADER_SIZE + 4 * (bucket_ms // 1000) + FILES_PER_BUCKET * FILE_BLOCK_BYTES)


def unfiled_bytes_bound(unfiled: Unfiled, *, settings: StoreSettings, log_bytes: int, id_allocation_bytes: int,
                        new_buckets_bytes: int) -> int:
    """Disk bytes that filing what is accepted and not filed yet will take at most (its
    message-log frames are written already, ``log_bytes`` of them): per record at most one
    schedule frame with its headers, a subject table of the longest subject and an index
    entry, plus its id entry and the id index's allocation steps, new buckets; the frames'
    bodies are at most the message-log bytes."""
    framing = (LOG_HEADER_SIZE + BATCH_HEADER_SIZE + 2 + settings.limits.subject_bytes_max + SCHEDULE_ENTRY_SIZE)
    return (log_bytes + unfiled.count * (framing + ID_ENTRY_SIZE) + id_allocation_bytes + new_buckets_bytes
            + FILES_PER_WRITE * FILE_BLOCK_BYTES)


def cancel_bytes_bound(msg_id: str, *, settings: StoreSettings, id_allocation_bytes: int) -> int:
    """``write_bytes_bound`` of the tombstone ``cancel(msg_id)`` appends and files."""
    limits = settings.limits
    framing = LOG_HEADER_SIZE + BATCH_HEADER_SIZE + 2 + limits.subject_bytes_max
    body = BATCH_HEADER_SIZE + 2 + limits.subject_bytes_max + COLUMN_BYTES + 8 + len(msg_id.encode())
    return (2 * (body + framing) + SCHEDULE_ENTRY_SIZE + ID_ENTRY_SIZE + id_allocation_bytes
            + FILES_PER_WRITE * FILE_BLOCK_BYTES)
