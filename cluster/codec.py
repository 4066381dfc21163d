"""The one record codec of Hourglass: a columnar *batch* of messages.

Every hop handles batches, never single messages (``shared/ARCHITECTURE.md``, "Hot
path"): the SDK builds one ``Batch``, ``SendBatch`` carries its bytes, the delay node
appends them to its message log as one frame, files sub-batches per due second,
fires and forwards sub-batches, the real-time node stores them as they arrive and
``Pull`` hands them to the consumer SDK, which decodes lazily. Per-message work
happens only inside C-speed calls (numpy, ``bytes.join``, ``struct``).

Body layout, version 2 (little-endian; ``docs/format.md`` is the reference)::

    off  size
    0    u8   version (= 2)
    1    u8   flags (0; reserved)
    2    u16  n_subjects
    4    u32  n                 messages in the batch
    8    u32  ids_len           bytes of the id blob
    12   u32  payloads_len      bytes of the payload blob
    16   u32  extras_len        bytes of the extras blob (tags, properties)
    20   u32  subjects_len      bytes of the subject table
    24   columns, each n entries, in this order:
           u64 seq               sequence given by the node that stored it (0 on the wire)
           i64 deliver_at_ms     due time, absolute UTC ms
           i64 effective_ms      schedule time (>= deliver_at_ms on a delay node; = deliver_at_ms elsewhere)
           i64 store_ms          when the node storing this copy accepted it
           u32 id_end            end of message i's id in the id blob (start = previous end)
           u32 payload_end       end of its payload in the payload blob
           u32 extra_end         end of its extras in the extras blob
           u16 attempts          delivery attempts so far
           u16 subject_idx       index into the subject table
           u8  kind              1 message, 2 cancel tombstone (payload = u64 target seq)
         subject table: n_subjects x (u16 len + UTF-8 bytes)
         id blob (ASCII), payload blob, extras blob

    49 bytes of columns per message; every message of a batch is addressed by its
    index. Extras of one message: ``u8 ntags, ntags x (u8 len + bytes), u8 nprops,
    nprops x (u16 len + key, u32 len + value)``; empty when it has neither.

``Batch.decode`` checks the structure (sizes add up, ends do not go backwards, every
subject index and kind is valid) and raises ``InvalidArgument`` otherwise; a frame's
CRC (``node.store.log``) guards the bytes on disk. ``validate`` applies the producer
limits to a whole batch with numpy and returns one code per message.

Example::

    b = Batch.build(["orders"] * 2, [b"a", b"bc"], ["id-1", "id-2"], [1000, 2000])
    raw = b.encode()
    c = Batch.decode(raw)
    c.id(1), c.payload(1), c.subject(1)      # -> ('id-2', b'bc', 'orders')
    c.take(np.array([1])).id_list()          # -> ['id-2']
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterable, Sequence
from itertools import chain
from dataclasses import dataclass

import numpy as np

from cluster.errors import InvalidArgument

VERSION = 2
KIND_MESSAGE = 1
KIND_CANCEL = 2

HEADER = struct.Struct("<BBHIIIII")
HEADER_SIZE = HEADER.size  # 24
COLUMN_BYTES = 8 * 4 + 4 * 3 + 2 * 2 + 1  # 49 per message
# flags bit 0: the columns are *packed* (docs/format.md "Packed columns"): each column stored
# as offsets from a base in the fewest bytes that hold them (0 = every value the same). The
# delay node packs its schedule frames (``encode(packed=True)``), where most columns are
# constant or span under a second; every reader decodes both layouts.
FLAG_PACKED = 0x01
PACKED_COLUMNS = ("seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end", "payload_end", "extra_end",
                  "attempts", "subject_idx", "kind")
_PACKED_DTYPE = {"seq": np.uint64, "deliver_at_ms": np.int64, "effective_ms": np.int64, "store_ms": np.int64,
                 "id_end": np.uint32, "payload_end": np.uint32, "extra_end": np.uint32, "attempts": np.uint16,
                 "subject_idx": np.uint16, "kind": np.uint8}
_PACKED_ENDS = {"id_end": "ids", "payload_end": "payloads", "extra_end": "extras"}
_PACKED_MATRIX_ROWS = PACKED_COLUMNS[1:]  # every packed column but seq, as i64 rows of one matrix
_PACKED_MATRIX_ENDS = tuple(_PACKED_MATRIX_ROWS.index(c) for c in _PACKED_ENDS)
_PACKED_MATRIX_EFFECTIVE = _PACKED_MATRIX_ROWS.index("effective_ms")
_PACKED_MATRIX_DELIVER = _PACKED_MATRIX_ROWS.index("deliver_at_ms")
_PACKED_BASE = 0x80  # descriptor bit: an 8-byte base follows (absent: the base is 0)
_PACKED_WIDTHS = (0, 1, 2, 4, 8)
PACKED_N_MIN = 8  # below this the plain layout is as small (the descriptor and bases cost up to 90 bytes)
N_MAX = 1 << 20
SUBJECTS_MAX = 65535

# codes per message (the values of hourglass.v1.Code)
OK = 0
INVALID_ARGUMENT = 1
PAYLOAD_TOO_LARGE = 2

# The one subject rule (docs/api.md "Subjects"; consumer group names follow it too): ASCII
# letters, digits, '.', '_' and '-', starting with a letter or digit, at most
# ``subject_bytes_max`` bytes. Matched whole (``fullmatch``): ``re.match`` with ``$`` takes
# "orders.a\n", since ``$`` also matches before a trailing newline. Every check of a subject
# (codec, SDK, CLI, meta server, nodes, grants) calls ``subject_problem`` / ``check_subject``.
SUBJECT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")
SUBJECT_BYTES_MAX = 200  # the default ``Limits.subject_bytes_max``, and the longest subject the meta servers route
SUBJECT_WIRE_BYTES_MAX = 0xFFFF  # the subject table's u16 length: no node takes a longer subject, whatever its limit

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_EMPTY_U32 = np.zeros(0, np.uint32)


DAY_MS = 24 * 3600 * 1000
# How far ahead a message may be due, the one default (docs/api.md, "Limits"): 732 days,
# so that "two years ahead" holds from any day (two calendar years are at most 731 days)
# with a day to spare. A node takes another value from ``HOURGLASS_DELAY_HORIZON_MS``.
DELAY_HORIZON_MS_DEFAULT = 732 * DAY_MS


def span_ms(ms: int) -> str:
    """``63244800000 ms (732 days)``: a span in ms, in days as well once it is that long."""
    if abs(ms) < DAY_MS:
        return f"{ms} ms"
    return f"{ms} ms ({ms // DAY_MS} days)" if ms % DAY_MS == 0 else f"{ms} ms ({ms / DAY_MS:.3f} days)"


@dataclass(frozen=True, slots=True)
class Limits:
    """Every producer-visible limit, with a name. Defaults are the documented ones
    (``node.config.NodeSettings`` takes its defaults from here)."""

    subject_bytes_max: int = SUBJECT_BYTES_MAX
    id_bytes_max: int = 128
    payload_bytes_max: int = 4 * 1024 * 1024
    tags_max: int = 16
    tag_bytes_max: int = 64
    properties_max: int = 32
    property_key_bytes_max: int = 128
    property_value_bytes_max: int = 4096
    delay_horizon_ms: int = DELAY_HORIZON_MS_DEFAULT  # deliver_at_ms - now_ms <= this
    batch_messages_max: int = 10_000
    batch_bytes_max: int = 64 * 1024 * 1024


DEFAULT_LIMITS = Limits()


def _starts(ends: np.ndarray) -> np.ndarray:
    out = np.empty(len(ends), np.int64)
    if len(ends):
        out[0] = 0
        out[1:] = ends[:-1]
    return out


def _merged_subjects(batches: Sequence["Batch"]) -> tuple[tuple[str, ...], np.ndarray]:
    """One subject table for ``batches`` and the subject_idx of all their messages, in order,
    numbered in it (``Batch.concat``, ``Batch.gather``)."""
    first = batches[0].subjects
    if all(b.subjects is first or b.subjects == first for b in batches):  # one table (the usual case)
        return first, np.concatenate([b.subject_idx for b in batches])
    # every table's names in one list, numbered in one pass; then one gather
    flat = list(chain.from_iterable([b.subjects for b in batches]))
    table = {x: i for i, x in enumerate(dict.fromkeys(flat))}  # first appearance order
    number = np.fromiter(map(table.__getitem__, flat), np.uint16, len(flat))
    sizes = np.fromiter((len(b.subjects) for b in batches), np.int64, len(batches))
    base = np.repeat(np.cumsum(sizes) - sizes, [b.n for b in batches])
    local = np.concatenate([b.subject_idx for b in batches]).astype(np.int64)
    return tuple(table), number[base + local]


_GATHER_WHOLE_MAX = 1024  # Batch.gather joins sources this small whole; larger ones are picked first


class _Picked:
    """Messages ``idx`` of a large source of ``Batch.gather`` (a loaded second): their columns
    indexed, and for each blob its start and end offsets in the source's own blob (``starts``
    by end column, ``*_end`` the ends: not a partition of the blob, as a Batch's are), so
    their bytes are cut once, with the other sources', never copied into a taken batch first."""

    __slots__ = ("n", "seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "kind", "subject_idx",
                 "subjects", "ids", "payloads", "extras", "id_end", "payload_end", "extra_end", "starts")

    def __init__(self, b: "Batch", idx: np.ndarray) -> None:
        self.n = len(idx)
        for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "kind", "subject_idx"):
            setattr(self, name, getattr(b, name)[idx])
        self.subjects = b.subjects
        self.starts = {}
        for name, blob_name in (("id_end", "ids"), ("payload_end", "payloads"), ("extra_end", "extras")):
            blob = getattr(b, blob_name)
            setattr(self, blob_name, blob)
            if not blob:
                setattr(self, name, np.zeros(self.n, np.int64))
                self.starts[name] = np.zeros(self.n, np.int64)
                continue
            ends = getattr(b, name)
            setattr(self, name, ends[idx].astype(np.int64))
            st = ends[idx - 1].astype(np.int64)  # idx - 1 is -1 for the first message: its start is 0
            st[idx == 0] = 0
            self.starts[name] = st


