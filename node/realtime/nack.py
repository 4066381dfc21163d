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

A retry copy goes back to its own subject, where every consumer group of that subject
would pull it; it is meant only for the group that nacked. ``other_groups_retries`` is the
rule a pull applies (``node/realtime/consume.py``): a message with ``attempts > 0`` whose
``hourglass.nacked_by`` is set and names another group than the puller is a retry of
another group's nack; the pull does not hand it out and settles it for the puller at once
(it counts as acked for that group, like an entry skipped by a tag filter). Dead letters
(subject ``hourglass.dlq``) are never filtered: their readers are not the group that nacked.
A copy without the property (made before it existed) goes to every group, as it always did.

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


def other_groups_retries(b: Batch, group: str) -> np.ndarray:
    """Per message of a pulled batch, whether it is a retry copy of another group's nack,
    not to be handed to ``group`` (rule in the module docstring). First attempts cost one
    vectorized compare: only messages with ``attempts > 0`` outside the dead-letter subject
    have their properties decoded.

    Example: group "mail"; "a" (attempts 0) -> False; "b~r1" (attempts 1, nacked_by "billing")
    -> True; "c~r1" (attempts 1, nacked_by "mail") -> False; "d~r1" (attempts 1, no
    nacked_by: an old copy) -> False; a dead letter on ``hourglass.dlq`` -> False."""
    out = np.zeros(b.n, bool)
    if not b.n:
        return out
    cand = np.asarray(b.attempts) > 0
    if not cand.any():
        return out
    dlq = [k for k, s in enumerate(b.subjects) if s == DLQ_SUBJECT]
    if dlq:
        cand &= ~np.isin(b.subject_idx, dlq)
    for i in np.flatnonzero(cand).tolist():
        by = dict(b.extra(i)[1]).get(NACKED_BY)
        out[i] = bool(by) and by != group
    return out


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
