"""Record codecs: the bodies stored inside log frames (see docs/format.md).

Message-log record body (little-endian), format version 1::

    u8  version (=1)
    u8  kind            1 = message, 2 = cancel tombstone
    u16 attempts        delivery attempts so far (retry-later, dead letter)
    u64 seq             64-bit sequence, strictly increasing, never reused
    i64 store_ms        when the node accepted the record
    i64 deliver_at_ms   due time (UTC ms); for a tombstone: the cancelled message's due time
    u16 len + bytes     message id (UTF-8)
    u16 len + bytes     subject (UTF-8)
    u8  n, n x (u8 len + bytes)                     tags
    u8  n, n x (u16 len + key, u32 len + value)     properties
    u32 len + bytes     payload (empty for a tombstone)

Dispatch-log record body: ``u64 seq | i64 deliver_at_ms | i64 dispatched_ms | u8 outcome``.

``validate_message`` enforces the limits a producer can violate; ``decode``
rejects anything that does not parse exactly (trailing bytes included).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from cluster.codec import DEFAULT_LIMITS, Limits  # noqa: F401  (one definition of the limits)
from cluster.errors import InvalidArgument, Overloaded, PayloadTooLarge

VERSION = 1
KIND_MESSAGE = 1
KIND_CANCEL = 2

_FIXED = struct.Struct("<BBHQqq")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

SUBJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
ID_RE = re.compile(r"^[!-~]+$")  # printable ASCII, no spaces




@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    store_ms: int
    deliver_at_ms: int
    msg_id: str
    subject: str
    payload: bytes = b""
    tags: tuple[str, ...] = ()
    properties: tuple[tuple[str, str], ...] = ()
    attempts: int = 0
    kind: int = KIND_MESSAGE

    @property
    def is_cancel(self) -> bool:
        return self.kind == KIND_CANCEL


@dataclass(frozen=True, slots=True)
class Dispatched:
    OK = 0
    DEAD_LETTER = 1

    seq: int
    deliver_at_ms: int
    dispatched_ms: int
    outcome: int = 0


_DISPATCH = struct.Struct("<Qqqb")


def _check_str(field_name: str, value: str, bytes_max: int, pattern: re.Pattern | None = None) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(field_name, "must be a string")
    raw = value.encode("utf-8")
    if not raw:
        raise InvalidArgument(field_name, "must not be empty")
    if len(raw) > bytes_max:
        raise InvalidArgument(field_name, f"{len(raw)} bytes exceeds {bytes_max}")
    if pattern is not None and not pattern.match(value):
        raise InvalidArgument(field_name, f"{value[:64]!r} does not match {pattern.pattern}")
    return raw


def validate_message(msg: Message, *, now_ms: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise InvalidArgument (or PayloadTooLarge) if a producer's message breaks a limit."""
    _check_str("subject", msg.subject, limits.subject_bytes_max, SUBJECT_RE)
    _check_str("id", msg.msg_id, limits.id_bytes_max, ID_RE)
    if not isinstance(msg.payload, (bytes, bytearray)):
        raise InvalidArgument("payload", "must be bytes")
    if len(msg.payload) > limits.payload_bytes_max:
        raise PayloadTooLarge("payload", f"{len(msg.payload)} bytes exceeds {limits.payload_bytes_max}")
    if len(msg.tags) > limits.tags_max:
        raise InvalidArgument("tags", f"{len(msg.tags)} tags exceeds {limits.tags_max}")
    for t in msg.tags:
        _check_str("tag", t, limits.tag_bytes_max)
    if len(msg.properties) > limits.properties_max:
        raise InvalidArgument("properties", f"{len(msg.properties)} exceeds {limits.properties_max}")
    for k, v in msg.properties:
        _check_str("property key", k, limits.property_key_bytes_max)
        if not isinstance(v, str) or len(v.encode()) > limits.property_value_bytes_max:
            raise InvalidArgument("property value", f"must be a string of at most {limits.property_value_bytes_max} bytes")
    if msg.deliver_at_ms - now_ms > limits.delay_horizon_ms:
        raise InvalidArgument("deliver_at_ms", f"more than {limits.delay_horizon_ms} ms in the future (delay horizon)")
    if msg.deliver_at_ms < 0:
        raise InvalidArgument("deliver_at_ms", "must not be negative")


def encode(msg: Message) -> bytes:
    mid = msg.msg_id.encode()
    subj = msg.subject.encode()
    parts = [
        _FIXED.pack(VERSION, msg.kind, msg.attempts, msg.seq, msg.store_ms, msg.deliver_at_ms),
        _U16.pack(len(mid)), mid,
        _U16.pack(len(subj)), subj,
        _U8.pack(len(msg.tags)),
    ]
    for t in msg.tags:
        tb = t.encode()
        parts += (_U8.pack(len(tb)), tb)
    parts.append(_U8.pack(len(msg.properties)))
    for k, v in msg.properties:
        kb, vb = k.encode(), v.encode()
        parts += (_U16.pack(len(kb)), kb, _U32.pack(len(vb)), vb)
    parts += (_U32.pack(len(msg.payload)), bytes(msg.payload))
    return b"".join(parts)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise InvalidArgument("record", "truncated")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def unpack(self, st: struct.Struct):
        vals = st.unpack_from(self.buf, self.pos) if self.pos + st.size <= len(self.buf) else None
        if vals is None:
            raise InvalidArgument("record", "truncated")
        self.pos += st.size
        return vals

    def text(self, st: struct.Struct) -> str:
        (n,) = self.unpack(st)
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("record", "text is not UTF-8") from None


