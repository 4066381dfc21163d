"""Healing of a delay node's derived data: a schedule bucket rebuilt from the message log.

The schedule log (data + index + heads per bucket) is derived data (``docs/design.md``,
"Durability"): everything in it was first appended to the message log, and the dispatch
log says what was delivered. So a bucket that fails a check is not a reason to stop: it is
re-filed, records due in it taken from the message log in log order, and swapped in by
rename (``ScheduleLog.replace_bucket``, crash-safe).

Which records go back into bucket ``B`` (records below the store's iterate offset, the
ones that were filed; later ones are filed by the iterator as usual), and under which
effective time, so that the new bucket holds what the old one held:

* a cancel tombstone: its own ``deliver_at_ms`` (its target's effective time, as filed);
* a message that was dispatched: the effective time in its dispatch record (known from
  the dispatch log when ``B`` is not in the future, from memory otherwise: a dispatched
  message due in a future bucket is in the store's recent-dispatch map);
* a cancelled message: its tombstone's effective time (the tombstone removes it from the
  same second when the second is loaded);
* any other message: ``max(deliver_at_ms, persisted completed_ms)``, the filing rule. A
  message the old bucket held under ``e`` is undispatched, so ``completed_ms <= e``; the
  persisted value only grows, so the rule puts it in the same bucket again (a message
  filed behind the wheel may move to a later second of it, never to a second already
  dispatched).

Voided seqs (a divergent suffix cut off) are left out. Records the message log cannot give
back are **salvaged** from the old bucket: every frame of its data log that still passes its
CRCs is kept as it was (same effective time); a corrupt frame is skipped (by its length when
only the body is bad, else by a search for the next good header, at most
``RESYNC_BYTES_MAX``). The message log cannot give back a record when retention deleted its
segment, or when the log itself is corrupt there: a second fault. The rebuild reads the log
around a corrupt record (``readable_records``: skipped by its length, or up to the next
frame that passes its checks, or to the next segment), notes it (``HealFault``, logged and
counted) and goes on; the records it held come from the old bucket's good frames. The same
holds for a corrupt dispatch-log record (its messages may then be delivered twice: at least
once, never lost). Which records the log holds is known by seq: seqs grow with the log, so
the readable records cover a few seq intervals (``LogScan``), one per store epoch plus one
more per corrupt spot; a filed record outside them comes from the old bucket.

**Missing records.** A record in a corrupt frame that the message log cannot give back is
missing from the rebuilt bucket. The rebuild reads what it can of the damaged frame without
trusting its checksum (its ids, seqs, due times; else the frame's index entry: a seq range
and a count) and writes it down in the bucket folder, ``lost.json`` (``node/delay/missing.py``,
written into the new bucket before the swap, so the two agree after any crash). Only records not yet
delivered count: due at or after ``completed_ms``, not in a dispatch record, not cancelled.
Then:

* a replicated node fetches the bucket's frames from another member of its group (its copy
  is filed from the same message log: same records, same effective times), keeps the missing
  ones (checked by CRC, frame by frame) and rebuilds the bucket again with them
  (``rebuild(extra=...)``), trying every member, again with a backoff while none answers
  (``fetch_due``, ``fetch_failed``); when every member answered and none had them, they are
  lost (``give_up``);
* a single node has nowhere to ask: ``give_up`` at once.

``give_up`` logs the ids at ERROR, counts them (``lost_records``; the node's metric
``hourglass_lost_records``) and marks ``lost.json`` lost: ``admin verify`` lists them until
retention deletes the bucket.

**Records the wheel already passed.** A record is missing from the moment of the rebuild: a
master's wheel may load its second from the rebuilt bucket before the fetch brings it back
(the current hour: the wheel itself is often what found the corrupt frame). Each missing
record remembers ``from_ms``, the end of what the wheel had loaded when it went missing (a
slave: its ``completed_ms``; lowered to ``completed_ms`` whenever a wheel starts again, at
open and promotion). A fetched record due before the wheel's ``loaded_until_ms`` and at or
after its ``from_ms`` was never handed to the wheel: it is filed again under the filing rule,
``max(effective_ms, persisted completed_ms)`` (the last millisecond of the bucket at most),
and given to the wheel (``DelayStore._rebuilt``), which fires it as overdue. Example: the
wheel finds frame F of the current hour corrupt while loading second 12:00:07; F's records
due 12:00:07.200 and 12:00:09.000 are missing, ``from_ms`` 12:00:07.000. The fetch returns
at 12:00:08.300 (wheel loaded until 12:00:09.000): the first is filed again at
12:00:08.100 (the persisted ``completed_ms``) and fires at once; the second is still ahead
of the wheel and stays in the bucket at 12:00:09.000.

``BucketHealer.check_soon`` runs at open, before the node announces serving: the buckets
the wheel loads first are verified (``Bucket.verify``: the whole index and heads, and the
frames due within ``verify_ahead_ms``) and rebuilt when they fail. Later buckets are rebuilt
when opening or reading them fails (``ScheduleLog._healing``).

The healer talks to its store only through ``HealedStore`` (the files, the store's progress,
its voided and recently delivered seqs, and ``bucket_rebuilt`` to hand records back), and
reads no clock: ``rebuild``, ``fetch_due`` and ``fetch_failed`` take ``now_ms`` (a rebuild a
read ran into takes the store's latest ``now_ms``). Reading around damage is
``node/delay/salvage.py``.
"""

