"""Appender: the append half of a real-time node's message path (``RealtimeStore.append``).

It owns the seq counter of the store's epoch and what the last append left for the service
(``appended_visible_ms``). One call: check the batch (``accept.validate``; subjects not
known are refused through the registry), ask ``accept.assign_seqs`` which messages are new,
and write those as one message-log frame plus one run of index entries per subject; their
ids go into the dedup window and the decoded frame into the frame cache.

Invariants: a refused message changes nothing; a frame whose index write fails (no space
left) is cut off the log again, so nothing of the refused batch stays; seqs of one epoch
never repeat (``counter`` moves by every message written). The store checks that it is open
and keeps the offset below which every message is indexed; nothing here reads a clock.

Example::

    a = Appender(messages, indexes, dedup, frames, subjects, settings, counters, frame_bytes_max=n, root=root)
    res = a.append(Batch.build("orders", [b"x"], ["id-1"], [t]), epoch=1, now_ms=t, refused_subjects={})
    # res.seqs[0] == make_seq(1, 0); a.counter == 1
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cluster.codec import OK, Batch
from cluster.errors import DiskFull, HourglassError, InvalidArgument, PayloadTooLarge
from cluster.wire import BatchResult
from node.realtime.accept import assign_seqs, encoded_size, validate, with_ids
from node.realtime.dedup import DedupWindow, keys_of
from node.realtime.frames import FrameCache
from node.realtime.index import batch_tag_masks, frame_runs, visible_ms
from node.realtime.indexfiles import IndexFiles
from node.realtime.subjects import SubjectRegistry
from node.store.log import SegmentedLog
from node.store.settings import RealtimeSettings

log = logging.getLogger("hourglass.realtime.store")

DEDUP_FULL_LOG_EVERY_MS = 60_000  # "dedup map full" is logged at most this often


class Appender:
    """See module docstring. Synchronous, not thread-safe (the store's thread)."""

    def __init__(self, messages: SegmentedLog, indexes: IndexFiles, dedup: DedupWindow, frames: FrameCache,
                 subjects: SubjectRegistry, settings: RealtimeSettings, counters: dict[str, int], *,
                 frame_bytes_max: int, root: Path) -> None:
        self.messages = messages
        self._indexes = indexes
        self._dedup = dedup
        self._frames = frames
        self._subjects = subjects
        self.settings = settings
        self.counters = counters
        self.frame_bytes_max = frame_bytes_max  # one frame holds one whole batch
        self.root = root
        self.counter = 0  # the next seq counter of the store's epoch
        self.appended_visible_ms = 0  # after an append: when its first message becomes visible
        self._dedup_full_logged_ms = -DEDUP_FULL_LOG_EVERY_MS

    def append(self, batch: Batch, *, epoch: int, now_ms: int,
               refused_subjects: dict[str, HourglassError]) -> BatchResult:
        """``RealtimeStore.append`` of an open store, seqs of ``epoch``."""
        limits = self.settings.limits
        n = batch.n
        if n > limits.batch_messages_max:
            raise InvalidArgument("batch", f"{n} messages exceeds batch_messages_max {limits.batch_messages_max}")
        res = BatchResult.sized(n)
        if not n:
            return res
        res.deliver_at_ms[:] = batch.deliver_at_ms
        batch = with_ids(batch)
        size = encoded_size(batch)
        if size > self.frame_bytes_max:
            raise PayloadTooLarge("batch", f"{size} bytes exceeds one frame ({self.frame_bytes_max} bytes)")
        self._dedup.expire(now_ms)
        codes, errors = validate(batch, now_ms=now_ms, limits=limits)
        self._subjects.refuse_unknown(batch, codes, errors, refused_subjects, now_ms=now_ms)

        ok = np.flatnonzero(codes == OK)
        sub = batch if len(ok) == n else batch.take(ok)  # ok is sorted: all of them is the batch itself
        keys = keys_of(sub.subject_list(), sub.id_list())
        seqs, dup, new = assign_seqs(keys, self._dedup, epoch=epoch, counter=self.counter)
        res.codes[:] = codes
        res.errors = errors
        res.seqs[ok] = seqs
        res.duplicates[ok[dup]] = 1
        self.counters["duplicates"] += int(dup.sum())
        k = len(new)
        if k:
            if k == sub.n:  # new is sorted: all of them is sub itself
                self._store_frame(sub, seqs, keys, now_ms)
            else:
                self._store_frame(sub.take(new), seqs[new], [keys[i] for i in new.tolist()], now_ms)
        return res

    def _store_frame(self, stored: Batch, seqs: np.ndarray, keys: list, now_ms: int) -> None:
        """Append one frame and its index runs; remember its ids and keep it decoded for pulls."""
        stored = stored.replace(seq=seqs, store_ms=now_ms)
        parts = stored.encode_parts()  # the body goes to one writev, never joined: two copies of it fewer
        off = self.messages.append_parts(parts)
        self.counter += stored.n
        vis = visible_ms(stored, now_ms, self.settings.visible_hold_ms_max, self.settings.visible_step_ms)
        held = int(vis.max())
        self.appended_visible_ms = int(vis.min())
        runs = frame_runs(offset=off, subject_idx=stored.subject_idx, visible_ms=vis, masks=batch_tag_masks(stored))
        try:
            self._indexes.append_frame(off, runs, stored.subjects, held)
        except DiskFull:  # rare: the refused batch leaves nothing behind
            self.messages.truncate(off)
            log.error("append undone: index write hit no space left path=%s offset=%d", self.messages.directory, off)
            raise
        evicted = self._dedup.add(keys, seqs, store_ms=now_ms, offset=off)
        if evicted:
            self._dedup_full(evicted, now_ms)
        self._frames.put(off, stored, sum(map(len, parts)))
        self.counters["appended"] += stored.n

    def _dedup_full(self, evicted: int, now_ms: int) -> None:
        """The dedup map reached ``dedup_entries_max``: the oldest ids were forgotten before
        their window ended (the window is shorter while the rate is this high). Counted,
        and said at most once per ``DEDUP_FULL_LOG_EVERY_MS``; never a reason to refuse."""
        self.counters["dedup_evicted_early"] += evicted
        if now_ms - self._dedup_full_logged_ms >= DEDUP_FULL_LOG_EVERY_MS:
            self._dedup_full_logged_ms = now_ms
            oldest = self._dedup.oldest_store_ms()
            oldest = now_ms if oldest is None else oldest
            log.warning("dedup map full path=%s dedup_entries_max=%d: ids are remembered for %d ms, not "
                        "dedup_window_ms=%d (evicted early so far: %d)", self.root, self.settings.dedup_entries_max,
                        now_ms - oldest, self.settings.dedup_window_ms, self.counters["dedup_evicted_early"])


__all__ = ["DEDUP_FULL_LOG_EVERY_MS", "Appender"]
