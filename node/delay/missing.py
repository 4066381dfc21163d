"""Records a rebuilt schedule bucket lacks: what a corrupt frame held that no copy on this node
has any more (``node/delay/heal.py`` decides; this module reads and writes it down).

``damaged_records`` reads the damaged spans of a bucket's data log without trusting their
checksums: a frame whose body fails its CRC but still decodes gives its records (ids, seqs,
due times; an id may itself be the damaged byte), a frame that does not decode gives its
index entry (a seq range and a count), bytes with neither are counted. ``Missing`` is what
is kept of them per bucket, in memory (``BucketHealer.missing``) and in the bucket's folder,
``lost.json`` (a checkpoint file: JSON + CRC line; ``docs/format.md``): written into the new
bucket's folder before the swap, so that bucket and file always agree after a crash.

Example: a frame of 40 records (seqs 1000-1039) is damaged in a payload byte; the message
log starts at seq 2000 (retention). ``damaged_records`` decodes the frame: 40 records;
``Missing.of`` keeps those the heal rules say were not delivered; a member's copy of the
bucket then gives back seqs 1000-1039 (``Missing.wanted`` picks them out of its frames), and
``Missing.minus`` of them is empty: the bucket is whole again and ``lost.json`` goes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.codec import KIND_CANCEL, KIND_MESSAGE, Batch
from node.store import checkpoint
from node.store.log import HEADER, HEADER_SIZE
from node.store.schedule import ENTRY_DTYPE as SCHEDULE_ENTRY_DTYPE
from node.store.schedule import ENTRY_SIZE as SCHEDULE_ENTRY_SIZE

LOST_FILE = "lost.json"      # in a bucket folder: its missing records (docs/format.md)
LOST_VERSION = 1
MISSING_RECORDS_MAX = 100_000  # records of one bucket written down one by one (more: fetched by seq range)
IDS_LOGGED_MAX = 200         # ids in one log line (lost.json and admin verify have them all)


def _read_span(data_dir: Path, offset: int, size: int) -> bytes:
    """Bytes ``[offset, offset + size)`` of a bucket's data log, from the segment holding ``offset``."""
    segs = sorted(int(p.stem) for p in data_dir.glob("*.log") if p.stem.isdigit())
    i = bisect.bisect_right(segs, offset) - 1
    if i < 0:
        return b""
    with open(data_dir / f"{segs[i]:020d}.log", "rb") as f:
        f.seek(offset - segs[i])
        return f.read(size)


def _decode_unchecked(body: bytes) -> Batch | None:
    """A damaged frame's body decoded without its checksum (best effort: its structure must
    still add up; an id or a payload byte may be the damaged one)."""
    try:
        b = Batch.decode(body)
        b.id_list()
        b.cancel_targets()
        return b
    except Exception:  # noqa: BLE001 - damaged bytes: whatever they fail with, they are unreadable
        return None


def damaged_records(bucket_path: Path, spans: list[tuple[int, int]], record_bytes_max: int
                    ) -> tuple[list[Batch], list[tuple[int, int, int, int]], int]:
    """What the damaged ``spans`` of a bucket's data log held, read without trusting their
    checksums: (frames decoded, (first_seq, last_seq, records, second) of frames known only
    from their index entry, bytes of which nothing could be told). The index entries are
    read raw (they carry no checksum); without one, a frame is read at the span's start by
    its own length field."""
    data_dir = bucket_path / "data"
    try:
        raw = (bucket_path / "index").read_bytes()
        e = np.frombuffer(raw[: len(raw) - len(raw) % SCHEDULE_ENTRY_SIZE], SCHEDULE_ENTRY_DTYPE)
    except OSError:
        e = np.zeros(0, SCHEDULE_ENTRY_DTYPE)
    frames: list[Batch] = []
    ranges: list[tuple[int, int, int, int]] = []
    unknown = 0
    for a, z in spans:
        sel = np.flatnonzero((e["data_offset"] >= np.uint64(a)) & (e["data_offset"] < np.uint64(z)))
        if not len(sel):
            buf = _read_span(data_dir, a, min(z - a, HEADER_SIZE + record_bytes_max))
            body_len = HEADER.unpack_from(buf, 0)[0] if len(buf) >= HEADER_SIZE else -1
            b = _decode_unchecked(buf[HEADER_SIZE:HEADER_SIZE + body_len]) \
                if 0 <= body_len <= len(buf) - HEADER_SIZE else None
            if b is not None:
                frames.append(b)
            else:
                unknown += z - a
            continue
        for i in sel.tolist():
            off, size = int(e["data_offset"][i]), int(e["frame_size"][i])
            b = None
            if HEADER_SIZE < size <= HEADER_SIZE + record_bytes_max:
                b = _decode_unchecked(_read_span(data_dir, off + HEADER_SIZE, size - HEADER_SIZE))
            if b is not None:
                frames.append(b)
            else:
                ranges.append((int(e["first_seq"][i]), int(e["last_seq"][i]),
                               int(e["messages"][i]) + int(e["cancels"][i]), int(e["second"][i])))
    return frames, ranges, unknown


