"""Verify a node's data folder: every file that has a check, checked, nothing written.

``verify_dir(root)`` walks a delay or real-time node's data folder (``docs/format.md``) and
checks, read-only:

* every segmented log (a folder of ``{base:020d}.log``): segments contiguous, every frame's
  header and body CRC; the last segment may end in a torn tail (offline: the node truncates
  it at its next open; online: it is being appended to), which is a note, not corruption;
* every schedule bucket: index entries describe consecutive frames of its data log, every
  ``prev`` links an older entry of the same second; offline also the heads file (header CRC,
  and every head equal to the newest entry of its second when the header vouches for all);
* checkpoint files (``checkpoint``, ``*.epochs``, ``voided.json``, ``subjects.json``): CRC line;
* id-index files (``ids/*.idx``): header CRC;
* a schedule bucket's ``lost.json`` (its CRC line too): the records a rebuild could not find
  (``node/delay/heal.py``), listed in the report's ``lost`` with their ids, whether they are
  still being fetched from a member (``missing``) or ``lost``.

Reads go through ``Throttle`` (bytes per second) when given: online, the node runs this on a
worker thread at ``verify_rate_mib_s`` so serving is not starved. Folders of a rebuild or a
deletion in progress (``*.rebuild``, ``*.ready``, ``*.old``, ``*.deleting``) are skipped, and
files that vanish while being read (retention, a bucket swapped) are skipped too.

The report lists what was checked, every corrupt record (path, offset, reason) and every
bucket's missing or lost records; ``summary()`` is the one line ``hourglass admin verify``
prints.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cluster.codec import KIND_MESSAGE
from cluster.errors import CorruptRecord
from node.store import checkpoint

from .log import RECORD_BYTES_MAX_DEFAULT
from .schedule import ENTRY_DTYPE, ENTRY_SIZE, FORMAT_VERSION, HEADS_HEADER, HEADS_HEADER_SIZE, HEADS_MAGIC
from .scrub import ScrubTarget, check_span

SEGMENT_RE = re.compile(r"^\d{20}\.log$")
CHECKPOINT_NAMES = ("checkpoint", "voided.json", "subjects.json")
LOST_NAME = "lost.json"        # a schedule bucket's missing records (node/delay/heal.py, docs/format.md)
IDX_HEADER_SIZE = 64
VERIFY_STEP_BYTES = 1 << 20         # bytes read per step of a segment
FINDINGS_MAX = 1000            # corrupt records listed in one report (the count goes on)
SKIP_SUFFIXES = (".rebuild", ".ready", ".old", ".deleting", ".tmp")


@dataclass(slots=True)
class Finding:
    path: str
    offset: int
    reason: str
    repaired: bool = False


@dataclass(slots=True)
class VerifyReport:
    root: str
    files: int = 0
    bytes: int = 0
    corrupt_count: int = 0
    corrupt: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_ms: int = 0
    # per bucket with records a rebuild could not find: {"bucket_start_ms", "path", "state" (missing |
    # lost), "records", "messages" (ids), "cancels" (ids of cancelled messages), "seq_ranges", "unreadable_bytes"}
    lost: list[dict] = field(default_factory=list)

    def add(self, err: CorruptRecord) -> Finding:
        self.corrupt_count += 1
        f = Finding(err.path, err.offset, err.reason)
        if len(self.corrupt) < FINDINGS_MAX:
            self.corrupt.append(f)
        return f

    @property
    def unrepaired(self) -> int:
        return self.corrupt_count - sum(1 for f in self.corrupt if f.repaired)

    @property
    def lost_records(self) -> int:
        """Records missing or lost in every bucket (``lost``)."""
        return sum(int(b["records"]) for b in self.lost)

    def summary(self) -> str:
        head = f"{self.files} files, {self.bytes / (1 << 20):.1f} MiB checked in {self.elapsed_ms / 1000:.1f} s"
        lost = ""
        if self.lost:
            gone = sum(int(b["records"]) for b in self.lost if b["state"] == "lost")
            lost = (f"; {gone} records lost and {self.lost_records - gone} being fetched from a member, in "
                    f"{len(self.lost)} rebuilt bucket{'s' if len(self.lost) > 1 else ''}")
        if not self.corrupt_count:
            return f"{self.root}: {'OK' if not self.lost else 'no corrupt record'}, {head}{lost}"
        repaired = self.corrupt_count - self.unrepaired
        first = self.corrupt[0]
        return (f"{self.root}: {self.corrupt_count} corrupt ({repaired} repaired), {head}; first: {first.path} "
                f"at offset {first.offset}: {first.reason}{lost}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "VerifyReport":
        d = json.loads(text)
        d["corrupt"] = [Finding(**f) for f in d.get("corrupt", [])]
        return cls(**d)


class Throttle:
    """At most ``rate_bytes_per_s`` on average (sleeps the calling thread); None: no limit."""

    def __init__(self, rate_bytes_per_s: float | None) -> None:
        self.rate = rate_bytes_per_s
        self._t0 = time.monotonic()
        self._bytes = 0

    def spent(self, n: int) -> None:
        if not self.rate:
            return
        self._bytes += n
        ahead = self._bytes / self.rate - (time.monotonic() - self._t0)
        if ahead > 0:
            time.sleep(min(ahead, 5.0))


def _skip(name: str) -> bool:
    return name.endswith(SKIP_SUFFIXES)


def verify_dir(root: str | os.PathLike, *, online: bool = False, rate_bytes_per_s: float | None = None,
               record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT) -> VerifyReport:
    """Check every file of a data folder (see module docstring). Never writes."""
    t0 = time.monotonic()
    root = Path(root)
    rep = VerifyReport(str(root))
    thr = Throttle(rate_bytes_per_s)
    if not root.is_dir():
        raise FileNotFoundError(f"no data folder at {root}")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip(d))
        here = Path(dirpath)
        segs = sorted(f for f in filenames if SEGMENT_RE.match(f))
        if segs:
            _verify_log(here, segs, rep, thr, online=online, record_bytes_max=record_bytes_max)
        if here.parent.name == "schedule" and here.name.isdigit() and "index" in filenames:
            _verify_bucket(here, rep, thr, online=online)
            if LOST_NAME in filenames:
                _read_lost(here / LOST_NAME, rep)
        for f in sorted(filenames):
            p = here / f
            if f in CHECKPOINT_NAMES or f.endswith(".epochs"):
                rep.files += 1
                try:
                    checkpoint.read(p)
                except CorruptRecord as e:
                    rep.add(e)
                except ValueError as e:  # a good CRC over bad JSON: a bug, reported as corrupt
                    rep.add(CorruptRecord(str(p), 0, f"not JSON: {e}"))
            elif f.endswith(".idx") and here.name == "ids":
                _verify_idx(p, rep)
    rep.elapsed_ms = int((time.monotonic() - t0) * 1000)
    return rep


def _verify_log(d: Path, names: list[str], rep: VerifyReport, thr: Throttle, *, online: bool,
                record_bytes_max: int) -> None:
    prev_end = None
    for i, name in enumerate(names):
        p = d / name
        base = int(name[:-4])
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            prev_end = None
            continue
        rep.files += 1
        last = i == len(names) - 1
        if prev_end is not None and prev_end != base:
            rep.add(CorruptRecord(str(d / names[i - 1]), prev_end,
                                  f"segment ends at {prev_end} but next segment starts at {base}"))
        prev_end = base + size
        t = ScrubTarget(name, str(p), base, size, d.name, growing=last)
        pos = 0
        while pos < size:
            r = check_span(t, pos, VERIFY_STEP_BYTES, record_bytes_max)
            rep.bytes += r.checked_bytes
            thr.spent(r.checked_bytes)
            if r.gone:
                break
            if r.corrupt is not None:
                if last and not online and _zeros_after(p, r.corrupt.offset - base):
                    rep.notes.append(f"{p}: torn tail of zero bytes at offset {r.corrupt.offset} (dropped at open)")
                else:
                    rep.add(r.corrupt)
                break
            if r.at_end:
                if not online:
                    rep.notes.append(f"{p}: torn tail at offset {base + pos + r.checked_bytes} "
                                     f"({size - pos - r.checked_bytes} bytes, dropped at open)")
                break
            if r.checked_bytes == 0:  # cannot happen (check_span always advances or reports)
                rep.add(CorruptRecord(str(p), base + pos, "no progress"))
                break
            pos += r.checked_bytes


def _zeros_after(p: Path, pos: int) -> bool:
    with open(p, "rb") as f:
        f.seek(pos)
        rest = f.read()
    return rest.count(0) == len(rest)


def _verify_bucket(d: Path, rep: VerifyReport, thr: Throttle, *, online: bool) -> None:
    ipath = d / "index"
    try:
        raw = ipath.read_bytes()
        seg_names = sorted(f for f in os.listdir(d / "data") if SEGMENT_RE.match(f))
        sizes = [(d / "data" / f).stat().st_size for f in seg_names]
        heads_raw = (d / "heads").read_bytes()
    except FileNotFoundError:
        return  # swapped or deleted while we looked
    rep.files += 2
    thr.spent(len(raw) + len(heads_raw))
    e = np.frombuffer(raw[: len(raw) - len(raw) % ENTRY_SIZE], ENTRY_DTYPE)
    data_start = int(seg_names[0][:-4]) if seg_names else 0
    data_end = int(seg_names[-1][:-4]) + sizes[-1] if seg_names else 0
    ends = e["data_offset"].astype(np.int64) + e["frame_size"].astype(np.int64)
    n = int(np.count_nonzero(ends <= data_end))  # entries past the data end are dropped at open
    e, ends = e[:n], ends[:n]
    if n:
        starts = np.concatenate([[data_start], ends[:-1]])
        bad = np.flatnonzero(e["data_offset"].astype(np.int64) != starts)
        if len(bad):
            rep.add(CorruptRecord(str(ipath), int(bad[0]) * ENTRY_SIZE, "index entry does not describe the next frame"))
            return
        prev = e["prev"].astype(np.int64)
        idx = np.arange(n)
        linked = prev > 0
        ok = ~linked | (prev <= idx)
        ok[linked & ok] = e["second"][prev[linked & ok] - 1] == e["second"][linked & ok]
        bad = np.flatnonzero(~ok)
        if len(bad):
            rep.add(CorruptRecord(str(ipath), int(bad[0]) * ENTRY_SIZE, "index chain is broken"))
            return
    if online or len(heads_raw) < HEADS_HEADER_SIZE:
        return
    hp = str(d / "heads")
    magic, version, start, seconds, covered = HEADS_HEADER.unpack_from(heads_raw)
    crc = struct.unpack_from("<I", heads_raw, 28)[0]
    if magic != HEADS_MAGIC or version != FORMAT_VERSION or crc != zlib.crc32(heads_raw[:28]):
        rep.add(CorruptRecord(hp, 0, "heads header fails its check"))
        return
    if covered != n or len(heads_raw) != HEADS_HEADER_SIZE + 4 * seconds:
        rep.notes.append(f"{hp}: covers {covered} of {n} index entries (relinked at open)")
        return
    heads = np.frombuffer(heads_raw, "<u4", seconds, HEADS_HEADER_SIZE).astype(np.int64)
    want = np.zeros(seconds, np.int64)
    sec = e["second"].astype(np.int64)
    if n and int(sec.max()) >= seconds:
        rep.add(CorruptRecord(str(ipath), int(np.flatnonzero(sec >= seconds)[0]) * ENTRY_SIZE,
                              "index entry second past bucket end"))
        return
    np.maximum.at(want, sec, np.arange(1, n + 1))
    bad = np.flatnonzero(heads != want)
    if len(bad):
        rep.add(CorruptRecord(hp, HEADS_HEADER_SIZE + 4 * int(bad[0]), "head does not match index"))


def _read_lost(p: Path, rep: VerifyReport) -> None:
    """A bucket's ``lost.json`` (format in docs/format.md) into the report's ``lost``."""
    rep.files += 1
    try:
        doc = checkpoint.read(p)
    except CorruptRecord as e:
        rep.add(e)
        return
    except ValueError as e:
        rep.add(CorruptRecord(str(p), 0, f"not JSON: {e}"))
        return
    if doc is None:
        return  # deleted with its bucket meanwhile
    rows = doc.get("records", [])
    ranges = doc.get("ranges", [])
    rep.lost.append({"bucket_start_ms": int(doc.get("bucket_start_ms", 0)), "path": str(p),
                     "state": "lost" if doc.get("lost") else "missing",
                     "records": len(rows) + sum(int(r[2]) for r in ranges),
                     "messages": [r[2] for r in rows if r[1] == KIND_MESSAGE],
                     "cancels": [r[2] for r in rows if r[1] != KIND_MESSAGE],
                     "seq_ranges": [list(r[:3]) for r in ranges], "unreadable_bytes": int(doc.get("unknown_bytes", 0))})


def _verify_idx(p: Path, rep: VerifyReport) -> None:
    rep.files += 1
    try:
        with open(p, "rb") as f:
            hdr = f.read(IDX_HEADER_SIZE)
    except FileNotFoundError:
        return
    if len(hdr) < IDX_HEADER_SIZE or struct.unpack_from("<I", hdr, 60)[0] != zlib.crc32(hdr[:60]):
        # the newest file's header is rewritten at every flush; online that is a race, not damage
        rep.add(CorruptRecord(str(p), 0, "id index header fails its check"))
