"""What a nack does with each message: a retry copy through a delay node, or a dead letter.

Pure: the nacked messages (the batch ``RealtimeStore.nack`` hands back), ``now_ms`` and the
limits in, the two batches to send out; no clock, no I/O. The servicer
(``node/realtime/service.py`` ``Nack``) sends the retries to a delay node, appends the dead
letters to ``DLQ_SUBJECT`` and acks the handles once both succeeded.

Rules, per message (``attempts`` is what it carried when it was pulled):

* it is **dead** once ``attempts + 1 >= max_attempts``: the copy goes to the dead-letter
  subject at once (due ``now_ms``), with properties ``dlq.subject`` (where it came from) and
  ``dlq.reason`` ("N delivery attempts");
* otherwise it is **retried**: the copy goes to its own subject, due ``now_ms +
  retry_after_ms`` (a negative ``retry_after_ms`` counts as 0);
* every copy carries ``attempts + 1`` and a new id ``{origin}~r{attempts + 1}`` (both the
  delay and the real-time side de-duplicate by id, so the copy needs an id of its own); the
  original id travels in property ``hourglass.origin_id`` (``ORIGIN_ID``), kept from the first
  nack on (a copy of a copy names the first message). ``origin`` is cut to its first
  ``ORIGIN_ID_CHARS_MAX`` characters, so that an ASCII id with its suffix stays within the
  codec's ``id_bytes_max`` (128). Property ``hourglass.nacked_by`` (``NACKED_BY``) names the
  group that nacked (the trace tells a nack from an ack by it). Tags, payload and the other
  properties travel unchanged.

Example: ``max_attempts=3``, ``now_ms=1000``, ``retry_after_ms=5000``; message "a" (attempts 0)
-> retry copy "a~r1", attempts 1, due 6000, origin "a"; message "b~r2" (attempts 2, origin
"b") -> dead letter "b~r3" on ``hourglass.dlq``, attempts 3, due 1000, ``dlq.subject`` its
subject. This path is rare: it builds the copies message by message.
"""

from __future__ import annotations

import numpy as np

from cluster.codec import Batch, encode_extra
from node.realtime.subjects import DLQ_SUBJECT

ORIGIN_ID = "hourglass.origin_id"  # cluster/client.py reads it back as the message's id
NACKED_BY = "hourglass.nacked_by"  # the consumer group whose nack made the copy (the trace, node/realtime/lookup.py)
ORIGIN_ID_CHARS_MAX = 100          # + "~r" + attempts (at most 5 digits): an ASCII id stays within 128 bytes


def is_dead(attempts: np.ndarray, max_attempts: int) -> np.ndarray:
    """Per message, whether its next attempt (``attempts + 1``) reaches ``max_attempts``."""
    return np.asarray(attempts, np.int64) + 1 >= max_attempts


def nack_copies(b: Batch, *, now_ms: int, retry_after_ms: int, max_attempts: int,
                group: str = "") -> tuple[Batch, Batch]:
    """The copies a nack of ``b`` by consumer group ``group`` sends: ``(retries to a delay
    node, dead letters)``, each in the order of ``b`` (rules in the module docstring)."""
    retry_at_ms = now_ms + max(0, retry_after_ms)
    dead_mask = is_dead(b.attempts, max_attempts)
    retry: list[tuple] = []
    dead: list[tuple] = []
    for i in range(b.n):
        tags, props = b.extra(i)
        props = dict(props)
        origin = props.setdefault(ORIGIN_ID, b.id(i))
        if group:
            props[NACKED_BY] = group  # the last nack's group (a copy of a copy: replaced)
        attempts = int(b.attempts[i]) + 1
        new_id = f"{origin[:ORIGIN_ID_CHARS_MAX]}~r{attempts}"
        if dead_mask[i]:
            props["dlq.subject"] = b.subject(i)
            props["dlq.reason"] = f"{attempts} delivery attempts"
            subject, due, to = DLQ_SUBJECT, now_ms, dead
        else:
            subject, due, to = b.subject(i), retry_at_ms, retry
        to.append((subject, b.payload(i), new_id, due, attempts, encode_extra(tags, sorted(props.items()))))
    return _build(retry), _build(dead)


def _build(rows: list[tuple]) -> Batch:
    if not rows:
        return Batch.empty()
    subjects, payloads, ids, due, attempts, extras = zip(*rows)
    return Batch.build(list(subjects), list(payloads), list(ids), np.array(due, np.int64),
                       attempts=np.array(attempts, np.uint16), extras=list(extras))
