"""What a write will take on disk at most, for the disk watermark (``node/diskspace.py``).

The store's side of the watermark's questions, read from the store's state; the byte rules
themselves are ``node/delay/ingest.py``'s (``write_bytes_bound``, ``unfiled_bytes_bound``,
``cancel_bytes_bound``, ``new_buckets_bytes``). ``DelayStore`` answers through these.
"""

from __future__ import annotations

import numpy as np

from cluster.codec import Batch
from node.delay import ingest


def new_buckets_bytes(store, due_ms: np.ndarray) -> int:
    """Bytes of the schedule buckets that messages due at ``due_ms`` would create."""
    starts = ingest.bucket_starts_of(due_ms, persisted_completed_ms=store.persisted_completed_ms,
                                     bucket_ms=store.settings.bucket_ms)
    new = ingest.BUCKETS_LOOKED_UP_MAX + 1 if starts is None else \
        sum(1 for b in starts if not store.schedule.exists(b))
    return ingest.new_buckets_bytes(new, store.settings.bucket_ms)


def write_bytes_bound(store, batch: Batch) -> int:
    """Disk bytes that accepting ``batch`` and filing it take at most."""
    if not batch.n:
        return 0
    return ingest.write_bytes_bound(batch, settings=store.settings,
                                    id_allocation_bytes=store.ids.allocation_bytes(store.unfiled.count + batch.n),
                                    new_buckets_bytes=new_buckets_bytes(store, batch.deliver_at_ms.astype(np.int64)))


def unfiled_bytes_bound(store) -> int:
    """Disk bytes that filing what is accepted and not filed yet will take at most: what a
    disk reading begun now cannot show yet (``DiskBudget.reading_started``)."""
    n = store.unfiled.count
    if not n and store.iterate_offset >= store.messages.end_offset:
        return 0
    return ingest.unfiled_bytes_bound(
        store.unfiled, settings=store.settings, log_bytes=max(0, store.messages.end_offset - store.iterate_offset),
        id_allocation_bytes=store.ids.allocation_bytes(n),
        new_buckets_bytes=new_buckets_bytes(store, store.unfiled.due_ms()))


def cancel_bytes_bound(store, msg_id: str) -> int:
    """``write_bytes_bound`` of the tombstone a cancel of ``msg_id`` appends and files."""
    return ingest.cancel_bytes_bound(msg_id, settings=store.settings,
                                     id_allocation_bytes=store.ids.allocation_bytes(store.unfiled.count + 1))
