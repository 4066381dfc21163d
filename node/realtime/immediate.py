"""A real-time node takes immediate messages; one due later belongs on a delay node.

Pure: due times, ``now_ms`` and the request's ``immediate`` flag in, which messages to store
and which to refuse out; no clock, no I/O. The servicer (``node/realtime/service.py``
``_append``) stores the ones it keeps and answers with ``refuse_due_later``.

Rule: a message due after ``now_ms`` is refused (INVALID_ARGUMENT, ``DUE_LATER``: "delay_ms:
a real-time node takes immediate messages; send delayed ones to a delay node"), the rest of
the batch is stored, unless the request says ``immediate``: a delay node dispatching sets it
(it fires up to ``dispatch_lead_ms`` ahead, and the real-time node holds such messages until
they are due), and then every message is stored.

Example: ``now_ms=1000``, due ``[0, 1000, 1001]``: without ``immediate`` messages 0 and 1 are
stored and 2 is refused; with it all three are stored.
"""

from __future__ import annotations

import numpy as np

from cluster import status
from cluster.errors import InvalidArgument
from cluster.wire import BatchResult

DUE_LATER = InvalidArgument("delay_ms", "a real-time node takes immediate messages; send delayed ones to a delay node")
_NONE = np.zeros(0, np.int64)


def due_later(deliver_at_ms: np.ndarray, *, now_ms: int, immediate: bool) -> np.ndarray:
    """Indexes (ascending) of the messages refused as due later; empty for the whole batch stored."""
    if immediate:
        return _NONE
    return np.flatnonzero(np.asarray(deliver_at_ms) > now_ms)


def refuse_due_later(deliver_at_ms: np.ndarray, keep: np.ndarray, stored: BatchResult, late: np.ndarray) -> BatchResult:
    """The answer to the whole batch: ``stored`` (the store's answer to the messages ``keep``)
    at their places, ``DUE_LATER`` for the messages ``late``. Per-message errors read "field:
    reason", as every per-message error (the client adds "invalid")."""
    res = BatchResult.sized(len(deliver_at_ms))
    res.deliver_at_ms[:] = deliver_at_ms
    res.place(keep, stored)
    code, text = status.to_code(DUE_LATER), f"{DUE_LATER.field}: {DUE_LATER.reason}"
    for i in late.tolist():
        res.refuse(i, code, text)
    return res
