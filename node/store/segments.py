"""The segment files of a segmented log (``node/store/log.py``): their names, the folder
scan at open and the recovery of the last segment's tail, and the second half of
retention (unlinking detached segments).

A folder holds ``{base_offset:020d}.log`` files; a segment's base is the global byte
offset of its first record, so names sort by offset. Leftovers a crash can leave:
``*.log.deleting`` (retention renamed it and had not unlinked it yet: it and every older
segment were due, so ``open_segments`` deletes them) and ``*.tmp`` (a sealed segment's
replacement not yet renamed over it: dropped).

Invariants established at open (``open_segments``): every segment's base equals the
previous segment's base plus its size (else ``CorruptRecord`` naming the file and the
offset of the gap); the last segment ends on a whole record.

Recovery of the last segment (``recover_tail``), scanned from its start with
``node/store/frame.py``'s ``decode_frame``:

* fewer bytes than a header remain, or a valid header announces a body running
  past end of file, or everything left is zero bytes -> torn tail: truncated,
  and logged with file, offset and bytes dropped (the ``RecoveryReport``);
* anything else that fails a check -> ``CorruptRecord(path, offset)``: the node
  refuses to start rather than guess.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import CorruptRecord
from cluster.files import DATA_DIR_MODE, DATA_MODE, fsync_dir

from .frame import TornRecord, decode_frame

log = logging.getLogger("hourglass.store.log")

SUFFIX = ".log"
DELETING_SUFFIX = ".deleting"


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """A torn tail cut at open: the file, the global offset it now ends at, the bytes dropped."""

    path: str
    offset: int
    bytes_dropped: int


@dataclass(slots=True)
class Segment:
    """One segment file: its base offset, path, size in bytes and last write time."""

    base: int
    path: Path
    size: int
    mtime: float


def segment_name(base: int) -> str:
    return f"{base:020d}{SUFFIX}"


def open_segments(d: Path, start_offset: int, record_bytes_max: int) -> tuple[list[Segment], RecoveryReport | None]:
    """The segments of folder ``d`` (created if missing), oldest first, checked contiguous,
    the last one's torn tail cut (``recover_tail``); a deletion or replacement a crash
    interrupted is finished or dropped first. A folder without segments gets an empty one
    based at ``start_offset``."""
    d.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    # retention renames segments "*.log.deleting" oldest first, then unlinks them: a crash
    # in between leaves some; every segment at or below the newest of them was due too
    # (a rename lost by a power cut would otherwise leave a gap)
    dying = [p for p in d.glob("*" + SUFFIX + DELETING_SUFFIX)]
    if dying:
        upto = max(int(p.name.split(".")[0]) for p in dying)
        for p in sorted(d.glob("*" + SUFFIX)):
            if p.stem.isdigit() and int(p.stem) <= upto and \
                    any(q.stem.isdigit() and int(q.stem) > int(p.stem) for q in d.glob("*" + SUFFIX)):
                dying.append(p)
        for p in dying:
            p.unlink()
        fsync_dir(d)
        log.warning("segment deletion finished path=%s segments=%d", d, len(dying))
    segments: list[Segment] = []
    for p in sorted(d.glob("*" + SUFFIX)):
        try:
            base = int(p.stem)
        except ValueError:
            continue
        st = p.stat()
        segments.append(Segment(base, p, st.st_size, st.st_mtime))
    for tmp in d.glob("*.tmp"):
        tmp.unlink()
    recovery = None
    if not segments:
        p = d / segment_name(start_offset)
        p.touch(mode=DATA_MODE)
        fsync_dir(d)
        segments.append(Segment(start_offset, p, 0, time.time()))
    else:
        for prev, seg in zip(segments, segments[1:]):
            if prev.base + prev.size != seg.base:
                raise CorruptRecord(str(prev.path), prev.base + prev.size,
                                    f"segment ends at {prev.base + prev.size} but next segment starts at {seg.base}")
        recovery = recover_tail(segments[-1], record_bytes_max)
    return segments, recovery


def recover_tail(seg: Segment, record_bytes_max: int) -> RecoveryReport | None:
    """Scan the last segment from its start; cut a torn tail (module docs) and report it,
    or return None when every byte is a whole record. ``CorruptRecord`` otherwise."""
    data = seg.path.read_bytes()
    pos = 0
    path = str(seg.path)
    while pos < len(data):
        try:
            _, pos = decode_frame(data, pos, path, seg.base, record_bytes_max)
        except TornRecord:
            break
        except CorruptRecord:
            if data.count(0, pos) == len(data) - pos:
                break  # zero-filled tail (preallocation / lost page): torn, not corrupt
            raise
    if pos == len(data):
        return None
    dropped = len(data) - pos
    with open(seg.path, "r+b") as f:
        f.truncate(pos)
        f.flush()
        os.fsync(f.fileno())
    seg.size = pos
    log.warning("torn tail truncated path=%s offset=%d bytes_dropped=%d", path, seg.base + pos, dropped)
    return RecoveryReport(path, seg.base + pos, dropped)


def unlink_segments(directory: Path, paths: list[Path]) -> int:
    """Delete detached segments oldest first (so a crash midway leaves the log's front cut,
    never a gap), then fsync the folder. Any thread. Returns bytes freed."""
    freed = 0
    for p in paths:
        try:
            freed += p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            pass
    if paths:
        fsync_dir(directory)
    return freed
