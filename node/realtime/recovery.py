"""Recovery of a real-time node's data folder at open, and the replay it shares with replicas.

``recover`` runs once, from ``RealtimeStore.open``, after the files are open (the message
log has already cut its own torn tail, ``SegmentedLog.recovery``), and returns a
``RecoveryReport`` of what it found and did:

1. every known subject's index is opened: a partial trailing entry, then trailing entries
   that fail their CRC (torn page) or point at or past the message-log end are cut; a
   compaction a crash interrupted is finished (``IndexFiles.load``). A CRC failure in the
   middle of an index is reported as ``CorruptRecord`` on read, not here;
2. frames from ``min(indexed_offset, dedup_offset)`` on are replayed (``index_frames``):
   entries their subject's index lacks are appended (from the last surviving entry's
   frame of a subject whose tail failed its CRC), subjects a replica learns from its
   master's log are created, and frames with ``store_ms > now_ms - dedup_window_ms`` go
   back into the dedup map. Entries are appended in log order, so a message (frame ``o``,
   index ``i``) is indexed iff ``(o, i) <= (offset, index)`` of its index's last entry:
   replay skips what is indexed without a set of seqs;
3. group positions come from the offsets log (its torn tail cut, the newest document of
   each group kept); a data folder of the old layout (one ``groups/{subject}/{group}.json``
   per group) is migrated: the files become one snapshot record, then are deleted.
   In-flight deadlines do not survive: handles pending at the last group commit (and
   everything handed out after it) are redelivered at once (at-least-once delivery).

``index_frames`` is also how a replica indexes frames it appended byte for byte
(``RealtimeStore.index_appended``): exactly as ``open`` replays a log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from node.realtime.dedup import DedupWindow, keys_of
from node.realtime.frames import FrameCache, decode_frame
from node.realtime.groups import ConsumerGroups
from node.realtime.index import ENTRY_DTYPE, ENTRY_SIZE, batch_tag_masks, frame_runs, visible_ms
from node.realtime.indexfiles import IndexFiles
from node.realtime.subjects import DLQ_SUBJECT, SubjectRegistry
from node.store import checkpoint
from node.store.log import RecoveryReport as LogRecovery
from node.store.log import SegmentedLog, fsync_dir
from node.store.settings import RealtimeSettings

log = logging.getLogger("hourglass.realtime.store")


@dataclass(slots=True)
class RecoveryReport:
    """What ``recover`` found and did (``RealtimeStore.recovery``)."""

    log_tail: LogRecovery | None = None  # the message log's torn tail, cut by the log itself
    subjects: int = 0                    # known subjects (indexes opened)
    reindex_from: int = 0                # log offset re-indexing started from
    dedup_from: int = 0                  # log offset the dedup map was rebuilt from
    entries_reindexed: int = 0           # index entries appended by the replay
    subjects_from_log: int = 0           # subjects created because the log named them (a replica's)
    compactions_finished: int = 0        # older index files whose tail was adopted, then deleted
    dedup_entries: int = 0               # ids back in the dedup map
    dedup_dropped: int = 0               # ids left out: the map was full (dedup_entries_max)
    last_seq: int | None = None          # newest seq in the log (the store stays above its epoch)
    groups: int = 0                      # consumer groups loaded
    groups_ignored: int = 0              # documents of subjects not known (logged)
    group_files_migrated: int = 0        # old-layout group files turned into one record


@dataclass(slots=True)
class Replay:
    last_seq: int | None = None
    reindexed: int = 0
    dedup_added: int = 0
    dedup_dropped: int = 0
    subjects_created: int = 0


def index_frames(messages: SegmentedLog, indexes: IndexFiles, dedup: DedupWindow, registry: SubjectRegistry,
                 settings: RealtimeSettings, reindex_from: int, dedup_offset: int, now_ms: int) -> Replay:
    """Index messages of frames from ``reindex_from`` on that their subject index lacks, and
    put frames from ``dedup_offset`` on back in the dedup map (module docstring, step 2)."""
    out = Replay()
    cutoff = now_ms - settings.dedup_window_ms
    by_subject = indexes.by_subject
    for off, body in messages.iterate(min(reindex_from, dedup_offset)):
        b = decode_frame(messages.directory, off, body)
        if not b.n:
            continue
        out.last_seq = int(b.seq[-1])
        if off >= reindex_from:
            missing = [s for s in b.subjects if s not in by_subject]
            if missing:  # a replica learns its master's new subjects from the log: one round per frame
                registry.create_now([(s, "") for s in missing], now_ms=now_ms)
                out.subjects_created += len(missing)
            vis = visible_ms(b, b.store_ms, settings.visible_hold_ms_max, settings.visible_step_ms)
            held = int(vis.max())
            runs = frame_runs(offset=off, subject_idx=b.subject_idx, visible_ms=vis, masks=batch_tag_masks(b))
            for k, raw in runs.items():
                ix = by_subject[b.subjects[k]]
                if off < ix.last_offset:
                    continue
                if off == ix.last_offset:  # a run cut short: keep the entries past the last one indexed
                    done = int((np.frombuffer(raw, ENTRY_DTYPE)["index"] <= ix.last_index).sum())
                    raw = raw[done * ENTRY_SIZE:]
                if raw:
                    ix.append_run(indexes.fd(ix), raw)
                    out.reindexed += len(raw) // ENTRY_SIZE
                    if held > ix.held_until:  # a replica's frames: held the same once it is promoted
                        ix.held_until = held
        store_ms = int(b.store_ms[0])
        if off >= dedup_offset and store_ms > cutoff:
            keys = keys_of(b.subject_list(), b.id_list())
            out.dedup_added += len(keys)
            out.dedup_dropped += dedup.add(keys, b.seq, store_ms=store_ms, offset=off)
    return out


def migrate_group_files(groups: ConsumerGroups, docs: dict) -> tuple[dict, int]:
    """Old layout: one JSON file per group. Into an empty offsets log they go as one
    snapshot record (fsynced) before the files are deleted; next to a non-empty log they
    are leftovers of a migration that crashed after that record, and only deleted.
    Returns the documents and how many files were found."""
    directory: Path = groups.offsets.directory
    files = sorted(p for sd in directory.iterdir() if sd.is_dir() for p in sd.glob("*.json"))
    if not files:
        return docs, 0
    if not docs:
        old = [checkpoint.read(p) for p in files]
        docs = {(d["subject"], d["group"]): d for d in old}
        groups.offsets.commit(old).result()
        log.warning("group files migrated to the offsets log path=%s groups=%d", directory, len(docs))
    for p in files:
        p.unlink()
    for sd in {p.parent for p in files}:
        if not any(sd.iterdir()):
            sd.rmdir()
    fsync_dir(directory)
    return docs, len(files)


def recover(*, messages: SegmentedLog, indexes: IndexFiles, registry: SubjectRegistry, groups: ConsumerGroups,
            group_docs: dict, dedup: DedupWindow, frames: FrameCache, settings: RealtimeSettings,
            indexed_offset: int, dedup_offset: int, now_ms: int) -> RecoveryReport:
    """Open the indexes, replay the log, load the groups (module docstring)."""
    report = RecoveryReport(log_tail=messages.recovery, dedup_from=dedup_offset)
    reindex_from = indexed_offset
    for s in registry.owners:
        rebuild, finished = indexes.load(s)
        report.compactions_finished += finished
        if rebuild is not None:
            reindex_from = min(reindex_from, rebuild)
    if DLQ_SUBJECT not in indexes.by_subject:
        registry.create_now([(DLQ_SUBJECT, "")], now_ms=now_ms)
    report.reindex_from = reindex_from

    replay = index_frames(messages, indexes, dedup, registry, settings, reindex_from, dedup_offset, now_ms)
    report.entries_reindexed = replay.reindexed
    report.subjects_from_log = replay.subjects_created
    report.dedup_entries = len(dedup)
    report.dedup_dropped = replay.dedup_dropped
    if replay.dedup_dropped:
        log.warning("dedup map full at recovery path=%s dedup_entries_max=%d entries_dropped=%d",
                    messages.directory.parent, settings.dedup_entries_max, replay.dedup_dropped)
    if replay.reindexed:
        log.info("re-indexed path=%s from_offset=%d entries=%d", messages.directory, reindex_from, replay.reindexed)
    last_seq = replay.last_seq
    if last_seq is None and messages.end_offset > messages.start_offset:
        last_off = max((ix.last_offset for ix in indexes.by_subject.values()), default=-1)
        if last_off >= 0:
            last_seq = int(frames.get(last_off).seq[-1])
    report.last_seq = last_seq
    for ix in indexes.by_subject.values():  # entries written before a restart may still be held
        ix.held_until = now_ms + settings.visible_hold_ms_max

    docs, report.group_files_migrated = migrate_group_files(groups, group_docs)
    report.groups_ignored = groups.load(docs, indexes.by_subject)
    report.groups = len(groups.by_key)
    report.subjects = len(indexes.by_subject)
    return report
