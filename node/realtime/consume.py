"""Delivery: pulls, acks and nacks of a real-time node (the consume half of the message path).

Per-batch Python, per-message numpy (``shared/ARCHITECTURE.md``, "Hot path"):

1. ``pull(subjects, group)`` first redelivers this group's in-flight handles whose ack
   deadline passed (``now_ms >= pulled_at_ms + ack_timeout_ms``, oldest pull first), then
   hands out new positions from each subject's ``next``, the subjects sharing
   ``max_messages`` (``take_new``). It reads each needed frame once (``FrameCache``) and
   answers ``(Batch, handles)`` in log order; message ``i`` is of subject
   ``batch.subject(i)`` with handle ``handles[i]``. In-flight handles are ranges owned by
   the group, not by a consumer, so consumers of one group never get the same handle at
   once. A tag filter skips entries whose mask shares no bit with the requested tags; a
   skipped entry counts as acked *for this group*; the mask may match falsely, so the
   client checks tags exactly. An entry not visible yet (dispatched ahead of its due time,
   ``index.visible_ms``) stops its subject; the earliest such time is left in
   ``held_next_ms`` for the caller's wait.

   A retry copy of another group's nack (``hourglass.nacked_by`` names another group,
   ``node/realtime/nack.py`` ``other_groups_retries``) is not handed out: its handle is
   dropped from the group's in-flight set at once (settled for this group, counted in
   ``skipped_other_group_retry`` after ``delivered``/``redelivered``), so each group gets
   the retries of its own nacks only. When a round's whole batch was such copies the pull
   tries again, at most ``SETTLE_ROUNDS_MAX`` rounds.
2. ``ack`` / ``ack_many`` drop handle ranges from the in-flight set; ``nack`` returns the
   in-flight messages of its ranges (their deadline restarted) for the service to re-send,
   which then acks them.

Every call marks the groups it moved dirty (``ConsumerGroups``); documents are committed
by the store's flush or the service's commit round, never here.

Example::

    d = Delivery(indexes, groups, frames, settings, counters)
    batch, handles = d.pull(["orders"], "billing", max_messages=10, tags=(), now_ms=t, start="earliest")
    d.ack_pairs(groups.get("orders", "billing"), ix, [[0, len(handles)]], t)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from cluster.codec import Batch
from cluster.errors import InvalidArgument, Overloaded
from cluster.wire import SMALL_RANGES_MAX
from node.realtime.frames import FrameCache
from node.realtime.groups import ConsumerGroups, Group
from node.realtime.index import SubjectIndex, held_mask, tags_mask
from node.realtime.indexfiles import IndexFiles
from node.realtime.nack import other_groups_retries
from node.store.settings import RealtimeSettings

RANGE_END_MAX = 1 << 62  # an acked handle range ends at most here (handles are i64 positions)
SCAN_CHUNK_ENTRIES = 4096  # index entries read at once while a tag filter skips entries
SETTLE_ROUNDS_MAX = 4  # pull rounds when a round's whole batch was other groups' retry copies
EMPTY_BATCH = Batch.empty()
NO_HANDLES = np.zeros(0, np.uint64)


def cat_entries(arrays: list[np.ndarray]) -> np.ndarray:
    """Index entries of several reads as one array. Joined as bytes: ``np.concatenate`` of
    structured arrays promotes their fields pair by pair (~8 us per array, 16 per pull)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8) for a in arrays]).view(arrays[0].dtype)


def as_pairs(ranges) -> list[list[int]]:
    """Handle ranges as ``[[lo, hi], ...]`` from a (k, 2) array (``wire.unpack_ranges``) or pairs."""
    if isinstance(ranges, np.ndarray):
        pairs = ranges.astype(np.int64).reshape(-1, 2).tolist()
    else:
        pairs = [[int(a), int(b)] for a, b in ranges]
    if any(lo < 0 or hi <= lo for lo, hi in pairs):
        raise InvalidArgument("ranges", "every range must have 0 <= lo < hi")
    return pairs


