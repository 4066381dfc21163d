"""gRPC channels: one cached ``grpc.aio`` channel per address, with the size limits set once,
and the client side of the ordered streams (``OrderedStream``)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from cluster.errors import CannotListen
from cluster.security import ClientSecurity, ServerSecurity
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.status import ERROR_ARGS_KEY, ERROR_KEY, status_code

MESSAGE_BYTES_MAX = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]


def listen(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity) -> int:
    """Bind ``server`` to ``host:port`` (0: any free port), with mutual TLS when ``security``
    has it; the bound port. A port in use is ``CannotListen`` naming the address, not grpc's
    RuntimeError."""
    address = f"{host}:{port}"
    try:
        bound = security.add_port(server, address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise CannotListen(f"cannot listen on {address}: the port is in use, or {host} is not an address "
                           f"of this machine")
    return bound


async def start_probe_server(host: str, port: int, servicer) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with only ``grpc.health.v1.Health`` (``servicer``, shared with the main
    server so both answer the same): Kubernetes ``grpc:`` probes cannot speak TLS, and health
    says nothing a stranger may not know."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise CannotListen(f"cannot listen on {address} (health probes): the port is in use, or {host} is not "
                           f"an address of this machine")
    await server.start()
    return server, bound


async def add_probe_server(server: grpc.aio.Server, host: str, health_port: int | None, servicer):
    """``server`` alone without a health port; else it and a probe server on ``health_port``,
    stopped together (``WithProbes``). A probe port that cannot be bound stops ``server``."""
    if health_port is None:
        return server
    try:
        probes, _ = await start_probe_server(host, health_port, servicer)
    except BaseException:
        await server.stop(None)
        raise
    return WithProbes(server, probes)


class WithProbes:
    """The main server and its probe server, stopped together; anything else is the main one's."""

    def __init__(self, main: grpc.aio.Server, probes: grpc.aio.Server) -> None:
        self.main, self.probes = main, probes

    async def stop(self, grace: float | None) -> None:
        await self.probes.stop(grace)
        await self.main.stop(grace)

    def __getattr__(self, name: str):
        return getattr(self.main, name)


def _error(code: grpc.StatusCode, details: str, trailing: grpc.aio.Metadata | None = None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details=details)


def _refused_error(refused) -> grpc.aio.AioRpcError:
    """The error the unary call would have raised for a request an ordered stream refused:
    its status, details and the server's error class and arguments as trailing metadata
    (``status.from_rpc_error`` rebuilds the same error from either)."""
    trailing = grpc.aio.Metadata()
    if refused.error:
        trailing.add(ERROR_KEY, refused.error)
        if refused.error_args:
            trailing.add(ERROR_ARGS_KEY, refused.error_args)
    return _error(status_code(refused.code), refused.details, trailing)


# A stream that ends with one of these did not refuse a request (refusals travel in the
# responses): the connection broke (a peer killed mid-stream shows as INTERNAL "Internal
# error from Core"), so its waiting calls fail as UNAVAILABLE, as a unary call would.
_BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)


def _broken(e: grpc.RpcError, name: str) -> grpc.RpcError:
    if e.code() not in _BROKEN:
        return e
    return _error(grpc.StatusCode.UNAVAILABLE, f"{name}: the stream broke ({e.code().name}: {e.details()})")


class _OpenStream:
    """One open bidirectional call and the callers waiting for its responses, in order."""

    __slots__ = ("call", "waiting", "reader", "failed")

    def __init__(self, call) -> None:
        self.call = call
        self.waiting: deque[asyncio.Future] = deque()
        self.reader: asyncio.Task | None = None
        self.failed = False


