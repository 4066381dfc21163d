"""Id index: message id -> location, on disk, in the style of RocketMQ's IndexFile.

Owns one folder (``{root}/ids/``) of index files. Cancel and lookup by message id
need to find a message among millions of pending ones without a dict in RAM: each
file is a fixed-size hash table whose slots head a chain of append-only entries,
memory-mapped, so RAM holds only the pages the kernel chooses to cache.

Files are named by the seq of their first entry, zero padded so names sort::

    ids/00000000000000000000.idx     entries for seq 0 .. 4_194_303 (full, sealed)
    ids/00000000000004194304.idx     the newest file: the only one written to

File layout (version 2, little-endian; files are created sparse at full size)::

    offset 0     header, 64 bytes:
                   4s  magic        b"HGIX"
                   u32 version      2 (1: the key hash is blake2b, see below)
                   u32 slots_count
                   u32 entries_max
                   u32 entries_used  as of the last flush / roll (recovered by scan on open)
                   u64 first_seq     seq of entry 0; equals the number in the file name
                   u64 last_seq      seq of entry entries_used-1 (0 while entries_used == 0)
                   24 bytes zero
                   u32 crc32 of header bytes [0, 60)
    offset 64    slots_count x u32 slot head: entry number + 1 of the newest entry whose
                 key hash maps to the slot (hash % slots_count), 0 = empty
    offset 64 + 4 * slots_count
                 entries_max x 40-byte entry (``<QqQQII``):
                   u64 key_hash        xxh3_64(id utf-8) (version 1 files: blake2b(id utf-8,
                                       digest_size=8) read as u64 LE)
                   i64 bucket_start_ms
                   u64 data_offset
                   u64 seq             the seq given to put
                   u32 frame_size      > 0 for a written entry; written last (the commit mark)
                   u32 prev            entry number + 1 of the previous entry in the same slot
                                       (0 = none); always < own number + 1

    file size = 64 + 4 * slots_count + 40 * entries_max
    (defaults 1<<20 slots, 4<<20 entries: 164 MiB sparse per file, ~44 bytes touched per id)

Writing an entry (``put``), in this order, each step a plain store into the shared map:

1. the entry with ``frame_size = 0`` and ``prev`` = the slot's current head;
2. ``frame_size`` (one aligned 4-byte store: the entry now counts);
3. the slot head = entry number + 1 (the entry is now linked).

Key hash versions: version 2 files hash ids with xxh3_64 (the ``xxhash`` package: 0.04 us
per id against 0.6 us for blake2b, ``docs/benchmarks.md``); version 1 files, written before,
hold blake2b hashes. Version 1 files are still read (``probe`` and ``get_all`` hash the ids
both ways while one is open) but never written: after an upgrade the next put rolls to a new
version 2 file, and retention deletes the old ones with their seqs.

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

Crash recovery (``open``): a killed process leaves its writes in the page cache, so
they survive. The header of the newest file may be behind: entries after its
``entries_used`` are scanned while ``frame_size > 0``, ``prev`` points backwards and
seqs do not decrease; the scan stops at the first entry failing that (a torn tail,
never linked since step 3 follows step 2). The one entry a kill can leave unlinked
(between steps 2 and 3) is linked again: its stored ``prev`` is still the slot's head.
An empty newest file (a kill between creating it and its first entry) is removed.
Walks are defensive all the same: a head beyond ``entries_used`` is treated as empty,
a walk stops at a ``prev`` not below its own number and takes at most ``entries_used``
steps. A header failing its CRC or its checks raises ``CorruptRecord`` naming the file.
Header updates go through ``pwrite`` (one syscall, atomic against a kill); ``flush``
syncs the entries before writing the header, so after a power loss the header never
vouches for entries that did not reach the disk.

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

import hashlib
import logging
import mmap
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from cluster.errors import Closed, CorruptRecord, DiskFull, InvalidArgument
from cluster.files import DATA_DIR_MODE, DATA_MODE
from node.store.diskspace import allocate
from node.store.log import fsync_dir
from node.store.settings import STORE_DEFAULTS
from node.store.syncplan import SyncPlan

log = logging.getLogger("hourglass.store.idindex")

MAGIC = b"HGIX"
VERSION = 2  # key hash xxh3_64
VERSION_BLAKE2B = 1  # key hash blake2b (digest_size=8): read, never written
VERSIONS = (VERSION_BLAKE2B, VERSION)
HEADER = struct.Struct("<4sIIIIQQ")  # 36 bytes, zero padded to 60, then u32 crc
HEADER_SIZE = 64
HEADER_CRC_OFFSET = 60
U32 = struct.Struct("<I")
SLOT_SIZE = U32.size
ENTRY = struct.Struct("<QqQQII")
ENTRY_SIZE = ENTRY.size  # 40
ENTRY_FRAME_SIZE_OFFSET = 32
SUFFIX = ".idx"

ALLOCATE_STEP_BYTES = 1 << 20  # entries are allocated on disk this far ahead of puts
COMPACT_CHUNK_ENTRIES = 1 << 18  # entries read at once while a sealed file is compacted
OPEN_FILES_MAX = 8  # sealed files kept mapped (LRU) unless ``open_files_max`` says otherwise

_U32_MAX = (1 << 32) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U64_MAX = (1 << 64) - 1
_SEQ_MAX = (1 << 63) - 1  # last_seq() uses -1 for "none", so keep seqs in the signed range


@dataclass(frozen=True, slots=True)
class IdLocation:
    """Where a message id was filed: a frame in a schedule-log bucket, and its seq."""

    bucket_start_ms: int
    data_offset: int
    frame_size: int
    seq: int


def key_hash(msg_id: str, version: int = VERSION) -> int:
    """The 8-byte key hash stored in entries of a file of ``version`` (collisions possible;
    callers confirm)."""
    if not isinstance(msg_id, str) or not msg_id:
        raise InvalidArgument("msg_id", "must be a non-empty str")
    try:
        raw = msg_id.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument("msg_id", f"not encodable as utf-8: {e.reason}") from None
    return int(key_hashes([raw], version)[0])


ENTRY_DTYPE = np.dtype([("key_hash", "<u8"), ("bucket_start_ms", "<i8"), ("data_offset", "<u8"), ("seq", "<u8"),
                        ("frame_size", "<u4"), ("prev", "<u4")])


def key_hashes(ids: list[bytes], version: int = VERSION) -> np.ndarray:
    """``key_hash`` of many ids (UTF-8 bytes) at once: one join over the C hash function
    (xxhash's digest is the u64 big-endian; the byte swap is one numpy step)."""
    if version == VERSION_BLAKE2B:
        blake = hashlib.blake2b
        return np.frombuffer(b"".join([blake(i, digest_size=8).digest() for i in ids]), "<u8")
    return np.frombuffer(b"".join(map(xxhash.xxh3_64_digest, ids)), ">u8").astype("<u8")


def file_size(slots_count: int, entries_max: int) -> int:
    return HEADER_SIZE + SLOT_SIZE * slots_count + ENTRY_SIZE * entries_max


def file_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SUFFIX}"