def _pieces(blob, ends: np.ndarray) -> list:
    """The consecutive pieces of ``blob`` that end at ``ends`` (one comprehension)."""
    if not len(ends):
        return []
    e = ends.tolist()
    return [blob[a:b] for a, b in zip([0] + e[:-1], e)]


def _ends_of(lengths: Iterable[int], n: int) -> np.ndarray:
    lens = np.fromiter(lengths, np.int64, n)
    ends = np.cumsum(lens)
    if n and ends[-1] >= 1 << 32:
        raise InvalidArgument("batch", "a blob exceeds 4 GiB")
    return ends.astype(np.uint32)


def _col(v, n: int, dtype, default=0) -> np.ndarray:
    if v is None:
        return np.full(n, default, dtype)
    if isinstance(v, (int, np.integer)):
        return np.full(n, v, dtype)
    a = np.asarray(v, dtype=dtype)
    if a.shape != (n,):
        raise InvalidArgument("batch", f"column has {a.shape} entries, expected {n}")
    return a


def encode_extra(tags: Sequence[str] = (), properties: Iterable[tuple[str, str]] = ()) -> bytes:
    """Extras of one message (tags, properties); b"" when it has neither."""
    props = list(properties.items() if isinstance(properties, dict) else properties)
    if not tags and not props:
        return b""
    if len(tags) > 255 or len(props) > 255:
        raise InvalidArgument("tags", "at most 255 tags and 255 properties")
    parts = [bytes([len(tags)])]
    for t in tags:
        tb = t.encode()
        if len(tb) > 255:
            raise InvalidArgument("tag", f"{len(tb)} bytes exceeds 255")
        parts += (bytes([len(tb)]), tb)
    parts.append(bytes([len(props)]))
    for k, v in props:
        kb, vb = str(k).encode(), str(v).encode()
        if len(kb) > 65535:
            raise InvalidArgument("property key", f"{len(kb)} bytes exceeds 65535")
        parts += (_U16.pack(len(kb)), kb, _U32.pack(len(vb)), vb)
    return b"".join(parts)