def unpack_ranges(items: Sequence[tuple[str, bytes]]) -> list[list[list[int]]]:
    """Packed u64 LE ``[lo, hi)`` pairs per subject, decoded and checked as one array:
    ``InvalidArgument`` for a malformed range of any subject."""
    sizes = [len(raw) for _, raw in items]
    if any(n % 16 for n in sizes):
        raise InvalidArgument("ranges", "not a whole number of [lo, hi) pairs")
    joined = b"".join([raw for _, raw in items])
    if len(joined) <= 16 * SMALL_RANGES_MAX:  # the same rule by a loop: an ack of a small batch
        v = struct.unpack(f"<{len(joined) // 8}Q", joined)
        flat = [[v[i], v[i + 1]] for i in range(0, len(v), 2)]
        if not all(lo < hi <= RANGE_END_MAX for lo, hi in flat):
            raise InvalidArgument("ranges", "every range must have 0 <= lo < hi")
    else:
        r = np.frombuffer(joined, "<u8").reshape(-1, 2)
        if len(r) and bool((r[:, 1] <= r[:, 0]).any() or (r[:, 1] > np.uint64(RANGE_END_MAX)).any()):
            raise InvalidArgument("ranges", "every range must have 0 <= lo < hi")
        flat = r.astype(np.int64).tolist()
    out, at = [], 0
    for size in sizes:
        out.append(flat[at:at + size // 16])
        at += size // 16
    return out


def _runs(handles: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct handles as ``[lo, hi)`` runs of consecutive values."""
    if not len(handles):
        return []
    h = handles.astype(np.int64)
    breaks = np.flatnonzero(np.diff(h) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(h)]))
    return list(zip(h[starts].tolist(), (h[ends - 1] + 1).tolist()))


class Delivery:
    """See module docstring. Synchronous, not thread-safe."""

    def __init__(self, indexes: IndexFiles, groups: ConsumerGroups, frames: FrameCache,
                 settings: RealtimeSettings, counters: dict[str, int]) -> None:
        self.indexes = indexes
        self.groups = groups
        self.frames = frames
        self.settings = settings
        # the store's: delivered, redelivered, acked, skipped_by_tag, skipped_other_group_retry
        self.counters = counters
        self.rotation = 0  # which subject of a multi-subject pull goes first (fairness)
        self.held_next_ms: int | None = None  # after a pull: when the first entry it held back becomes visible

    def pull(self, subjects: list[str], group: str, *, max_messages: int, tags: Sequence[str], now_ms: int,
             start: str, horizon_ms: int | None = None, gate_ms: int | None = None) -> tuple[Batch, np.ndarray]:
        if not subjects:
            raise InvalidArgument("subjects", "name at least one subject")
        ixs = [self.indexes.index(s) for s in subjects]
        if not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidArgument("max_messages", "must be a positive integer")
        left = min(max_messages, self.settings.pull_max)
        tags = list(tags)
        if not all(isinstance(t, str) and t for t in tags):
            raise InvalidArgument("tags", "a tag filter holds non-empty strings")
        want = np.uint64(tags_mask(tags))
        groups = [self.groups.open_group(s, group, ix, start) for s, ix in zip(subjects, ixs)]
        for g, ix in zip(groups, ixs):
            self.groups.touch(g, ix, now_ms)
        for _ in range(SETTLE_ROUNDS_MAX):
            batch, handles = self.pull_once(subjects, groups, ixs, group, left, want, now_ms, horizon_ms, gate_ms)
            other = other_groups_retries(batch, group)
            if not other.any():  # first attempts: one compare of the attempts column
                return batch, handles
            self.settle_other_retries(batch, handles, other, groups)
            keep = np.flatnonzero(~other)
            if len(keep):
                return batch.take(keep), handles[keep]
            # the whole batch was other groups' retries: pull again rather than answer empty
        return EMPTY_BATCH, NO_HANDLES

    def pull_once(self, subjects: list[str], groups: list[Group], ixs: list[SubjectIndex], group: str, left: int,
                  want: np.uint64, now_ms: int, horizon_ms: int | None = None,
                  gate_ms: int | None = None) -> tuple[Batch, np.ndarray]:
        """One round of ``pull``: redeliveries, then new positions (module docstring, step 1)."""
        r = self.rotation % len(subjects)
        self.rotation += 1
        order = list(range(r, len(subjects))) + list(range(r))

        parts: list[tuple[np.ndarray, np.ndarray]] = []  # (entries, handles) per piece
        cutoff = now_ms - self.settings.ack_timeout_ms
        fd = self.indexes.fd
        for i in order:  # 1. redeliveries
            if left <= 0:
                break
            g, ix = groups[i], ixs[i]
            for a, b in g.inflight.take_due(cutoff, left, now_ms=now_ms):
                parts.append((ix.read(fd(ix), a, b - a), np.arange(a, b, dtype=np.int64)))
                left -= b - a
                self.counters["redelivered"] += b - a
                g.redelivered += b - a
                self.groups.mark_dirty(g)

        self.held_next_ms = None
        gate = gate_ms if not parts else None  # a redelivery answers the pull: nothing to wait for
        full = self.take_new(groups, ixs, left, want, now_ms, parts, horizon_ms, gate)  # 2. new positions
        if not parts:
            if full:
                raise Overloaded(f"group {group!r} has inflight_per_group_max="
                                 f"{self.settings.inflight_per_group_max} messages in flight")
            return EMPTY_BATCH, NO_HANDLES
        return self.gather(cat_entries([e for e, _ in parts]), np.concatenate([h for _, h in parts]))

    def settle_other_retries(self, batch: Batch, handles: np.ndarray, other: np.ndarray, groups: list[Group]) -> None:
        """Drop the handles of ``batch``'s messages marked in ``other`` (retry copies of other
        groups' nacks, ``nack.other_groups_retries``) from the pulling group's in-flight sets:
        settled for it at once, as if acked, never redelivered to it."""
        by_subject = {g.subject: g for g in groups}
        sel = np.flatnonzero(other)
        for k in np.unique(batch.subject_idx[sel]).tolist():
            g = by_subject[batch.subjects[k]]
            h = np.unique(handles[sel[batch.subject_idx[sel] == k]].astype(np.int64))
            n = g.inflight.remove(_runs(h))
            if n:
                self.groups.mark_dirty(g)
            self.counters["skipped_other_group_retry"] += n

    def take_new(self, groups: list[Group], ixs: list[SubjectIndex], left: int, want: np.uint64, now_ms: int,
                 parts: list, horizon_ms: int | None = None, gate_ms: int | None = None) -> bool:
        """Hand out up to ``left`` new positions over the groups, oldest in the log first, so
        that a pull covers few frames (one ``take`` each). Each round reads a chunk of every
        subject's unread entries (a little more than its share), merges the matching ones by
        log position and keeps the first ``left``; a subject's ``next`` moves past what it
        handed out and past skipped entries before it. Returns True when a group could not
        hand out because its in-flight set is full while its subject has more entries.

        A subject's entries are handed out in order up to the first one not visible yet
        (``visible_ms`` after ``now_ms``: dispatched ahead of its due time); the earliest such
        time over the subjects is left in ``held_next_ms`` for the caller's wait. With
        ``horizon_ms`` (a lookahead pull), "visible" means visible by then. With ``gate_ms``
        too (``RealtimeStore.pull_ahead``), nothing is handed out unless one of the entries it
        would hand out is visible by ``gate_ms``; then ``held_next_ms`` is the earliest of them
        (the caller waits for the gate), and nothing moves."""
        vis = now_ms if horizon_ms is None else max(now_ms, horizon_ms)
        scan_left = self.settings.pull_scan_entries_max
        full = False
        hold_window = self.settings.visible_hold_ms_max + self.settings.visible_step_ms
        held: set[int] = set()  # groups stopped at an entry not visible yet
        fd = self.indexes.fd
        counters = self.counters
        while left > 0 and scan_left > 0:
            live = []
            for g, ix in zip(groups, ixs):
                if g.next_pos < ix.count and id(g) not in held:
                    room = self.settings.inflight_per_group_max - len(g.inflight)
                    if room > 0:
                        live.append((g, ix, room))
                    else:
                        full = True
            if not live:
                break
            share = -(-left // len(live))
            chunk = share + share // 4 + 8 if not want else max(2 * share, 64)
            chunk = max(1, min(chunk, SCAN_CHUNK_ENTRIES, scan_left // len(live)))
            cands = []
            for g, ix, room in live:
                if ix.held_pos == g.next_pos and vis < ix.held_visible_ms <= vis + hold_window:
                    # its next entry is one a pull found held, still held (``held_mask``): no read
                    at = ix.held_visible_ms
                    self.held_next_ms = at if self.held_next_ms is None else min(self.held_next_ms, at)
                    held.add(id(g))
                    continue
                e = ix.read(fd(ix), g.next_pos, chunk)
                if ix.held_until > vis:
                    late = np.flatnonzero(held_mask(e["visible_ms"], vis, hold_window))
                    if len(late):
                        cut = int(late[0])
                        at = int(e["visible_ms"][cut])
                        ix.held_pos, ix.held_visible_ms = g.next_pos + cut, at
                        self.held_next_ms = at if self.held_next_ms is None else min(self.held_next_ms, at)
                        held.add(id(g))
                        e = e[:cut]
                if want:
                    sel = np.flatnonzero(e["mask"] & want)
                    cands.append((g, e, sel, min(room, len(sel))))
                else:  # every entry matches: prefixes are slices
                    cands.append((g, e, None, min(room, len(e))))
            if not cands:  # every live group was held at its next entry: the next round finds none live
                continue
            if gate_ms is not None:  # the first round only: is one of these visible by the gate?
                early = self._gate_closed(cands, gate_ms, hold_window)
                if early is not None:
                    self.held_next_ms = early if self.held_next_ms is None else min(self.held_next_ms, early)
                    return full
                gate_ms = None
            offsets = np.concatenate([e["offset"][:k] if sel is None else e["offset"][sel[:k]]
                                      for _, e, sel, k in cands])
            index = np.concatenate([e["index"][:k] if sel is None else e["index"][sel[:k]] for _, e, sel, k in cands])
            owner = np.repeat(np.arange(len(cands)), [k for *_, k in cands])
            if len(owner) > left:  # keep the oldest ``left``: per subject, a prefix of what matched
                first = np.lexsort((index, offsets))[:left]
                taken = np.bincount(owner[first], minlength=len(cands)).tolist()
            else:
                taken = [k for *_, k in cands]
            for (g, e, sel, _), t in zip(cands, taken):
                if sel is None:  # no tag filter: the first t entries
                    used = t
                    if t:
                        parts.append((e[:t], np.arange(g.next_pos, g.next_pos + t, dtype=np.int64)))
                        g.inflight.add(g.next_pos, g.next_pos + t, now_ms)
                else:
                    used = int(sel[t]) if t < len(sel) else len(e)  # stop at the first match not handed out
                    if t:
                        handles = g.next_pos + sel[:t]
                        parts.append((e[sel[:t]], handles))
                        g.inflight.add_runs(_runs(handles), now_ms)
                counters["skipped_by_tag"] += used - t
                counters["delivered"] += t
                g.next_pos += used
                if used:
                    self.groups.mark_dirty(g)
                left -= t
                scan_left -= used
        return full

    @staticmethod
    def _gate_closed(cands: list, gate_ms: int, hold_window: int) -> int | None:
        """None when an entry ``take_new`` would hand out of ``cands`` is visible by
        ``gate_ms``; else when the first of them becomes so."""
        vis = np.concatenate([e["visible_ms"][:k] if sel is None else e["visible_ms"][sel[:k]]
                              for _, e, sel, k in cands])
        if not len(vis) or not held_mask(vis, gate_ms, hold_window).all():
            return None
        return int(vis.min())

    def gather(self, entries: np.ndarray, handles: np.ndarray) -> tuple[Batch, np.ndarray]:
        """The messages ``entries`` point at, in log order: one take per frame, one concat."""
        order = np.lexsort((entries["index"], entries["offset"]))
        offsets = entries["offset"][order]
        index = entries["index"][order]
        cuts = np.flatnonzero(np.diff(offsets)) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = np.concatenate((cuts, [len(order)])).tolist()
        frame = self.frames.get
        if len(starts) == 1:
            return frame(int(offsets[0])).take(index), handles[order].astype(np.uint64)
        return Batch.gather([(frame(int(offsets[a])), index[a:b]) for a, b in zip(starts, ends)]), \
            handles[order].astype(np.uint64)

    def ack_pairs(self, g: Group, ix: SubjectIndex, pairs: list, now_ms: int) -> int:
        """The group is active; drop ``pairs`` from its in-flight set. Returns handles dropped."""
        self.groups.touch(g, ix, now_ms)
        n = g.inflight.remove(pairs)
        if n:
            self.groups.mark_dirty(g)
            self.counters["acked"] += n
        return n

    def ack_many(self, group: str, items: Sequence[tuple[str, bytes]], now_ms: int) -> int:
        """Acks of several subjects' packed ranges, decoded and checked as one array first
        (nothing acked when any is malformed)."""
        n = 0
        for (subject, _), pairs in zip(items, unpack_ranges(items)):
            ix = self.indexes.index(subject)
            g = self.groups.get(subject, group)
            if g is not None and pairs:
                n += self.ack_pairs(g, ix, pairs, now_ms)
        return n

    def nack(self, subject: str, group: str, ranges, now_ms: int) -> tuple[Batch, np.ndarray]:
        ix = self.indexes.index(subject)
        g = self.groups.get(subject, group)
        if g is None:
            return EMPTY_BATCH, NO_HANDLES
        pairs = as_pairs(ranges)
        self.groups.touch(g, ix, now_ms)
        found = g.inflight.touch(pairs, now_ms)
        if not found:
            return EMPTY_BATCH, NO_HANDLES
        entries = np.concatenate([ix.read(self.indexes.fd(ix), a, b - a) for a, b in found])
        handles = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in found])
        return self.gather(entries, handles)