def pack_header(slots_count: int, entries_max: int, entries_used: int, first_seq: int, last_seq: int,
                version: int = VERSION) -> bytes:
    buf = bytearray(HEADER_SIZE)
    HEADER.pack_into(buf, 0, MAGIC, version, slots_count, entries_max, entries_used, first_seq,
                     max(last_seq, 0) if entries_used else 0)
    U32.pack_into(buf, HEADER_CRC_OFFSET, zlib.crc32(buf[:HEADER_CRC_OFFSET]))
    return bytes(buf)


@dataclass(slots=True, eq=False)
class _IndexFile:
    """One index file: header fields plus, while mapped, its fd and map."""

    path: Path
    first_seq: int
    slots_count: int
    entries_max: int
    entries_used: int
    last_seq: int  # -1 while entries_used == 0
    fd: int = -1
    mm: mmap.mmap | None = None
    writable: bool = False
    dirty: bool = False
    allocated: int = 0  # bytes from the start allocated on disk (writable newest file; see ``_ensure_allocated``)
    buckets: tuple | None = None  # sealed file: (unique bucket_start_ms, counts), computed once (retention)
    version: int = VERSION  # VERSION_BLAKE2B: an older file, read only

    @property
    def entries_offset(self) -> int:
        return HEADER_SIZE + SLOT_SIZE * self.slots_count

    @property
    def size(self) -> int:
        return file_size(self.slots_count, self.entries_max)

    def header(self) -> bytes:
        return pack_header(self.slots_count, self.entries_max, self.entries_used, self.first_seq, self.last_seq,
                           self.version)


