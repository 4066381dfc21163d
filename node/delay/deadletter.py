"""What the delay node does with a message the real-time side refused for good (an invalid
argument, a payload too large, an unknown subject, a conflicting id): try again a few times,
then dead-letter it.

Pure: the refused messages, the count of earlier refusals per seq (``failures``, updated in
place) and the limits in; which to dead-letter, which to try again and after how long, and
the dead-letter batch out. No clock, no I/O. The servicer (``node/delay/service.py``
``_handle_permanent``) requeues, sends the dead letters to ``DLQ_SUBJECT`` and writes their
dispatch records (outcome ``OUTCOME_DEAD_LETTER``) once the real-time side has them.

Rules, per message:

* each refusal adds one to ``failures[seq]``;
* it is **dead** once ``failures[seq] >= attempts_max``, or at once when it was itself bound for
  ``DLQ_SUBJECT`` (a dead letter of a dead letter would loop);
* the others are **tried again** after ``min(backoff_ms_max, 50 * 2**n)`` ms, ``n`` the highest
  failure count among them;
* a dead letter keeps its id, payload, due time, attempts and tags, and gains the properties
  ``dlq.subject`` (where it was bound), ``dlq.reason`` (the refusal's text, cut to
  ``REASON_CHARS_MAX``) and ``dlq.code`` (the refusal's code name).

Example: ``attempts_max=3``, message seq 7 refused the first time: ``failures={7: 1}``, tried
again in 100 ms; refused the third time: dead, its dead letter bound for ``hourglass.dlq`` with
``dlq.subject`` its subject.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.codec import Batch, encode_extra
from cluster.proto import hourglass_pb2 as pb
from node.realtime.store import DLQ_SUBJECT

BACKOFF_BASE_MS = 50       # the first retry's wait; it doubles with every refusal
REASON_CHARS_MAX = 500     # of a refusal's text kept in dlq.reason


@dataclass(frozen=True, slots=True)
class Refused:
    dead: list[int]        # indexes into the batch: dead-letter now
    again: list[int]       # indexes into the batch: try again after ``again_ms``
    again_ms: int


def sort_refused(b: Batch, idx: np.ndarray, failures: dict[int, int], *, attempts_max: int,
                 backoff_ms_max: int) -> Refused:
    """Count one more refusal of each message ``idx`` of ``b`` and sort them (module docstring)."""
    dead, again = [], []
    for i in np.asarray(idx, np.int64).tolist():
        seq = int(b.seq[i])
        n = failures.get(seq, 0) + 1
        failures[seq] = n
        (dead if n >= attempts_max or b.subject(i) == DLQ_SUBJECT else again).append(i)
    n_max = max((failures[int(b.seq[i])] for i in again), default=0)
    return Refused(dead, again, min(backoff_ms_max, BACKOFF_BASE_MS * 2 ** n_max) if again else 0)


def dead_letters(b: Batch, dead: list[int], why: dict[int, tuple[int, str]]) -> Batch:
    """The dead-letter batch of messages ``dead`` of ``b`` (``why[i]``: the refusal's code and text)."""
    extras = []
    for i in dead:
        tags, props = b.extra(i)
        code, error = why[i]
        extras.append(encode_extra(tags, sorted(dict(props, **{
            "dlq.subject": b.subject(i), "dlq.reason": error[:REASON_CHARS_MAX],
            "dlq.code": pb.Code.Name(code)}).items())))
    return Batch.build(DLQ_SUBJECT, [b.payload(i) for i in dead], [b.id(i) for i in dead],
                       b.deliver_at_ms[dead], attempts=b.attempts[dead], extras=extras)
