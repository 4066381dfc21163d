"""Arrow record batches from log frames: one row per message, built a batch at a time.

Every frame of a message, schedule or real-time log holds one ``cluster.codec.Batch``;
every frame of a dispatch log one ``cluster.codec.DispatchBatch``. This module turns the
frames of one segment (``cluster.spark.scan``) into ``pyarrow.RecordBatch`` es of the data
source's schema without a Python object per message: frames are decoded with the one
codec, collected until ``rows_max`` rows (or ``blob_bytes_max`` bytes of ids, payloads
and extras) are pending, merged with ``Batch.concat`` and handed to Arrow as numpy
columns and blob buffers (ids and payloads are zero-copy ``from_buffers`` views of the
merged blobs; subjects, kinds and outcomes are ``take`` s from small tables).

Per message Python work happens only for messages that carry tags or properties (their
extras are parsed by ``cluster.codec.decode_extra``); everything else is numpy/Arrow.

Rows of one frame share its ``offset`` (global byte offset of the frame) and
``frame_bytes`` (its framed size): ``(segment, offset)`` names the batch a message was
stored in, ``seq`` the message. A frame the scanner rejected (torn, corrupt) or whose
body is not a valid batch (``undecodable: ...``: the codec's structural checks, a
tombstone whose payload is not a u64, an id or extra that is not UTF-8) becomes one row
whose ``error`` is set and whose message columns are null; rows stay in log order.

Example: a segment holding a frame of 3 messages at offset 0 (400 bytes) and a torn
tail at 400 gives one record batch of 3 rows (``offset`` 0, 0, 0; ``frame_bytes`` 400)
and one of 1 row (``offset`` 400, ``error`` "torn tail: ...").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cluster.codec import KIND_CANCEL, OUTCOME_DEAD_LETTER, OUTCOME_OK, Batch, DispatchBatch, decode_extra
from cluster.errors import InvalidArgument

from .scan import Frame

MESSAGE_COLUMNS = ("node", "log", "segment", "offset", "frame_bytes", "kind", "seq", "attempts", "store_ms",
                   "deliver_at_ms", "effective_ms", "bucket_start_ms", "id", "subject", "tags", "properties",
                   "payload_bytes", "payload", "cancels_seq", "error")
DISPATCH_COLUMNS = ("node", "log", "segment", "offset", "frame_bytes", "seq", "effective_ms", "dispatched_ms",
                    "outcome", "error")
KIND_NAMES = ("unknown", "message", "cancel")              # by codec kind (1, 2)
OUTCOME_NAMES = {OUTCOME_OK: "delivered", OUTCOME_DEAD_LETTER: "dead_letter"}
ROWS_MAX = 65_536                     # rows per record batch (a frame is never split): the reader's bound, no setting
BLOB_BYTES_MAX = 64 * 1024 * 1024     # id and payload bytes pending before a record batch is cut

_KIND_TABLE = pa.array(KIND_NAMES)
_OUTCOME_TABLE = pa.array([OUTCOME_NAMES[k] for k in sorted(OUTCOME_NAMES)])


@dataclass(frozen=True, slots=True)
class Where:
    """The constant columns of one segment's rows."""

    node: str
    log: str
    segment: str
    bucket_start_ms: int | None = None   # schedule log only


def _const(value, n: int, type_: pa.DataType) -> pa.Array:
    """``value`` n times (or n nulls), built from buffers: ``pa.repeat`` of a string costs ~80 ns a row."""
    if value is None:
        return pa.nulls(n, type_)
    if type_ == pa.string():
        raw = value.encode()
        offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(raw))
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(raw * n))
    return pa.array(np.full(n, value, np.int64), type_)


def _lengths(ends: np.ndarray) -> np.ndarray:
    """Item lengths (i64) from a codec ``*_end`` column."""
    out = ends.astype(np.int64)
    if len(out) > 1:
        out[1:] -= out[:-1].copy()
    return out


def _offsets(ends: np.ndarray) -> pa.Buffer:
    """Arrow i32 offsets (n + 1 entries) from ends (i64, running totals)."""
    out = np.zeros(len(ends) + 1, np.int32)
    out[1:] = ends
    return pa.py_buffer(out)


