"""Retention decisions: what may be deleted now, and why the rest stays. Pure.

Every function takes offsets, checkpointed state, slave offsets, ``now_ms`` and settings,
and returns what may go plus the reason the oldest thing kept is kept (a metric label and
a log line). The shells (``node/delay/service.py``, ``node/realtime/service.py``) apply
the answer with the stores' deletion plans (file deletions run on a worker thread).

Rules (``docs/design.md``, "Retention"):

* **Segmented logs** (delay message log and dispatch log, real-time log): only whole
  sealed segments go, oldest first; a segment goes once every *hold* is past its end. A
  hold is ``name -> offset``: the holder still needs the bytes at and after it.
  Delay message log: ``checkpoint`` (the persisted iterate offset: every record below it is
  filed into the schedule log, and the schedule log and id index are fsynced before the
  checkpoint document that says so) and ``slave:{id}`` (the next offset each registered
  slave asks for). Dispatch log: ``checkpoint`` (the persisted ``dispatch_offset``) and the
  slaves'. Real-time log: ``group:{subject}/{group}`` (the frame of each group's lowest
  unacked position), ``dedup`` (the oldest frame inside the dedup window), and the
  condition that the segment is older than ``age_ms_max`` or the log is larger than
  ``bytes_max``.
* **Schedule buckets**: a bucket ``[start, start + bucket_ms)`` goes once
  ``start + bucket_ms <= completed_ms`` as persisted by a checkpoint: every message filed
  there is then in the (fsynced) dispatch log, or was cancelled.
* **Id index**: an entry goes once its bucket went (message delivered or cancelled) and
  its bucket ended at least ``dedupe_window_ms`` ago; a sealed file is rewritten without
  such entries once at least ``compact_ratio_min`` of them can go (deleted when all can).

Worked example (segments of 100 bytes, bases 0, 100, 200, 300 (active), holds
``{"checkpoint": 250, "slave:b": 120}``): segment 0 ends at 100 <= 120 and goes; segment
100 ends at 200 > 120: ``SegmentCut(offset=100, held_by="slave:b", held_base=100)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ACTIVE = "active segment"
NOTHING = ""


@dataclass(frozen=True, slots=True)
class SegmentCut:
    """Delete whole segments ending at or before ``offset``. ``held_base`` is the base of
    the oldest segment kept and ``held_by`` why it is kept."""

    offset: int
    held_by: str
    held_base: int


def segment_cut(bases: Sequence[int], end_offset: int, holds: Mapping[str, int]) -> SegmentCut:
    """The cut for a segmented log with segments starting at ``bases`` (ascending; the last
    is the active one, never deleted) under ``holds``."""
    assert bases, "a log has at least its active segment"
    limit = min(holds.values()) if holds else end_offset
    cut = bases[0]
    for nxt in bases[1:]:
        if nxt > limit:
            break
        cut = nxt
    if cut == bases[-1]:
        return SegmentCut(cut, ACTIVE, cut)
    who = min(holds, key=lambda k: (holds[k], k)) if holds else ACTIVE
    return SegmentCut(cut, who, cut)


def aged_segment_cut(segments: Sequence[tuple[int, int, int]], end_offset: int, holds: Mapping[str, int], *,
                     now_ms: int, age_ms_max: int | None, bytes_max: int | None) -> SegmentCut:
    """``segment_cut`` where a segment must also be due by age or size: older (by its last
    write, ``mtime_ms``) than ``age_ms_max`` or, counting from the oldest, part of the
    excess over ``bytes_max``. ``segments`` is ``(base, size, mtime_ms)`` ascending."""
    bases = [s[0] for s in segments]
    by_holds = segment_cut(bases, end_offset, holds)
    total = end_offset - bases[0]
    cut = bases[0]
    for (base, size, mtime_ms), nxt in zip(segments, bases[1:]):
        if nxt > by_holds.offset:
            return by_holds if cut == by_holds.offset else SegmentCut(cut, "age/size", cut)
        old = age_ms_max is not None and now_ms - mtime_ms > age_ms_max
        big = bytes_max is not None and total > bytes_max
        if not (old or big):
            return SegmentCut(cut, "age/size", cut)
        total -= size
        cut = nxt
    return by_holds if cut == by_holds.offset else SegmentCut(cut, "age/size", cut)


@dataclass(frozen=True, slots=True)
class BucketCut:
    drop: list[int]          # bucket starts that may go
    held_start: int | None   # oldest bucket kept (None: none kept)
    held_by: str


def bucket_cut(starts: Sequence[int], bucket_ms: int, completed_ms: int) -> BucketCut:
    """Schedule buckets (``starts`` ascending) that end at or before the checkpointed
    ``completed_ms``."""
    drop = [s for s in starts if s + bucket_ms <= completed_ms]
    kept = [s for s in starts if s + bucket_ms > completed_ms]
    return BucketCut(drop, kept[0] if kept else None, "pending messages" if kept else NOTHING)


def id_entries_gone(bucket_start_ms: np.ndarray, *, bucket_ms: int, completed_ms: int, now_ms: int,
                    dedupe_window_ms: int) -> np.ndarray:
    """Per id-index entry: may it go? Its bucket is done (ends at or before the checkpointed
    ``completed_ms``) and ended ``dedupe_window_ms`` or more before ``now_ms``."""
    end = bucket_start_ms.astype(np.int64) + bucket_ms
    return (end <= completed_ms) & (end + dedupe_window_ms <= now_ms)


@dataclass(frozen=True, slots=True)
class IdFileAction:
    first_seq: int
    action: str          # "delete" | "compact"
    keep: int            # entries kept


def id_file_actions(files: Sequence[tuple[int, int, int]], *, compact_ratio_min: float) -> list[IdFileAction]:
    """``files``: ``(first_seq, entries_used, entries_gone)`` of the *sealed* id files.
    A file whose every entry may go is deleted; one where at least ``compact_ratio_min``
    may go is compacted."""
    out = []
    for first_seq, used, gone in files:
        if used and gone >= used:
            out.append(IdFileAction(first_seq, "delete", 0))
        elif used and gone and gone >= compact_ratio_min * used:
            out.append(IdFileAction(first_seq, "compact", used - gone))
    return out


def slave_holds(peers: Sequence[str], fetched: Mapping[str, Mapping[str, int]], log_name: str, *,
                known: bool) -> dict[str, int]:
    """Holds of a master's slaves on ``log_name``: each registered peer holds from the next
    offset it asked for (0 - everything - until it has asked at all); a slave not (or no
    longer) registered holds nothing. ``known`` False (the group's membership not read yet
    after a start or promotion) holds everything."""
    if not known:
        return {"membership unknown": 0}
    return {f"slave:{p}": int(fetched.get(p, {}).get(log_name, 0)) for p in peers}


__all__ = ["ACTIVE", "BucketCut", "IdFileAction", "SegmentCut", "aged_segment_cut", "bucket_cut",
           "id_entries_gone", "id_file_actions", "segment_cut", "slave_holds"]