def decode_extra(raw: bytes) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    if not raw:
        return (), ()
    try:
        pos = 0
        nt = raw[pos]
        pos += 1
        tags = []
        for _ in range(nt):
            ln = raw[pos]
            tags.append(raw[pos + 1:pos + 1 + ln].decode())
            pos += 1 + ln
        npr = raw[pos]
        pos += 1
        props = []
        for _ in range(npr):
            (kl,) = _U16.unpack_from(raw, pos)
            k = raw[pos + 2:pos + 2 + kl].decode()
            pos += 2 + kl
            (vl,) = _U32.unpack_from(raw, pos)
            v = raw[pos + 4:pos + 4 + vl].decode()
            pos += 4 + vl
            props.append((k, v))
        if pos != len(raw):
            raise ValueError("trailing bytes")
    except (IndexError, struct.error, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgument("extras", f"malformed tags/properties: {e}") from None
    return tuple(tags), tuple(props)


@functools.lru_cache(maxsize=4096)
def _subject_table(subjects: tuple[str, ...]) -> bytes:
    """The encoded subject table (a producer sends the same few subjects again and again)."""
    return b"".join(_U16.pack(len(sb)) + sb for sb in (s.encode() for s in subjects))


def subject_problem(s: str, bytes_max: int = SUBJECT_BYTES_MAX) -> str | None:
    """What is wrong with ``s`` as a subject (or a consumer group name), or None when it is
    one: empty, longer than ``bytes_max`` bytes, or not of the subject rule (``SUBJECT_RE``,
    matched whole: no trailing newline, no '/', nothing but ASCII)."""
    if not isinstance(s, str) or not s:
        return "must not be empty" if isinstance(s, str) else "must be a string"
    if len(s) > bytes_max:  # a character is at least a byte: too long without encoding it
        return f"{len(s.encode(errors='surrogatepass'))} bytes exceeds {bytes_max}"
    if len(s) <= SUBJECT_BYTES_MAX:
        return _subject_shape(s)
    return None if SUBJECT_RE.fullmatch(s) else f"{s[:64]!r} does not match {SUBJECT_RE.pattern}"


@functools.lru_cache(maxsize=4096)
def _subject_shape(s: str) -> str | None:
    """The cached part of ``subject_problem``, for ``s`` of at most ``SUBJECT_BYTES_MAX``
    characters (a producer sends the same few subjects again and again; the cache holds at
    most 4096 x 200 characters). The rule is ASCII only, so a subject that matches it is as
    many bytes as characters."""
    return None if SUBJECT_RE.fullmatch(s) else f"{s[:64]!r} does not match {SUBJECT_RE.pattern}"


def check_subject(s: str, field: str = "subject", bytes_max: int = SUBJECT_BYTES_MAX) -> str:
    """``s`` when it is a subject (``subject_problem``), else ``InvalidArgument(field, why)``."""
    problem = subject_problem(s, bytes_max)
    if problem is not None:
        raise InvalidArgument(field, problem)
    return s


class Batch:
    """A columnar batch (see module docstring). Columns are numpy arrays (read-only
    views of the decoded bytes, or arrays built by ``build``); blobs are ``bytes``."""

    __slots__ = ("n", "seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end", "payload_end", "extra_end",
                 "attempts", "subject_idx", "kind", "subjects", "ids", "payloads", "extras", "_id_str")

    def __init__(self, *, seq, deliver_at_ms, effective_ms, store_ms, id_end, payload_end, extra_end, attempts,
                 subject_idx, kind, subjects: tuple[str, ...], ids: bytes, payloads: bytes, extras: bytes) -> None:
        self.n = len(seq)
        self.seq = seq
        self.deliver_at_ms = deliver_at_ms
        self.effective_ms = effective_ms
        self.store_ms = store_ms
        self.id_end = id_end
        self.payload_end = payload_end
        self.extra_end = extra_end
        self.attempts = attempts
        self.subject_idx = subject_idx
        self.kind = kind
        self.subjects = subjects
        self.ids = ids
        self.payloads = payloads
        self.extras = extras
        self._id_str: str | None = None

    # ------------------------------------------------------------------ building

    @classmethod
    def build(cls, subjects: Sequence[str] | str, payloads: Sequence[bytes], ids: Sequence[str],
              deliver_at_ms, *, seq=None, effective_ms=None, store_ms=None, attempts=None, kind=None,
              extras: Sequence[bytes] | None = None) -> "Batch":
        """A batch from per-message sequences (the SDK's and the tests' way in).
        ``subjects`` is one subject for all or one per message; ``extras`` one
        ``encode_extra`` blob per message (or None)."""
        n = len(payloads)
        if len(ids) != n:
            raise InvalidArgument("batch", f"{len(ids)} ids for {n} payloads")
        if n > N_MAX:
            raise InvalidArgument("batch", f"{n} messages exceeds {N_MAX}")
        if isinstance(subjects, str):
            table: tuple[str, ...] = (subjects,)
            sidx = np.zeros(n, np.uint16)
        else:
            if len(subjects) != n:
                raise InvalidArgument("batch", f"{len(subjects)} subjects for {n} payloads")
            lookup: dict[str, int] = {}
            sidx = np.fromiter((lookup.setdefault(s, len(lookup)) for s in subjects), np.int64, n)
            if len(lookup) > SUBJECTS_MAX:
                raise InvalidArgument("batch", f"more than {SUBJECTS_MAX} subjects in one batch")
            table = tuple(lookup)
            sidx = sidx.astype(np.uint16)
        id_blob = "".join(ids).encode()
        id_end = _ends_of(map(len, ids), n)
        if n and int(id_end[-1]) != len(id_blob):  # non-ASCII ids: byte lengths differ from str lengths
            enc = [i.encode() for i in ids]
            id_blob = b"".join(enc)
            id_end = _ends_of(map(len, enc), n)
        payload_blob = b"".join(payloads)
        payload_end = _ends_of(map(len, payloads), n)
        if extras is None:
            extra_blob, extra_end = b"", np.zeros(n, np.uint32)
        else:
            extra_blob = b"".join(extras)
            extra_end = _ends_of(map(len, extras), n)
        deliver = _col(deliver_at_ms, n, np.int64)
        return cls(seq=_col(seq, n, np.uint64), deliver_at_ms=deliver,
                   effective_ms=deliver if effective_ms is None else _col(effective_ms, n, np.int64),
                   store_ms=_col(store_ms, n, np.int64), id_end=id_end, payload_end=payload_end,
                   extra_end=extra_end, attempts=_col(attempts, n, np.uint16),
                   subject_idx=sidx, kind=_col(kind, n, np.uint8, KIND_MESSAGE), subjects=table,
                   ids=id_blob, payloads=payload_blob, extras=extra_blob)

    @classmethod
    def empty(cls) -> "Batch":
        return cls.build((), [], [], [])

    def replace(self, **columns) -> "Batch":
        """A copy with some columns (or blobs) replaced; the others are shared."""
        kw = {k: getattr(self, k) for k in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end",
                                             "payload_end", "extra_end", "attempts", "subject_idx", "kind",
                                             "subjects", "ids", "payloads", "extras")}
        for k, v in columns.items():
            if k not in kw:
                raise TypeError(f"unknown column {k}")
            if isinstance(v, (int, np.integer)) and k not in ("subjects", "ids", "payloads", "extras"):
                v = np.full(self.n, v, kw[k].dtype)
            kw[k] = v
        return Batch(**kw)

    # ------------------------------------------------------------------ bytes

    def encode(self, *, packed: bool = False) -> bytes:
        """The body bytes. ``packed``: the packed column layout when it is smaller (a frame
        kept on disk for a long time; the wire and the logs that are read back at once keep
        the plain layout, whose columns decode as views without a copy)."""
        return b"".join(self.encode_parts(packed=packed))

    def encode_parts(self, *, packed: bool = False) -> tuple[bytes, ...]:
        """``encode()`` as its pieces, not joined: a writer that hands them to ``os.writev``
        (the real-time node's frame append) saves a copy of the whole body."""
        n = self.n
        table = _subject_table(self.subjects)
        cols = _pack_columns(self) if packed and n >= PACKED_N_MIN else None
        if cols is not None:
            head = HEADER.pack(VERSION, FLAG_PACKED, len(self.subjects), n, len(self.ids), len(self.payloads),
                               len(self.extras), len(table))
            return head, cols, table, self.ids, self.payloads, self.extras
        head = HEADER.pack(VERSION, 0, len(self.subjects), n, len(self.ids), len(self.payloads), len(self.extras),
                           len(table))
        return (
            head,
            np.ascontiguousarray(self.seq, "<u8").tobytes(),
            np.ascontiguousarray(self.deliver_at_ms, "<i8").tobytes(),
            np.ascontiguousarray(self.effective_ms, "<i8").tobytes(),
            np.ascontiguousarray(self.store_ms, "<i8").tobytes(),
            np.ascontiguousarray(self.id_end, "<u4").tobytes(),
            np.ascontiguousarray(self.payload_end, "<u4").tobytes(),
            np.ascontiguousarray(self.extra_end, "<u4").tobytes(),
            np.ascontiguousarray(self.attempts, "<u2").tobytes(),
            np.ascontiguousarray(self.subject_idx, "<u2").tobytes(),
            np.ascontiguousarray(self.kind, "u1").tobytes(),
            table, self.ids, self.payloads, self.extras,
        )

    @classmethod
    def decode(cls, body: bytes | bytearray | memoryview) -> "Batch":
        """Parse and check the structure of a batch body; columns are views of ``body``."""
        if isinstance(body, (bytearray, memoryview)):
            body = bytes(body)
        if len(body) < HEADER_SIZE:
            raise InvalidArgument("batch", f"{len(body)} bytes is shorter than the {HEADER_SIZE}-byte header")
        version, flags, nsub, n, ids_len, pay_len, ext_len, sub_len = HEADER.unpack_from(body, 0)
        if version != VERSION:
            raise InvalidArgument("batch", f"unknown batch version {version} (this node reads {VERSION})")
        if flags & ~FLAG_PACKED:
            raise InvalidArgument("batch", f"unknown flags {flags:#04x}")
        if n > N_MAX:
            raise InvalidArgument("batch", f"{n} messages exceeds {N_MAX}")
        if flags & FLAG_PACKED:
            columns, cols_len = _unpack_columns(body, n, {"ids": ids_len, "payloads": pay_len, "extras": ext_len})
        else:
            columns, cols_len = None, n * COLUMN_BYTES
        want = HEADER_SIZE + cols_len + sub_len + ids_len + pay_len + ext_len
        if want != len(body):
            raise InvalidArgument("batch", f"sizes add up to {want} bytes, the batch has {len(body)}")
        pos = HEADER_SIZE

        def col(dtype: str, width: int) -> np.ndarray:
            nonlocal pos
            a = np.frombuffer(body, dtype, n, pos)
            pos += n * width
            return a

        if columns is None:
            seq = col("<u8", 8)
            deliver = col("<i8", 8)
            effective = col("<i8", 8)
            store = col("<i8", 8)
            id_end = col("<u4", 4)
            payload_end = col("<u4", 4)
            extra_end = col("<u4", 4)
            attempts = col("<u2", 2)
            sidx = col("<u2", 2)
            kind = col("u1", 1)
        else:
            pos += cols_len
            seq, deliver, effective, store, id_end, payload_end, extra_end, attempts, sidx, kind = columns
        subjects = []
        end_table = pos + sub_len
        try:
            for k in range(nsub):
                (ln,) = _U16.unpack_from(body, pos)
                if pos + 2 + ln > end_table:
                    raise ValueError("subject table overruns")
                raw = body[pos + 2:pos + 2 + ln]
                try:
                    subjects.append(raw.decode())
                except UnicodeDecodeError as e:
                    raise InvalidArgument("subject", f"subject {k} of the batch is not UTF-8 ({e.reason} at byte "
                                                     f"{e.start}: {raw[:64]!r})") from None
                pos += 2 + ln
        except (struct.error, ValueError) as e:
            raise InvalidArgument("batch", f"bad subject table: {e}") from None
        if pos != end_table:
            raise InvalidArgument("batch", "subject table size does not match")
        ids = body[pos:pos + ids_len]
        pos += ids_len
        payloads = body[pos:pos + pay_len]
        pos += pay_len
        extras = body[pos:pos + ext_len]
        if n:
            for name, ends, total in (("id", id_end, ids_len), ("payload", payload_end, pay_len),
                                      ("extras", extra_end, ext_len)):
                if int(ends[-1]) != total or (n > 1 and bool((ends[1:] < ends[:-1]).any())):
                    raise InvalidArgument("batch", f"{name} ends are not a partition of the {name} blob")
            if nsub == 0 or int(sidx.max()) >= nsub:
                raise InvalidArgument("batch", "a subject index points past the subject table")
            if int(kind.max()) > KIND_CANCEL or int(kind.min()) < KIND_MESSAGE:
                raise InvalidArgument("batch", "unknown record kind")
        return cls(seq=seq, deliver_at_ms=deliver, effective_ms=effective, store_ms=store, id_end=id_end,
                   payload_end=payload_end, extra_end=extra_end, attempts=attempts, subject_idx=sidx, kind=kind,
                   subjects=tuple(subjects), ids=ids, payloads=payloads, extras=extras)

    # ------------------------------------------------------------------ per message (lazy)

    def __len__(self) -> int:
        return self.n

    def _ids_text(self) -> str:
        if self._id_str is None:
            self._id_str = self.ids.decode("utf-8", "replace")
        return self._id_str

    def id(self, i: int) -> str:
        a = int(self.id_end[i - 1]) if i else 0
        return self.ids[a:int(self.id_end[i])].decode("utf-8", "replace")

    def id_list(self) -> list[str]:
        """Every id, in order (one decode of the blob, then slices)."""
        if not self.n:
            return []
        text = self._ids_text()
        if len(text) == len(self.ids):  # ASCII: byte offsets are character offsets
            return _pieces(text, self.id_end)
        return [i.decode("utf-8", "replace") for i in _pieces(self.ids, self.id_end)]

    def id_bytes_list(self) -> list[bytes]:
        return _pieces(self.ids, self.id_end)

    def payload(self, i: int) -> bytes:
        a = int(self.payload_end[i - 1]) if i else 0
        return self.payloads[a:int(self.payload_end[i])]

    def payload_list(self) -> list[bytes]:
        return _pieces(self.payloads, self.payload_end)

    def subject(self, i: int) -> str:
        return self.subjects[int(self.subject_idx[i])]

    def subject_list(self) -> list[str]:
        t = self.subjects
        return [t[i] for i in self.subject_idx.tolist()]

    def extra(self, i: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        a = int(self.extra_end[i - 1]) if i else 0
        b = int(self.extra_end[i])
        return decode_extra(self.extras[a:b]) if b > a else ((), ())

    def cancel_target(self, i: int) -> int:
        """The seq a cancel tombstone cancels (its payload)."""
        p = self.payload(i)
        if len(p) != 8:
            raise InvalidArgument("batch", "a cancel tombstone's payload must be the u64 target seq")
        return _U64.unpack(p)[0]

    def cancel_targets(self) -> np.ndarray:
        """Target seq of every record (0 for messages): payloads of tombstones are u64s."""
        out = np.zeros(self.n, np.uint64)
        sel = np.flatnonzero(self.kind == KIND_CANCEL)
        for i in sel.tolist():
            out[i] = self.cancel_target(i)
        return out

    # ------------------------------------------------------------------ subsets

    def take(self, idx) -> "Batch":
        """The messages at ``idx`` (an index array or a slice), in that order. A contiguous
        run is a slice: columns are views and blobs one slice each, nothing per message."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self.n)
            if step == 1:
                return self._slice(start, max(start, stop))
            idx = np.arange(start, stop, step)
        idx = np.asarray(idx, np.int64)
        m = len(idx)
        if m == 0:
            return self._slice(0, 0)
        first, last = int(idx[0]), int(idx[-1])
        if last - first == m - 1 and (m == 1 or bool((np.diff(idx) == 1).all())):
            return self._slice(first, last + 1)
        cols = {}
        for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "subject_idx", "kind"):
            cols[name] = getattr(self, name)[idx]
        for name, blob_name in (("id_end", "ids"), ("payload_end", "payloads"), ("extra_end", "extras")):
            blob = getattr(self, blob_name)
            if not blob:
                cols[name], cols[blob_name] = np.zeros(m, np.uint32), b""
                continue
            ends = getattr(self, name)
            e = ends[idx].astype(np.int64)  # only the taken messages' ends: a round's take from a
            s = ends[idx - 1].astype(np.int64)  # loaded second must not convert the whole second
            s[idx == 0] = 0
            cols[blob_name] = b"".join([blob[a:b] for a, b in zip(s.tolist(), e.tolist())])
            cols[name] = np.cumsum(e - s).astype(np.uint32)
        return Batch(subjects=self.subjects, **cols)

    @staticmethod
    def gather(parts: Sequence[tuple["Batch", np.ndarray]], *, due_order: bool = False) -> "Batch":
        """``Batch.concat([b.take(idx) for b, idx in parts])`` in a fixed number of numpy
        calls: a firing round takes a message or two from each of many small frames, and a
        take is mostly fixed cost. Small sources are joined whole (columns concatenated,
        blobs not copied) and indexed once; a large source (a loaded second) is picked
        first (``_Picked``: its messages' columns and blob offsets), so nothing scales with
        its size and each message's bytes are cut once.

        ``due_order``: the same messages stably sorted by ``deliver_at_ms`` (what
        ``.take(np.argsort(b.deliver_at_ms, kind="stable"))`` of the result gives), sorted
        before the blobs are cut, so each message's bytes are copied once, not twice (a
        firing round gathers from many frames and is almost never in due order as taken)."""
        parts = [(b, i) for b, i in parts if len(i)]
        if len(parts) <= 1:
            if not parts:
                return Batch.empty()
            one = parts[0][0].take(parts[0][1])
            return one.take(_due_sort(one.deliver_at_ms)) if due_order and _out_of_order(one.deliver_at_ms) else one
        srcs, idxs = [], []
        for b, i in parts:
            i = np.asarray(i, np.int64)
            if b.n > _GATHER_WHOLE_MAX:  # a loaded second: its messages' columns and blob ranges now,
                b = _Picked(b, i)        # their bytes cut once below with the others'
                i = np.arange(b.n)
            srcs.append(b)
            idxs.append(i)
        counts = np.fromiter((b.n for b in srcs), np.int64, len(srcs))
        takes = np.fromiter(map(len, idxs), np.int64, len(idxs))
        firsts = np.cumsum(counts) - counts  # where each source starts in the joined columns
        gidx = np.concatenate(idxs) + np.repeat(firsts, takes)
        src_of = np.repeat(np.arange(len(srcs)), takes)
        if due_order:
            due = np.concatenate([b.deliver_at_ms for b in srcs])[gidx]
            if _out_of_order(due):
                order = _due_sort(due)
                gidx, src_of = gidx[order], src_of[order]
        subjects, subject_idx = _merged_subjects(srcs)
        subject_idx = subject_idx[gidx]
        cols = {name: np.concatenate([getattr(b, name) for b in srcs])[gidx]
                for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "kind")}
        src_of = src_of.tolist()
        picked = [k for k, b in enumerate(srcs) if isinstance(b, _Picked)]
        for name, blob_name in (("id_end", "ids"), ("payload_end", "payloads"), ("extra_end", "extras")):
            blobs = [getattr(b, blob_name) for b in srcs]
            if not any(blobs):
                cols[name], cols[blob_name] = np.zeros(len(gidx), np.uint32), b""
                continue
            ends = np.concatenate([getattr(b, name) for b in srcs]).astype(np.int64)
            starts = np.empty_like(ends)  # a whole source's message starts where the one before ends,
            starts[1:] = ends[:-1]        # its first at 0; a picked one's starts are its own
            starts[firsts] = 0
            for k in picked:
                starts[firsts[k]:firsts[k] + counts[k]] = srcs[k].starts[name]
            e = ends[gidx]
            st = starts[gidx]
            cols[blob_name] = b"".join([blobs[k][x:y] for k, x, y in zip(src_of, st.tolist(), e.tolist())])
            out = np.cumsum(e - st)
            if int(out[-1]) >= 1 << 32:
                raise InvalidArgument("batch", "a blob exceeds 4 GiB")
            cols[name] = out.astype(np.uint32)
        return Batch(subject_idx=subject_idx, subjects=subjects, **cols)

    def _slice(self, a: int, b: int) -> "Batch":
        if a == 0 and b == self.n:
            return self
        cols = {name: getattr(self, name)[a:b]
                for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "subject_idx", "kind")}
        for name, blob_name in (("id_end", "ids"), ("payload_end", "payloads"), ("extra_end", "extras")):
            ends = getattr(self, name)
            lo = int(ends[a - 1]) if a else 0
            hi = int(ends[b - 1]) if b > a else lo
            blob = getattr(self, blob_name)
            cols[blob_name] = blob[lo:hi] if (lo, hi) != (0, len(blob)) else blob
            cols[name] = ends[a:b] - np.uint32(lo) if lo else ends[a:b]
        return Batch(subjects=self.subjects, **cols)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """One batch of every message of ``batches``, in order (subject tables merged).
        Work per batch is a few list items: a second loaded from hundreds of filed frames
        is one concatenate per column (the node does this on its event loop)."""
        batches = [b for b in batches if b.n]
        if not batches:
            return Batch.empty()
        if len(batches) == 1:
            return batches[0]
        subjects, subject_idx = _merged_subjects(batches)
        cols = {name: np.concatenate([getattr(b, name) for b in batches])
                for name in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "attempts", "kind")}
        counts = np.fromiter((b.n for b in batches), np.int64, len(batches))
        for name, blob_name in (("id_end", "ids"), ("payload_end", "payloads"), ("extra_end", "extras")):
            blobs = [getattr(b, blob_name) for b in batches]
            sizes = np.fromiter(map(len, blobs), np.int64, len(blobs))
            shifts = np.cumsum(sizes) - sizes
            if len(sizes) and int(shifts[-1] + sizes[-1]) >= 1 << 32:
                raise InvalidArgument("batch", "a blob exceeds 4 GiB")
            ends = np.concatenate([getattr(b, name) for b in batches]).astype(np.int64)
            cols[name] = (ends + np.repeat(shifts, counts)).astype(np.uint32)
            cols[blob_name] = b"".join(blobs)
        return Batch(subject_idx=subject_idx, subjects=subjects, **cols)

    def split_by_subject(self) -> dict[str, np.ndarray]:
        """subject -> indices of its messages, in batch order."""
        if not self.n:
            return {}
        order = np.argsort(self.subject_idx, kind="stable")
        keys = self.subject_idx[order]
        cuts = np.flatnonzero(np.diff(keys.astype(np.int64))) + 1
        out = {}
        for part in np.split(order, cuts):
            out[self.subjects[int(self.subject_idx[part[0]])]] = part
        return out

    # ------------------------------------------------------------------ producer limits

    def validate(self, *, now_ms: int, limits: Limits = DEFAULT_LIMITS) -> tuple[np.ndarray, dict[int, str]]:
        """Apply the producer limits to every message at once. Returns ``codes`` (u8 per
        message: OK, INVALID_ARGUMENT, PAYLOAD_TOO_LARGE) and index -> reason for the
        refused ones. Messages refused here change nothing; the others go on."""
        n = self.n
        codes = np.zeros(n, np.uint8)
        reasons: dict[int, str] = {}
        if not n:
            return codes, reasons

        def refuse(mask: np.ndarray, code: int, reason) -> None:
            if not mask.any():  # the usual case: one reduction, nothing per message
                return
            for i in np.flatnonzero(mask & (codes == OK)).tolist():
                codes[i] = code
                reasons[i] = reason(i) if callable(reason) else reason

        for k, s in enumerate(self.subjects):
            bad = subject_problem(s, limits.subject_bytes_max)
            if bad:
                refuse(self.subject_idx == k, INVALID_ARGUMENT, f"subject: {bad}")
        id_ends = self.id_end.astype(np.int64)
        id_lens = id_ends - _starts(id_ends)
        refuse(id_lens == 0, INVALID_ARGUMENT, "id: must not be empty")
        refuse(id_lens > limits.id_bytes_max, INVALID_ARGUMENT,
               lambda i: f"id: {int(id_lens[i])} bytes exceeds {limits.id_bytes_max}")
        if self.ids:
            blob = np.frombuffer(self.ids, np.uint8)
            bad_pos = np.flatnonzero((blob < 0x21) | (blob > 0x7E))
            if len(bad_pos):
                owners = np.searchsorted(id_ends, bad_pos, side="right")
                mask = np.zeros(n, bool)
                mask[owners] = True
                refuse(mask, INVALID_ARGUMENT, "id: must be printable ASCII without spaces")
        pay_ends = self.payload_end.astype(np.int64)
        pay_lens = pay_ends - _starts(pay_ends)
        refuse(pay_lens > limits.payload_bytes_max, PAYLOAD_TOO_LARGE,
               lambda i: f"payload: {int(pay_lens[i])} bytes exceeds {limits.payload_bytes_max}")
        d = self.deliver_at_ms
        refuse(d < 0, INVALID_ARGUMENT, "deliver_at_ms: must not be negative")
        ahead = d - now_ms
        refuse(ahead > limits.delay_horizon_ms, INVALID_ARGUMENT,
               lambda i: f"deliver_at_ms: {span_ms(int(ahead[i]))} ahead is beyond the delay horizon, "
                         f"delay_horizon_ms = {span_ms(limits.delay_horizon_ms)}")
        refuse(self.kind != KIND_MESSAGE, INVALID_ARGUMENT, "kind: producers send messages only")
        if self.extras:
            ext_ends = self.extra_end.astype(np.int64)
            has = np.flatnonzero((ext_ends - _starts(ext_ends)) > 0)
            for i in has.tolist():
                if codes[i] != OK:
                    continue
                try:
                    tags, props = self.extra(i)
                    _check_extra(tags, props, limits)
                except InvalidArgument as e:
                    codes[i] = INVALID_ARGUMENT
                    reasons[i] = str(e)
        return codes, reasons


def _check_extra(tags, props, limits: Limits) -> None:
    if len(tags) > limits.tags_max:
        raise InvalidArgument("tags", f"{len(tags)} tags exceeds {limits.tags_max}")
    for t in tags:
        if not t or len(t.encode()) > limits.tag_bytes_max:
            raise InvalidArgument("tag", f"must be 1..{limits.tag_bytes_max} bytes")
    if len(props) > limits.properties_max:
        raise InvalidArgument("properties", f"{len(props)} exceeds {limits.properties_max}")
    for k, v in props:
        if not k or len(k.encode()) > limits.property_key_bytes_max:
            raise InvalidArgument("property key", f"must be 1..{limits.property_key_bytes_max} bytes")
        if len(v.encode()) > limits.property_value_bytes_max:
            raise InvalidArgument("property value", f"must be at most {limits.property_value_bytes_max} bytes")


def _out_of_order(due: np.ndarray) -> bool:
    return len(due) > 1 and bool((due[1:] < due[:-1]).any())


def _due_sort(due: np.ndarray) -> np.ndarray:
    return np.argsort(due, kind="stable")


def _pack_columns(b: Batch) -> bytes | None:
    """The packed column block (descriptor, bases, offsets) or None when the plain
    layout is not larger. The i64 columns go through as one (9, n) matrix: one min and one
    max for all of them (a schedule frame is encoded per second of due time at every filing
    round, so the fixed cost per numpy call is what this pays), nothing per message."""
    n = b.n
    m = _PACKED_MATRIX_ROWS
    vals = np.empty((len(m), n), np.int64)
    for k, name in enumerate(m):
        vals[k] = getattr(b, name)
    for k in _PACKED_MATRIX_ENDS:  # ends as lengths
        vals[k, 1:] -= vals[k, :-1].copy()
    vals[_PACKED_MATRIX_EFFECTIVE] -= vals[_PACKED_MATRIX_DELIVER]  # effective_ms as its lead over deliver_at_ms
    los, his = vals.min(axis=1).tolist(), vals.max(axis=1).tolist()
    seq = b.seq.astype(np.uint64)
    descr = bytearray(len(PACKED_COLUMNS))
    bases: list[bytes] = []
    data: list[bytes] = []
    size = len(descr)
    for k, name in enumerate(PACKED_COLUMNS):
        if k == 0:  # seq: u64 arithmetic (offsets wrap, bases add back)
            v = seq
            lo, hi = int(v.min()), int(v.max())
        else:
            v = vals[k - 1]
            lo, hi = los[k - 1], his[k - 1]
        span = hi - lo
        w = 0 if span == 0 else 1 if span < 1 << 8 else 2 if span < 1 << 16 else 4 if span < 1 << 32 else 8
        descr[k] = w
        if lo:
            descr[k] |= _PACKED_BASE
            bases.append(_U64.pack(lo & 0xFFFF_FFFF_FFFF_FFFF))
            size += 8
        if w:
            off = (v - v.dtype.type(lo)) if k == 0 else (v - lo)
            data.append(off.astype(f"<u{w}").tobytes())
            size += n * w
    if size >= n * COLUMN_BYTES:
        return None
    return b"".join((bytes(descr), *bases, *data))


def _unpack_columns(body: bytes, n: int, blob_lens: dict[str, int]) -> tuple[list[np.ndarray], int]:
    """Columns of a packed body (in ``PACKED_COLUMNS`` order) and the block's length. The
    arrays are new (read-only, like the views of a plain body); ends are checked to be a
    partition of their blob here, the rest by ``Batch.decode`` as for a plain body."""
    pos = HEADER_SIZE
    nd = len(PACKED_COLUMNS)
    if len(body) < pos + nd:
        raise InvalidArgument("batch", "packed columns: the descriptor is cut short")
    descr = body[pos:pos + nd]
    pos += nd
    specs = []
    for k, d in enumerate(descr):
        w = d & ~_PACKED_BASE
        if w not in _PACKED_WIDTHS:
            raise InvalidArgument("batch", f"packed columns: column {PACKED_COLUMNS[k]} has width {w}")
        specs.append((w, bool(d & _PACKED_BASE)))
    bases = []
    for w, has_base in specs:
        if has_base:
            if len(body) < pos + 8:
                raise InvalidArgument("batch", "packed columns: the bases are cut short")
            bases.append(_U64.unpack_from(body, pos)[0])
            pos += 8
        else:
            bases.append(0)
    if len(body) < pos + n * sum(w for w, _ in specs):
        raise InvalidArgument("batch", "packed columns: the offsets are cut short")
    out: list[np.ndarray] = []
    deliver = None
    for name, (w, _), base in zip(PACKED_COLUMNS, specs, bases):
        if w:
            v = np.frombuffer(body, f"<u{w}", n, pos).astype(np.uint64)
            pos += n * w
            v += np.uint64(base)
        else:
            v = np.full(n, base, np.uint64)
        if name in _PACKED_ENDS:
            total = blob_lens[_PACKED_ENDS[name]]
            if n and int(v.max()) > total:
                raise InvalidArgument("batch", f"packed columns: a {name[:-4]} length exceeds its blob")
            v = np.cumsum(v)
            if n and int(v[-1]) != total:
                raise InvalidArgument("batch", f"packed columns: {name[:-4]} lengths do not add up to the blob")
        elif name == "deliver_at_ms":
            deliver = v
        elif name == "effective_ms":
            v = v + deliver  # u64: the lead added back, wrapping as it was taken
        a = v.view(np.int64) if _PACKED_DTYPE[name] is np.int64 else v.astype(_PACKED_DTYPE[name])
        a.flags.writeable = False
        out.append(a)
    return out, pos - HEADER_SIZE


def pack_u64(values) -> bytes:
    return np.ascontiguousarray(values, "<u8").tobytes()


def pack_i64(values) -> bytes:
    return np.ascontiguousarray(values, "<i8").tobytes()


def unpack_i64(raw: bytes) -> np.ndarray:
    if len(raw) % 8:
        raise InvalidArgument("i64 array", f"{len(raw)} bytes is not a multiple of 8")
    return np.frombuffer(raw, "<i8")


# ---------------------------------------------------------------------- dispatch-log batches

DISPATCH_HEADER = struct.Struct("<BBHIq")  # version, outcome, pad, n, dispatched_ms
OUTCOME_OK = 0
OUTCOME_DEAD_LETTER = 1


@dataclass(frozen=True, slots=True)
class DispatchBatch:
    """One dispatch-log record: messages delivered (or dead-lettered) together.

    Body (little-endian): ``u8 version (=2) | u8 outcome | u16 pad | u32 n |
    i64 dispatched_ms | u64 seq[n] | i64 effective_ms[n] | i64 deliver_at_ms[n]``."""

    seq: np.ndarray
    effective_ms: np.ndarray
    deliver_at_ms: np.ndarray
    dispatched_ms: int
    outcome: int = OUTCOME_OK

    @property
    def n(self) -> int:
        return len(self.seq)

    def encode(self) -> bytes:
        return b"".join((DISPATCH_HEADER.pack(VERSION, self.outcome, 0, self.n, self.dispatched_ms),
                         np.ascontiguousarray(self.seq, "<u8").tobytes(),
                         np.ascontiguousarray(self.effective_ms, "<i8").tobytes(),
                         np.ascontiguousarray(self.deliver_at_ms, "<i8").tobytes()))

    @classmethod
    def decode(cls, body: bytes) -> "DispatchBatch":
        if len(body) < DISPATCH_HEADER.size:
            raise InvalidArgument("dispatch record", f"{len(body)} bytes is shorter than its header")
        version, outcome, _pad, n, dispatched_ms = DISPATCH_HEADER.unpack_from(body, 0)
        if version != VERSION:
            raise InvalidArgument("dispatch record", f"unknown version {version}")
        if len(body) != DISPATCH_HEADER.size + 24 * n:
            raise InvalidArgument("dispatch record", f"{len(body)} bytes, expected {DISPATCH_HEADER.size + 24 * n}")
        if outcome not in (OUTCOME_OK, OUTCOME_DEAD_LETTER):
            raise InvalidArgument("dispatch record", f"unknown outcome {outcome}")
        p = DISPATCH_HEADER.size
        return cls(np.frombuffer(body, "<u8", n, p), np.frombuffer(body, "<i8", n, p + 8 * n),
                   np.frombuffer(body, "<i8", n, p + 16 * n), dispatched_ms, outcome)