def _error_batch(schema: pa.Schema, where: Where, fr: Frame, error: str) -> pa.RecordBatch:
    """One row naming the bad bytes; every record column null."""
    known = {"node": where.node, "log": where.log, "segment": where.segment, "offset": fr.offset,
             "frame_bytes": fr.size, "bucket_start_ms": where.bucket_start_ms, "error": error}
    return pa.RecordBatch.from_arrays([pa.array([known.get(f.name)], f.type) for f in schema], schema=schema)


# ---------------------------------------------------------------------- message-shaped logs


@dataclass(slots=True)
class _Extras:
    """Parsed tags and properties of one frame, flattened (counts per message)."""

    tag_counts: np.ndarray
    tags: list[str]
    prop_counts: np.ndarray
    keys: list[str]
    values: list[str]


@dataclass(slots=True)
class _Decoded:
    """One good frame: its batch and what the rows need beyond the columns."""

    frame: Frame
    batch: Batch
    extras: _Extras | None       # None: no message of the frame has tags or properties
    cancels: np.ndarray | None   # i64 target seq per message (0 for messages); None: no tombstone


def _extras_of(b: Batch) -> _Extras | None:
    """Tags and properties of every message of ``b``; each distinct extras blob is parsed once."""
    if not b.extras:
        return None
    lens = _lengths(b.extra_end)
    has = np.flatnonzero(lens)
    blob = b.extras
    parts = [blob[e - k:e] for e, k in zip(b.extra_end[has].tolist(), lens[has].tolist())]
    parsed = {raw: decode_extra(raw) for raw in set(parts)}
    ex = _Extras(np.zeros(b.n, np.int32), [], np.zeros(b.n, np.int32), [], [])
    ex.tag_counts[has] = [len(parsed[raw][0]) for raw in parts]
    ex.prop_counts[has] = [len(parsed[raw][1]) for raw in parts]
    for raw in parts:
        tags, props = parsed[raw]
        ex.tags += tags
        for k, v in props:
            ex.keys.append(k)
            ex.values.append(v)
    return ex


def _decode(fr: Frame, *, extras: bool = True) -> _Decoded:
    """Decode a good frame with the codec and check what ``Batch.decode`` leaves to readers:
    ids and extras are UTF-8 text, a tombstone's payload is a u64. Raises ``InvalidArgument``.
    ``extras=False``: tags and properties are not wanted (not parsed, so not checked)."""
    b = Batch.decode(fr.body)
    if not b.ids.isascii():  # rare: producers send ASCII ids; check each id, not just the blob
        try:
            for raw in b.id_bytes_list():
                raw.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("batch", "an id is not UTF-8") from None
    cancels = b.cancel_targets().view(np.int64) if bool((b.kind == KIND_CANCEL).any()) else None
    return _Decoded(fr, b, _extras_of(b) if extras else None, cancels)


