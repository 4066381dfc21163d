"""Id-index files written whole, off to the side: compaction of a sealed file (retention
drops the entries of buckets gone) and the rebuild of a corrupt file from the data the
index is derived from (the schedule log, ``IdIndex.open(rebuild=...)``).

Both write ``{name}.tmp`` with the kept entries in their order, chains relinked with
numpy (about two slots per entry), header last, fsynced; a failure removes the temporary
file. Invariants: the source file is only read (nobody writes a sealed file), so the
build may run on any thread; a compacted file takes the old one's place by one atomic
rename (``IdIndex.swap_compacted``), a rebuilt one once the bad file is renamed
``{name}.corrupt`` (``rebuild_file``, kept for a look, never read again); a ``*.idx.tmp``
a crash left behind is removed at open. A compacted file keeps its source's version (its
key hash); a rebuilt one is written in the current version.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.errors import CorruptRecord
from cluster.files import DATA_MODE
from node.store.diskspace import allocate
from node.store.log import fsync_dir

from .idindex_file import (ENTRY_DTYPE, ENTRY_SIZE, HEADER, HEADER_SIZE, SLOT_SIZE, VERSION, IndexFile, file_size,
                           pack_header, read_entries, read_header)

log = logging.getLogger("hourglass.store.idindex")

COMPACT_CHUNK_ENTRIES = 1 << 18  # entries read at once while a sealed file is compacted


@dataclass(frozen=True, slots=True)
class Compacted:
    tmp: Path
    slots_count: int
    entries_max: int
    entries_used: int
    last_seq: int


def build_compacted(path: Path, entries_offset: int, entries_used: int, gone_buckets: np.ndarray, *,
                    first_seq: int) -> Compacted:
    """Write ``{path}.tmp``: the entries of sealed file ``path`` whose bucket is not in
    ``gone_buckets``, in their order, chains relinked; fsynced. Pure file work on a file
    nobody writes (any thread). Memory: one chunk of entries plus the slot table."""
    with open(path, "rb") as src:  # the copy keeps the source's version (its key hash)
        version = HEADER.unpack_from(src.read(HEADER_SIZE))[1]
    keep_total = 0
    for lo in range(0, entries_used, COMPACT_CHUNK_ENTRIES):
        e = read_entries(path, entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, entries_used - lo))
        keep_total += int(np.count_nonzero(~np.isin(e["bucket_start_ms"], gone_buckets)))

    def kept():
        for lo in range(0, entries_used, COMPACT_CHUNK_ENTRIES):
            e = read_entries(path, entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, entries_used - lo))
            yield e[~np.isin(e["bucket_start_ms"], gone_buckets)].copy()

    return _write_table(path.with_name(path.name + ".tmp"), kept(), max(1, keep_total), first_seq=first_seq,
                        version=version)


def build_from_entries(path: Path, entries: np.ndarray, *, first_seq: int) -> Compacted:
    """Write ``{path}.tmp`` holding ``entries`` (``ENTRY_DTYPE``, sorted by seq, each seq >=
    ``first_seq``), chains linked; fsynced. How a corrupt file is rebuilt (``IdIndex.open``)."""
    e = np.array(entries, ENTRY_DTYPE)  # a writable copy: the writer sets ``prev``
    chunks = (e[lo:lo + COMPACT_CHUNK_ENTRIES] for lo in range(0, len(e), COMPACT_CHUNK_ENTRIES))
    return _write_table(path.with_name(path.name + ".tmp"), chunks, max(1, len(e)), first_seq=first_seq,
                        version=VERSION)


def _write_table(tmp: Path, chunks: Iterable[np.ndarray], entries_max: int, *, first_seq: int,
                 version: int) -> Compacted:
    """A sealed file at ``tmp`` from chunks of entries in order (``prev`` is set here), with
    about two slots per entry; fsynced. Removed again if anything fails."""
    slots_count = 1 << max(10, (2 * entries_max - 1).bit_length())  # about two slots per entry
    slots = np.zeros(slots_count, np.uint32)
    size = file_size(slots_count, entries_max)
    ent_off = HEADER_SIZE + SLOT_SIZE * slots_count
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, DATA_MODE)
    try:
        allocate(fd, 0, size, str(tmp))
        n = 0
        last_seq = -1
        for e in chunks:
            k = len(e)
            if not k:
                continue
            slot_of = (e["key_hash"] % np.uint64(slots_count)).astype(np.int64)
            numbers = np.arange(n + 1, n + k + 1, dtype=np.int64)
            order = np.argsort(slot_of, kind="stable")
            s_sorted = slot_of[order]
            prev_sorted = slots[s_sorted].astype(np.int64)
            same = np.zeros(k, bool)
            same[1:] = s_sorted[1:] == s_sorted[:-1]
            prev_sorted[same] = numbers[order][:-1][same[1:]]
            prev = np.empty(k, np.int64)
            prev[order] = prev_sorted
            e["prev"] = prev
            last = np.ones(k, bool)
            last[:-1] = s_sorted[:-1] != s_sorted[1:]
            slots[s_sorted[last]] = numbers[order][last]
            os.pwrite(fd, e.tobytes(), ent_off + n * ENTRY_SIZE)
            n += k
            last_seq = int(e["seq"][-1])
        os.pwrite(fd, slots.tobytes(), HEADER_SIZE)
        os.pwrite(fd, pack_header(slots_count, entries_max, n, first_seq, last_seq if n else first_seq, version), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return Compacted(tmp, slots_count, entries_max, n, last_seq if n else first_seq)


def rebuild_file(p: Path, first_seq: int, next_first_seq: int | None,
                  rebuild: Callable[[int, int | None], np.ndarray], why: CorruptRecord) -> IndexFile:
    """Replace corrupt file ``p`` by one written from ``rebuild``'s entries (module docs)."""
    log.warning("id index file corrupt, rebuilding it from the schedule log path=%s offset=%d reason=%r",
                p, why.offset, why.reason)
    entries = rebuild(first_seq, next_first_seq)
    built = build_from_entries(p, entries, first_seq=first_seq)
    os.replace(p, p.with_name(p.name + ".corrupt"))  # kept for a look; never read again
    os.replace(built.tmp, p)
    fsync_dir(p.parent)
    log.warning("id index file rebuilt path=%s entries=%d last_seq=%d (the bad file is %s.corrupt)",
                p, built.entries_used, built.last_seq, p.name)
    return read_header(p, first_seq)
