"""Where the logs are: node data folders, their role, and one read task per segment file.

Pure planning over directory listings; opens no log for writing and never changes a file
(``SegmentedLog.open`` would truncate a torn tail, so the Spark reader does not use it).

A path given to the reader is one of:

* a **delay node** folder: it has ``dispatch/`` or ``schedule/`` (``docs/format.md``);
* a **real-time node** folder: it has ``index/`` or ``subjects.json``;
* anything else: its sub-folders are examined the same way, two levels deep at most, so
  the root of a ``LocalCluster`` (or a folder where an operator copied every node's data)
  works as one path.

Logs (the ``log`` option of the data source):

=========  ===========  ==========================================
log        node role    segment files read
=========  ===========  ==========================================
message    delay        ``{node}/messages/*.log``
schedule   delay        ``{node}/schedule/{start_ms}/data/*.log``
dispatch   delay        ``{node}/dispatch/*.log``
realtime   real-time    ``{node}/messages/*.log``
=========  ===========  ==========================================

Example: ``plan(["/data"], "dispatch")`` on a folder holding ``delay-1`` and
``realtime-1`` returns one ``Segment`` per ``/data/delay-1/dispatch/*.log``, the
last one flagged ``last=True`` (only there can a tail be torn rather than corrupt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import InvalidArgument
from cluster.logformat import BUCKET_MS_DEFAULT  # StoreSettings.bucket_ms, without loading the node

LOGS = ("message", "schedule", "dispatch", "realtime")
ROLE_DELAY = "delay"
ROLE_REALTIME = "realtime"
SEARCH_DEPTH_MAX = 2
SEGMENT_SUFFIX = ".log"


@dataclass(frozen=True, slots=True)
class NodeDir:
    name: str
    path: str
    role: str


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment file: the unit of work of one Spark task."""

    node: str
    log: str
    path: str
    base: int                  # global byte offset of the file's first byte
    last: bool                 # newest segment of its log: a short tail is torn, not corrupt
    size: int
    bucket_start_ms: int | None = None   # schedule log only
    bucket_ms: int | None = None         # schedule log only


def role_of(path: Path) -> str | None:
    if (path / "dispatch").is_dir() or (path / "schedule").is_dir():
        return ROLE_DELAY
    if (path / "index").is_dir() or (path / "subjects.json").is_file():
        return ROLE_REALTIME
    return None


def find_nodes(paths: list[str]) -> list[NodeDir]:
    """Node folders under ``paths`` (see module docstring), in a stable order."""
    found: list[tuple[str, str]] = []

    def visit(p: Path, depth: int) -> None:
        role = role_of(p)
        if role is not None:
            found.append((str(p.resolve()), role))
            return
        if depth >= SEARCH_DEPTH_MAX or not p.is_dir():
            return
        for child in sorted(p.iterdir()):
            if child.is_dir():
                visit(child, depth + 1)

    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise InvalidArgument("path", f"{raw} does not exist")
        visit(p, 0)
    unique = sorted(set(found))
    names = [Path(p).name for p, _ in unique]
    out = []
    for (p, role), name in zip(unique, names):
        # folder names identify nodes (delay-1, realtime-1); fall back to the path when two collide
        out.append(NodeDir(name if names.count(name) == 1 else p, p, role))
    return out


def _segments_in(directory: Path) -> list[tuple[int, Path, int]]:
    segs = []
    if not directory.is_dir():
        return segs
    for p in directory.iterdir():
        if not p.name.endswith(SEGMENT_SUFFIX):
            continue
        try:
            base = int(p.name[: -len(SEGMENT_SUFFIX)])
        except ValueError:
            continue
        segs.append((base, p, p.stat().st_size))
    return sorted(segs)


def _log_segments(node: NodeDir, log: str, directory: Path, **extra) -> list[Segment]:
    segs = _segments_in(directory)
    return [Segment(node.name, log, str(p), base, i == len(segs) - 1, size, **extra)
            for i, (base, p, size) in enumerate(segs)]


def bucket_ms_of(node_path: str) -> int:
    meta = Path(node_path) / "schedule" / "meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["bucket_ms"])
    return BUCKET_MS_DEFAULT


def plan(paths: list[str], log: str) -> list[Segment]:
    """Every segment file of ``log`` under ``paths``, ordered by node then offset."""
    if log not in LOGS:
        raise InvalidArgument("log", f"{log!r} is not one of {', '.join(LOGS)}")
    want_role = ROLE_REALTIME if log == "realtime" else ROLE_DELAY
    out: list[Segment] = []
    for node in find_nodes(paths):
        if node.role != want_role:
            continue
        root = Path(node.path)
        if log in ("message", "realtime"):
            out += _log_segments(node, log, root / "messages")
        elif log == "dispatch":
            out += _log_segments(node, log, root / "dispatch")
        else:
            bucket_ms = bucket_ms_of(node.path)
            sched = root / "schedule"
            for b in sorted(sched.iterdir()) if sched.is_dir() else []:
                if b.is_dir() and b.name.isdigit():
                    out += _log_segments(node, log, b / "data", bucket_start_ms=int(b.name), bucket_ms=bucket_ms)
    return out


def split_paths(value: str | None) -> list[str]:
    """The ``path`` option: one path, several separated by commas, or a JSON list."""
    if not value:
        return []
    value = value.strip()
    if value.startswith("["):
        return [str(v) for v in json.loads(value)]
    return [v.strip() for v in value.split(",") if v.strip()]


def total_bytes(segments: list[Segment]) -> int:
    return sum(s.size for s in segments)


__all__ = ["LOGS", "NodeDir", "Segment", "find_nodes", "plan", "split_paths", "role_of", "bucket_ms_of",
           "total_bytes"]