class _Pending:
    """Decoded frames waiting to become one record batch."""

    def __init__(self) -> None:
        self.frames: list[_Decoded] = []
        self.rows = 0
        self.blob_bytes = 0

    def add(self, d: _Decoded) -> None:
        self.frames.append(d)
        self.rows += d.batch.n
        self.blob_bytes += len(d.batch.ids) + len(d.batch.payloads)

    def take(self, schema: pa.Schema, where: Where, with_payload: bool) -> pa.RecordBatch:
        batches = [d.batch for d in self.frames]
        counts = np.fromiter((b.n for b in batches), np.int64, len(batches))
        n = self.rows

        def column(name: str) -> np.ndarray:
            if len(batches) == 1:
                return getattr(batches[0], name)
            return np.concatenate([getattr(b, name) for b in batches])

        def ends(name: str, blob: str) -> np.ndarray:
            """Running ends over the frames' blobs laid end to end."""
            sizes = np.fromiter((len(getattr(b, blob)) for b in batches), np.int64, len(batches))
            shift = np.repeat(np.cumsum(sizes) - sizes, counts)
            return column(name).astype(np.int64) + shift

        table: dict[str, int] = {}
        subject_idx = np.concatenate([np.array([table.setdefault(x, len(table)) for x in b.subjects], np.int32)[
            b.subject_idx] for b in batches])
        kind = column("kind")
        cancel = kind == KIND_CANCEL
        payload_ends = ends("payload_end", "payloads")
        payload_bytes = _lengths(payload_ends)
        any_cancel = any(d.cancels is not None for d in self.frames)
        if any_cancel:
            targets = np.concatenate([np.zeros(d.batch.n, np.int64) if d.cancels is None else d.cancels
                                      for d in self.frames])
            cancels = pa.array(targets, pa.int64(), mask=~cancel)
            payload_bytes[cancel] = 0
        else:
            cancels = pa.nulls(n, pa.int64())
        if with_payload and "payload" in schema.names:
            valid = pa.py_buffer(np.packbits(~cancel, bitorder="little")) if any_cancel else None
            payload = pa.Array.from_buffers(pa.binary(), n, [valid, _offsets(payload_ends),
                                                             pa.py_buffer(b"".join(b.payloads for b in batches))])
        else:
            payload = pa.nulls(n, pa.binary())
        extras: list[tuple[pa.Array, pa.Array]] = []

        def extra(k: int) -> pa.Array:
            if not extras:
                extras.append(self._extras(counts))
            return extras[0][k]

        # only the schema's columns are built (a reader given a narrower schema saves the rest)
        cols = {
            "node": lambda: _const(where.node, n, pa.string()),
            "log": lambda: _const(where.log, n, pa.string()),
            "segment": lambda: _const(where.segment, n, pa.string()),
            "offset": lambda: pa.array(np.repeat(np.fromiter((d.frame.offset for d in self.frames), np.int64),
                                                 counts)),
            "frame_bytes": lambda: pa.array(np.repeat(np.fromiter((d.frame.size for d in self.frames), np.int32),
                                                      counts)),
            "kind": lambda: _KIND_TABLE.take(pa.array(kind)),
            "seq": lambda: pa.array(column("seq").view(np.int64)),
            "attempts": lambda: pa.array(column("attempts").astype(np.int32)),
            "store_ms": lambda: pa.array(column("store_ms")),
            "deliver_at_ms": lambda: pa.array(column("deliver_at_ms")),
            "effective_ms": lambda: pa.array(column("effective_ms")),
            "bucket_start_ms": lambda: _const(where.bucket_start_ms, n, pa.int64()),
            "id": lambda: pa.StringArray.from_buffers(n, _offsets(ends("id_end", "ids")),
                                                      pa.py_buffer(b"".join(b.ids for b in batches))),
            "subject": lambda: pa.array(list(table), pa.string()).take(pa.array(subject_idx)),
            "tags": lambda: extra(0),
            "properties": lambda: extra(1),
            "payload_bytes": lambda: pa.array(payload_bytes.astype(np.int32)),
            "payload": lambda: payload,
            "cancels_seq": lambda: cancels,
            "error": lambda: pa.nulls(n, pa.string()),
        }
        return pa.RecordBatch.from_arrays([cols[f.name]() for f in schema], schema=schema)

    def _extras(self, counts: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """``tags`` (list<string>) and ``properties`` (map<string,string>) of every pending row."""
        n = self.rows
        if all(d.extras is None for d in self.frames):
            empty = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(np.zeros(n + 1, np.int32))])
            return (pa.ListArray.from_arrays(empty, pa.array([], pa.string())),
                    pa.MapArray.from_arrays(empty, pa.array([], pa.string()), pa.array([], pa.string())))
        tag_counts, prop_counts, tags, keys, values = [], [], [], [], []
        for d, k in zip(self.frames, counts.tolist()):
            ex = d.extras
            if ex is None:
                tag_counts.append(np.zeros(k, np.int32))
                prop_counts.append(np.zeros(k, np.int32))
                continue
            tag_counts.append(ex.tag_counts)
            prop_counts.append(ex.prop_counts)
            tags += ex.tags
            keys += ex.keys
            values += ex.values

        def offsets(parts: list[np.ndarray]) -> pa.Array:
            return pa.Array.from_buffers(pa.int32(), n + 1, [None, _offsets(np.cumsum(np.concatenate(parts)))])

        return (pa.ListArray.from_arrays(offsets(tag_counts), pa.array(tags, pa.string())),
                pa.MapArray.from_arrays(offsets(prop_counts), pa.array(keys, pa.string()),
                                        pa.array(values, pa.string())))


