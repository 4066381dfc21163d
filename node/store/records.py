"""Domain records for slow paths, and the seq rule.

The bytes of every record Hourglass stores are one codec's: ``cluster/codec.py`` (a
columnar batch; ``docs/format.md``, "Batch record"). This module keeps what is not
bytes: the ``Message`` dataclass that tests, tools and lookups use one message at a time
(``batch_from_messages`` and ``message_at`` convert), and ``make_seq``, the one rule for
sequence numbers. The hot path never builds a ``Message``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.codec import COLUMN_BYTES, DEFAULT_LIMITS, KIND_CANCEL, KIND_MESSAGE, Batch, Limits, encode_extra
from cluster.codec import HEADER_SIZE as BATCH_HEADER_SIZE
from cluster.errors import Overloaded

__all__ = ["BATCH_HEADER_SIZE", "DEFAULT_LIMITS", "KIND_CANCEL", "KIND_MESSAGE", "Limits", "Message",
           "SEQ_COUNTER_MAX", "SEQ_EPOCH_SHIFT", "batch_from_messages", "encoded_bytes_max", "make_seq", "message_at",
           "messages_of", "subject_table_bytes"]

MADE_ID_BYTES = 32  # the id a node makes for a message sent without one (``uuid4().hex``)


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


def batch_from_messages(msgs: list[Message]) -> Batch:
    """A codec batch of domain messages: the way in for tests, tools and other slow paths
    (the hot path builds batches from columns and never makes a ``Message``)."""
    extras = [encode_extra(m.tags, m.properties) for m in msgs]
    return Batch.build([m.subject for m in msgs], [bytes(m.payload) for m in msgs], [m.msg_id for m in msgs],
                       np.array([m.deliver_at_ms for m in msgs], np.int64),
                       seq=np.array([m.seq for m in msgs], np.uint64),
                       store_ms=np.array([m.store_ms for m in msgs], np.int64),
                       attempts=np.array([m.attempts for m in msgs], np.uint16),
                       kind=np.array([m.kind for m in msgs], np.uint8),
                       extras=extras if any(extras) else None)


def message_at(batch: Batch, i: int) -> Message:
    """Record ``i`` of a codec batch as a domain ``Message`` (slow paths: lookups, tools)."""
    tags, props = batch.extra(i)
    return Message(seq=int(batch.seq[i]), store_ms=int(batch.store_ms[i]),
                   deliver_at_ms=int(batch.deliver_at_ms[i]), msg_id=batch.id(i), subject=batch.subject(i),
                   payload=batch.payload(i), tags=tags, properties=props, attempts=int(batch.attempts[i]),
                   kind=int(batch.kind[i]))


def messages_of(batch: Batch) -> list[Message]:
    return [message_at(batch, i) for i in range(batch.n)]


# ---------------------------------------------------------------------- sizes (the disk watermark's bounds)


def subject_table_bytes(batch: Batch) -> int:
    """Bytes of a batch's subject table in a frame (u16 length and UTF-8 name each)."""
    return sum(2 + len(s.encode()) for s in batch.subjects)


def encoded_bytes_max(batch: Batch) -> int:
    """Bytes of ``batch`` as a frame body in the plain layout (the packed one is never larger),
    counting the ids a node makes for messages sent without one: a bound of what storing it
    writes (``DelayStore`` / ``RealtimeStore.write_bytes_bound``)."""
    if not batch.n:
        return BATCH_HEADER_SIZE
    ends = batch.id_end  # an id of length 0 (made by the node): its end equals the previous one
    made = int(ends[0] == 0) + int(np.count_nonzero(ends[1:] == ends[:-1]))  # np.diff(prepend=) costs 5x
    return (BATCH_HEADER_SIZE + subject_table_bytes(batch) + batch.n * COLUMN_BYTES + len(batch.ids)
            + len(batch.payloads) + len(batch.extras) + made * MADE_ID_BYTES)