from __future__ import annotations

import logging
import time  # perf_counter: a rebuild's elapsed_ms for its log line, no rule reads it
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from cluster.codec import KIND_CANCEL, KIND_MESSAGE, Batch, DispatchBatch
from cluster.errors import CorruptRecord, InvalidArgument
from node.delay.missing import LOST_FILE, Missing, damaged_records, ids_text, read_missing
from node.delay.salvage import (
    HealFault, LogScan, group_by_second, readable_records, refile_times, salvage_frames)
from node.store import checkpoint, records
from node.store.log import SegmentedLog
from node.store.schedule import ScheduleLog
from node.store.settings import StoreSettings

log = logging.getLogger("hourglass.delay.heal")

REBUILDS_PER_BUCKET_MAX = 3      # a bucket failing again after this many rebuilds ...
REBUILD_WINDOW_MS = 600_000      # ... within this long is a bug or a dying disk: the error is raised
FAULTS_KEPT_MAX = 32         # recent faults shown in Status
FETCH_RETRY_MS_MIN = 200     # a failed fetch of a bucket's missing records is tried again after this ...
FETCH_RETRY_MS_MAX = 30_000  # ... doubling up to this



class HealedStore(Protocol):
    """What the healer needs of the store it heals, and all it touches (``DelayStore``
    implements it): the files it reads and swaps buckets in, the store's progress, and two
    answers of its core. No private attribute, no clock: time comes in as ``now_ms``."""

    settings: StoreSettings
    schedule: ScheduleLog
    messages: SegmentedLog
    dispatch: SegmentedLog
    iterate_offset: int

    @property
    def epoch(self) -> int: ...
    @property
    def follower(self) -> bool: ...
    @property
    def completed_ms(self) -> int: ...
    @property
    def persisted_completed_ms(self) -> int: ...
    @property
    def loaded_until_ms(self) -> int:
        """The end of what the wheel has loaded."""
    @property
    def now_ms(self) -> int:
        """The latest ``now_ms`` a caller gave the store (a rebuild found by a read has no other)."""

    def voided_mask(self, seq: np.ndarray) -> np.ndarray | None:
        """Which seqs were cut off the message log (None: none ever were)."""

    def delivered_recently(self) -> dict[int, int]:
        """seq -> effective_ms of messages delivered at or after the persisted ``completed_ms``."""

    def bucket_rebuilt(self, start_ms: int, *, late: Batch | None, cancelled: np.ndarray | None) -> None:
        """Bucket ``start_ms`` was swapped: ``late`` records to hand to the wheel, ``cancelled``
        targets to take out of it."""


