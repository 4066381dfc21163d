"""Id index: message id -> location, on disk, in the style of RocketMQ's IndexFile.

Owns one folder (``{root}/ids/``) of index files. Cancel and lookup by message id
need to find a message among millions of pending ones without a dict in RAM: each
file is a fixed-size hash table whose slots head a chain of append-only entries,
memory-mapped, so RAM holds only the pages the kernel chooses to cache.

Files are named by the seq of their first entry, zero padded so names sort::

    ids/00000000000000000000.idx     entries for seq 0 .. 4_194_303 (full, sealed)
    ids/00000000000004194304.idx     the newest file: the only one written to

The format of one file (header, slot table, 40-byte entries, the key hash and its
versions, the order an entry is written in) is ``node/store/idindex_file.py``'s;
compaction and the rebuild of a corrupt file are ``node/store/idindex_compact.py``'s.
This module owns the folder: which file is written, rolling, the LRU of mapped files,
lookups across files, flushing, retention.

Invariants:

* only the newest file is written; a file is sealed (header written, synced) before
  the next one is created, and a file is full (or of version 1) when the next one starts;
* entries of a file are in put order, so their seqs are non-decreasing and every
  ``prev`` points backwards; a chain walk from a slot head visits that slot's entries
  newest first;
* ``seq`` is non-decreasing across puts (checked), so ``last_seq()`` is a high-water
  mark: a caller replaying its log after a crash skips records with ``seq <= last_seq()``
  and nothing is indexed twice. This needs distinct seqs per put, as the message log's are;
  at most ``entries_max`` puts may share one seq (a file's name is its first seq).

Crash recovery (``open``): the newest file's tail is scanned and its one unlinked entry
relinked (``idindex_file.recover_tail``). An empty newest file (a kill between creating it
and its first entry) is removed. Walks are defensive all the same: a head beyond
``entries_used`` is treated as empty, a walk stops at a ``prev`` not below its own number
and takes at most ``entries_used`` steps. A header failing its CRC or its checks raises
``CorruptRecord`` naming the file, unless ``open`` was given ``rebuild``. ``flush`` syncs
the entries before writing the header, so after a power loss the header never vouches for
entries that did not reach the disk.

Lookups return candidates, not answers: two ids can share an 8-byte hash. ``get_all``
returns every location whose hash matches, newest first across files (newest file
first); the caller confirms the id by reading the record at the location.

Only ``open_files_max`` files stay mapped (LRU, the newest always among them); older
files are mapped read-only on demand. One process writes a folder at a time (not locked).

Example, with 4 slots::

    ids = IdIndex.open(root / "ids", slots_count=4, entries_max=3)
    ids.put("a", IdLocation(bucket_start_ms=3_600_000, data_offset=0, frame_size=90, seq=7))
        # file 00000000000000000007.idx, entry 0 (number 1); slot h("a") % 4 -> head 1
    ids.put("b", IdLocation(3_600_000, 90, 80, seq=8))
        # entry 1; if "b" shares a's slot, entry 1 gets prev=1 and the head becomes 2
    ids.put("a", IdLocation(7_200_000, 0, 95, seq=9))        # entry 2 shadows entry 0
    ids.get_all("a")
        # walk head -> entry 2 (hash match), -> entry 1 ("b": hash differs, skipped),
        # -> entry 0 (match): [IdLocation(7_200_000, 0, 95, 9), IdLocation(3_600_000, 0, 90, 7)]
    ids.put("c", IdLocation(7_200_000, 95, 70, seq=10))      # file full: seal it, start ...0010.idx
    ids.last_seq()                                           # 10
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cluster.errors import Closed, CorruptRecord, DiskFull, InvalidArgument
from cluster.files import DATA_DIR_MODE, DATA_MODE
from node.store.diskspace import allocate
from node.store.log import fsync_dir
from node.store.settings import STORE_DEFAULTS
from node.store.syncplan import SyncPlan

from .idindex_compact import COMPACT_CHUNK_ENTRIES, Compacted, build_compacted, build_from_entries, rebuild_file
from .idindex_file import (ALLOCATE_STEP_BYTES, ENTRY, ENTRY_DTYPE, ENTRY_FRAME_SIZE_OFFSET, ENTRY_SIZE, HEADER,
                           HEADER_CRC_OFFSET, HEADER_SIZE, I64_MAX, I64_MIN, MAGIC, SEQ_MAX, SLOT_SIZE, SUFFIX, U32,
                           U32_MAX, U64_MAX, VERSION, VERSION_BLAKE2B, VERSIONS, IdLocation, IndexFile, file_name,
                           file_size, key_hash, key_hashes, pack_header, put_chunk, read_entries, read_header,
                           recover_tail)

log = logging.getLogger("hourglass.store.idindex")

OPEN_FILES_MAX = 8  # sealed files kept mapped (LRU) unless ``open_files_max`` says otherwise


class IdIndex:
    """Message id -> ``IdLocation`` candidates, in rolling mmap'd hash-slot files."""

    def __init__(self, directory: Path, files: list[IndexFile], *, slots_count: int, entries_max: int,
                 open_files_max: int) -> None:
        self.directory = directory
        self.slots_count = slots_count
        self.entries_max = entries_max
        self.open_files_max = open_files_max
        self._files = files  # ascending first_seq; the last one is the active (writable) file
        self._mapped: OrderedDict[int, IndexFile] = OrderedDict()  # first_seq -> file, LRU order
        self._closed = False
        self._last_seq = -1
        self.rebuilt_files: list[Path] = []  # files rebuilt at open (their header was corrupt)

    # -- opening and recovery ------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, slots_count: int = STORE_DEFAULTS.id_slots,
             entries_max: int = STORE_DEFAULTS.id_entries_max, open_files_max: int = OPEN_FILES_MAX,
             rebuild: Callable[[int, int | None], np.ndarray] | None = None) -> IdIndex:
        """Open (or create) the folder; ``slots_count``/``entries_max`` apply to new files.

        ``rebuild(first_seq, next_first_seq)``: the entries (``ENTRY_DTYPE``, sorted by seq)
        of the records with ``first_seq <= seq < next_first_seq`` (None: no bound), from the
        data the index is derived from. A file whose header fails its checks is then rebuilt
        from them (the bad file kept as ``{name}.corrupt``) instead of failing the open;
        without it the ``CorruptRecord`` is raised."""
        for name, value, lo, hi in (("slots_count", slots_count, 1, U32_MAX),
                                    ("entries_max", entries_max, 1, U32_MAX - 1),
                                    ("open_files_max", open_files_max, 1, 1 << 16)):
            if not isinstance(value, int) or not lo <= value <= hi:
                raise InvalidArgument(name, f"must be an int in [{lo}, {hi}], got {value!r}")
        path = Path(directory)
        path.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        for dead in path.glob(f"*{SUFFIX}.deleting"):  # retention stopped between rename and unlink
            dead.unlink()
        for tmp in path.glob(f"*{SUFFIX}.tmp"):  # a kill while creating a file: never named, never used
            log.warning("id index removing unfinished file path=%s", tmp)
            tmp.unlink()
        files = []
        rebuilt: list[Path] = []
        names = sorted(path.glob(f"*{SUFFIX}"))
        for k, p in enumerate(names):
            stem = p.name[: -len(SUFFIX)]
            if len(stem) != 20 or not stem.isdigit():
                raise CorruptRecord(str(p), 0, "file name is not a 20-digit first seq")
            try:
                files.append(read_header(p, int(stem)))
            except CorruptRecord as e:
                if rebuild is None:
                    raise
                nxt = int(names[k + 1].name[: -len(SUFFIX)]) if k + 1 < len(names) else None
                files.append(rebuild_file(p, int(stem), nxt, rebuild, e))
                rebuilt.append(p)
        self = cls(path, files, slots_count=slots_count, entries_max=entries_max, open_files_max=open_files_max)
        self.rebuilt_files = rebuilt
        try:
            self._recover_newest()
        except BaseException:
            self._unmap_all()
            raise
        return self

    def _recover_newest(self) -> None:
        while self._files:
            f = self._files[-1]
            self._map(f, writable=True)
            try:
                f.ensure_allocated(f.entries_used + 1)
            except DiskFull as e:  # still opens: the next put will say so again
                log.error("id index cannot allocate path=%s error=%s", f.path, e)
            recover_tail(f)
            if f.entries_used:
                self._last_seq = f.last_seq
                return
            # created, then killed before its first entry was committed
            log.warning("id index removing empty newest file path=%s", f.path)
            self._unmap(f)
            f.path.unlink()
            fsync_dir(self.directory)
            self._files.pop()

    # -- mapping (LRU) -----------------------------------------------------------------

    def _map(self, f: IndexFile, *, writable: bool = False) -> mmap.mmap:
        if f.mm is not None:
            self._mapped.move_to_end(f.first_seq)
            return f.mm
        fd = os.open(f.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != f.size:
                raise CorruptRecord(str(f.path), 0, f"file size changed, want {f.size}")
            f.mm = mmap.mmap(fd, f.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        f.fd, f.writable = fd, writable
        self._mapped[f.first_seq] = f
        active = self._files[-1] if self._files else None
        while len(self._mapped) > self.open_files_max:
            victim = next((v for v in self._mapped.values() if v is not active and v is not f), None)
            if victim is None:
                break
            self._unmap(victim)
        return f.mm

    def _unmap(self, f: IndexFile) -> None:
        if f.mm is None:
            return
        if f.dirty:
            f.sync()
        f.mm.close()
        os.close(f.fd)
        f.mm, f.fd, f.writable = None, -1, False
        self._mapped.pop(f.first_seq, None)

    def _unmap_all(self) -> None:
        for f in list(self._mapped.values()):
            self._unmap(f)

    # -- writing -------------------------------------------------------------------------

    def put(self, msg_id: str, loc: IdLocation) -> None:
        """Append ``msg_id -> loc``; it shadows earlier puts of the id. Not durable until ``flush``."""
        self._check_open()
        h = key_hash(msg_id)
        if not isinstance(loc, IdLocation):
            raise InvalidArgument("loc", f"must be an IdLocation, got {type(loc).__name__}")
        for name, value, lo, hi in (("bucket_start_ms", loc.bucket_start_ms, I64_MIN, I64_MAX),
                                    ("data_offset", loc.data_offset, 0, U64_MAX),
                                    ("frame_size", loc.frame_size, 1, U32_MAX),
                                    ("seq", loc.seq, 0, SEQ_MAX)):
            if not isinstance(value, int) or not lo <= value <= hi:
                raise InvalidArgument(name, f"must be an int in [{lo}, {hi}], got {value!r}")
        if loc.seq < self._last_seq:
            raise InvalidArgument("seq", f"{loc.seq} < last_seq {self._last_seq}: seqs must not decrease")
        f = self._files[-1] if self._files else None
        if f is None or f.entries_used >= f.entries_max or f.version != VERSION:
            f = self._roll(loc.seq)
        mm = f.mm
        assert mm is not None and f.writable
        n = f.entries_used
        f.ensure_allocated(n + 1)
        slot_off = HEADER_SIZE + SLOT_SIZE * (h % f.slots_count)
        (head,) = U32.unpack_from(mm, slot_off)
        if head > n:
            head = 0  # never link to an entry that does not exist (cannot happen with the write order)
        entry_off = f.entries_offset + n * ENTRY_SIZE
        ENTRY.pack_into(mm, entry_off, h, loc.bucket_start_ms, loc.data_offset, loc.seq, 0, head)
        U32.pack_into(mm, entry_off + ENTRY_FRAME_SIZE_OFFSET, loc.frame_size)  # commit
        U32.pack_into(mm, slot_off, n + 1)  # link
        f.entries_used = n + 1
        f.last_seq = loc.seq
        f.dirty = True
        self._last_seq = loc.seq

    def _roll(self, seq: int) -> IndexFile:
        old = self._files[-1] if self._files else None
        if old is not None:
            if seq == old.first_seq:
                raise InvalidArgument("seq", f"more than entries_max={old.entries_max} puts share seq {seq}")
            self._map(old, writable=True)
            old.sync()  # sealed: the header now covers every entry
        path = self.directory / file_name(seq)
        tmp = path.with_name(path.name + ".tmp")
        size = file_size(self.slots_count, self.entries_max)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, DATA_MODE)
        try:
            os.ftruncate(fd, size)  # sparse: untouched entries cost no disk
            # header and slots are allocated before the file is mapped (a store into a page the
            # disk cannot back is a SIGBUS); entries are allocated ahead of puts
            allocate(fd, 0, HEADER_SIZE + SLOT_SIZE * self.slots_count, str(path))
            os.pwrite(fd, pack_header(self.slots_count, self.entries_max, 0, seq, -1), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink()
            raise
        os.close(fd)
        os.rename(tmp, path)
        fsync_dir(self.directory)
        f = IndexFile(path, seq, self.slots_count, self.entries_max, 0, -1)
        self._files.append(f)
        if old is not None and old.writable:
            self._unmap(old)  # remapped read-only if a lookup needs it
        self._map(f, writable=True)
        log.info("id index rolled path=%s first_seq=%d", path, seq)
        return f

    def flush(self) -> None:
        """Make every put so far durable (entries fsynced, then the header entries_used/last_seq, fsync)."""
        plan = SyncPlan()
        self.plan_flush(plan)
        plan.run()

    def dirty(self) -> bool:
        """Entries put since the last flush (``plan_flush`` has work to do)."""
        return any(f.dirty for f in self._mapped.values())

    def plan_flush(self, plan: SyncPlan) -> None:
        """``flush`` as steps for a worker thread. The header bytes are taken now, so they
        vouch only for entries put before the plan's first fsync; a put meanwhile marks the
        file dirty again for the next flush."""
        self._check_open()
        for f in list(self._mapped.values()):
            if f.dirty:
                plan.fsync(f.fd)
                plan.pwrite(f.fd, f.header(), 0)
                plan.fsync(f.fd)
                f.dirty = False

    def put_many(self, hashes: np.ndarray, bucket_start_ms: np.ndarray, data_offset: np.ndarray,
                 frame_size: np.ndarray, seqs: np.ndarray) -> None:
        """``put`` for a whole batch (seqs non-decreasing): entries written as one numpy
        array per file, then their commit marks, then the slot heads; chains inside the
        batch are linked with numpy (entries sharing a slot point at each other)."""
        self._check_open()
        n = len(hashes)
        if not n:
            return
        seqs = np.asarray(seqs, np.uint64)
        if int(seqs[0]) < self._last_seq or (n > 1 and bool((np.diff(seqs.astype(np.int64)) < 0).any())):
            raise InvalidArgument("seq", f"seqs must not decrease (last_seq {self._last_seq})")
        if bool((np.asarray(frame_size) <= 0).any()):
            raise InvalidArgument("frame_size", "must be > 0")
        i = 0
        while i < n:
            f = self._files[-1] if self._files else None
            if f is None or f.entries_used >= f.entries_max or f.version != VERSION:
                f = self._roll(int(seqs[i]))
            k = min(n - i, f.entries_max - f.entries_used)
            put_chunk(f, hashes[i:i + k], bucket_start_ms[i:i + k], data_offset[i:i + k],
                      frame_size[i:i + k], seqs[i:i + k])
            i += k
        self._last_seq = int(seqs[-1])

    def allocation_bytes(self, entries: int) -> int:
        """Bytes the next ``entries`` puts allocate on disk at most: allocation steps of the
        newest file and, for what does not fit in it, new files (header and slot table at once,
        entries in steps). Pure arithmetic on the header fields (the disk watermark's bound of a
        write, ``DelayStore.write_bytes_bound``)."""
        if entries <= 0:
            return 0
        total = 0
        f = self._files[-1] if self._files else None
        if f is not None and f.version == VERSION and f.entries_used < f.entries_max:
            k = min(entries, f.entries_max - f.entries_used)
            need = f.entries_offset + (f.entries_used + k) * ENTRY_SIZE
            # what is certainly allocated: ``allocated`` is 0 for a file opened at start, whose
            # used entries are on disk all the same
            have = max(f.allocated, f.entries_offset + f.entries_used * ENTRY_SIZE)
            total += max(0, min(f.size, -(-need // ALLOCATE_STEP_BYTES) * ALLOCATE_STEP_BYTES) - have)
            entries -= k
        while entries > 0:  # new files: slots at once, entries rounded up to a step
            k = min(entries, self.entries_max)
            slots = HEADER_SIZE + SLOT_SIZE * self.slots_count
            need = slots + k * ENTRY_SIZE
            total += min(file_size(self.slots_count, self.entries_max),
                         max(slots, -(-need // ALLOCATE_STEP_BYTES) * ALLOCATE_STEP_BYTES))
            entries -= k
        return total

    def probe(self, hashes: np.ndarray, ids: list[bytes] | None = None) -> np.ndarray:
        """For each key hash (``key_hashes`` of ``ids``), whether some entry carries it (a
        candidate: the caller confirms with ``get_all`` and the record). One numpy step per
        chain link over the whole batch, per file, never one Python step per message.
        ``ids`` are needed while a version 1 file is open (they are hashed its way)."""
        self._check_open()
        cur_h = np.asarray(hashes, np.uint64)
        old_h = None
        found = np.zeros(len(cur_h), bool)
        for f in reversed(self._files):
            used = f.entries_used
            if not used or found.all():
                continue
            if f.version == VERSION:
                h = cur_h
            else:
                if ids is None:
                    raise InvalidArgument("ids", f"{f.path} hashes ids the version {f.version} way: pass ids")
                if old_h is None:
                    old_h = key_hashes(ids, f.version)
                h = old_h
            mm = self._map(f)
            slots = np.frombuffer(mm, "<u4", f.slots_count, HEADER_SIZE)
            entries = np.frombuffer(mm, ENTRY_DTYPE, used, f.entries_offset)
            active = np.flatnonzero(~found)
            cur = slots[(h[active] % np.uint64(f.slots_count)).astype(np.int64)].astype(np.int64)
            keep = (cur > 0) & (cur <= used)
            active, cur = active[keep], cur[keep]
            steps = 0
            e = None
            while len(active) and steps < used:
                e = entries[cur - 1]
                hit = e["key_hash"] == h[active]
                found[active[hit]] = True
                prev = e["prev"].astype(np.int64)
                go = ~hit & (prev > 0) & (prev < cur)  # chains only point backwards
                active, cur = active[go], prev[go]
                steps += 1
            del slots, entries, e  # no view may outlive the map: the next _map may unmap it
        return found

    # -- reading ---------------------------------------------------------------------------

    def get_all(self, msg_id: str) -> list[IdLocation]:
        """Every location put under ``msg_id``'s key hash, newest first (newest file first).

        Candidates only: a different id with the same 8-byte hash also matches, so the
        caller reads the record at each location and compares ids."""
        self._check_open()
        by_version = {v: key_hash(msg_id, v) for v in {f.version for f in self._files}}
        found: list[IdLocation] = []
        for f in reversed(self._files):
            used = f.entries_used
            if not used:
                continue
            h = by_version[f.version]
            mm = self._map(f)
            (cur,) = U32.unpack_from(mm, HEADER_SIZE + SLOT_SIZE * (h % f.slots_count))
            base = f.entries_offset
            steps = 0
            while 0 < cur <= used and steps < used:
                eh, bucket_start_ms, data_offset, seq, frame_size, prev = ENTRY.unpack_from(
                    mm, base + (cur - 1) * ENTRY_SIZE)
                if eh == h:
                    found.append(IdLocation(bucket_start_ms, data_offset, frame_size, seq))
                if prev >= cur:
                    break  # a chain only points backwards
                cur = prev
                steps += 1
        return found

    def last_seq(self) -> int:
        """Highest seq put (-1 if none); puts with ``seq <= last_seq()`` are already indexed."""
        return self._last_seq

    def file_count(self) -> int:
        return len(self._files)

    # -- retention and lifecycle -----------------------------------------------------------

    def delete_before_seq(self, seq: int) -> int:
        """Delete whole files whose last_seq < seq; the newest file is always kept
        (it is the one written to and carries ``last_seq``). Returns files deleted."""
        self._check_open()
        keep: list[IndexFile] = []
        deleted = 0
        for i, f in enumerate(self._files):
            if i < len(self._files) - 1 and f.entries_used and f.last_seq < seq:
                self._unmap(f)
                f.path.unlink()
                deleted += 1
                log.info("id index deleted path=%s last_seq=%d", f.path, f.last_seq)
            else:
                keep.append(f)
        if deleted:
            self._files = keep
            fsync_dir(self.directory)
        return deleted

    # -- retention: compaction of sealed files (node/store/retention.py decides) -----------

    def sealed_bucket_counts(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``(first_seq, entries_used, bucket starts, entries per bucket start)`` of every
        sealed file (all but the newest). A sealed file never changes, so its counts are
        computed once (one pass over its entries) and kept."""
        self._check_open()
        out = []
        for f in self._files[:-1]:
            if f.buckets is None:
                starts = np.zeros(0, np.int64)
                counts = np.zeros(0, np.int64)
                for lo in range(0, f.entries_used, COMPACT_CHUNK_ENTRIES):
                    e = read_entries(f.path, f.entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, f.entries_used - lo))
                    u, c = np.unique(e["bucket_start_ms"], return_counts=True)
                    starts, inv = np.unique(np.concatenate([starts, u]), return_inverse=True)
                    counts = np.bincount(inv, weights=np.concatenate([counts, c]), minlength=len(starts)).astype(np.int64)
                f.buckets = (starts, counts)
            out.append((f.first_seq, f.entries_used, *f.buckets))
        return out

    def detach_file(self, first_seq: int) -> Path | None:
        """Retention (on the caller's thread): forget a sealed file whose every entry may go;
        the caller unlinks the returned path (``unlink_files``, any thread). A crash before
        that finds the file again at open: nothing is lost, it is deleted next time."""
        self._check_open()
        for i, f in enumerate(self._files[:-1]):
            if f.first_seq == first_seq:
                self._unmap(f)
                del self._files[i]
                dead = f.path.with_name(f.path.name + ".deleting")
                os.replace(f.path, dead)  # a reopened index never lists it; open removes leftovers
                log.info("id index file retired path=%s last_seq=%d", f.path, f.last_seq)
                return dead
        return None

    def unlink_files(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if paths:
            fsync_dir(self.directory)

    def compact_source(self, first_seq: int) -> tuple[Path, int, int, int] | None:
        """What ``build_compacted`` reads: (path, entries_offset, entries_used, slots_count)."""
        for f in self._files[:-1]:
            if f.first_seq == first_seq:
                return f.path, f.entries_offset, f.entries_used, f.slots_count
        return None

    def swap_compacted(self, first_seq: int, built: "Compacted") -> bool:
        """Put a file written by ``build_compacted`` in place of the sealed file (one atomic
        rename; a crash before it leaves ``*.idx.tmp``, removed at open)."""
        self._check_open()
        for f in self._files[:-1]:
            if f.first_seq == first_seq:
                self._unmap(f)
                os.replace(built.tmp, f.path)
                f.slots_count, f.entries_max, f.entries_used, f.last_seq = (built.slots_count, built.entries_max,
                                                                            built.entries_used, built.last_seq)
                f.buckets = None
                log.info("id index file compacted path=%s entries=%d", f.path, built.entries_used)
                return True
        built.tmp.unlink(missing_ok=True)
        return False

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._unmap_all()

    def __del__(self) -> None:
        # dropped without close(): give the maps and descriptors back, write nothing
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._unmap_all()
        except Exception:
            pass

    def __enter__(self) -> IdIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("id index is closed")


__all__ = ["ALLOCATE_STEP_BYTES", "COMPACT_CHUNK_ENTRIES", "ENTRY", "ENTRY_DTYPE", "ENTRY_FRAME_SIZE_OFFSET",
           "ENTRY_SIZE", "HEADER", "HEADER_CRC_OFFSET", "HEADER_SIZE", "MAGIC", "OPEN_FILES_MAX", "SLOT_SIZE", "SUFFIX",
           "U32", "VERSION", "VERSION_BLAKE2B", "VERSIONS", "Compacted", "IdIndex", "IdLocation", "IndexFile",
           "build_compacted", "build_from_entries", "file_name", "file_size", "key_hash", "key_hashes",
           "pack_header", "read_entries", "read_header"]
