"""Opening a delay node's data folder: the files, the checkpoint, and a report of both.

``recover`` opens the four stores (message log, dispatch log, schedule log, id index: each
recovers its own tail, ``node/store/log.py``), reads the checkpoint, ``voided.json`` and
``refiled.json``, and restores the core (``DelayCore``) from them:

1. the epoch: the checkpoint's, plus one unless told not to (the shell persists it before
   any seq of it is used);
2. the iterate offset, where filing resumes: the checkpoint's, moved back to the log's end
   when the log is shorter (a torn tail), or to the start of the record holding it when it
   is not a record boundary here (a checkpoint taken before a cut, the range since filled
   by another term's bytes: records filed before are not filed twice);
3. the wheel and ``completed_ms`` from the tick state, and the delivered-seq map from the
   dispatch records after its ``dispatch_offset`` (moved back to a record boundary the same
   way: another term's offset inside this log's own divergent dispatch suffix);
4. a follower's copy of its master's checkpoint (``replicated``), whose iterate offset is
   held to this replica's own when it is not a record boundary here.

It returns the opened files, the core and a ``RecoveryReport``: what it found and what it
did (bytes each log dropped from its torn tail, offsets moved and why, dispatch records
replayed, id files rebuilt). The shell then verifies the first buckets (the healer), counts
what is pending (``count_pending``), persists the new epoch and files what the crash left
unfiled (the report's ``records_refiled``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.codec import KIND_CANCEL, DispatchBatch
from cluster.files import DATA_DIR_MODE, remove_leftover_temps
from node.delay import cuts
from node.delay.core import DelayCore
from node.delay.salvage import id_entries
from node.store import checkpoint
from node.store.idindex import IdIndex
from node.store.log import SegmentedLog
from node.store.schedule import ScheduleLog
from node.store.settings import StoreSettings

log = logging.getLogger("hourglass.delay.store")


@dataclass(slots=True)
class RecoveryReport:
    """What opening a delay store found and did (``DelayStore.recovery``)."""

    epoch: int                          # the epoch this store issues seqs of
    checkpoint_found: bool
    iterate_offset: int                 # where filing resumed
    iterate_offset_was: int | None      # the checkpoint's, when it could not be used as it was
    dispatch_offset: int                # dispatch records from here name what was delivered
    dispatch_offset_was: int | None
    dispatch_records_replayed: int
    messages_bytes_dropped: int         # torn tails the logs cut at open
    dispatch_bytes_dropped: int
    id_files_rebuilt: int               # id files whose header failed, rebuilt from the schedule log
    voided_ranges: int
    records_refiled: int = 0            # records the replay filed (set by the shell after filing)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Recovered:
    messages: SegmentedLog
    dispatch: SegmentedLog
    schedule: ScheduleLog
    ids: IdIndex
    core: DelayCore
    iterate_offset: int
    refiled: cuts.Refiled
    report: RecoveryReport


def iterate_start(messages: SegmentedLog, offset: int, notes: list[str]) -> int:
    """Where filing resumes given the checkpoint's iterate offset (module docs, step 2)."""
    if offset > messages.end_offset:
        notes.append(f"iterate offset {offset} past the log end {messages.end_offset}")
        log.warning("iterate offset past log end path=%s iterate_offset=%d end=%d",
                    messages.directory, offset, messages.end_offset)
        return messages.end_offset
    if not messages.is_boundary(max(offset, messages.start_offset)):
        back = messages.boundary_at_or_before(offset)
        notes.append(f"iterate offset {offset} is not a record boundary here; filing from {back}")
        log.warning("iterate offset %d is not a record boundary here; filing from %d", offset, back)
        return back
    return offset


def recover(root: Path, settings: StoreSettings, now_ms: int, *, bump_epoch: bool, follower: bool) -> Recovered:
    """Open and restore (module docs). Reads files; decides nothing the core does not."""
    root.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    remove_leftover_temps(root)  # a checkpoint write a crash cut short (cluster/files.py)
    messages = SegmentedLog.open(root / "messages", segment_bytes_max=settings.message_segment_bytes)
    dispatch = SegmentedLog.open(root / "dispatch", segment_bytes_max=settings.dispatch_segment_bytes)
    schedule = ScheduleLog(root / "schedule", bucket_ms=settings.bucket_ms,
                           data_segment_bytes=settings.schedule_segment_bytes,
                           cache_bytes_max=settings.schedule_cache_bytes_max)
    # derived from the schedule log: a file with a corrupt header is rebuilt from it
    ids = IdIndex.open(root / "ids", slots_count=settings.id_slots, entries_max=settings.id_entries_max,
                       rebuild=lambda lo, hi: id_entries(schedule, lo, hi))
    ck = checkpoint.read(root / "checkpoint") or {}
    notes: list[str] = []
    core = DelayCore(settings, epoch=int(ck.get("epoch", 0)) + (1 if bump_epoch else 0), follower=follower)
    # the checkpoint's iterate offset, held to this log (a torn tail, a cut refilled)
    was = int(ck.get("iterate_offset", messages.start_offset))
    iterate_offset = iterate_start(messages, was, notes)
    cuts.load_voided(root / "voided.json", core)
    refiled = cuts.Refiled(root / "refiled.json")
    dispatch_offset, dispatch_was, replayed = restore_tick(core, dispatch, ck, now_ms)
    if follower:
        core.replicated = ck.get("replicated")
    r = core.replicated
    if r is not None:
        mark = int(r.get("iterate_offset", 0))
        if mark > messages.end_offset or not messages.is_boundary(mark):
            # not where a record of this log starts (a document persisted before the seed-8
            # fix): file no further than this replica's own filed offset until the master's
            # next document
            notes.append(f"replicated iterate offset {mark} is not a record boundary here; using {iterate_offset}")
            log.warning("replicated iterate offset %d is not a record boundary here; using %d", mark, iterate_offset)
            r["iterate_offset"] = iterate_offset
    report = RecoveryReport(
        epoch=core.epoch, checkpoint_found=bool(ck), iterate_offset=iterate_offset,
        iterate_offset_was=None if was == iterate_offset else was, dispatch_offset=dispatch_offset,
        dispatch_offset_was=dispatch_was, dispatch_records_replayed=replayed,
        messages_bytes_dropped=messages.recovery.bytes_dropped if messages.recovery else 0,
        dispatch_bytes_dropped=dispatch.recovery.bytes_dropped if dispatch.recovery else 0,
        id_files_rebuilt=len(ids.rebuilt_files), voided_ranges=len(core.voided), notes=notes)
    return Recovered(messages, dispatch, schedule, ids, core, iterate_offset, refiled, report)


