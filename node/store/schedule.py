"""Schedule log: messages filed by the UTC time bucket of their due time.

Owns ``{root}/schedule/`` with one folder per bucket, named by the bucket's
start in UTC milliseconds (zero padded, so names sort by time)::

    schedule/meta.json                       {"bucket_ms": 3600000, "version": 1}
    schedule/000001795424400000/data/        a SegmentedLog: i64 effective_ms + message-log record body
    schedule/000001795424400000/index        fixed 40-byte entries, one per record
    schedule/000001795424400000/heads        header + one u32 head per second of the bucket

Index entry (``<QIIQQIB3x``, 40 bytes, little-endian)::

    u64 data_offset   offset of the record's frame in the bucket's data log
    u32 frame_size    header + body bytes
    u32 prev          entry number + 1 of the previous entry due in the same second (0 = none)
    u64 seq           the record's own sequence (high-water mark for replay)
    u64 ref_seq       the message's seq; for a cancel tombstone, the cancelled message's seq
    u32 rel_ms        due time minus bucket start, in ms (past due times clamp to 0)
    u8  kind          1 message, 2 cancel tombstone
    u8  pad[3]

heads: 32-byte header ``magic "HGHD" | u32 version | i64 bucket_start_ms | u32 seconds |
u64 entries_covered | u32 crc32(first 28 bytes)`` then ``seconds`` x u32 (entry number + 1 of
the newest entry of that second, 0 = none). The heads file is memory-mapped: inserting is
O(1) (append one index entry, overwrite one head) and loading second ``s`` is a walk of
its chain from ``heads[s]`` through ``prev``, newest first; no sort and nothing per
message in RAM.

Invariants and recovery (``Bucket.open``):

* data is written before its index entry, the index entry before its head;
* the data log recovers its own torn tail; index entries pointing past the data end
  are dropped; records in data past the last index entry are re-indexed;
* ``entries_covered`` in the heads header says which index entries are reflected in
  the heads; entries after it are re-applied; a heads file failing its CRC is rebuilt
  from the index;
* the high-water mark ``last_seq`` is the ``seq`` of the last index entry: replaying the
  message log re-offers records and ``append`` skips any with ``seq <= last_seq``, so
  nothing is filed twice.

Example: ``sched.append(msg_body, deliver_at_ms=1_795_424_401_234, seq=7, ...)`` files the
record in bucket 1_795_424_400_000, second 1, ms 234; ``sched.load_second(1_795_424_401)``
yields ``ScheduledEntry(deliver_at_ms=1_795_424_401_234, seq=7, ...)``.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import CorruptRecord, InvalidArgument

from . import records
from .log import HEADER_SIZE, SegmentedLog

log = logging.getLogger("hourglass.store.schedule")

ENTRY = struct.Struct("<QIIQQIB3x")
ENTRY_SIZE = ENTRY.size  # 40
HEADS_HEADER = struct.Struct("<4sIqIQ")  # 28 bytes, then u32 crc, padded to 32
HEADS_HEADER_SIZE = 32
HEADS_MAGIC = b"HGHD"
BUCKET_MS_DEFAULT = 3_600_000
DATA_SEGMENT_BYTES_DEFAULT = 256 * 1024 * 1024
OPEN_BUCKETS_MAX_DEFAULT = 32


@dataclass(frozen=True, slots=True)
class ScheduledEntry:
    """One record of a second's chain, as the wheel needs it (no payload)."""

    deliver_at_ms: int
    seq: int
    ref_seq: int
    kind: int
    bucket_start_ms: int
    data_offset: int
    frame_size: int