@dataclass(slots=True)
class Missing:
    """Records of bucket ``bucket_ms`` that a rebuild could not find (module docs), as written
    in its ``lost.json``. Per record: seq, kind, id, deliver_at_ms and ``from_ms`` (due at or
    after it, the record was never handed to the wheel). ``ranges``: damaged frames known
    only from their index entry, ``(first_seq, last_seq, records, from_ms)``. ``unknown_bytes``:
    damaged bytes of which nothing could be read (every record the message log does not hold
    is then fetched). ``lost``: given up (no member has them, or there is no member)."""

    bucket_ms: int
    seqs: np.ndarray
    kinds: np.ndarray
    ids: list[str]
    deliver_at_ms: np.ndarray
    from_ms: np.ndarray
    ranges: list[tuple[int, int, int, int]] = field(default_factory=list)
    unknown_bytes: int = 0
    unknown_from_ms: int = 0
    damaged_bytes: int = 0
    lost: bool = False
    attempts: int = 0       # fetch rounds that failed (not persisted)
    next_try_ms: int = 0    # monotonic ms of the next fetch round (not persisted)

    @property
    def count(self) -> int:
        """Records known missing (the ranges' counts included)."""
        return len(self.seqs) + sum(r[2] for r in self.ranges)

    def empty(self) -> bool:
        return not len(self.seqs) and not self.ranges and not self.unknown_bytes

    def messages(self) -> list[str]:
        return [i for i, k in zip(self.ids, self.kinds.tolist()) if k == KIND_MESSAGE]

    def cancels(self) -> list[str]:
        return [i for i, k in zip(self.ids, self.kinds.tolist()) if k == KIND_CANCEL]

    def wanted(self, seq: np.ndarray, below_seq: int | None) -> np.ndarray:
        """Which of a member's records would fill this in: a missing seq, one in a missing
        range, or (damaged bytes nobody could read) any seq below ``below_seq`` (the
        message log's first)."""
        out = np.isin(seq, self.seqs)
        for lo, hi, _n, _f in self.ranges:
            out |= (seq >= np.uint64(lo)) & (seq <= np.uint64(hi))
        if self.unknown_bytes:
            out |= np.ones(len(seq), bool) if below_seq is None else seq < np.uint64(below_seq)
        return out

    def from_of(self, seq: np.ndarray) -> np.ndarray:
        """``from_ms`` of each (wanted) seq: its own, its range's, else the unknown bytes'."""
        out = np.full(len(seq), self.unknown_from_ms if self.unknown_bytes else np.iinfo(np.int64).max, np.int64)
        for lo, hi, _n, f in self.ranges:
            out[(seq >= np.uint64(lo)) & (seq <= np.uint64(hi))] = f
        if len(self.seqs):
            order = np.argsort(self.seqs)
            s = self.seqs[order]
            at = np.clip(np.searchsorted(s, seq), 0, len(s) - 1)
            hit = s[at] == seq
            out[hit] = self.from_ms[order][at[hit]]
        return out

    def minus(self, found: np.ndarray) -> "Missing":
        """What is still missing once ``found`` (seqs) came back; a range is found once as
        many of its seqs came back as it held; damaged unreadable bytes count as found once
        any fetch answered."""
        keep = ~np.isin(self.seqs, found)
        ranges = [r for r in self.ranges
                  if int(np.count_nonzero((found >= np.uint64(r[0])) & (found <= np.uint64(r[1])))) < r[2]]
        return Missing(self.bucket_ms, self.seqs[keep], self.kinds[keep], [i for i, k in zip(self.ids, keep) if k],
                       self.deliver_at_ms[keep], self.from_ms[keep], ranges, 0, 0, self.damaged_bytes, self.lost,
                       self.attempts, self.next_try_ms)

    def merged(self, new: "Missing") -> "Missing":
        """This and ``new`` (a later damage in the same bucket) together."""
        old = ~np.isin(self.seqs, new.seqs)
        return Missing(self.bucket_ms, np.concatenate([self.seqs[old], new.seqs]),
                       np.concatenate([self.kinds[old], new.kinds]),
                       [i for i, k in zip(self.ids, old) if k] + new.ids,
                       np.concatenate([self.deliver_at_ms[old], new.deliver_at_ms]),
                       np.concatenate([self.from_ms[old], new.from_ms]), self.ranges + new.ranges,
                       self.unknown_bytes + new.unknown_bytes,
                       min(self.unknown_from_ms if self.unknown_bytes else new.unknown_from_ms,
                           new.unknown_from_ms if new.unknown_bytes else self.unknown_from_ms),
                       self.damaged_bytes + new.damaged_bytes, self.lost and new.empty())

    def wheel_restarted(self, completed_ms: int) -> None:
        """A wheel starts again from ``completed_ms`` (open, promotion): nothing at or after
        it has been handed to that wheel."""
        self.from_ms = np.minimum(self.from_ms, completed_ms)
        self.ranges = [(lo, hi, n, min(f, completed_ms)) for lo, hi, n, f in self.ranges]
        self.unknown_from_ms = min(self.unknown_from_ms, completed_ms)

    def doc(self) -> dict:
        n = min(len(self.seqs), MISSING_RECORDS_MAX)
        rows = [[int(s), int(k), i, int(d), int(f)] for s, k, i, d, f in zip(
            self.seqs[:n].tolist(), self.kinds[:n].tolist(), self.ids[:n], self.deliver_at_ms[:n].tolist(),
            self.from_ms[:n].tolist())]
        ranges = [list(r) for r in self.ranges]
        if len(self.seqs) > n:  # too many to list: the rest as one seq range
            rest = self.seqs[n:]
            ranges.append([int(rest.min()), int(rest.max()), len(rest), int(self.from_ms[n:].min())])
        return {"version": LOST_VERSION, "bucket_start_ms": self.bucket_ms, "records": rows, "ranges": ranges,
                "unknown_bytes": self.unknown_bytes, "unknown_from_ms": self.unknown_from_ms,
                "damaged_bytes": self.damaged_bytes, "lost": self.lost}

    @classmethod
    def from_doc(cls, doc: dict) -> "Missing":
        rows = doc.get("records", [])
        return cls(int(doc["bucket_start_ms"]), np.array([r[0] for r in rows], np.uint64),
                   np.array([r[1] for r in rows], np.uint8), [str(r[2]) for r in rows],
                   np.array([r[3] for r in rows], np.int64), np.array([r[4] for r in rows], np.int64),
                   [tuple(int(x) for x in r) for r in doc.get("ranges", [])], int(doc.get("unknown_bytes", 0)),
                   int(doc.get("unknown_from_ms", 0)), int(doc.get("damaged_bytes", 0)), bool(doc.get("lost", False)))

    @classmethod
    def of(cls, bucket_ms: int, frames: list[Batch], ranges, unknown_bytes: int, *, from_ms: int,
           damaged_bytes: int) -> "Missing":
        b = Batch.concat(frames) if frames else None
        if b is None or not b.n:
            return cls(bucket_ms, np.zeros(0, np.uint64), np.zeros(0, np.uint8), [], np.zeros(0, np.int64),
                       np.zeros(0, np.int64), list(ranges), unknown_bytes, from_ms, damaged_bytes)
        return cls(bucket_ms, b.seq.astype(np.uint64), b.kind.astype(np.uint8), b.id_list(),
                   b.deliver_at_ms.astype(np.int64), np.full(b.n, from_ms, np.int64), list(ranges), unknown_bytes,
                   from_ms, damaged_bytes)

    def summary(self, path: str) -> dict:
        """One entry of ``admin verify``'s report and of Status (``healing.missing``)."""
        return {"bucket_start_ms": self.bucket_ms, "path": path, "state": "lost" if self.lost else "missing",
                "records": self.count, "messages": self.messages(), "cancels": self.cancels(),
                "seq_ranges": [[lo, hi, n] for lo, hi, n, _ in self.ranges], "unreadable_bytes": self.unknown_bytes}


def read_missing(bucket_path: Path) -> Missing | None:
    """A bucket folder's ``lost.json`` (None when it has none). Raises ``CorruptRecord``."""
    doc = checkpoint.read(bucket_path / LOST_FILE)
    return None if doc is None else Missing.from_doc(doc)


def ids_text(ids: list[str]) -> str:
    shown = ",".join(ids[:IDS_LOGGED_MAX])
    return shown + (f",...(+{len(ids) - IDS_LOGGED_MAX})" if len(ids) > IDS_LOGGED_MAX else "")