def restore_tick(core: DelayCore, dispatch: SegmentedLog, ck: dict, now_ms: int) -> tuple[int, int | None, int]:
    """The core's wheel, ``completed_ms`` and delivered-seq map from a checkpoint document (at
    open, and at a promotion from the master's replicated tick state). Returns (dispatch
    offset read from, the document's when it moved, dispatch records replayed)."""
    was = None
    if "completed_ms" in ck:
        dispatch_offset = max(int(ck["dispatch_offset"]), dispatch.start_offset)
        # another term's offset inside this log's own divergent dispatch suffix, not cut yet
        # (chaos meta-pause seed 28: a promotion failed on "header checksum mismatch"): start
        # at the record before it. Its records name messages this member delivered itself,
        # so reading more of them loses nothing
        if not dispatch.is_boundary(min(dispatch_offset, dispatch.end_offset)):
            back = dispatch.boundary_at_or_before(dispatch_offset)
            log.warning("dispatch offset %d is not a record boundary here; reading from %d", dispatch_offset, back)
            was, dispatch_offset = dispatch_offset, back
    else:
        dispatch_offset = dispatch.end_offset
    core.restore_tick(ck, dispatch_offset=dispatch_offset, now_ms=now_ms)
    replayed = 0
    if dispatch_offset < dispatch.end_offset:
        for off, body in dispatch.iterate(dispatch_offset):
            core.replayed(off, DispatchBatch.decode(body))
            replayed += 1
    return dispatch_offset, was, replayed


# ---------------------------------------------------------------------- pending counts


def count_pending(schedule: ScheduleLog, core: DelayCore, each=None) -> dict[int, int]:
    """Messages filed and not dispatched nor cancelled, by bucket start, from the schedule
    index (one read per bucket, counts per frame). ``each(start)``: called for every bucket
    counted, while it is open (the counts per subject, ``subject_tables.py``: opening a bucket
    twice costs a restart twice the opens)."""
    out: dict[int, int] = {}
    c = core.completed_ms
    for start in schedule.bucket_starts():
        if start + core.settings.bucket_ms <= c:
            continue
        n = filed_pending(schedule, start, c)
        if n is not None:
            out[start] = n
            if each is not None:
                each(start)
    for eff in core.dispatched.values():
        if eff >= c:
            b = schedule.bucket_start(eff)
            out[b] = out.get(b, 0) - 1
    return {b: n for b, n in out.items() if n > 0}


def filed_pending(schedule: ScheduleLog, start: int, c: int) -> int | None:
    """Messages minus tombstones filed in bucket ``start`` and due at or after ``c`` (None: no
    such bucket): whole seconds after ``c``'s from the index, ``c``'s own second exactly."""
    b = schedule.bucket(start, create=False)
    if b is None:
        return None
    e = b.entries_array()
    n = 0
    if start < c:  # the current bucket: whole seconds after completed_ms's, its own second exactly
        for ref in schedule.load_second(c // 1000):
            late = ref.batch.effective_ms >= c
            cancels = ref.batch.kind == KIND_CANCEL
            n += int(np.count_nonzero(late & ~cancels)) - int(np.count_nonzero(late & cancels))
        b = schedule.bucket(start, create=False)  # the load may have rebuilt it
        e = b.entries_array() if b is not None else e[:0]
        e = e[e["second"].astype(np.int64) * 1000 + start > c - c % 1000]
    return n + int(e["messages"].astype(np.int64).sum() - e["cancels"].astype(np.int64).sum())


def recount_pending(schedule: ScheduleLog, core: DelayCore, start: int) -> None:
    """The pending count of one bucket again (it was rebuilt: records may have gone or come back)."""
    c = core.completed_ms
    n = filed_pending(schedule, start, c) or 0
    n -= core.dispatched_in(max(c, start), start + core.settings.bucket_ms)
    core.set_pending(start, n)
