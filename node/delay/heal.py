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

Voided seqs (a divergent suffix cut off) are left out. Records whose message-log segment
retention already deleted (seq below the log's first record) are **salvaged** from the old
bucket instead: every frame of its data log that still passes its CRCs is kept as it was
(same effective time); a corrupt frame is skipped (by its length when only the body is bad,
else by a search for the next good header, at most ``RESYNC_BYTES_MAX``). Records of a
corrupt frame that the message log no longer holds are lost here: the log line says how
many bytes were skipped (``lost_bytes``) and ``docs/operations.md`` tells what to do.

The **id index** is derived too: ``id_entries`` rebuilds the entries of one id file (a seq
range) from the schedule frames that hold those records, read through each bucket's index
(first/last seq per frame). ``IdIndex.open`` uses it for a file whose header fails its
checks, which used to stop the node at every start. What it cannot give back: entries of
messages whose bucket retention already deleted (delivered or cancelled, still inside the
dedupe window) - a re-send of such an id inside the window is then accepted as new - and
entries in a bucket that itself fails to read (it is rebuilt right after, and its records
are found by seq, ``docs/format.md``). Both are counted in the log line.

``BucketHealer.check_soon`` runs at open, before the node announces serving: the buckets
the wheel loads first are verified (``Bucket.verify``: the whole index and heads, and the
frames due within ``verify_ahead_ms``) and rebuilt when they fail. Later buckets are rebuilt
when opening or reading them fails (``ScheduleLog._healing``).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster.codec import KIND_CANCEL, Batch, DispatchBatch
from cluster.errors import CorruptRecord, InvalidArgument
from node.store import records
from node.store.idindex import ENTRY_DTYPE, key_hashes
from node.store.log import HEADER, HEADER_SIZE

if TYPE_CHECKING:
    from node.delay.store import DelayStore
    from node.store.schedule import ScheduleLog

log = logging.getLogger("hourglass.delay.heal")

REBUILDS_PER_BUCKET_MAX = 3      # a bucket failing again after this many rebuilds ...
REBUILD_WINDOW_S = 600.0          # ... within this long is a bug or a dying disk: the error is raised
RESYNC_BYTES_MAX = 1 << 20   # after a bad frame header, look this far for the next good frame


def _frame_at(buf: bytes, pos: int, record_bytes_max: int) -> tuple[bytes | None, int]:
    """(body, next position) of a frame at ``pos`` that passes its checks; (None, frame end)
    when only its body is bad (the length is trusted); (None, -1) when its header is bad."""
    if len(buf) - pos < HEADER_SIZE:
        return None, -1
    body_len, body_crc, header_crc = HEADER.unpack_from(buf, pos)
    if zlib.crc32(buf[pos:pos + 8]) != header_crc or body_len > record_bytes_max or \
            pos + HEADER_SIZE + body_len > len(buf):
        return None, -1
    body = buf[pos + HEADER_SIZE:pos + HEADER_SIZE + body_len]
    return (body if zlib.crc32(body) == body_crc else None), pos + HEADER_SIZE + body_len


def salvage_frames(data_dir: Path, record_bytes_max: int) -> tuple[list[Batch], int]:
    """Every frame of a bucket's data log that passes its checks (log order), and the bytes
    skipped as corrupt. Reads the files directly: the bucket may not open."""
    out: list[Batch] = []
    lost = 0
    for seg in sorted(data_dir.glob("*.log")):
        buf = seg.read_bytes()
        pos = 0
        while pos < len(buf):
            body, nxt = _frame_at(buf, pos, record_bytes_max)
            if body is not None:
                try:
                    out.append(Batch.decode(body))
                except InvalidArgument:
                    lost += nxt - pos  # a good CRC over a bad structure: skipped all the same
                pos = nxt
                continue
            if nxt > 0:  # the body is bad, the length is good: skip exactly this frame
                lost += nxt - pos
                pos = nxt
                continue
            found = next((p for p in range(pos + 1, min(len(buf), pos + RESYNC_BYTES_MAX))
                          if _frame_at(buf, p, record_bytes_max)[0] is not None), None)
            if found is None:
                lost += len(buf) - pos
                break
            lost += found - pos
            pos = found
    return out, lost


def id_entries(schedule: "ScheduleLog", lo_seq: int, hi_seq: int | None) -> np.ndarray:
    """Id-index entries (``ENTRY_DTYPE``, sorted by seq) of every filed record with
    ``lo_seq <= seq < hi_seq``: one per record of the schedule frames whose seq range meets
    it, pointing at that frame (module docs). Buckets or frames that fail to read are
    skipped and logged: the bucket healer deals with them, the index loses those entries."""
    hi = (1 << 64) - 1 if hi_seq is None else hi_seq - 1
    parts: list[np.ndarray] = []
    skipped = 0
    for start in schedule.bucket_starts():
        try:
            b = schedule.bucket(start, create=False)
            frames = b.entries_array() if b is not None else None
        except CorruptRecord as e:
            log.warning("id index rebuild skips a bucket that does not open bucket=%d error=%s", start, e)
            skipped += 1
            continue
        if frames is None:
            continue
        sel = np.flatnonzero((frames["last_seq"] >= np.uint64(lo_seq)) & (frames["first_seq"] <= np.uint64(hi)))
        for off, size in zip(frames["data_offset"][sel].tolist(), frames["frame_size"][sel].tolist()):
            try:
                batch = b.read(off, size)
            except (CorruptRecord, InvalidArgument) as e:
                log.warning("id index rebuild skips a frame that does not read bucket=%d offset=%d error=%s",
                            start, off, e)
                skipped += 1
                continue
            m = (batch.seq >= np.uint64(lo_seq)) & (batch.seq <= np.uint64(hi))
            if not m.any():
                continue
            part = batch.take(np.flatnonzero(m))
            e = np.zeros(part.n, ENTRY_DTYPE)
            e["key_hash"] = key_hashes(part.id_bytes_list())
            e["bucket_start_ms"] = start
            e["data_offset"] = off
            e["seq"] = part.seq
            e["frame_size"] = size
            parts.append(e)
    out = np.concatenate(parts) if parts else np.zeros(0, ENTRY_DTYPE)
    out = out[np.argsort(out["seq"], kind="stable")]
    log.warning("id index entries rebuilt from the schedule log seqs=[%d, %s) entries=%d unreadable=%d", lo_seq,
                "end" if hi_seq is None else hi_seq, len(out), skipped)
    return out


def group_by_second(b: Batch) -> list[Batch]:
    """Cut a batch (``effective_ms`` set) into groups due in one second, each in due order."""
    if not b.n:
        return []
    eff = b.effective_ms
    order = np.argsort(eff, kind="stable")
    cuts = np.flatnonzero(np.diff(eff[order] // 1000)) + 1
    return [b.take(part) for part in np.split(order, cuts)]


def refile_times(b: Batch, *, completed_ms: int, known_seq: np.ndarray, known_eff: np.ndarray) -> np.ndarray:
    """Effective times of a message-log batch's records for a rebuild (rules above).
    ``known_seq`` (sorted) / ``known_eff``: seqs whose effective time is known (dispatched or
    cancelled messages)."""
    is_cancel = b.kind == KIND_CANCEL
    eff = np.where(is_cancel, b.deliver_at_ms, np.maximum(b.deliver_at_ms, completed_ms)).astype(np.int64)
    if len(known_seq):
        at = np.searchsorted(known_seq, b.seq)
        at[at >= len(known_seq)] = 0
        hit = (known_seq[at] == b.seq) & ~is_cancel
        eff[hit] = known_eff[at[hit]]
    return eff


class BucketHealer:
    """Verifies and rebuilds schedule buckets of one ``DelayStore``; counts what it did."""

    def __init__(self, store: "DelayStore") -> None:
        self.store = store
        self.counters = {"corrupt_found": 0, "buckets_rebuilt": 0, "frames_rebuilt": 0}
        self._rebuilds: dict[int, list[float]] = {}  # bucket -> monotonic times of its recent rebuilds
        # bucket -> bytes lost with corrupt frames whose records the message log no longer has:
        # a replicated node fetches the bucket's frames from a member (node/replication/delay.py)
        self.fetch_wanted: dict[int, int] = {}

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

    def rebuild(self, start_ms: int, why: CorruptRecord, *, extra: list[Batch] | None = None) -> None:
        """Re-file bucket ``start_ms`` from the message log and swap it in. ``extra``: frames
        of the same bucket from a replica (``fetch_wanted``), for records that the message log
        no longer holds and that were lost with a corrupt frame here."""
        s = self.store
        if extra is None:
            self.counters["corrupt_found"] += 1
        now = time.monotonic()
        recent = [t for t in self._rebuilds.get(start_ms, []) if now - t < REBUILD_WINDOW_S]
        if len(recent) >= REBUILDS_PER_BUCKET_MAX:
            log.error("schedule bucket keeps failing bucket=%d rebuilds=%d in %d s error=%s", start_ms, len(recent),
                      REBUILD_WINDOW_S, why)
            raise why
        self._rebuilds[start_ms] = recent + [now]
        log.warning("schedule bucket corrupt, rebuilding from the message log bucket=%d path=%s offset=%d "
                    "reason=%r", start_ms, why.path, why.offset, why.reason)
        t0 = time.monotonic()
        counted = {"messages": 0, "salvaged": 0, "lost_bytes": 0}
        frames = s.schedule.replace_bucket(start_ms, self._chunks(start_ms, counted, extra))
        self.counters["buckets_rebuilt"] += 1
        self.counters["frames_rebuilt"] += frames
        log.warning("schedule bucket rebuilt bucket=%d frames=%d records=%d salvaged=%d lost_bytes=%d "
                    "messages_from=%d iterate_offset=%d elapsed_ms=%d", start_ms, frames, counted["messages"],
                    counted["salvaged"], counted["lost_bytes"], s.messages.start_offset, s.iterate_offset,
                    (time.monotonic() - t0) * 1000)
        if extra is not None:
            self.fetch_wanted.pop(start_ms, None)
        elif counted["lost_bytes"]:
            self.fetch_wanted[start_ms] = counted["lost_bytes"]  # a replicated node asks a member
        if counted["lost_bytes"] and extra is None:
            self.counters["lost_bytes"] = self.counters.get("lost_bytes", 0) + counted["lost_bytes"]
            log.error("schedule bucket rebuild incomplete bucket=%d: %d corrupt bytes held records the message "
                      "log no longer has (deleted by retention); see docs/operations.md, \"Self-healing and "
                      "scrubbing\"", start_ms, counted["lost_bytes"])

    def _known_times(self, start_ms: int, end_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """Seqs with a known effective time in [start, end): dispatched messages and the
        targets of tombstones."""
        s = self.store
        seqs: list[np.ndarray] = []
        effs: list[np.ndarray] = []
        if start_ms < s.completed_ms:  # the current (or a past) bucket: the dispatch log says
            for _off, body in s.dispatch.iterate():
                d = DispatchBatch.decode(body)
                m = (d.effective_ms >= start_ms) & (d.effective_ms < end_ms)
                if m.any():
                    seqs.append(d.seq[m])
                    effs.append(d.effective_ms[m])
        else:  # a future bucket: only what was delivered early, which memory still holds
            got = [(q, e) for q, e in s._dispatched.items() if start_ms <= e < end_ms]
            if got:
                seqs.append(np.array([q for q, _ in got], np.uint64))
                effs.append(np.array([e for _, e in got], np.int64))
        for b in self._log_batches():
            m = (b.kind == KIND_CANCEL) & (b.deliver_at_ms >= start_ms) & (b.deliver_at_ms < end_ms)
            if m.any():
                seqs.append(b.cancel_targets()[m])
                effs.append(b.deliver_at_ms[m])
        if not seqs:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        seq = np.concatenate(seqs).astype(np.uint64)
        eff = np.concatenate(effs).astype(np.int64)
        order = np.argsort(seq, kind="stable")
        return seq[order], eff[order]

    def first_log_seq(self) -> int | None:
        s = self.store
        if s.messages.start_offset >= s.messages.end_offset:
            return None
        body, _ = s.messages.read(s.messages.start_offset)
        b = Batch.decode(body)
        return int(b.seq[0]) if b.n else None

    def _log_batches(self) -> Iterator[Batch]:
        s = self.store
        start = s.messages.start_offset
        if s.iterate_offset <= start:
            return
        for _off, body in s.messages.iterate(start, s.iterate_offset):
            yield Batch.decode(body)

    def _chunks(self, start_ms: int, counted: dict, extra: list[Batch] | None = None) -> Iterator[list[Batch]]:
        s = self.store
        end_ms = start_ms + s.settings.bucket_ms
        known_seq, known_eff = self._known_times(start_ms, end_ms)
        if s.messages.start_offset > 0:
            # retention deleted the log's beginning: older records come from the old bucket as they were
            first = self.first_log_seq()
            frames, lost = salvage_frames(s.schedule.bucket_path(start_ms) / "data", s.messages.record_bytes_max)
            counted["lost_bytes"] = lost
            seen: list[np.ndarray] = []
            for f in frames + [f.take(np.flatnonzero((f.effective_ms >= start_ms) & (f.effective_ms < end_ms)))
                               for f in extra or ()]:
                keep = f.seq < np.uint64(first) if first is not None else np.ones(f.n, bool)
                if s.voided:
                    keep &= ~s._voided_mask(f.seq)
                if seen and keep.any():  # a replica's frames: only records not salvaged here
                    keep &= ~np.isin(f.seq, np.concatenate(seen))
                if keep.any():
                    part = f if keep.all() else f.take(np.flatnonzero(keep))
                    counted["salvaged"] += part.n
                    seen.append(part.seq)
                    yield [part]
        for b in self._log_batches():
            eff = refile_times(b, completed_ms=s.persisted_completed_ms, known_seq=known_seq, known_eff=known_eff)
            m = (eff >= start_ms) & (eff < end_ms)
            if s.voided:
                m &= ~s._voided_mask(b.seq)
            if not m.any():
                continue
            idx = np.flatnonzero(m)
            part = b.take(idx).replace(effective_ms=eff[idx])
            counted["messages"] += part.n
            yield group_by_second(part)