def _read_header(path: Path, first_seq: int) -> _IndexFile:
    """Read and check a file's header; any failure is corruption of that file."""
    where = str(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
        actual_size = os.fstat(f.fileno()).st_size
    if len(raw) < HEADER_SIZE:
        raise CorruptRecord(where, 0, f"header truncated: {len(raw)} of {HEADER_SIZE} bytes")
    (crc,) = U32.unpack_from(raw, HEADER_CRC_OFFSET)
    if crc != zlib.crc32(raw[:HEADER_CRC_OFFSET]):
        raise CorruptRecord(where, 0, "header crc mismatch")
    magic, version, slots_count, entries_max, entries_used, hdr_first_seq, last_seq = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptRecord(where, 0, f"bad magic {magic!r}")
    if version not in VERSIONS:
        raise CorruptRecord(where, 4, f"unsupported version {version}")
    if slots_count < 1 or entries_max < 1 or entries_max >= _U32_MAX:
        raise CorruptRecord(where, 8, f"bad geometry slots_count={slots_count} entries_max={entries_max}")
    if entries_used > entries_max:
        raise CorruptRecord(where, 16, f"entries_used {entries_used} > entries_max {entries_max}")
    if hdr_first_seq != first_seq:
        raise CorruptRecord(where, 20, f"first_seq {hdr_first_seq} does not match the file name")
    if entries_used and last_seq < first_seq:
        raise CorruptRecord(where, 28, f"last_seq {last_seq} < first_seq {first_seq}")
    want = file_size(slots_count, entries_max)
    if actual_size != want:
        raise CorruptRecord(where, 0, f"file size {actual_size}, header geometry says {want}")
    return _IndexFile(path, first_seq, slots_count, entries_max, entries_used, last_seq if entries_used else -1,
                      version=version)


def _read_entries(path: Path, entries_offset: int, first: int, count: int) -> np.ndarray:
    with open(path, "rb") as fh:
        raw = os.pread(fh.fileno(), count * ENTRY_SIZE, entries_offset + first * ENTRY_SIZE)
    return np.frombuffer(raw[: len(raw) - len(raw) % ENTRY_SIZE], ENTRY_DTYPE)


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
        e = _read_entries(path, entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, entries_used - lo))
        keep_total += int(np.count_nonzero(~np.isin(e["bucket_start_ms"], gone_buckets)))

    def kept():
        for lo in range(0, entries_used, COMPACT_CHUNK_ENTRIES):
            e = _read_entries(path, entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, entries_used - lo))
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


def _rebuild_file(p: Path, first_seq: int, next_first_seq: int | None,
                  rebuild: Callable[[int, int | None], np.ndarray], why: CorruptRecord) -> _IndexFile:
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
    return _read_header(p, first_seq)