class Bucket:
    """One time bucket: data log + index + mmap'd heads."""

    def __init__(self, path: Path, start_ms: int, bucket_ms: int, *, data_segment_bytes: int) -> None:
        self.path = path
        self.start_ms = start_ms
        self.seconds = bucket_ms // 1000
        path.mkdir(parents=True, exist_ok=True)
        self.data = SegmentedLog.open(path / "data", segment_bytes_max=data_segment_bytes)
        self._index_path = path / "index"
        self._index_fd = os.open(self._index_path, os.O_RDWR | os.O_CREAT, 0o644)
        self._heads_path = path / "heads"
        self.entries = 0
        self.last_seq = -1
        self._recover_index()
        self._open_heads()

    # -- recovery ----------------------------------------------------------------

    def _read_entry(self, n: int) -> tuple:
        raw = os.pread(self._index_fd, ENTRY_SIZE, n * ENTRY_SIZE)
        if len(raw) != ENTRY_SIZE:
            raise CorruptRecord(str(self._index_path), n * ENTRY_SIZE, "short index entry")
        return ENTRY.unpack(raw)

    def _recover_index(self) -> None:
        size = os.fstat(self._index_fd).st_size
        n = size // ENTRY_SIZE
        data_end = self.data.end_offset
        # drop entries whose record is not (or no longer) in the data log
        while n > 0:
            off, fsize, *_ = self._read_entry(n - 1)
            if off + fsize <= data_end:
                break
            n -= 1
        if n * ENTRY_SIZE != size:
            os.ftruncate(self._index_fd, n * ENTRY_SIZE)
            log.warning("schedule index truncated path=%s entries=%d bytes_dropped=%d",
                        self._index_path, n, size - n * ENTRY_SIZE)
        self.entries = n
        self._repaired = n * ENTRY_SIZE != size
        indexed_end = self.data.start_offset
        if n:
            off, fsize, _prev, seq, *_ = self._read_entry(n - 1)
            indexed_end = off + fsize
            self.last_seq = seq
        if indexed_end < data_end:
            # records reached the data log but not the index: index them now (heads follow below)
            pending = []
            for off, body in self.data.iterate(indexed_end):
                pending.append((off, HEADER_SIZE + len(body), body))
            for off, fsize, body in pending:
                effective_ms = _EFFECTIVE.unpack_from(body)[0]
                msg_body = body[_EFFECTIVE.size:]
                kind, seq, _, _ = records.peek_header(msg_body)
                ref_seq = _tombstone_target(msg_body) if kind == records.KIND_CANCEL else seq
                self._write_entry(off, fsize, 0, seq, ref_seq, effective_ms, kind)
            self._repaired = True
            log.warning("schedule index rebuilt path=%s records=%d", self._index_path, len(pending))

    def _open_heads(self) -> None:
        want = HEADS_HEADER_SIZE + 4 * self.seconds
        fd = os.open(self._heads_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fresh = os.fstat(fd).st_size != want
            if fresh:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, want)
            self._heads_map = mmap.mmap(fd, want)
        finally:
            os.close(fd)
        self.heads = memoryview(self._heads_map)[HEADS_HEADER_SIZE:].cast("I")
        covered = 0
        if not fresh:
            hdr = bytes(self._heads_map[:HEADS_HEADER_SIZE])
            magic, version, start, seconds, covered = HEADS_HEADER.unpack_from(hdr)
            crc = struct.unpack_from("<I", hdr, 28)[0]
            ok = (magic == HEADS_MAGIC and version == 1 and start == self.start_ms
                  and seconds == self.seconds and crc == zlib.crc32(hdr[:28]) and covered <= self.entries)
            if not ok or self._repaired:
                log.warning("schedule heads rebuilt path=%s reason=%s", self._heads_path,
                            "index repaired" if ok else "bad header")
                covered = 0
        if covered == 0:
            self._heads_map[HEADS_HEADER_SIZE:] = bytes(4 * self.seconds)
        # Re-apply index entries the header does not vouch for. A killed process may have
        # linked some of them already (the map lives in the page cache): a head at or past
        # the entry means it is linked; otherwise relink it, since its stored prev may be stale.
        heads = self.heads
        if covered < self.entries:
            region = bytearray(os.pread(self._index_fd, (self.entries - covered) * ENTRY_SIZE, covered * ENTRY_SIZE))
            for i, (off, fsize, _prev, seq, ref_seq, rel_ms, kind) in enumerate(ENTRY.iter_unpack(region)):
                n = covered + i
                second = rel_ms // 1000
                if heads[second] >= n + 1:
                    continue
                ENTRY.pack_into(region, i * ENTRY_SIZE, off, fsize, heads[second], seq, ref_seq, rel_ms, kind)
                heads[second] = n + 1
            os.pwrite(self._index_fd, region, covered * ENTRY_SIZE)
        self._write_heads_header()

    def _write_heads_header(self) -> None:
        hdr = HEADS_HEADER.pack(HEADS_MAGIC, 1, self.start_ms, self.seconds, self.entries)
        self._heads_map[:HEADS_HEADER_SIZE] = hdr + struct.pack("<I", zlib.crc32(hdr))

    # -- writing -----------------------------------------------------------------

    def _write_entry(self, off: int, fsize: int, prev_unused: int, seq: int, ref_seq: int,
                     deliver_at_ms: int, kind: int) -> None:
        rel = max(deliver_at_ms, self.start_ms) - self.start_ms
        second = rel // 1000
        if second >= self.seconds:
            raise InvalidArgument("deliver_at_ms", f"{deliver_at_ms} outside bucket {self.start_ms}")
        n = self.entries
        heads = getattr(self, "heads", None)
        prev = heads[second] if heads is not None else 0
        os.pwrite(self._index_fd, ENTRY.pack(off, fsize, prev, seq, ref_seq, rel, kind), n * ENTRY_SIZE)
        if heads is not None:
            heads[second] = n + 1
        self.entries = n + 1
        self.last_seq = seq

    def append(self, items: list[tuple[bytes, int, int, int, int]]) -> list[tuple[int, int]]:
        """File records; items are (body, seq, ref_seq, effective_ms, kind), in seq order.

        Records with ``seq <= last_seq`` were filed before a crash and are skipped.
        Returns (data_offset, frame_size) for each item filed (None-free list of filed ones).
        """
        fresh = [it for it in items if it[1] > self.last_seq]
        if not fresh:
            return []
        bodies = [_EFFECTIVE.pack(it[3]) + it[0] for it in fresh]
        offsets = self.data.append(bodies)
        out = []
        for (_, seq, ref_seq, effective_ms, kind), off, body in zip(fresh, offsets, bodies):
            fsize = HEADER_SIZE + len(body)
            self._write_entry(off, fsize, 0, seq, ref_seq, effective_ms, kind)
            out.append((off, fsize))
        return out

    def flush(self) -> None:
        """Make data, index and heads durable, in that order."""
        self.data.flush()
        os.fsync(self._index_fd)
        self._heads_map.flush()
        self._write_heads_header()
        self._heads_map.flush()

    # -- reading -----------------------------------------------------------------

    def chain(self, second_in_bucket: int) -> Iterator[ScheduledEntry]:
        """Entries due in one second, newest first."""
        n = self.heads[second_in_bucket]
        steps = 0
        while n:
            if n > self.entries or steps > self.entries:
                raise CorruptRecord(str(self._index_path), (n - 1) * ENTRY_SIZE, "index chain points past the end")
            off, fsize, prev, seq, ref_seq, rel_ms, kind = self._read_entry(n - 1)
            if prev >= n:
                raise CorruptRecord(str(self._index_path), (n - 1) * ENTRY_SIZE, "index chain does not go backwards")
            yield ScheduledEntry(self.start_ms + rel_ms, seq, ref_seq, kind, self.start_ms, off, fsize)
            n = prev
            steps += 1

    def read(self, data_offset: int, frame_size: int) -> bytes:
        """The message-log record body filed at this place."""
        return self.data.read_at(data_offset, frame_size)[_EFFECTIVE.size:]

    def close(self) -> None:
        self.flush()
        self.heads.release()
        self._heads_map.close()
        os.close(self._index_fd)
        self._index_fd = -1
        self.data.close()

    def __del__(self) -> None:
        # dropped without close(): give the descriptors back, write nothing
        try:
            if getattr(self, "_index_fd", -1) >= 0:
                os.close(self._index_fd)
                self._index_fd = -1
            self.heads.release()
            self._heads_map.close()
        except Exception:
            pass