@dataclass(slots=True)
class _Rebuild:
    """What one rebuild of bucket ``start_ms`` found while its records went by."""

    start_ms: int
    end_ms: int
    scan: LogScan
    extra: list[Batch] | None
    messages: int = 0            # records refiled from the message log
    salvaged: int = 0            # records kept from the old bucket's good frames
    skipped: list[tuple[int, int]] = field(default_factory=list)  # damaged spans of the old bucket's data
    seen: list[np.ndarray] = field(default_factory=list)         # seqs taken from the old bucket or a member
    cancelled: list[np.ndarray] = field(default_factory=list)    # targets of the tombstones taken so
    fetched: list[np.ndarray] = field(default_factory=list)      # seqs a member gave back
    late: list[Batch] = field(default_factory=list)              # fetched records the wheel passed: filed again
    missing: Missing | None = None

    @property
    def damaged_bytes(self) -> int:
        return sum(z - a for a, z in self.skipped)


class BucketHealer:
    """Verifies and rebuilds schedule buckets of one ``DelayStore``; keeps their missing
    records (``missing``, bucket start -> ``Missing``) and counts what it did."""

    def __init__(self, store: HealedStore) -> None:
        self.store = store
        self.counters = {"corrupt_found": 0, "buckets_rebuilt": 0, "frames_rebuilt": 0, "damaged_bytes": 0,
                         "missing_records": 0, "fetched_records": 0, "lost_records": 0, "faults": 0}
        self.fault_counts: dict[str, int] = {}      # kind -> faults met while healing
        self.recent_faults: deque[HealFault] = deque(maxlen=FAULTS_KEPT_MAX)
        self._rebuilds: dict[int, list[int]] = {}  # bucket -> now_ms of its recent rebuilds
        self.missing: dict[int, Missing] = {}
        self._load_missing()

    # ------------------------------------------------------------------ missing records

    def _load_missing(self) -> None:
        """``lost.json`` of every bucket, at open: a wheel starts again from ``completed_ms``."""
        s = self.store
        for start in s.schedule.bucket_starts():
            path = s.schedule.bucket_path(start)
            if not (path / LOST_FILE).exists():
                continue
            try:
                m = read_missing(path)
            except (CorruptRecord, ValueError, KeyError, TypeError) as e:
                self.fault(HealFault("rebuild", str(path / LOST_FILE), 0, f"unreadable: {e}"))
                continue
            if m is None:
                continue
            m.wheel_restarted(s.completed_ms)
            self.missing[start] = m
            log.error("schedule bucket has %s records bucket=%d records=%d messages=[%s] cancels=[%s]",
                      "lost" if m.lost else "missing", start, m.count, ids_text(m.messages()), ids_text(m.cancels()))
        self._count_missing()

    def _count_missing(self) -> None:
        self.counters["missing_records"] = sum(m.count for m in self.missing.values() if not m.lost)

    def wheel_restarted(self) -> None:
        """The store's wheel starts again (promotion) from its ``completed_ms``."""
        for m in self.missing.values():
            m.wheel_restarted(self.store.completed_ms)

    def forget_deleted(self) -> None:
        """Drop what is kept of buckets that retention deleted."""
        for start in [b for b in self.missing if not self.store.schedule.exists(b)]:
            del self.missing[start]
        self._count_missing()

    def fetch_due(self, now_ms: int) -> list[int]:
        """Buckets whose missing records should be asked for now (``now_ms``: monotonic)."""
        return [b for b, m in self.missing.items() if not m.lost and m.next_try_ms <= now_ms]

    def fetch_failed(self, start_ms: int, now_ms: int) -> None:
        """No member answered for bucket ``start_ms``: ask again later (backoff)."""
        m = self.missing.get(start_ms)
        if m is not None:
            m.attempts += 1
            m.next_try_ms = now_ms + min(FETCH_RETRY_MS_MAX, FETCH_RETRY_MS_MIN << min(m.attempts, 16))

    def give_up(self, start_ms: int, why: str) -> None:
        """The missing records of bucket ``start_ms`` are lost: logged with their ids, counted,
        written down (``lost.json``) for ``admin verify``."""
        m = self.missing.get(start_ms)
        if m is None or m.lost:
            return
        m.lost = True
        self.counters["lost_records"] += m.count
        path = self.store.schedule.bucket_path(start_ms)
        if path.is_dir():
            try:
                checkpoint.write_atomic(path / LOST_FILE, m.doc())
            except OSError as e:
                self.fault(HealFault("rebuild", str(path / LOST_FILE), 0, f"not written: {e}"))
        self._count_missing()
        log.error("acknowledged records LOST bucket=%d records=%d messages=[%s] cancels=[%s] seq_ranges=%s "
                  "unreadable_bytes=%d (%s); the ids are in %s and `hourglass admin verify`; see docs/operations.md, "
                  "\"Self-healing and scrubbing\"", start_ms, m.count, ids_text(m.messages()),
                  ids_text(m.cancels()), [[lo, hi, n] for lo, hi, n, _ in m.ranges], m.unknown_bytes, why,
                  path / LOST_FILE)

    def report(self) -> list[dict]:
        """Missing and lost records of every bucket (``admin verify``, Status)."""
        return [m.summary(str(self.store.schedule.bucket_path(b) / LOST_FILE)) for b, m in sorted(self.missing.items())]

    def fault(self, f: HealFault) -> None:
        """A second fault met while healing: logged, counted, kept for Status; healing goes on."""
        self.counters["faults"] += 1
        self.fault_counts[f.kind] = self.fault_counts.get(f.kind, 0) + 1
        self.recent_faults.append(f)
        log.error("fault while healing kind=%s path=%s offset=%d reason=%r; the node keeps serving", f.kind,
                  f.where, f.offset, f.reason)

    def status(self) -> dict:
        """``healing`` in Status: the counters, faults by kind, recent faults, missing records."""
        return {**self.counters, "faults_by_kind": dict(self.fault_counts),
                "recent_faults": [[f.kind, f.where, f.offset, f.reason] for f in self.recent_faults],
                "missing": self.report()}

    # ------------------------------------------------------------------ verify and rebuild

    def check_soon(self, *, ahead_ms: int) -> None:
        """Verify the buckets the wheel loads first, rebuilding any that fails: the whole
        index and heads of the bucket holding ``completed_ms`` and of the one ``ahead_ms``
        later (numpy, no frame read), and every frame due in ``[completed_ms, +ahead_ms]``
        (``Bucket.verify``). Bounded by that window, not by the bucket's size, so a
        promotion stays fast. Later frames are checked when they are read."""
        s = self.store
        c = s.completed_ms
        seq_below = records.make_seq(s.epoch, 0)  # no seq of this epoch is issued yet
        for start in sorted({s.schedule.bucket_start(c), s.schedule.bucket_start(c + ahead_ms)}):
            b = s.schedule.bucket(start, create=False)  # an open that fails is rebuilt here
            if b is None:
                continue
            lo = max(0, (c - start) // 1000)
            hi = min(b.seconds, (c + ahead_ms - start) // 1000 + 1)
            try:
                b.verify(seconds=range(lo, max(lo, hi)), seq_below=seq_below)
            except CorruptRecord as e:
                self.rebuild(start, e)

    def rebuild(self, start_ms: int, why: CorruptRecord, *, extra: list[Batch] | None = None,
                source: str = "", now_ms: int | None = None) -> None:
        """Re-file bucket ``start_ms`` from the message log and swap it in. ``extra``: frames
        of the same bucket from ``source``, a member of the group, for its missing records
        (module docs). Faults met on the way (a corrupt message-log or dispatch-log record)
        are read around and reported; what stays missing is written down. ``now_ms`` paces
        repeated rebuilds of one bucket (``REBUILDS_PER_BUCKET_MAX`` in ``REBUILD_WINDOW_MS``);
        None: the store's latest ``now_ms`` (a rebuild a read ran into has no caller's time)."""
        s = self.store
        if extra is None:
            self.counters["corrupt_found"] += 1
            now = s.now_ms if now_ms is None else now_ms
            recent = [t for t in self._rebuilds.get(start_ms, []) if now - t < REBUILD_WINDOW_MS]
            if len(recent) >= REBUILDS_PER_BUCKET_MAX:
                log.error("schedule bucket keeps failing bucket=%d rebuilds=%d in %d s error=%s", start_ms,
                          len(recent), REBUILD_WINDOW_MS // 1000, why)
                raise why
            self._rebuilds[start_ms] = recent + [now]
            log.warning("schedule bucket corrupt, rebuilding from the message log bucket=%d path=%s offset=%d "
                        "reason=%r", start_ms, why.path, why.offset, why.reason)
        t0 = time.perf_counter()
        end_ms = start_ms + s.settings.bucket_ms
        r = _Rebuild(start_ms, end_ms, self._scan(start_ms, end_ms), extra)
        frames = s.schedule.replace_bucket(start_ms, self._chunks(r),
                                           before_swap=lambda tmp: self._write_missing(r, tmp))
        for f in r.scan.faults:
            self.fault(f)
        if extra is None:  # a rebuild with a member's records completes an earlier one (fetched_records)
            self.counters["buckets_rebuilt"] += 1
        self.counters["frames_rebuilt"] += frames
        fetched = np.concatenate(r.fetched) if r.fetched else np.zeros(0, np.uint64)
        late = Batch.concat(r.late) if r.late else None
        log.warning("schedule bucket rebuilt bucket=%d frames=%d records=%d salvaged=%d fetched=%d refiled_late=%d "
                    "damaged_bytes=%d messages_from=%d iterate_offset=%d faults=%d elapsed_ms=%d", start_ms, frames,
                    r.messages, r.salvaged, len(fetched), 0 if late is None else late.n, r.damaged_bytes,
                    s.messages.start_offset, s.iterate_offset, len(r.scan.faults), (time.perf_counter() - t0) * 1000)
        self.missing.pop(start_ms, None)
        if r.missing is not None:
            self.missing[start_ms] = r.missing
        if extra is not None:
            self.counters["fetched_records"] += len(fetched)
            log.warning("schedule bucket completed from a member address=%s bucket=%d records_fetched=%d "
                        "still_missing=%d", source, start_ms, len(fetched), 0 if r.missing is None else r.missing.count)
        if r.damaged_bytes:
            self.counters["damaged_bytes"] += r.damaged_bytes
        if r.skipped and r.missing is not None:
            m = r.missing
            log.error("schedule bucket rebuild incomplete bucket=%d: %d corrupt bytes held records the message log "
                      "no longer has (deleted by retention, or corrupt there too): %d records missing messages=[%s] "
                      "cancels=[%s] seq_ranges=%s unreadable_bytes=%d; a replicated node asks the members of its "
                      "group; see docs/operations.md, \"Self-healing and scrubbing\"", start_ms, r.damaged_bytes,
                      m.count, ids_text(m.messages()), ids_text(m.cancels()),
                      [[lo, hi, n] for lo, hi, n, _ in m.ranges], m.unknown_bytes)
        self._count_missing()
        cancels = np.concatenate(r.cancelled) if (extra is not None and r.cancelled) else None
        s.bucket_rebuilt(start_ms, late=late, cancelled=cancels)

    def _write_missing(self, r: _Rebuild, tmp: Path) -> None:
        """Before the swap: what the new bucket lacks, into its folder (``lost.json``)."""
        s = self.store
        before = self.missing.get(r.start_ms)
        new = None
        if r.skipped:
            frames, ranges, unknown = damaged_records(s.schedule.bucket_path(r.start_ms), r.skipped,
                                                      s.messages.record_bytes_max)
            from_ms = s.completed_ms if s.follower else max(s.completed_ms, s.loaded_until_ms)
            kept = [b for b in (self._undelivered(r, f) for f in frames) if b is not None and b.n]
            ranges = [(lo, hi, n, from_ms) for lo, hi, n, sec in ranges
                      if r.start_ms + 1000 * (sec + 1) > s.completed_ms
                      and not bool(r.scan.covered(np.array([lo, hi], np.uint64)).all())]
            new = Missing.of(r.start_ms, kept, ranges, unknown, from_ms=from_ms, damaged_bytes=r.damaged_bytes)
        m = before if new is None else (new if before is None else before.merged(new))
        if m is not None and r.fetched:
            m = m.minus(np.concatenate(r.fetched))
        r.missing = None if m is None or m.empty() else m
        if r.missing is not None:
            checkpoint.write_atomic(tmp / LOST_FILE, r.missing.doc())

    def _undelivered(self, r: _Rebuild, b: Batch) -> Batch | None:
        """The records of a damaged frame that are missing: not in the message log, not voided,
        not given back by a member, due in this bucket at or after ``completed_ms``, and (a
        message) neither delivered nor cancelled."""
        s = self.store
        eff = b.effective_ms
        keep = ~r.scan.covered(b.seq) & (eff >= max(s.completed_ms, r.start_ms)) & (eff < r.end_ms)
        voided = s.voided_mask(b.seq)
        if voided is not None:
            keep &= ~voided
        if r.fetched:
            keep &= ~np.isin(b.seq, np.concatenate(r.fetched))
        keep &= ~((b.kind == KIND_MESSAGE) & np.isin(b.seq, self._settled(r)))
        return b.take(np.flatnonzero(keep)) if keep.any() else None

    def _settled(self, r: _Rebuild) -> np.ndarray:
        """Seqs of messages that need no delivery any more: dispatched (dispatch log, memory)
        or cancelled (a tombstone in the log, the old bucket or a member's copy)."""
        s = self.store
        parts = [r.scan.known_seq] + r.cancelled
        delivered = s.delivered_recently()
        if delivered:
            parts.append(np.fromiter(delivered.keys(), np.uint64, len(delivered)))
        return np.concatenate(parts).astype(np.uint64)

    def _scan(self, start_ms: int, end_ms: int) -> LogScan:
        """One pass over the filed part of the message log (read around damage): the seq
        intervals it holds, the tombstones of this bucket; and what was delivered: the
        dispatch log when the bucket is not in the future, memory otherwise."""
        s = self.store
        faults: list[HealFault] = []
        lo: list[int] = []
        hi: list[int] = []
        seqs: list[np.ndarray] = []
        effs: list[np.ndarray] = []
        for b in self._log_batches(faults):
            if not b.n:
                continue
            a, z = int(b.seq.min()), int(b.seq.max())
            if hi and lo[-1] <= a <= hi[-1] + 1:
                hi[-1] = max(hi[-1], z)
            else:
                lo.append(a)
                hi.append(z)
            m = (b.kind == KIND_CANCEL) & (b.deliver_at_ms >= start_ms) & (b.deliver_at_ms < end_ms)
            if m.any():
                seqs.append(b.cancel_targets()[m])
                effs.append(b.deliver_at_ms[m])
        if start_ms < s.completed_ms:  # the current (or a past) bucket: the dispatch log says
            for _off, body in readable_records(s.dispatch, s.dispatch.start_offset, s.dispatch.end_offset,
                                               "dispatch", faults):
                try:
                    d = DispatchBatch.decode(body)
                except InvalidArgument as e:
                    faults.append(HealFault("dispatch", str(s.dispatch.directory), _off, str(e)))
                    continue
                m = (d.effective_ms >= start_ms) & (d.effective_ms < end_ms)
                if m.any():
                    seqs.append(d.seq[m])
                    effs.append(d.effective_ms[m])
        else:  # a future bucket: only what was delivered early, which memory still holds
            got = [(q, e) for q, e in s.delivered_recently().items() if start_ms <= e < end_ms]
            if got:
                seqs.append(np.array([q for q, _ in got], np.uint64))
                effs.append(np.array([e for _, e in got], np.int64))
        order = np.argsort(np.array(lo, np.uint64), kind="stable")
        cover_lo, cover_hi = np.array(lo, np.uint64)[order], np.array(hi, np.uint64)[order]
        if seqs:
            seq = np.concatenate(seqs).astype(np.uint64)
            eff = np.concatenate(effs).astype(np.int64)
            o = np.argsort(seq, kind="stable")
            known_seq, known_eff = seq[o], eff[o]
        else:
            known_seq, known_eff = np.zeros(0, np.uint64), np.zeros(0, np.int64)
        return LogScan(cover_lo, cover_hi, known_seq, known_eff, faults)

    def first_log_seq(self) -> int | None:
        s = self.store
        if s.messages.start_offset >= s.messages.end_offset:
            return None
        for _off, body in readable_records(s.messages, s.messages.start_offset, s.messages.end_offset, "messages",
                                           []):
            try:
                b = Batch.decode(body)
            except InvalidArgument:
                continue
            if b.n:
                return int(b.seq[0])
        return None

    def _log_batches(self, faults: list[HealFault]) -> Iterator[Batch]:
        s = self.store
        start = s.messages.start_offset
        if s.iterate_offset <= start:
            return
        for off, body in readable_records(s.messages, start, s.iterate_offset, "messages", faults):
            try:
                yield Batch.decode(body)
            except InvalidArgument as e:  # a good CRC over a bad structure: read around it all the same
                faults.append(HealFault("messages", str(s.messages.directory), off, str(e)))

    def _chunks(self, r: _Rebuild) -> Iterator[list[Batch]]:
        s = self.store
        start_ms, end_ms, scan = r.start_ms, r.end_ms, r.scan
        if s.messages.start_offset > 0 or scan.faults or r.extra:
            # records the message log cannot give back come from the old bucket as they were,
            # then (a fetch) from a member's copy
            frames, r.skipped = salvage_frames(s.schedule.bucket_path(start_ms) / "data",
                                               s.messages.record_bytes_max)
            theirs = [f.take(np.flatnonzero((f.effective_ms >= start_ms) & (f.effective_ms < end_ms)))
                      for f in r.extra or ()]
            for f in frames + theirs:  # tombstones first: a fetched record they cancel is not refiled late
                tomb = f.kind == KIND_CANCEL
                voided = s.voided_mask(f.seq) if tomb.any() else None
                if voided is not None:
                    tomb &= ~voided
                if tomb.any():
                    r.cancelled.append(f.cancel_targets()[tomb])
            for k, f in enumerate(frames + theirs):
                fetched = k >= len(frames)
                keep = ~scan.covered(f.seq)
                voided = s.voided_mask(f.seq)
                if voided is not None:
                    keep &= ~voided
                if r.seen and keep.any():  # a member's frames: only records not salvaged here
                    keep &= ~np.isin(f.seq, np.concatenate(r.seen))
                if not keep.any():
                    continue
                part = f if keep.all() else f.take(np.flatnonzero(keep))
                r.seen.append(part.seq)
                if not fetched:
                    r.salvaged += part.n
                    yield [part]
                    continue
                r.fetched.append(part.seq)
                yield from self._place_fetched(r, part)
        for b in self._log_batches([]):  # its faults were noted by the scan (the same records)
            eff = refile_times(b, completed_ms=s.persisted_completed_ms, known_seq=scan.known_seq,
                               known_eff=scan.known_eff)
            m = (eff >= start_ms) & (eff < end_ms)
            voided = s.voided_mask(b.seq)
            if voided is not None:
                m &= ~voided
            if not m.any():
                continue
            idx = np.flatnonzero(m)
            part = b.take(idx).replace(effective_ms=eff[idx])
            r.messages += part.n
            yield group_by_second(part)

    def _place_fetched(self, r: _Rebuild, part: Batch) -> Iterator[list[Batch]]:
        """A member's records: as they were, except those a master's wheel passed while they
        were missing (module docs), filed again under the filing rule and handed to the wheel."""
        s = self.store
        m = self.missing.get(r.start_ms)
        if s.follower or m is None:
            yield [part]
            return
        passed = (part.kind == KIND_MESSAGE) & (part.effective_ms < s.loaded_until_ms) & \
            (part.effective_ms >= m.from_of(part.seq))
        passed &= ~np.isin(part.seq, self._settled(r))
        if not passed.any():
            yield [part]
            return
        if not passed.all():
            yield [part.take(np.flatnonzero(~passed))]
        late = part.take(np.flatnonzero(passed))
        eff = np.minimum(np.maximum(late.effective_ms, s.persisted_completed_ms), r.end_ms - 1).astype(np.int64)
        late = late.replace(effective_ms=eff)
        r.late.append(late)
        yield group_by_second(late)


__all__ = ["BucketHealer", "HealFault", "HealedStore", "readable_records", "salvage_frames"]
