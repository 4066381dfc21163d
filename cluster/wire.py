"""Wire protocol v2 helpers shared by servers and the SDK: a ``SendBatch`` request's batch
in and out, its columnar answer, and handle ranges for acks (``docs/api.md``).

Nothing here is per message in Python: arrays go in and out as packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.codec import Batch, pack_i64, pack_u64, unpack_i64
from cluster.errors import InvalidArgument
from cluster.proto import hourglass_pb2 as pb


def request_batch(req: pb.SendBatchRequest, *, now_ms: int, immediate: bool = False) -> Batch:
    """The batch of a SendBatch request, due times resolved: a message with
    ``deliver_at_ms == 0`` is due at ``now_ms + delay_ms[i]`` (or now, with no delay).
    A malformed batch as a whole raises ``InvalidArgument``."""
    b = Batch.decode(req.batch)
    due = b.deliver_at_ms
    if req.delay_ms:
        delays = unpack_i64(req.delay_ms)
        if len(delays) != b.n:
            raise InvalidArgument("delay_ms", f"{len(delays)} delays for {b.n} messages")
        if bool((delays < 0).any()):
            raise InvalidArgument("delay_ms", "must not be negative")
        if bool(((due != 0) & (delays != 0)).any()):
            raise InvalidArgument("deliver_at_ms", "give deliver_at_ms or delay_ms, not both")
        due = np.where(due == 0, now_ms + delays, due)
    elif b.n and bool((due == 0).any()):
        due = np.where(due == 0, now_ms, due)
    if due is not b.deliver_at_ms:
        b = b.replace(deliver_at_ms=due.astype(np.int64), effective_ms=due.astype(np.int64))
    return b


def make_request(batch: Batch, *, delay_ms=None, immediate: bool = False, epoch: int = 0) -> pb.SendBatchRequest:
    return pb.SendBatchRequest(batch=batch.encode(), delay_ms=b"" if delay_ms is None else pack_i64(delay_ms),
                               immediate=immediate, epoch=epoch)


@dataclass(slots=True)
class BatchResult:
    """One answer per message of a batch, as arrays (``codes`` are ``hourglass.v1.Code``)."""

    codes: np.ndarray
    seqs: np.ndarray
    deliver_at_ms: np.ndarray
    duplicates: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def sized(cls, n: int) -> "BatchResult":
        return cls(np.zeros(n, np.uint8), np.zeros(n, np.uint64), np.zeros(n, np.int64), np.zeros(n, np.uint8))

    @property
    def n(self) -> int:
        return len(self.codes)

    def refuse(self, i: int, code: int, error: str) -> None:
        self.codes[i] = code
        self.seqs[i] = 0
        self.errors[i] = error

    def to_pb(self) -> pb.SendBatchResponse:
        return pb.SendBatchResponse(
            codes=np.ascontiguousarray(self.codes, np.uint8).tobytes(), seqs=pack_u64(self.seqs),
            deliver_at_ms=pack_i64(self.deliver_at_ms),
            duplicates=np.ascontiguousarray(self.duplicates, np.uint8).tobytes(),
            errors=[pb.BatchError(index=i, error=e) for i, e in sorted(self.errors.items())])

    @classmethod
    def from_pb(cls, resp: pb.SendBatchResponse, n: int) -> "BatchResult":
        codes = np.frombuffer(resp.codes, np.uint8)
        seqs = np.frombuffer(resp.seqs, "<u8")
        due = np.frombuffer(resp.deliver_at_ms, "<i8")
        dup = np.frombuffer(resp.duplicates, np.uint8)
        if not (len(codes) == len(seqs) == len(due) == len(dup) == n):
            raise InvalidArgument("response", f"answer sizes {len(codes)}/{len(seqs)}/{len(due)}/{len(dup)} "
                                              f"for {n} messages")
        return cls(codes, seqs, due, dup, {e.index: e.error for e in resp.errors})


def pack_ranges(handles) -> bytes:
    """Handles (any order) as sorted, merged u64 pairs ``[lo, hi)``."""
    h = np.unique(np.asarray(handles, np.uint64))
    if not len(h):
        return b""
    breaks = np.flatnonzero(np.diff(h.astype(np.int64)) != 1) + 1
    lo = h[np.concatenate(([0], breaks))]
    hi = h[np.concatenate((breaks - 1, [len(h) - 1]))] + 1
    return pack_u64(np.column_stack((lo, hi)).ravel())


def unpack_ranges(raw: bytes) -> np.ndarray:
    """``[[lo, hi), ...]`` as an (k, 2) u64 array; refuses odd sizes and empty or reversed ranges."""
    if len(raw) % 16:
        raise InvalidArgument("ranges", f"{len(raw)} bytes is not a whole number of [lo, hi) pairs")
    r = np.frombuffer(raw, "<u8").reshape(-1, 2)
    if len(r) and bool((r[:, 1] <= r[:, 0]).any()):
        raise InvalidArgument("ranges", "every range must have lo < hi")
    return r


def expand_ranges(ranges: np.ndarray, count_max: int = 1 << 20) -> np.ndarray:
    """Every handle of (k, 2) ranges, as one u64 array (at most ``count_max``)."""
    if not len(ranges):
        return np.zeros(0, np.uint64)
    lens = (ranges[:, 1] - ranges[:, 0]).astype(np.int64)
    total = int(lens.sum())
    if total > count_max:
        raise InvalidArgument("ranges", f"{total} handles exceeds {count_max}")
    starts = np.repeat(ranges[:, 0].astype(np.int64) - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return (np.arange(total, dtype=np.int64) + starts).astype(np.uint64)