_EFFECTIVE = struct.Struct("<q")


def _tombstone_target(body: bytes) -> int:
    msg = records.decode(body)
    if len(msg.payload) != 8:
        raise CorruptRecord("<tombstone>", 0, "tombstone payload must hold the target seq")
    return struct.unpack("<Q", msg.payload)[0]


class ScheduleLog:
    """All buckets of one node. Keeps at most ``open_buckets_max`` buckets open (LRU)."""

    def __init__(self, root: str | os.PathLike, *, bucket_ms: int = BUCKET_MS_DEFAULT,
                 data_segment_bytes: int = DATA_SEGMENT_BYTES_DEFAULT,
                 open_buckets_max: int = OPEN_BUCKETS_MAX_DEFAULT) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            bucket_ms = int(meta["bucket_ms"])  # fixed at creation
        else:
            if bucket_ms % 1000 or bucket_ms <= 0:
                raise InvalidArgument("bucket_ms", "must be a positive whole number of seconds")
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"bucket_ms": bucket_ms, "version": 1}))
            os.replace(tmp, meta_path)
        self.bucket_ms = bucket_ms
        self.data_segment_bytes = data_segment_bytes
        self.open_buckets_max = open_buckets_max
        self._open: OrderedDict[int, Bucket] = OrderedDict()

    def bucket_start(self, deliver_at_ms: int) -> int:
        return deliver_at_ms - deliver_at_ms % self.bucket_ms

    def _path(self, start_ms: int) -> Path:
        return self.root / f"{start_ms:018d}"

    def bucket(self, start_ms: int, *, create: bool = True) -> Bucket | None:
        b = self._open.get(start_ms)
        if b is not None:
            self._open.move_to_end(start_ms)
            return b
        path = self._path(start_ms)
        if not create and not path.exists():
            return None
        b = Bucket(path, start_ms, self.bucket_ms, data_segment_bytes=self.data_segment_bytes)
        self._open[start_ms] = b
        while len(self._open) > self.open_buckets_max:
            _, old = self._open.popitem(last=False)
            old.close()
        return b

    def bucket_starts(self) -> list[int]:
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.isdigit():
                out.append(int(p.name))
        return sorted(out)

    def append(self, body: bytes, *, seq: int, ref_seq: int, effective_ms: int, kind: int) -> tuple[int, int, int] | None:
        """File one record under its effective due time (its due time, or later if that
        time was already dispatched when it arrived); returns (bucket_start_ms,
        data_offset, frame_size), or None if it was filed before (replay after a crash)."""
        start = self.bucket_start(effective_ms)
        got = self.bucket(start).append([(body, seq, ref_seq, effective_ms, kind)])
        if not got:
            return None
        return (start, *got[0])

    def load_second(self, second: int) -> list[ScheduledEntry]:
        """Every entry due within epoch-second ``second``, newest first (chain order)."""
        ms = second * 1000
        b = self.bucket(self.bucket_start(ms), create=False)
        if b is None:
            return []
        return list(b.chain((ms - b.start_ms) // 1000))

    def read(self, bucket_start_ms: int, data_offset: int, frame_size: int) -> bytes:
        b = self.bucket(bucket_start_ms, create=False)
        if b is None:
            raise CorruptRecord(str(self._path(bucket_start_ms)), data_offset, "bucket missing")
        return b.read(data_offset, frame_size)

    def flush(self) -> None:
        for b in self._open.values():
            b.flush()

    def drop_before(self, start_ms: int) -> int:
        """Retention: delete whole buckets that end at or before ``start_ms`` (all dispatched)."""
        n = 0
        for s in self.bucket_starts():
            if s + self.bucket_ms <= start_ms:
                b = self._open.pop(s, None)
                if b is not None:
                    b.close()
                shutil.rmtree(self._path(s))
                n += 1
        return n

    def close(self) -> None:
        while self._open:
            _, b = self._open.popitem()
            b.close()
