"""What a cut of a divergent message-log suffix leaves behind, and its two files.

A follower truncates records the new master never had (``DelayStore.truncate_messages``).
Records it had filed stay in the schedule log; their seqs are **voided** (``DelayCore.void``,
persisted in ``voided.json`` with ``refile_seq_max``, the largest seq ever cut) so that they
are never loaded, found or counted, and un-voided when the same records come back.

Filing's high-water marks (per bucket, id index) assume seqs grow along the log, which a cut
and a refetch can break: the new master's suffix may hold an older term's records after this
log filed a newer term's. Records at or below ``refile_seq_max`` are checked one by one
(``Refiled.mask``) and filed anyway when this store has not filed them. They cannot go into
the id index (its seqs only grow), so ``Refiled`` remembers where they went, by id
(``refiled.json``, ``REFILED_MAX`` entries, the oldest buckets' dropped first).

``truncate_messages`` and ``truncate_dispatch`` are the shell's steps of a cut
(``DelayStore.truncate_messages`` / ``truncate_dispatch``): they cut the file, void what it
held, and move the replicated tick state back when it rested on the cut bytes
(``DelayCore.forget_cut_cancels``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster.codec import Batch
from node.delay.core import DelayCore
from node.store import checkpoint
from node.store.idindex import IdIndex, IdLocation

if TYPE_CHECKING:
    from node.delay.store import DelayStore

log = logging.getLogger("hourglass.delay.store")

REFILED_MAX = 1_000_000  # records filed below the high-water marks after cuts, remembered by id (refiled.json)


def load_voided(path: Path, core: DelayCore) -> None:
    """``voided.json`` into the core."""
    doc = checkpoint.read(path) or {}
    core.voided = [tuple(r) for r in doc.get("ranges", [])]
    core.refile_seq_max = int(doc.get("refile_seq_max", max((hi - 1 for _, hi in core.voided), default=-1)))


def save_voided(path: Path, core: DelayCore) -> None:
    checkpoint.write_atomic(path, {"ranges": [list(r) for r in core.voided], "refile_seq_max": core.refile_seq_max})


class Refiled:
    """Records filed below the high-water marks after a cut: id -> location (module docs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = checkpoint.read(path) or {}
        self.ids: dict[str, IdLocation] = {k: IdLocation(*v) for k, v in doc.get("ids", {}).items()}

    def get(self, msg_id: str) -> IdLocation | None:
        return self.ids.get(msg_id)

    def mask(self, batch: Batch, *, refile_seq_max: int, index: IdIndex) -> np.ndarray | None:
        """Records at or below ``refile_seq_max`` that this store has not filed: the high-water
        marks would skip them; they are filed anyway. A record filed before (the same seq
        under its id, here or in the id index) is not filed twice."""
        if refile_seq_max < 0:
            return None
        seq = batch.seq
        cand = np.flatnonzero(seq <= np.uint64(refile_seq_max))
        if not len(cand):
            return None
        force = np.zeros(batch.n, bool)
        for i in cand.tolist():
            s_i = int(seq[i])
            known = self.ids.get(batch.id(i))
            if (known is None or known.seq != s_i) and not any(loc.seq == s_i for loc in index.get_all(batch.id(i))):
                force[i] = True
        return force if force.any() else None

    def note(self, batch: Batch, which: np.ndarray, placed) -> None:
        """Remember where records ``which`` of ``batch`` went (``ScheduleLog.file``'s answer),
        and persist the map."""
        for i in np.flatnonzero(which).tolist():
            self.ids[batch.id(i)] = IdLocation(int(placed.bucket_start_ms[i]), int(placed.data_offset[i]),
                                               int(placed.frame_size[i]), int(batch.seq[i]))
        if len(self.ids) > REFILED_MAX:  # bounded: the oldest buckets' entries go first
            for k in sorted(self.ids, key=lambda k: self.ids[k].bucket_start_ms)[:len(self.ids) - REFILED_MAX]:
                del self.ids[k]
        checkpoint.write_atomic(self.path, {"ids": {k: [v.bucket_start_ms, v.data_offset, v.frame_size, v.seq]
                                                    for k, v in self.ids.items()}})


def truncate_messages(store: "DelayStore", cut: int) -> int:
    """Drop a divergent message-log suffix (records the new master never had). Records
    already filed stay in the schedule log but their seqs are voided (persisted), so
    they are never loaded, found or counted. Returns the records voided.

    A voided range is exactly the seqs cut (``[min, max]`` per store epoch, never "to the
    end of the epoch"), and a record that comes back into the log (the same bytes fetched
    again from the new master) is filed and un-voided (``DelayCore.unvoid``): voiding
    describes what the log does not hold, nothing more."""
    if cut >= store.messages.end_offset:
        return 0
    cut_batches = [Batch.decode(body) for _, body in store.messages.iterate(cut)]
    cols = [b.seq for b in cut_batches]
    seqs = np.concatenate(cols) if cols else np.zeros(0, np.uint64)
    changed, lowered = store.core.forget_cut_cancels(cut, cut_batches, log_end=store.messages.end_offset)
    if lowered:
        log.warning("a cut tombstone's message is due again: replicated completed_ms back to %d",
                    store.core.replicated["completed_ms"])
    if len(seqs):
        store.core.void(seqs)
        save_voided(store.root / "voided.json", store.core)
    dropped = store.messages.truncate(cut)
    store.messages.flush()
    store.iterate_offset = min(store.iterate_offset, cut)
    store.durable_offset = min(store.durable_offset, cut)
    store.unfiled.cut(cut)
    if changed:
        store.checkpoint()
    log.warning("message log truncated to %d (divergent suffix, %d bytes, %d records voided)",
                cut, dropped, len(seqs))
    return len(seqs)


def truncate_dispatch(store: "DelayStore", cut: int) -> int:
    """Drop a divergent dispatch-log suffix; the tick state's dispatch offset goes back to the
    cut with it. Returns the bytes dropped."""
    if cut >= store.dispatch.end_offset:
        return 0
    dropped = store.dispatch.truncate(cut)
    store.dispatch.flush()
    # the tick state's dispatch offset (the old master's, replicated, and the checkpoint
    # made of it) may point into the cut bytes; once the new master's bytes fill that range
    # it would point into the middle of a record ("header checksum mismatch" at promotion,
    # chaos meta-pause seeds 20 and 22, and the evidence at 10:10:02): it goes back
    # to the cut (reading more dispatch records there only names more as delivered)
    # A follower with no document of the current master yet holds its own (seed 18): the same
    core = store.core
    r = core.replicated if core.replicated is not None else core.own_doc(store.messages.end_offset)
    if r is not None and int(r.get("dispatch_offset", 0)) > cut:
        r["dispatch_offset"] = cut
        core.replicated = r
        store.checkpoint()
    if int(store.persisted_doc.get("dispatch_offset", 0)) > cut and store.follower:
        store.checkpoint()
    log.warning("dispatch log truncated to %d (divergent suffix, %d bytes)", cut, dropped)
    return dropped