def decode(body: bytes) -> Message:
    r = _Reader(body)
    version, kind, attempts, seq, store_ms, deliver_at_ms = r.unpack(_FIXED)
    if version != VERSION:
        raise InvalidArgument("record", f"unknown format version {version}")
    if kind not in (KIND_MESSAGE, KIND_CANCEL):
        raise InvalidArgument("record", f"unknown kind {kind}")
    msg_id = r.text(_U16)
    subject = r.text(_U16)
    (ntags,) = r.unpack(_U8)
    tags = tuple(r.text(_U8) for _ in range(ntags))
    (nprops,) = r.unpack(_U8)
    props = tuple((r.text(_U16), r.text(_U32)) for _ in range(nprops))
    (plen,) = r.unpack(_U32)
    payload = r.take(plen)
    if r.pos != len(body):
        raise InvalidArgument("record", f"{len(body) - r.pos} trailing bytes")
    return Message(seq=seq, store_ms=store_ms, deliver_at_ms=deliver_at_ms, msg_id=msg_id, subject=subject,
                   payload=payload, tags=tags, properties=props, attempts=attempts, kind=kind)


def peek_header(body: bytes) -> tuple[int, int, int, int]:
    """(kind, seq, deliver_at_ms, attempts) without decoding the rest: the hot path of the iterator."""
    _v, kind, attempts, seq, _store, deliver_at_ms = _FIXED.unpack_from(body, 0)
    return kind, seq, deliver_at_ms, attempts


def peek_id(body: bytes) -> str:
    (n,) = _U16.unpack_from(body, _FIXED.size)
    start = _FIXED.size + 2
    return body[start:start + n].decode()


def encode_dispatched(d: Dispatched) -> bytes:
    return _DISPATCH.pack(d.seq, d.deliver_at_ms, d.dispatched_ms, d.outcome)


def decode_dispatched(body: bytes) -> Dispatched:
    if len(body) != _DISPATCH.size:
        raise InvalidArgument("dispatch record", f"{len(body)} bytes, expected {_DISPATCH.size}")
    return Dispatched(*_DISPATCH.unpack(body))


# ---------------------------------------------------------------------- sequences

SEQ_EPOCH_SHIFT = 40
SEQ_COUNTER_MAX = (1 << SEQ_EPOCH_SHIFT) - 1


def make_seq(epoch: int, counter: int) -> int:
    """``(epoch << 40) | counter``: never reused across restarts (the epoch is checkpointed
    before use) and increasing in log order. ``Overloaded`` once an epoch's 2^40 are used."""
    if counter > SEQ_COUNTER_MAX:
        raise Overloaded("sequence space of this epoch is exhausted; restart the node")
    return (epoch << SEQ_EPOCH_SHIFT) | counter



# ---------------------------------------------------------------------- batches (slow paths, tests)


def batch_from_messages(msgs: "list[Message]"):
    """A codec batch of domain messages: the way in for tests, tools and other slow paths
    (the hot path builds batches from columns and never makes a ``Message``)."""
    import numpy as np

    from cluster.codec import Batch, encode_extra

    extras = [encode_extra(m.tags, m.properties) for m in msgs]
    return Batch.build([m.subject for m in msgs], [bytes(m.payload) for m in msgs], [m.msg_id for m in msgs],
                       np.array([m.deliver_at_ms for m in msgs], np.int64),
                       seq=np.array([m.seq for m in msgs], np.uint64),
                       store_ms=np.array([m.store_ms for m in msgs], np.int64),
                       attempts=np.array([m.attempts for m in msgs], np.uint16),
                       kind=np.array([m.kind for m in msgs], np.uint8),
                       extras=extras if any(extras) else None)


def message_at(batch, i: int) -> Message:
    """Record ``i`` of a codec batch as a domain ``Message`` (slow paths: lookups, tools)."""
    tags, props = batch.extra(i)
    return Message(seq=int(batch.seq[i]), store_ms=int(batch.store_ms[i]),
                   deliver_at_ms=int(batch.deliver_at_ms[i]), msg_id=batch.id(i), subject=batch.subject(i),
                   payload=batch.payload(i), tags=tags, properties=props, attempts=int(batch.attempts[i]),
                   kind=int(batch.kind[i]))


def messages_of(batch) -> "list[Message]":
    return [message_at(batch, i) for i in range(batch.n)]
