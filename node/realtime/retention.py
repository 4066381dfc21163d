"""Retention decisions of a real-time node: which message-log segments may go now, which
consumer groups stopped holding data back, which consume indexes to compact. Pure: group
positions, offsets, ``now_ms`` and limits in, a decision out. ``RealtimeStore.retention_plan``
applies it (renames on the caller's thread, deletions and copies on a worker thread),
``node/realtime/service.py`` runs it every ``retention_interval_ms``.

Rules (``docs/design.md``, "Real-time retention"): a sealed segment goes when **both**

(a) nothing still needs its bytes - every *hold* is past its end. Holds (``name -> offset``):
    ``group:{subject}/{group}`` the frame of the group's committed position (its lowest
    unacked handle; a group with nothing unacked holds nothing), unless the group is idle
    (no pull, ack or nack for longer than ``group_idle_ms_max``): an idle group holds
    nothing, and when it comes back its position moves to the first entry still on disk;
    ``dedup`` the oldest frame inside the dedup window (a restart rebuilds the window from
    those frames); ``checkpoint`` the persisted ``indexed_offset`` (every message below it
    has its index entry on disk; replay at open starts there); ``slave:{id}`` the next offset
    each registered slave asks for (a master that has not read its group yet: everything);
(b) it is due: sealed longer than ``retention_ms`` ago, or the log is over
    ``retention_bytes`` (0 = no size limit) counting from the oldest segment.

So unconsumed data of an active group is never deleted, however old or large the log:
(b) only decides *when* consumed data goes (Kafka would delete by (b) alone).

A segment's age counts from when it was sealed: the ``store_ms`` of the first frame of the
next segment (the append that did not fit), so age follows the node's clock, not file times.

Index compaction: entries below a subject's ``live_from`` (the first entry whose frame is
still on disk) are dead; the file is rewritten without them once the dead part is at least
``entries_min`` entries and at least ``ratio_min`` of the file (each entry is then copied
O(1) times on average).

Worked example (segments ``(base, size, sealed_ms)``: (0, 100, 1000), (100, 100, 2000),
(200, 50, active); ``now_ms=10_000``, ``retention_ms=5000``; group ``s/a`` committed at a
frame in segment 100, group ``s/b`` idle): holds ``{"group:s/a": 150}``, segment 0 ends at
100 <= 150 and was sealed 9000 ms ago: it goes; segment 100 ends at 200 > 150: kept,
``held_by="group:s/a"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from node.store.retention import SegmentCut, aged_segment_cut
from node.store.settings import REALTIME_DEFAULTS

COMPACT_RATIO_MIN = 0.5
COMPACT_ENTRIES_MIN = REALTIME_DEFAULTS.index_compact_entries_min  # 128 KiB of dead entries before a rewrite


@dataclass(frozen=True, slots=True)
class GroupPosition:
    """What retention needs of one consumer group."""

    key: str                # "{subject}/{group}"
    hold_offset: int | None  # frame offset of its committed position; None: holds nothing (all acked, or behind)
    active_ms: int          # last pull, ack or nack


@dataclass(frozen=True, slots=True)
class Decision:
    cut: SegmentCut
    holds: dict[str, int] = field(default_factory=dict)
    idle: list[str] = field(default_factory=list)   # groups idle past the limit (they hold nothing)


def idle_groups(groups: Sequence[GroupPosition], *, now_ms: int, idle_ms_max: int) -> list[str]:
    """Keys of the groups with no activity for longer than ``idle_ms_max``."""
    return [g.key for g in groups if now_ms - g.active_ms > idle_ms_max]


def decide(segments: Sequence[tuple[int, int, int]], end_offset: int, groups: Sequence[GroupPosition], *,
           now_ms: int, retention_ms: int, retention_bytes: int, group_idle_ms_max: int,
           dedup_offset: int | None, indexed_offset: int, slave_holds: Mapping[str, int] | None = None) -> Decision:
    """The cut of the message log (``segments``: ``(base, size, sealed_ms)`` ascending, the
    last one active) under the rules of the module docstring."""
    idle = idle_groups(groups, now_ms=now_ms, idle_ms_max=group_idle_ms_max)
    gone = set(idle)
    holds = {f"group:{g.key}": g.hold_offset for g in groups if g.key not in gone and g.hold_offset is not None}
    holds["checkpoint"] = indexed_offset
    if dedup_offset is not None:
        holds["dedup"] = dedup_offset
    holds.update(slave_holds or {})
    cut = aged_segment_cut(segments, end_offset, holds, now_ms=now_ms, age_ms_max=retention_ms,
                           bytes_max=retention_bytes or None)
    return Decision(cut, holds, idle)


def compact_index(base: int, count: int, live_from: int, *, entries_min: int = COMPACT_ENTRIES_MIN,
                  ratio_min: float = COMPACT_RATIO_MIN) -> bool:
    """Whether a subject's index file (entries ``[base, count)``, dead below ``live_from``)
    is worth rewriting without its dead prefix."""
    dead = live_from - base
    return dead > 0 and dead >= entries_min and dead >= ratio_min * (count - base)


__all__ = ["COMPACT_ENTRIES_MIN", "COMPACT_RATIO_MIN", "Decision", "GroupPosition", "compact_index", "decide",
           "idle_groups"]