def _only(d: _Decoded, code: int, extras: bool) -> _Decoded | None:
    """The messages of kind ``code`` of a decoded frame (None if it has none)."""
    keep = np.flatnonzero(d.batch.kind == code)
    if len(keep) == d.batch.n:
        return d
    if not len(keep):
        return None
    b = d.batch.take(keep)
    return _Decoded(d.frame, b, _extras_of(b) if extras else None, None if d.cancels is None else d.cancels[keep])


def message_batches(frames: Iterable[Frame], schema: pa.Schema, where: Where, *, with_payload: bool,
                    rows_max: int = ROWS_MAX, kind: str | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of ``schema`` (the message schema, or some of its columns) for the frames
    of one segment. ``kind`` ("message" | "cancel"): only the rows of that kind - frames without
    one cost a decode and nothing else, and error rows (whose kind is null) are left out too."""
    pending = _Pending()
    extras = "tags" in schema.names or "properties" in schema.names
    code = KIND_NAMES.index(kind) if kind in KIND_NAMES else -1
    for fr in frames:
        if fr.body is None:
            if kind is not None:
                continue
            error = fr.error
        else:
            try:
                d = _decode(fr, extras=extras)
            except InvalidArgument as e:
                if kind is not None:
                    continue
                error = f"undecodable: {e}"
            else:
                if kind is not None:
                    d = _only(d, code, extras)
                if d is not None and d.batch.n:
                    pending.add(d)
                    if pending.rows >= rows_max or pending.blob_bytes >= BLOB_BYTES_MAX:
                        yield pending.take(schema, where, with_payload)
                        pending = _Pending()
                continue
        if pending.rows:  # keep log order: what came before the bad bytes first
            yield pending.take(schema, where, with_payload)
            pending = _Pending()
        yield _error_batch(schema, where, fr, error)
    if pending.rows:
        yield pending.take(schema, where, with_payload)


# ---------------------------------------------------------------------- dispatch log


def _dispatch_batch(schema: pa.Schema, where: Where, frames: list[Frame], recs: list[DispatchBatch]) -> pa.RecordBatch:
    counts = np.fromiter((r.n for r in recs), np.int64, len(recs))
    n = int(counts.sum())
    outcomes = np.repeat(np.fromiter((r.outcome for r in recs), np.uint8, len(recs)), counts)
    cols = {
        "node": lambda: _const(where.node, n, pa.string()),
        "log": lambda: _const(where.log, n, pa.string()),
        "segment": lambda: _const(where.segment, n, pa.string()),
        "offset": lambda: pa.array(np.repeat(np.fromiter((f.offset for f in frames), np.int64, len(frames)), counts)),
        "frame_bytes": lambda: pa.array(np.repeat(np.fromiter((f.size for f in frames), np.int32, len(frames)),
                                                  counts)),
        "seq": lambda: pa.array(np.concatenate([r.seq for r in recs]).view(np.int64)),
        "effective_ms": lambda: pa.array(np.concatenate([r.effective_ms for r in recs])),
        "dispatched_ms": lambda: pa.array(np.repeat(np.fromiter((r.dispatched_ms for r in recs), np.int64,
                                                                len(recs)), counts)),
        "outcome": lambda: _OUTCOME_TABLE.take(pa.array(outcomes)),
        "error": lambda: pa.nulls(n, pa.string()),
    }
    return pa.RecordBatch.from_arrays([cols[f.name]() for f in schema], schema=schema)


def dispatch_batches(frames: Iterable[Frame], schema: pa.Schema, where: Where, *,
                     rows_max: int = ROWS_MAX) -> Iterator[pa.RecordBatch]:
    """Record batches of ``schema`` (the dispatch schema) for the frames of one segment."""
    good: list[Frame] = []
    recs: list[DispatchBatch] = []
    rows = 0
    for fr in frames:
        if fr.body is None:
            error = fr.error
        else:
            try:
                r = DispatchBatch.decode(fr.body)
            except InvalidArgument as e:
                error = f"undecodable: {e}"
            else:
                if r.n:
                    good.append(fr)
                    recs.append(r)
                    rows += r.n
                    if rows >= rows_max:
                        yield _dispatch_batch(schema, where, good, recs)
                        good, recs, rows = [], [], 0
                continue
        if recs:
            yield _dispatch_batch(schema, where, good, recs)
            good, recs, rows = [], [], 0
        yield _error_batch(schema, where, fr, error)
    if recs:
        yield _dispatch_batch(schema, where, good, recs)