class IdIndex:
    """Message id -> ``IdLocation`` candidates, in rolling mmap'd hash-slot files."""

    def __init__(self, directory: Path, files: list[_IndexFile], *, slots_count: int, entries_max: int,
                 open_files_max: int) -> None:
        self.directory = directory
        self.slots_count = slots_count
        self.entries_max = entries_max
        self.open_files_max = open_files_max
        self._files = files  # ascending first_seq; the last one is the active (writable) file
        self._mapped: OrderedDict[int, _IndexFile] = OrderedDict()  # first_seq -> file, LRU order
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
        for name, value, lo, hi in (("slots_count", slots_count, 1, _U32_MAX),
                                    ("entries_max", entries_max, 1, _U32_MAX - 1),
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
                files.append(_read_header(p, int(stem)))
            except CorruptRecord as e:
                if rebuild is None:
                    raise
                nxt = int(names[k + 1].name[: -len(SUFFIX)]) if k + 1 < len(names) else None
                files.append(_rebuild_file(p, int(stem), nxt, rebuild, e))
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
                self._ensure_allocated(f, f.entries_used + 1)
            except DiskFull as e:  # still opens: the next put will say so again
                log.error("id index cannot allocate path=%s error=%s", f.path, e)
            self._recover(f)
            if f.entries_used:
                self._last_seq = f.last_seq
                return
            # created, then killed before its first entry was committed
            log.warning("id index removing empty newest file path=%s", f.path)
            self._unmap(f)
            f.path.unlink()
            fsync_dir(self.directory)
            self._files.pop()

    def _recover(self, f: _IndexFile) -> None:
        mm = f.mm
        assert mm is not None
        start = n = f.entries_used
        last = f.last_seq
        relinked = 0
        base = f.entries_offset
        while n < f.entries_max:
            h, _bucket, _off, seq, frame_size, prev = ENTRY.unpack_from(mm, base + n * ENTRY_SIZE)
            if frame_size == 0 or prev > n or seq < last or seq < f.first_seq:
                break  # not committed (or torn): the tail ends here
            slot_off = HEADER_SIZE + SLOT_SIZE * (h % f.slots_count)
            (head,) = U32.unpack_from(mm, slot_off)
            if head < n + 1:
                # committed but killed before the link; its prev is the slot's head of then, still current
                U32.pack_into(mm, slot_off, n + 1)
                relinked += 1
            last = seq
            n += 1
        if n != start or relinked:
            f.entries_used, f.last_seq = n, last
            f.dirty = True
            self._write_header(f)
            log.warning("id index recovered path=%s entries_header=%d entries_recovered=%d relinked=%d",
                        f.path, start, n, relinked)

    # -- mapping (LRU) -----------------------------------------------------------------

    def _map(self, f: _IndexFile, *, writable: bool = False) -> mmap.mmap:
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

    def _unmap(self, f: _IndexFile) -> None:
        if f.mm is None:
            return
        if f.dirty:
            self._sync(f)
        f.mm.close()
        os.close(f.fd)
        f.mm, f.fd, f.writable = None, -1, False
        self._mapped.pop(f.first_seq, None)

    def _unmap_all(self) -> None:
        for f in list(self._mapped.values()):
            self._unmap(f)

    def _write_header(self, f: _IndexFile) -> None:
        # pwrite, not a store into the map: one syscall cannot be torn by a kill
        os.pwrite(f.fd, f.header(), 0)

    def _sync(self, f: _IndexFile) -> None:
        """Entries and heads to disk first, then the header that vouches for them."""
        assert f.mm is not None
        # fsync, not msync: the map shares the file's page cache, and fsync costs what is
        # dirty while msync walks the whole (sparse, 164 MiB by default) mapping
        os.fsync(f.fd)
        self._write_header(f)
        os.fsync(f.fd)
        f.dirty = False

    # -- writing -------------------------------------------------------------------------

    def put(self, msg_id: str, loc: IdLocation) -> None:
        """Append ``msg_id -> loc``; it shadows earlier puts of the id. Not durable until ``flush``."""
        self._check_open()
        h = key_hash(msg_id)
        if not isinstance(loc, IdLocation):
            raise InvalidArgument("loc", f"must be an IdLocation, got {type(loc).__name__}")
        for name, value, lo, hi in (("bucket_start_ms", loc.bucket_start_ms, _I64_MIN, _I64_MAX),
                                    ("data_offset", loc.data_offset, 0, _U64_MAX),
                                    ("frame_size", loc.frame_size, 1, _U32_MAX),
                                    ("seq", loc.seq, 0, _SEQ_MAX)):
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
        self._ensure_allocated(f, n + 1)
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

    def _roll(self, seq: int) -> _IndexFile:
        old = self._files[-1] if self._files else None
        if old is not None:
            if seq == old.first_seq:
                raise InvalidArgument("seq", f"more than entries_max={old.entries_max} puts share seq {seq}")
            self._map(old, writable=True)
            self._sync(old)  # sealed: the header now covers every entry
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
        f = _IndexFile(path, seq, self.slots_count, self.entries_max, 0, -1)
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
            self._put_chunk(f, hashes[i:i + k], bucket_start_ms[i:i + k], data_offset[i:i + k],
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

    def _ensure_allocated(self, f: _IndexFile, entries: int) -> None:
        """Allocate the file up to ``entries`` entries (in steps of ``ALLOCATE_STEP_BYTES``)
        before they are stored through the map; ``DiskFull`` (nothing written) if the disk
        cannot."""
        need = f.entries_offset + entries * ENTRY_SIZE
        if need <= f.allocated:
            return
        upto = min(f.size, -(-need // ALLOCATE_STEP_BYTES) * ALLOCATE_STEP_BYTES)
        assert f.fd >= 0
        allocate(f.fd, f.allocated, upto - f.allocated, str(f.path))
        f.allocated = upto

    def _put_chunk(self, f: _IndexFile, h, bucket, off, size, seqs) -> None:
        mm = f.mm
        assert mm is not None and f.writable
        k = len(h)
        n0 = f.entries_used
        self._ensure_allocated(f, n0 + k)
        slots = np.frombuffer(mm, "<u4", f.slots_count, HEADER_SIZE)
        entries = np.frombuffer(mm, ENTRY_DTYPE, k, f.entries_offset + n0 * ENTRY_SIZE)
        slot_of = (np.asarray(h, np.uint64) % np.uint64(f.slots_count)).astype(np.int64)
        numbers = np.arange(n0 + 1, n0 + k + 1, dtype=np.int64)
        heads = slots[slot_of].astype(np.int64)
        heads[heads > n0] = 0  # never link to an entry that does not exist
        order = np.argsort(slot_of, kind="stable")
        s_sorted = slot_of[order]
        prev_sorted = heads[order]
        same = np.zeros(k, bool)
        same[1:] = s_sorted[1:] == s_sorted[:-1]
        prev_sorted[same] = numbers[order][:-1][same[1:]]
        prev = np.empty(k, np.int64)
        prev[order] = prev_sorted
        entries["key_hash"] = h
        entries["bucket_start_ms"] = bucket
        entries["data_offset"] = off
        entries["seq"] = seqs
        entries["prev"] = prev
        entries["frame_size"] = size  # commit marks, after the rest of each entry
        last_of_slot = np.ones(k, bool)
        last_of_slot[:-1] = s_sorted[:-1] != s_sorted[1:]
        slots[s_sorted[last_of_slot]] = numbers[order][last_of_slot]  # link, last
        del slots, entries  # views of the map must not outlive this call (unmap needs none)
        f.entries_used = n0 + k
        f.last_seq = int(seqs[-1])
        f.dirty = True

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
        keep: list[_IndexFile] = []
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
                    e = _read_entries(f.path, f.entries_offset, lo, min(COMPACT_CHUNK_ENTRIES, f.entries_used - lo))
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
