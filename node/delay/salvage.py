"""Reading a delay node's files around damage: what a bucket rebuild (node/delay/heal.py) reads.

Pure readers, no decision: each returns what it could read and where it could not.

* ``salvage_frames``: every frame of a schedule bucket's data log that still passes its
  CRCs, and the spans skipped (a bad body skipped by its length, a bad header by a search
  for the next good frame, at most ``RESYNC_BYTES_MAX`` on).
* ``readable_records``: the records of a segmented log (message log, dispatch log) in a
  range, a corrupt one read around (``_resync``: past its body when its header is good,
  else the next good frame in its segment, else the next segment) and noted (``HealFault``).
* ``LogScan``: what the message log (its filed part) and the dispatch log say about one
  bucket: the seq intervals the log holds (one per store epoch plus one more per corrupt
  spot) and the seqs whose effective time is known.
* ``refile_times``: the effective time of a message-log record in a rebuilt bucket (the
  rules in heal.py); ``group_by_second``: a batch cut into one group per due second.

The **id index** is derived too: ``id_entries`` rebuilds the entries of one id file (a seq
range) from the schedule frames that hold those records, read through each bucket's index
(first/last seq per frame). ``IdIndex.open`` uses it for a file whose header fails its
checks, which used to stop the node at every start. What it cannot give back: entries of
messages whose bucket retention already deleted (delivered or cancelled, still inside the
dedupe window) - a re-send of such an id inside the window is then accepted as new - and
entries in a bucket that itself fails to read (it is rebuilt right after, and its records
are found by seq, ``docs/format.md``). Both are counted in the log line.
"""

from __future__ import annotations

import bisect
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster.codec import KIND_CANCEL, Batch
from cluster.errors import CorruptRecord, InvalidArgument
from node.store.idindex import ENTRY_DTYPE, key_hashes
from node.store.log import HEADER, HEADER_SIZE, SegmentedLog

if TYPE_CHECKING:
    from node.store.schedule import ScheduleLog

log = logging.getLogger("hourglass.delay.heal")

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


def _next_good(buf: bytes, pos: int, record_bytes_max: int, limit: int) -> int | None:
    """The first position after ``pos`` (below ``limit``) where a frame passes its checks."""
    return next((p for p in range(pos + 1, min(len(buf), limit))
                 if _frame_at(buf, p, record_bytes_max)[0] is not None), None)


def salvage_frames(data_dir: Path, record_bytes_max: int) -> tuple[list[Batch], list[tuple[int, int]]]:
    """Every frame of a bucket's data log that passes its checks (log order), and the spans
    skipped as corrupt (``(offset, end)`` in the data log's offsets). Reads the files
    directly: the bucket may not open."""
    out: list[Batch] = []
    skipped: list[tuple[int, int]] = []
    for seg in sorted(data_dir.glob("*.log")):
        if not seg.stem.isdigit():
            continue
        base = int(seg.stem)
        buf = seg.read_bytes()
        pos = 0
        while pos < len(buf):
            body, nxt = _frame_at(buf, pos, record_bytes_max)
            if body is not None:
                try:
                    out.append(Batch.decode(body))
                except InvalidArgument:
                    skipped.append((base + pos, base + nxt))  # a good CRC over a bad structure: skipped all the same
                pos = nxt
                continue
            if nxt > 0:  # the body is bad, the length is good: skip exactly this frame
                skipped.append((base + pos, base + nxt))
                pos = nxt
                continue
            found = _next_good(buf, pos, record_bytes_max, pos + RESYNC_BYTES_MAX)
            end = len(buf) if found is None else found
            skipped.append((base + pos, base + end))
            pos = end
    return out, skipped


# ---------------------------------------------------------------------- reading logs around damage


@dataclass(frozen=True, slots=True)
class HealFault:
    """A second fault met while healing: ``kind`` messages | dispatch (a corrupt record a
    rebuild read around), fetch (a member that could not give a bucket's missing records),
    rebuild (a rebuild that failed and left the bucket as it was)."""

    kind: str
    where: str   # a file, or a member's address
    offset: int
    reason: str


def _resync(lg: SegmentedLog, bad: int, end: int) -> int:
    """Where to read on after a corrupt record at ``bad``: past its body when its header is
    good, else the next frame that passes its checks in the same segment (within
    ``RESYNC_BYTES_MAX``), else the next segment (or ``end``)."""
    bases = lg.segment_bases()
    i = max(0, bisect.bisect_right(bases, bad) - 1)
    limit = min(end, bases[i + 1] if i + 1 < len(bases) else lg.end_offset)
    if bad >= limit:
        return limit
    try:
        with open(lg.directory / f"{bases[i]:020d}.log", "rb") as f:
            f.seek(bad - bases[i])
            buf = f.read(min(limit - bad, RESYNC_BYTES_MAX + HEADER_SIZE + lg.record_bytes_max))
    except OSError:
        return limit
    _, nxt = _frame_at(buf, 0, lg.record_bytes_max)
    if nxt > 0:
        return bad + nxt
    found = _next_good(buf, 0, lg.record_bytes_max, RESYNC_BYTES_MAX)
    return limit if found is None else bad + found


def readable_records(lg: SegmentedLog, start: int, end: int, kind: str,
                     faults: list[HealFault]) -> Iterator[tuple[int, bytes]]:
    """(offset, body) of every record of ``lg`` in ``[start, end)`` that passes its checks;
    a corrupt one is read around (``_resync``) and noted in ``faults``."""
    off = start
    while off < end:
        try:
            for o, body in lg.iterate(off, end):
                off = o + HEADER_SIZE + len(body)
                yield o, body
            return
        except CorruptRecord as e:
            at = max(off, e.offset)
            nxt = _resync(lg, at, end)
            faults.append(HealFault(kind, e.path, e.offset, f"{e.reason}; read on at offset {nxt}"))
            off = nxt


@dataclass(slots=True)
class LogScan:
    """What the message log (its filed part) and the dispatch log say about one bucket."""

    cover_lo: np.ndarray   # seq intervals [lo, hi] of the message log's readable records, sorted
    cover_hi: np.ndarray
    known_seq: np.ndarray  # sorted: seqs whose effective time is known (dispatched, or a tombstone's target)
    known_eff: np.ndarray
    faults: list[HealFault]

    def covered(self, seq: np.ndarray) -> np.ndarray:
        """Which seqs the message log holds (readable)."""
        if not len(self.cover_lo):
            return np.zeros(len(seq), bool)
        at = np.searchsorted(self.cover_lo, seq, side="right") - 1
        ok = at >= 0
        out = np.zeros(len(seq), bool)
        out[ok] = seq[ok] <= self.cover_hi[at[ok]]
        return out

    @property
    def first_seq(self) -> int | None:
        return int(self.cover_lo[0]) if len(self.cover_lo) else None


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
