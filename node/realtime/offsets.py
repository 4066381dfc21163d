"""OffsetsLog: the durable positions of the consumer groups of a real-time node (``{root}/groups/``).

Acks must survive a crash once answered, and the bench consumer acks every pulled
batch over 16 subjects: one file per (subject, group) per ack round (temp file, fsync,
rename, dir fsync) cost a round O(groups touched) fsyncs. Here a round costs one
record, one ``write`` and one ``fsync`` whatever the number of groups it changed.

Format (``docs/format.md``, real-time section): a ``SegmentedLog`` (``node/store/log.py``:
CRC-checked frames, torn tail truncated at open) whose record bodies are UTF-8 JSON::

    {"v": 1, "snapshot": false, "groups": [doc, ...]}

``doc`` is a group document (``node/realtime/groups.py``: version, subject, group, start,
committed, next, pending). A *round* record holds the groups that changed in one commit
round; a *snapshot* record holds every group. The position of a group is its doc in the
newest record naming it: replay reads the log from its start and keeps the last doc per
``(subject, group)``. Groups are never deleted, so a snapshot makes every record before
it redundant.

Compaction: once the bytes written after the last snapshot pass
``max(compact_bytes, 2 * snapshot bytes)``, the next round is written as a snapshot
(the round's docs merged into every group's newest doc), fsynced, and then the sealed
segments that end at or before the snapshot are deleted. Segments are
``compact_bytes // 4`` long, so the log holds at most about ``1.25 * compact_bytes``
plus two snapshots. A crash between the snapshot and the deletion leaves old segments
whose docs the snapshot overrides: replay gives the same positions.

Threads: ``commit`` runs on the caller's thread (the event loop) and only encodes and
queues; every touch of the log (append, fsync, delete) runs on the one writer thread,
in submission order, so a newer doc never lands before an older one and a roll never
races an fsync.

Example::

    log, docs = OffsetsLog.open(root / "groups")     # docs: {(subject, group): doc}
    fut = log.commit([doc_a, doc_b])                 # one record; fut done once fsynced
    fut.result()
    log.close()
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from cluster.errors import CorruptRecord
from node.store.log import HEADER_SIZE, SegmentedLog
from node.store.settings import REALTIME_DEFAULTS

log = logging.getLogger("hourglass.realtime.offsets")

OFFSETS_RECORD_VERSION = 1
COMPACT_BYTES_DEFAULT = REALTIME_DEFAULTS.offsets_compact_bytes
RECORD_BYTES_MAX = 256 * 1024 * 1024  # a snapshot of groups_max groups (about 200 bytes each) fits

GroupKey = tuple[str, str]


def encode_record(docs: list[dict], *, snapshot: bool) -> bytes:
    return json.dumps({"v": OFFSETS_RECORD_VERSION, "snapshot": snapshot, "groups": docs},
                      separators=(",", ":")).encode()


def decode_record(body: bytes, path: str, offset: int) -> tuple[bool, list[dict]]:
    """``(snapshot, docs)`` of one record; ``CorruptRecord`` for a body this module did not
    write (its CRC matched, so it is not a torn write)."""
    try:
        rec = json.loads(body)
        if rec["v"] != OFFSETS_RECORD_VERSION:
            raise ValueError(f"version {rec['v']}")
        docs = rec["groups"]
        for d in docs:
            d["subject"], d["group"]  # noqa: B018 - every doc names its group
        return bool(rec["snapshot"]), docs
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptRecord(path, offset, f"not an offsets record: {e!r}") from None


class OffsetsLog:
    """See module docstring. ``commit`` from one thread only."""

    def __init__(self, seglog: SegmentedLog, latest: dict[GroupKey, dict], *, compact_bytes: int,
                 since_snapshot_bytes: int, snapshot_bytes: int) -> None:
        self.log = seglog
        self.compact_bytes = compact_bytes
        self._latest = latest                       # (subject, group) -> newest doc committed
        self._since_snapshot = since_snapshot_bytes  # bytes written after the last snapshot record
        self._snapshot_bytes = snapshot_bytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offsets-writer")
        self.records = 0
        self.snapshots = 0

    @classmethod
    def open(cls, directory: str | os.PathLike, *,
             compact_bytes: int = COMPACT_BYTES_DEFAULT) -> tuple["OffsetsLog", dict[GroupKey, dict]]:
        """Open (creating if needed) and replay: the log and the newest doc of every group."""
        seglog = SegmentedLog.open(directory, segment_bytes_max=max(4096, compact_bytes // 4),
                                   record_bytes_max=RECORD_BYTES_MAX)
        latest: dict[GroupKey, dict] = {}
        since = seglog.end_offset - seglog.start_offset
        snap = 0
        for off, body in seglog.iterate():
            is_snapshot, docs = decode_record(body, str(seglog.directory), off)
            for d in docs:
                latest[(d["subject"], d["group"])] = d
            if is_snapshot:
                snap = HEADER_SIZE + len(body)
                since = seglog.end_offset - off - snap
        return cls(seglog, latest, compact_bytes=compact_bytes, since_snapshot_bytes=since,
                   snapshot_bytes=snap), dict(latest)

    @property
    def directory(self) -> Path:
        return self.log.directory

    def commit(self, docs: list[dict]) -> Future:
        """Append one record holding ``docs`` (a snapshot when compaction is due); the future
        completes once it is fsynced (its exception if the write or fsync failed)."""
        for d in docs:
            self._latest[(d["subject"], d["group"])] = d
        body = encode_record(docs, snapshot=False)
        snapshot = self._since_snapshot + len(body) > max(self.compact_bytes, 2 * self._snapshot_bytes)
        if snapshot:
            body = encode_record(list(self._latest.values()), snapshot=True)
            self._snapshot_bytes = HEADER_SIZE + len(body)
            self._since_snapshot = 0
        else:
            self._since_snapshot += HEADER_SIZE + len(body)
        self.records += 1
        return self._writer.submit(self._write, body, snapshot)

    def _write(self, body: bytes, snapshot: bool) -> None:  # writer thread
        [off] = self.log.append([body])
        self.log.flush()
        if snapshot:
            freed = self.log.delete_before(off)
            self.snapshots += 1
            log.info("offsets log compacted path=%s offset=%d snapshot_bytes=%d bytes_freed=%d",
                     self.log.directory, off, len(body), freed)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.log.close()

    def abandon(self) -> None:
        """Drop without waiting (a crash simulation: the store was not closed)."""
        self._writer.shutdown(wait=False)