class OrderedStream:
    """Unary-style calls carried on one open bidirectional stream whose server answers every
    request once, in request order (``SendBatchStream``, ``PullStream``; docs/api.md,
    "Ordered streams"). A message on an open stream costs both sides about a third of a
    unary call's CPU here (``bench/bench_grpc.py``), which is what the hot path's hops pay.

    ``await call(request, timeout)`` behaves like the unary call: it returns the response or
    raises ``grpc.RpcError`` (a request the server refused whole raises an error with the
    status the unary call would have ended with). The stream opens on first use; when it
    breaks, every caller waiting on it gets the error and the next call opens a new one. A
    timeout closes the stream too: a response that did not come cannot be told apart from
    the ones queued behind it.

    A server that does not have the stream method (``UNIMPLEMENTED``: a node of an older
    version, during a rolling upgrade) is called with ``unary`` from then on."""

    def __init__(self, open_call: Callable[[], object], name: str, *, unary: Callable | None = None) -> None:
        self._open = open_call
        self._unary = unary
        self.name = name
        self._stream: _OpenStream | None = None
        self._lock = asyncio.Lock()  # one write at a time, and writes in the order of ``waiting``
        self.opened = 0
        self.unary_only = False

    async def call(self, request, timeout: float):
        if self.unary_only:
            return await self._unary(request, timeout=timeout)
        try:
            resp = await self._call(request, timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED or self._unary is None:
                raise
            self.unary_only = True
            return await self._unary(request, timeout=timeout)
        if resp.refused.code:
            raise _refused_error(resp.refused)
        return resp

    async def _call(self, request, timeout: float):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        async with self._lock:
            st = self._stream
            if st is None:
                st = self._stream = _OpenStream(self._open())
                st.reader = loop.create_task(self._read(st), name=f"stream-{self.name}")
                self.opened += 1
            st.waiting.append(fut)
            try:
                await st.call.write(request)
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                self._fail(st, _broken(e, self.name) if isinstance(e, grpc.RpcError)
                           else _error(grpc.StatusCode.UNAVAILABLE, f"{self.name}: stream closed ({e})"))
            except asyncio.CancelledError:
                # the request may or may not have gone out: the responses can no longer be
                # matched to their callers, so this stream ends (the next call opens another);
                # this caller's own slot is cancelled, not failed: nobody would read its error
                # ("Future exception was never retrieved" when a consumer closes mid-pull)
                fut.cancel()
                self._fail(st, _error(grpc.StatusCode.CANCELLED, f"{self.name}: a write was cancelled"))
                raise
        # the deadline as one timer that fails the stream (this caller's slot with it), not an
        # ``asyncio.timeout`` around the wait: a context and a cancellation per call for nothing
        timer = loop.call_later(timeout, self._expire, st, fut, timeout)
        try:
            return await fut
        finally:
            timer.cancel()

    def _expire(self, st: _OpenStream, fut: asyncio.Future, timeout: float) -> None:
        """A caller's deadline passed without its answer: the stream ends (its later answers could
        no longer be matched to their callers) and every caller waiting on it, this one too,
        gets DEADLINE_EXCEEDED. A slot not done is still in ``st.waiting`` (answers, failures
        and cancellations all make it done)."""
        if not fut.done():
            err = _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: no answer within {timeout:g} s")
            self._fail(st, err)
            if not fut.done():  # never (see above); a caller must not wait past its deadline though
                fut.set_exception(err)

    async def _read(self, st: _OpenStream) -> None:
        try:
            while True:
                resp = await st.call.read()
                if resp is grpc.aio.EOF:
                    raise _error(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the server closed the stream")
                if not st.waiting:
                    raise _error(grpc.StatusCode.INTERNAL, f"{self.name}: a response nobody asked for")
                fut = st.waiting.popleft()
                if not fut.done():  # a caller that gave up (cancelled) leaves its slot in the order
                    fut.set_result(resp)
        except grpc.RpcError as e:
            self._fail(st, _broken(e, self.name))
        except asyncio.CancelledError:
            self._fail(st, _error(grpc.StatusCode.CANCELLED, f"{self.name}: stream closed"))
            raise

    def _fail(self, st: _OpenStream, err: grpc.RpcError) -> None:
        if st.failed:
            return
        st.failed = True
        if self._stream is st:
            self._stream = None
        st.call.cancel()
        if st.reader is not None and st.reader is not asyncio.current_task():
            st.reader.cancel()
        waiting, st.waiting = st.waiting, deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        if self._stream is not None:
            self._fail(self._stream, _error(grpc.StatusCode.CANCELLED, f"{self.name}: closed"))


RETIRED_CHANNELS_MAX = 16  # channels made with certificates since rotated, kept for their calls in flight


class Channels:
    """Owns channels to many peers; close() closes them all. With TLS (``ClientSecurity``,
    from ``HOURGLASS_TLS_*`` unless given) every channel speaks mutual TLS and sends the
    token; when the certificate files change on disk, later calls dial again with the new
    ones (calls in flight finish on the old channel)."""

    def __init__(self, security: ClientSecurity | None = None) -> None:
        self.security = security if security is not None else ClientSecurity()
        self._generation = self.security.generation()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], object] = {}  # a stub per (kind, address): made once
        self._retired: list[grpc.aio.Channel] = []
        self._closing: set[asyncio.Task] = set()  # closes of retired channels (held: a task needs a reference)

    def _fresh(self) -> None:
        if not self.security.tls:
            return
        gen = self.security.generation()
        if gen == self._generation:
            return
        self._generation = gen
        self._retired.extend(self._channels.values())
        self._channels, self._stubs = {}, {}
        while len(self._retired) > RETIRED_CHANNELS_MAX:
            task = asyncio.get_running_loop().create_task(self._retired.pop(0).close(grace=5))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def get(self, address: str) -> grpc.aio.Channel:
        self._fresh()
        ch = self._channels.get(address)
        if ch is None:
            ch = self.security.channel(address, CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def _stub(self, kind: type, address: str):
        self._fresh()
        stub = self._stubs.get((kind, address))
        if stub is None:
            stub = self._stubs[(kind, address)] = kind(self.get(address))
        return stub

    def producer(self, address: str) -> rpc.ProducerStub:
        return self._stub(rpc.ProducerStub, address)

    def consumer(self, address: str) -> rpc.ConsumerStub:
        return self._stub(rpc.ConsumerStub, address)

    def admin(self, address: str) -> rpc.AdminStub:
        return self._stub(rpc.AdminStub, address)

    def send_stream(self, address: str) -> OrderedStream:
        """``SendBatch`` on an ordered stream to ``address`` (opened on first use)."""
        return self._ordered("SendBatchStream", address, lambda: self.producer(address).SendBatchStream(),
                             lambda req, timeout: self.producer(address).SendBatch(req, timeout=timeout))

    def pull_stream(self, address: str) -> OrderedStream:
        """``Pull`` on an ordered stream to ``address`` (opened on first use)."""
        return self._ordered("PullStream", address, lambda: self.consumer(address).PullStream(),
                             lambda req, timeout: self.consumer(address).Pull(req, timeout=timeout))

    def _ordered(self, method: str, address: str, open_call, unary) -> OrderedStream:
        self._fresh()
        st = self._stubs.get((method, address))
        if st is None:
            st = self._stubs[(method, address)] = OrderedStream(open_call, f"{method} {address}", unary=unary)
        return st

    async def drop(self, address: str) -> None:
        for k, v in list(self._stubs.items()):
            if k[1] == address and isinstance(v, OrderedStream):
                v.close()
        self._stubs = {k: v for k, v in self._stubs.items() if k[1] != address}
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        chans, self._channels = list(self._channels.values()) + self._retired, {}
        self._retired = []
        for v in self._stubs.values():
            if isinstance(v, OrderedStream):
                v.close()
        self._stubs = {}
        for ch in chans:
            await ch.close()
