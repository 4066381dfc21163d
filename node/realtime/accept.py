"""The accept decision of a real-time append (pure: a batch, the dedup map and the seq counter in).

``RealtimeStore.append`` checks a batch (``validate``: per-message codes), then asks
``assign_seqs`` which of its messages are new and which seq each one is answered with; the
store then writes the new ones as one frame (at most ``write_bytes_bound`` bytes). Per-message work runs in numpy and in C-level ``map``/``dict`` calls over the batch
(``shared/ARCHITECTURE.md``, "Hot path").

Rules: a message whose ``(subject, id)`` is in the dedup map (stored within the window) is
a duplicate answered with the stored seq; a key repeated inside the batch is stored once,
its repeats answered with the first copy's seq; the new messages get consecutive seqs
``make_seq(epoch, counter + k)`` in batch order (``Overloaded`` once the epoch's counter
runs out, before anything is written).

``known`` is the window (``dedup.DedupWindow``: ``isdisjoint(keys)`` and ``get_many(keys, default)``).

Worked example: keys ``[a, b, a, c]``, the window holds ``{c: 7}``, epoch 1, counter 5::

    seqs, dup, new = assign_seqs(keys, window, epoch=1, counter=5)
    # new == [0, 1]; seqs == [s(1,5), s(1,6), s(1,5), 7]; dup == [F, F, T, T]
"""

from __future__ import annotations

import uuid

import numpy as np

from cluster.codec import COLUMN_BYTES, INVALID_ARGUMENT, OK, Batch, Limits
from cluster.codec import HEADER_SIZE as BATCH_HEADER_SIZE
from node.realtime.index import ENTRY_SIZE
from node.store.diskspace import FILE_BLOCK_BYTES
from node.store.log import HEADER_SIZE as LOG_HEADER_SIZE
from node.store.records import encoded_bytes_max, make_seq


def with_ids(b: Batch) -> Batch:
    """Messages sent without an id get a random one (sends stay idempotent only with an id)."""
    ends = b.id_end
    if not b.n or (ends[0] and not (ends[1:] == ends[:-1]).any()):
        return b
    ids = [i or uuid.uuid4().hex for i in b.id_list()]
    blob = "".join(ids).encode()
    return b.replace(ids=blob, id_end=np.cumsum([len(i.encode()) for i in ids]).astype(np.uint32))


def encoded_size(b: Batch) -> int:
    """Bytes of ``b.encode()``, without encoding it."""
    table = sum(2 + len(s.encode()) for s in b.subjects)
    return BATCH_HEADER_SIZE + b.n * COLUMN_BYTES + table + len(b.ids) + len(b.payloads) + len(b.extras)


def validate(batch: Batch, *, now_ms: int, limits: Limits) -> tuple[np.ndarray, dict[int, str]]:
    """Per-message ``(codes, errors)`` before subjects and dedup: ``Batch.validate`` with every
    message due now (the delay horizon does not apply to ``deliver_at_ms`` on this node, which
    is kept as given), and ``deliver_at_ms`` must not be negative."""
    codes, errors = batch.replace(deliver_at_ms=np.full(batch.n, now_ms, np.int64)).validate(now_ms=now_ms,
                                                                                             limits=limits)
    for i in np.flatnonzero((batch.deliver_at_ms < 0) & (codes == OK)).tolist():
        codes[i], errors[i] = INVALID_ARGUMENT, "deliver_at_ms: must not be negative"
    return codes, errors


def write_bytes_bound(batch: Batch) -> int:
    """Disk bytes that appending ``batch`` takes at most (the disk watermark admits or refuses a
    write by it, node/store/diskspace.py): one frame (plain layout, ids the node makes
    included), one index entry per message, and a partly used block for the message segment
    (and a new one) and for each subject's index file and folder (a new subject)."""
    if not batch.n:
        return 0
    return (LOG_HEADER_SIZE + encoded_bytes_max(batch) + batch.n * ENTRY_SIZE
            + (2 + 2 * len(batch.subjects)) * FILE_BLOCK_BYTES)


def assign_seqs(keys: list, known, *, epoch: int,
                counter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seqs, duplicate, new)`` for the messages of ``keys`` (module docstring): the seq
    each is answered with (u64), whether it is a duplicate, and the sorted indexes of the
    messages to store."""
    m = len(keys)
    distinct = len(set(keys)) == m  # a set, not the key -> first index dict: 3x cheaper at 400 keys
    fresh = known.isdisjoint(keys)
    if distinct and fresh:  # the common case (every message new): no per-message arrays but the seqs
        seqs = np.zeros(m, np.uint64)
        if m:
            make_seq(epoch, counter + m - 1)  # Overloaded once the epoch's seqs run out
            base = make_seq(epoch, counter)
            seqs[:] = np.arange(base, base + m, dtype=np.uint64)
        return seqs, np.zeros(m, bool), np.arange(m)
    if distinct:
        first_idx = np.arange(m)
    else:
        first = dict(zip(reversed(keys), range(m - 1, -1, -1)))  # key -> its first index in the batch
        first_idx = np.fromiter(map(first.get, keys), np.int64, m)
    if fresh:
        prior = np.full(m, -1, np.int64)
    else:
        prior = np.fromiter(known.get_many(keys, -1), np.int64, m)
    seen = prior >= 0
    repeated = (first_idx != np.arange(m)) & ~seen
    new = np.flatnonzero(~seen & ~repeated)
    k = len(new)
    seqs = np.zeros(m, np.uint64)
    if k:
        make_seq(epoch, counter + k - 1)  # Overloaded once the epoch's seqs run out
        base = make_seq(epoch, counter)
        seqs[new] = np.arange(base, base + k, dtype=np.uint64)
    seqs[seen] = prior[seen].astype(np.uint64)
    seqs[repeated] = seqs[first_idx[repeated]]
    return seqs, seen | repeated, new
