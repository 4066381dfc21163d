"""One id-index file: a fixed-size hash table whose slots head chains of append-only
entries (RocketMQ's IndexFile), memory-mapped. Owns the file format (header, slot table,
40-byte entries), the key hash, writing a run of entries into a mapped file (``put_chunk``)
and the scan of a file's tail at open (``recover_tail``). ``node/store/idindex.py`` owns
the folder of these files (rolling, lookups, retention); ``docs/format.md`` "Id index".

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

Writing an entry (``IdIndex.put``; ``put_chunk`` takes each step for a whole run of entries
before the next), in this order, each step a plain store into the shared map:

1. the entry with ``frame_size = 0`` and ``prev`` = the slot's current head;
2. ``frame_size`` (one aligned 4-byte store: the entry now counts);
3. the slot head = entry number + 1 (the entry is now linked).

Key hash versions: version 2 files hash ids with xxh3_64 (the ``xxhash`` package: 0.04 us
per id against 0.6 us for blake2b, ``docs/benchmarks.md``); version 1 files, written before,
hold blake2b hashes. Version 1 files are still read (``probe`` and ``get_all`` hash the ids
both ways while one is open) but never written: after an upgrade the next put rolls to a new
version 2 file, and retention deletes the old ones with their seqs.

Recovery of the newest file at open (``recover_tail``): a killed process leaves its writes
in the page cache, so they survive. The header may be behind: entries after its
``entries_used`` are scanned while ``frame_size > 0``, ``prev`` points backwards and
seqs do not decrease; the scan stops at the first entry failing that (a torn tail,
never linked since step 3 follows step 2). The one entry a kill can leave unlinked
(between steps 2 and 3) is linked again: its stored ``prev`` is still the slot's head.

Header updates go through ``pwrite`` (one syscall, atomic against a kill); ``sync``
fsyncs the entries before writing the header, so after a power loss the header never
vouches for entries that did not reach the disk. A header failing its CRC or its checks
(``read_header``) raises ``CorruptRecord`` naming the file.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from cluster.errors import CorruptRecord, InvalidArgument
from node.store.diskspace import allocate

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

U32_MAX = (1 << 32) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
U64_MAX = (1 << 64) - 1
SEQ_MAX = (1 << 63) - 1  # last_seq() uses -1 for "none", so keep seqs in the signed range


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
class IndexFile:
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
    allocated: int = 0  # bytes from the start allocated on disk (writable newest file; see ``ensure_allocated``)
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

    def write_header(self) -> None:
        # pwrite, not a store into the map: one syscall cannot be torn by a kill
        os.pwrite(self.fd, self.header(), 0)

    def sync(self) -> None:
        """Entries and heads to disk first, then the header that vouches for them."""
        assert self.mm is not None
        # fsync, not msync: the map shares the file's page cache, and fsync costs what is
        # dirty while msync walks the whole (sparse, 164 MiB by default) mapping
        os.fsync(self.fd)
        self.write_header()
        os.fsync(self.fd)
        self.dirty = False

    def ensure_allocated(self, entries: int) -> None:
        """Allocate the file up to ``entries`` entries (in steps of ``ALLOCATE_STEP_BYTES``)
        before they are stored through the map; ``DiskFull`` (nothing written) if the disk
        cannot."""
        need = self.entries_offset + entries * ENTRY_SIZE
        if need <= self.allocated:
            return
        upto = min(self.size, -(-need // ALLOCATE_STEP_BYTES) * ALLOCATE_STEP_BYTES)
        assert self.fd >= 0
        allocate(self.fd, self.allocated, upto - self.allocated, str(self.path))
        self.allocated = upto


def read_header(path: Path, first_seq: int) -> IndexFile:
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
    if slots_count < 1 or entries_max < 1 or entries_max >= U32_MAX:
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
    return IndexFile(path, first_seq, slots_count, entries_max, entries_used, last_seq if entries_used else -1,
                     version=version)


def read_entries(path: Path, entries_offset: int, first: int, count: int) -> np.ndarray:
    with open(path, "rb") as fh:
        raw = os.pread(fh.fileno(), count * ENTRY_SIZE, entries_offset + first * ENTRY_SIZE)
    return np.frombuffer(raw[: len(raw) - len(raw) % ENTRY_SIZE], ENTRY_DTYPE)


def recover_tail(f: IndexFile) -> None:
    """Scan the newest file's entries past its header's ``entries_used`` (module docs):
    count the committed ones, relink the one a kill left unlinked, write the header."""
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
        f.write_header()
        log.warning("id index recovered path=%s entries_header=%d entries_recovered=%d relinked=%d",
                    f.path, start, n, relinked)


def put_chunk(f: IndexFile, h, bucket, off, size, seqs) -> None:
    """Write a run of entries (seqs non-decreasing, all fitting in ``f``) into the mapped
    file: entries, then their commit marks (``frame_size``), then the slot heads; chains
    inside the run linked with numpy (entries sharing a slot point at each other)."""
    mm = f.mm
    assert mm is not None and f.writable
    k = len(h)
    n0 = f.entries_used
    f.ensure_allocated(n0 + k)
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
