"""Wire protocol v2 helpers shared by servers and the SDK: a ``SendBatch`` request's batch
in and out, its columnar answer, handle ranges for acks (``docs/api.md``), the server side
of the ordered streams (``serve_ordered``: ``SendBatchStream``, ``PullStream``) and the
server's guard against requests protobuf cannot parse (``UndecodableRequests``).

Nothing here is per message in Python: arrays go in and out as packed bytes.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from cluster import status
from cluster.codec import SUBJECT_WIRE_BYTES_MAX, Batch, pack_i64, pack_u64, subject_problem, unpack_i64
from cluster.errors import InvalidArgument
from cluster.proto import hourglass_pb2 as pb

log = logging.getLogger("hourglass.wire")


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


def grantable_subjects(batch: Batch) -> list[str]:
    """The subjects of a send a produce grant is checked for: those of the subject rule. The
    messages of any other subject are refused one by one (INVALID_ARGUMENT, ``Batch.validate``)
    and never stored, so they need no grant (and a grant never covers them)."""
    return [s for s in batch.subjects if subject_problem(s, SUBJECT_WIRE_BYTES_MAX) is None]


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

    def place(self, idx: np.ndarray, part: "BatchResult") -> None:
        """Put ``part``, the answer to the messages ``idx`` of this batch (a sub-batch, in
        that order), at their places: codes, seqs, duplicates and errors."""
        for name in ("codes", "seqs", "duplicates"):
            getattr(self, name)[idx] = getattr(part, name)
        self.errors.update({int(idx[i]): e for i, e in part.errors.items()})

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


SMALL_RANGES_MAX = 64  # at most this many handles, a Python loop costs less than a dozen numpy calls


def range_pairs(hs: list[int]) -> list[int]:
    """Sorted non-negative handles as flat ``[lo, hi)`` pairs: runs of consecutive handles
    merged, a repeated handle starting a new pair (as ``pack_ranges``'s arrays do)."""
    out: list[int] = []
    lo = prev = hs[0]
    for h in hs[1:]:
        if h != prev + 1:
            out += (lo, prev + 1)
            lo = h
        prev = h
    out += (lo, prev + 1)
    return out


def pack_ranges(handles) -> bytes:
    """Handles (any order) as sorted, merged u64 pairs ``[lo, hi)``."""
    if isinstance(handles, np.ndarray) and handles.dtype == np.uint64 and 0 < handles.size <= SMALL_RANGES_MAX:
        pairs = range_pairs(sorted(set(handles.tolist())))
        return struct.pack(f"<{len(pairs)}Q", *pairs)
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


# ---------------------------------------------------------------------- ordered streams


class _Refused(Exception):
    """A unary handler's ``context.abort`` while it answers one request of an ordered stream."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata=()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.metadata = metadata


class _OneRequestContext:
    """The context a unary handler sees when it answers one request of an ordered stream:
    ``abort`` refuses that request only (its response carries ``refused``); everything else
    is the stream's context (peer, metadata, deadline)."""

    __slots__ = ("_context",)

    def __init__(self, context) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Refused(code, details, trailing_metadata)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def refused_response(make: Callable[[], object], code: grpc.StatusCode, details: str, metadata=()):
    """A response of type ``make`` that refuses its request whole with ``code``; the error's
    class and arguments (``status.to_metadata``, what a unary call's trailing metadata
    carries) go in ``error`` / ``error_args``, so the client rebuilds the same error."""
    resp = make()
    resp.refused.code = code.value[0]
    resp.refused.details = details
    for key, value in metadata or ():
        if key == status.ERROR_KEY:
            resp.refused.error = value
        elif key == status.ERROR_ARGS_KEY:
            resp.refused.error_args = value
    return resp


async def serve_ordered(requests: AsyncIterator, context, handler: Callable[[object, object], Awaitable],
                        response: Callable[[], object], *, window: int,
                        window_bytes: int | None = None) -> AsyncIterator:
    """The server side of an ordered stream (docs/api.md, "Ordered streams"): every request
    of ``requests`` is answered by ``handler`` (the unary handler of the same call), one
    response per request, in request order. Up to ``window`` requests are answered at once
    (a SendBatch waits for its group commit while the next one is appended), and, with
    ``window_bytes``, only while the requests being answered hold at most that many bytes
    (one request alone is always read): the next one stays unread in the stream, so a
    client's stream holds at most about ``window_bytes`` of the node's memory whatever its
    requests' sizes. With ``window`` 1 each request is answered before the next is read (a
    pull). A refusal or a failure of one request becomes that request's ``refused``
    status; the stream stays open."""
    ctx = _OneRequestContext(context)

    async def answer(req):
        if isinstance(req, _Undecodable):
            return refused_response(response, grpc.StatusCode.INVALID_ARGUMENT, _undecodable_text(req))
        try:
            return await handler(req, ctx)
        except _Refused as e:
            return refused_response(response, e.code, e.details, e.metadata)
        except Exception as e:  # a bug answering one request must not fail the others on the stream
            log.exception("ordered stream: request failed")
            return refused_response(response, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")

    if window <= 1:
        async for req in requests:
            yield await answer(req)
        return
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue = asyncio.Queue(window)
    held = [0]  # bytes of the requests being answered (only counted with window_bytes)
    room = asyncio.Event()

    def answered(size: int, _task) -> None:
        held[0] -= size
        room.set()

    async def read() -> None:
        try:
            async for req in requests:
                size = 0 if window_bytes is None or isinstance(req, _Undecodable) else req.ByteSize()
                while held[0] and held[0] + size > window_bytes:  # held stays 0 without window_bytes
                    room.clear()
                    await room.wait()
                task = loop.create_task(answer(req))
                if size:
                    held[0] += size
                    task.add_done_callback(functools.partial(answered, size))
                await answers.put(task)
        finally:
            answers.put_nowait(None) if not answers.full() else None

    reader = loop.create_task(read())
    try:
        while True:
            task = await answers.get()
            if task is None:
                break
            yield await task
            if reader.done() and answers.empty():
                break
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()
    finally:
        reader.cancel()
        while not answers.empty():
            t = answers.get_nowait()
            if t is not None:
                t.cancel()


# ---------------------------------------------------------------------- requests protobuf refuses


@dataclass(frozen=True, slots=True)
class _Undecodable:
    method: str
    reason: str


# Requests served, by method: one per unary call and one per request of a stream (an ordered
# stream's SendBatch or Pull, a Replicate fetch). Counted as protobuf parses the request, so a
# refused one counts too. Process-wide like REFUSALS (cluster/security.py): each node and meta
# server registers it in its own registry. What a node's CPU goes to is mostly per request
# (docs/benchmarks.md, "User-mode client"); this is how requests per message are counted.
REQUESTS = Counter("hourglass_requests", "Requests served, by method (every request of a stream counts)",
                   ["method"], registry=None)


def _method_label(method: str) -> str:
    """``/hourglass.v1.Producer/SendBatch`` -> ``Producer/SendBatch``."""
    service, _, name = method.lstrip("/").partition("/")
    return f"{service.rsplit('.', 1)[-1]}/{name}"


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """A request protobuf cannot parse (a ``string`` field such as a Pull's subject or a
    Cancel's id that is not UTF-8, truncated bytes) is the caller's mistake: answer
    ``INVALID_ARGUMENT`` saying which request and why. Without this, grpc answers
    ``UNKNOWN: Unexpected DecodeError`` and logs a traceback for every such call.

    Unary requests, and the requests of the ordered streams (``...Stream``: that request
    alone is refused, ``serve_ordered``); the streamed ``Replicate`` requests come from
    nodes of the same build.

    Every request it parses is also counted in ``REQUESTS`` by method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        count = REQUESTS.labels(method=_method_label(method)).inc
        if handler.request_streaming and not (handler.response_streaming and method.endswith("Stream")):
            wrapped = _counted(handler, count)
        else:
            wrapped = _guarded(method, handler, count)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _counted(handler: grpc.RpcMethodHandler, count: Callable[[], None]) -> grpc.RpcMethodHandler:
    """A request-streaming handler (Replicate) whose every parsed request is counted."""
    parse = handler.request_deserializer

    def deserialize(raw: bytes):
        count()
        return parse(raw)

    make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler)
    return make(handler.stream_stream if handler.response_streaming else handler.stream_unary,
                request_deserializer=deserialize, response_serializer=handler.response_serializer)


def _undecodable(bad: _Undecodable) -> InvalidArgument:
    return InvalidArgument("request", f"{bad.method}: cannot parse the request: {bad.reason}")


def _undecodable_text(bad: _Undecodable) -> str:
    return str(_undecodable(bad))


async def _refuse(bad: _Undecodable, context) -> None:
    await status.abort(context, _undecodable(bad))  # the status table chooses the code


def _guarded(method: str, handler: grpc.RpcMethodHandler,
             count: Callable[[], None] = lambda: None) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(raw: bytes):
        count()
        try:
            return parse(raw)
        except DecodeError as e:
            return _Undecodable(method, str(e))

    if handler.stream_stream is not None:  # an ordered stream: serve_ordered refuses an _Undecodable
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, request_deserializer=deserialize,
                                                     response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=deserialize,
                                                   response_serializer=handler.response_serializer)
    inner_stream = handler.unary_stream
    if inspect.isasyncgenfunction(inner_stream):
        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            async for response in inner_stream(request, context):
                yield response
    else:  # a coroutine that writes with context.write (grpc health's Watch)
        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            return await inner_stream(request, context)
    return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=deserialize,
                                                response_serializer=handler.response_serializer)
