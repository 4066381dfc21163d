"""Python client SDK: a batching producer and a pulling consumer.

Producer::

    async with Producer(StaticResolver(delay=["127.0.0.1:7001"], realtime=["127.0.0.1:7002"])) as p:
        fut = await p.send("orders.cancel", b"order 42", delay_ms=30 * 60_000, id="order-42")
        result = await fut            # SendResult(id="order-42", seq=..., deliver_at_ms=...)

``send`` returns a future per message at once; a background task gathers messages
into batches (``linger_ms``, ``batch_max``) and keeps at most ``inflight_max``
batches on the wire. Retryable answers (overloaded, not leader, node down) are
retried with backoff up to ``retries_max`` times, on the next node when there is
one; final answers (invalid, too large, id reused) fail that message's future
with the matching ``cluster.errors`` exception.

Consumer::

    async with Consumer(resolver, "orders.cancel", group="billing") as c:
        async for msg in c:           # long-poll pull
            handle(msg.payload)
            await msg.ack()           # or await msg.nack(retry_after_ms=5000)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster import errors as E
from cluster import status
from cluster.proto import hourglass_pb2 as pb
from cluster.transport import Channels

log = logging.getLogger("hourglass.client")


# ---------------------------------------------------------------------- models at the boundary


class OutgoingMessage(BaseModel):
    model_config = ConfigDict(frozen=True)

    subject: str = Field(min_length=1)
    payload: bytes = b""
    id: str = ""
    delay_ms: int = Field(default=0, ge=0)
    deliver_at_ms: int = Field(default=0, ge=0)
    tags: tuple[str, ...] = ()
    properties: dict[str, str] = {}
    immediate: bool = False

    @field_validator("payload", mode="before")
    @classmethod
    def _bytes(cls, v):
        return v.encode() if isinstance(v, str) else v


class SendResult(BaseModel):
    id: str
    seq: int
    deliver_at_ms: int
    duplicate: bool = False


class CancelResult(BaseModel):
    id: str
    seq: int


class LookupResult(BaseModel):
    id: str
    status: str
    seq: int
    deliver_at_ms: int
    subject: str


class Received(BaseModel):
    """A delivered message. ``id`` is the id the producer gave (a retry after a nack travels
    as ``{id}~r{n}`` with the original in property ``hourglass.origin_id``; ``id`` shows the
    original, ``wire_id`` the one on the wire)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    id: str
    subject: str
    payload: bytes
    tags: tuple[str, ...]
    properties: dict[str, str]
    deliver_at_ms: int
    attempts: int
    handle: int
    received_ms: int
    wire_id: str = ""
    consumer: object = Field(default=None, exclude=True, repr=False)

    @property
    def lateness_ms(self) -> int:
        return self.received_ms - self.deliver_at_ms

    async def ack(self) -> None:
        await self.consumer.ack([self])

    async def nack(self, retry_after_ms: int = 1000) -> None:
        await self.consumer.nack([self], retry_after_ms=retry_after_ms)


# ---------------------------------------------------------------------- discovery


class StaticResolver:
    """Fixed node lists. Subjects map to real-time nodes by a stable hash, the same
    rule the delay nodes use, so producers, delay nodes and consumers agree."""

    def __init__(self, *, delay: list[str] = (), realtime: list[str] = ()) -> None:
        self.delay = list(delay)
        self.realtime = list(realtime)

    async def delay_nodes(self) -> list[str]:
        if not self.delay:
            raise E.Unavailable("no delay node known")
        return self.delay

    async def delay_groups(self) -> list[tuple[str, str]]:
        """Without a meta server each delay node is a group of its own."""
        if not self.delay:
            raise E.Unavailable("no delay node known")
        return [(a, a) for a in self.delay]

    async def realtime_for(self, subject: str) -> str:
        if not self.realtime:
            raise E.Unavailable("no real-time node known")
        return self.realtime[zlib.crc32(subject.encode()) % len(self.realtime)]

    async def refresh(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def group_for(msg_id: str, groups: list[tuple[str, str]]) -> str:
    """The delay group a message id belongs to: a stable hash over the sorted group names.
    Sends, retries and re-sends of one id go to one group (ids are de-duplicated per group),
    and cancel/lookup ask that group first."""
    return groups[zlib.crc32(msg_id.encode()) % len(groups)][0]


# ---------------------------------------------------------------------- producer


class Producer:
    def __init__(self, resolver, *, linger_ms: int = 2, batch_max: int = 500, inflight_max: int = 8,
                 queue_max: int = 100_000, timeout_s: float = 10.0, retries_max: int = 8,
                 backoff_ms_max: int = 2000) -> None:
        self.resolver = resolver
        self.linger_ms = linger_ms
        self.batch_max = batch_max
        self.timeout_s = timeout_s
        self.retries_max = retries_max
        self.backoff_ms_max = backoff_ms_max
        self.channels = Channels()
        self._queue: asyncio.Queue[tuple[OutgoingMessage, asyncio.Future]] = asyncio.Queue(maxsize=queue_max)
        self._inflight = asyncio.Semaphore(inflight_max)
        self._batcher: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()

    async def __aenter__(self) -> "Producer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _ensure_started(self) -> None:
        if self._batcher is None:
            self._batcher = asyncio.get_running_loop().create_task(self._batch_loop(), name="producer-batcher")

    async def send(self, subject: str, payload: bytes | str = b"", *, delay_ms: int = 0, deliver_at_ms: int = 0,
                   id: str = "", tags: tuple[str, ...] | list[str] = (), properties: dict[str, str] | None = None,
                   immediate: bool = False) -> asyncio.Future:
        """Queue one message; returns a future of its SendResult. Waits only if the queue is full."""
        msg = OutgoingMessage(subject=subject, payload=payload, id=id or uuid.uuid4().hex, delay_ms=delay_ms,
                              deliver_at_ms=deliver_at_ms, tags=tuple(tags), properties=properties or {},
                              immediate=immediate)
        return await self.send_message(msg)

    async def send_message(self, msg: OutgoingMessage) -> asyncio.Future:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((msg, fut))
        return fut

    async def send_and_wait(self, subject: str, payload: bytes | str = b"", **kw) -> SendResult:
        return await (await self.send(subject, payload, **kw))

    async def _batch_loop(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.linger_ms / 1000
            while len(batch) < self.batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                # poll rather than wait_for(get()): a cancelled get may drop an item on 3.11
                await asyncio.sleep(min(left, 0.001))
            # delayed and immediate messages go to different node kinds
            groups: dict[tuple, list] = {}
            for m, f in batch:
                key = ("rt", m.subject) if m.immediate else ("delay",)
                groups.setdefault(key, []).append((m, f))
            for key, items in groups.items():
                await self._inflight.acquire()
                t = asyncio.get_running_loop().create_task(self._send_batch(key, items))
                self._sending.add(t)
                t.add_done_callback(self._sending.discard)

    async def _target(self, key: tuple, attempt: int) -> str:
        if key[0] == "rt":
            return await self.resolver.realtime_for(key[1])
        # a delayed batch stays with its group: after a failover, the group's new master
        master = dict(await self.resolver.delay_groups()).get(key[1], "")
        if not master:
            raise E.Unavailable(f"delay group {key[1]!r} has no live master now")
        return master

    async def _send_batch(self, key: tuple, items: list[tuple[OutgoingMessage, asyncio.Future]]) -> None:
        try:
            if key == ("delay",):
                await self._send_delayed(items)
            else:
                await self._send_keyed(key, items)
        finally:
            self._inflight.release()

    async def _send_delayed(self, items: list[tuple[OutgoingMessage, asyncio.Future]]) -> None:
        """Split a delayed batch by the group each id belongs to, send each part to its group."""
        last: BaseException | None = None
        for attempt in range(self.retries_max + 1):
            try:
                groups = await self.resolver.delay_groups()
                if groups:
                    break
                last = E.Unavailable("no delay group known")
            except E.Unavailable as err:
                last = err
                await self.resolver.refresh()
            await asyncio.sleep(min(self.backoff_ms_max, 25 * 2 ** attempt) / 1000 * random.uniform(0.5, 1))
        else:
            for _, f in items:
                if not f.done():
                    f.set_exception(E.Unavailable(f"gave up after {self.retries_max} retries: {last}"))
            return
        parts: dict[str, list] = {}
        for m, f in items:
            parts.setdefault(group_for(m.id, groups), []).append((m, f))
        await asyncio.gather(*(self._send_keyed(("delay", g), part) for g, part in parts.items()))

    async def _send_keyed(self, key: tuple, items: list[tuple[OutgoingMessage, asyncio.Future]]) -> None:
        try:
            pending = items
            for attempt in range(self.retries_max + 1):
                if attempt:
                    await asyncio.sleep(min(self.backoff_ms_max, 25 * 2 ** attempt) / 1000 * random.uniform(0.5, 1))
                try:
                    address = await self._target(key, attempt)
                    req = pb.SendBatchRequest(immediate=key[0] == "rt", messages=[
                        pb.Message(id=m.id, subject=m.subject, payload=m.payload, delay_ms=m.delay_ms,
                                   deliver_at_ms=m.deliver_at_ms, tags=list(m.tags), properties=m.properties)
                        for m, _ in pending])
                    resp = await self.channels.producer(address).SendBatch(req, timeout=self.timeout_s)
                except grpc.RpcError as e:
                    err = status.from_rpc_error(e)
                    if not isinstance(err, E.Unavailable):
                        for _, f in pending:
                            if not f.done():
                                f.set_exception(err)
                        return
                    await self.resolver.refresh()
                    last: BaseException = err
                    continue
                except E.Unavailable as err:
                    await self.resolver.refresh()
                    last = err
                    continue
                retry = []
                for (m, f), st in zip(pending, resp.statuses):
                    if f.done():
                        continue
                    if st.code == pb.OK:
                        f.set_result(SendResult(id=st.id, seq=st.seq, deliver_at_ms=st.deliver_at_ms,
                                                duplicate=st.duplicate))
                    elif st.code in status.RETRYABLE_CODES:
                        retry.append((m, f))
                        last = status.from_code(st.code, st.error)
                    else:
                        f.set_exception(status.from_code(st.code, st.error))
                if not retry:
                    return
                pending = retry
            for _, f in pending:
                if not f.done():
                    f.set_exception(E.Unavailable(f"gave up after {self.retries_max} retries: {last}"))
        except asyncio.CancelledError:
            for _, f in items:
                if not f.done():
                    f.set_exception(E.Closed("producer closed before the message was acknowledged"))
            raise

    async def flush(self) -> None:
        """Wait until everything queued so far has an answer."""
        while not self._queue.empty() or self._sending:
            if self._sending:
                await asyncio.wait(set(self._sending))
            else:
                await asyncio.sleep(self.linger_ms / 1000)

    async def _groups_for_id(self, msg_id: str) -> list[str]:
        """Masters to ask about an id: its own group's first, then every other group's (an id
        sent before the set of groups changed may live elsewhere)."""
        groups = await self.resolver.delay_groups()
        mine = group_for(msg_id, groups)
        ordered = [m for g, m in groups if g == mine] + [m for g, m in groups if g != mine]
        if not ordered[0]:
            raise E.Unavailable(f"delay group {mine!r} of id {msg_id!r} has no live master now")
        return [m for m in ordered if m]

    async def _ask_groups(self, msg_id: str, method: str, request):
        """The first OK answer; an error other than NotFound from any group wins over NotFound."""
        last: BaseException | None = None
        for attempt in range(self.retries_max + 1):
            try:
                nodes = await self._groups_for_id(msg_id)
                not_found: BaseException | None = None
                for address in nodes:
                    resp = await self._call_node(address, method, request)
                    if resp.code == pb.OK:
                        return resp
                    err = status.from_code(resp.code, resp.error)
                    if not isinstance(err, E.NotFound):
                        raise err
                    not_found = err
                raise not_found or E.NotFound(msg_id)
            except E.Unavailable as err:
                last = err
                await self.resolver.refresh()
                await asyncio.sleep(min(self.backoff_ms_max, 25 * 2 ** attempt) / 1000)
        raise E.Unavailable(f"gave up: {last}")

    async def cancel(self, msg_id: str) -> CancelResult:
        """Cancel a scheduled message. NotFound for an unknown id, TooLate once dispatched.
        Asked of the id's group (and, for ids sent before the groups changed, the others)."""
        resp = await self._ask_groups(msg_id, "Cancel", pb.CancelRequest(id=msg_id))
        return CancelResult(id=msg_id, seq=resp.seq)

    async def lookup(self, msg_id: str) -> LookupResult:
        resp = await self._ask_groups(msg_id, "Lookup", pb.LookupRequest(id=msg_id))
        return LookupResult(id=msg_id, status=resp.status, seq=resp.seq, deliver_at_ms=resp.deliver_at_ms,
                            subject=resp.subject)

    async def _call_node(self, address: str, method: str, request):
        try:
            return await getattr(self.channels.producer(address), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), self.timeout_s)
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batcher
        for t in list(self._sending):
            t.cancel()
        while not self._queue.empty():
            _, f = self._queue.get_nowait()
            if not f.done():
                f.set_exception(E.Closed("producer closed"))
        await self.channels.close()


# ---------------------------------------------------------------------- consumer


class Consumer:
    def __init__(self, resolver, subject: str, *, group: str, consumer_id: str | None = None,
                 tags: tuple[str, ...] | list[str] = (), batch_max: int = 100, wait_ms: int = 1000,
                 timeout_s: float = 10.0, backoff_ms_max: int = 2000) -> None:
        self.resolver = resolver
        self.subject = subject
        self.group = group
        self.consumer_id = consumer_id or f"c-{uuid.uuid4().hex[:8]}"
        self.tags = tuple(tags)
        self.batch_max = batch_max
        self.wait_ms = wait_ms
        self.timeout_s = timeout_s
        self.backoff_ms_max = backoff_ms_max
        self.channels = Channels()
        self._buffer: list[Received] = []
        self._closed = False

    async def __aenter__(self) -> "Consumer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _stub(self):
        return self.channels.consumer(await self.resolver.realtime_for(self.subject))

    async def pull(self, max_messages: int | None = None, wait_ms: int | None = None) -> list[Received]:
        """One long-poll pull. Messages whose tags do not match (the server's filter is a hash) are acked away."""
        req = pb.PullRequest(subject=self.subject, group=self.group, consumer_id=self.consumer_id,
                             max_messages=max_messages or self.batch_max,
                             wait_ms=self.wait_ms if wait_ms is None else wait_ms, tags=list(self.tags))
        try:
            resp = await (await self._stub()).Pull(req, timeout=self.timeout_s + req.wait_ms / 1000)
        except grpc.RpcError as e:
            await self.resolver.refresh()
            raise status.from_rpc_error(e) from None
        now = _now_ms()
        out, skip = [], []
        for d in resp.deliveries:
            m = d.message
            r = Received(id=m.properties.get("hourglass.origin_id", m.id), wire_id=m.id, subject=m.subject, payload=m.payload, tags=tuple(m.tags),
                         properties=dict(m.properties), deliver_at_ms=d.deliver_at_ms, attempts=m.attempts,
                         handle=d.handle, received_ms=now, consumer=self)
            if self.tags and not set(self.tags) & set(r.tags):
                skip.append(r)
            else:
                out.append(r)
        if skip:
            await self.ack(skip)
        return out

    async def ack(self, msgs: list[Received]) -> int:
        if not msgs:
            return 0
        req = pb.AckRequest(subject=self.subject, group=self.group, handles=[m.handle for m in msgs])
        try:
            resp = await (await self._stub()).Ack(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None
        return resp.acked

    async def nack(self, msgs: list[Received], *, retry_after_ms: int = 1000) -> None:
        req = pb.NackRequest(subject=self.subject, group=self.group, handles=[m.handle for m in msgs],
                             retry_after_ms=retry_after_ms)
        try:
            await (await self._stub()).Nack(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Received]:
        failures = 0
        while not self._closed:
            if not self._buffer:
                try:
                    self._buffer = await self.pull()
                    failures = 0
                except E.Unavailable:
                    failures += 1
                    await asyncio.sleep(min(self.backoff_ms_max, 25 * 2 ** min(failures, 10)) / 1000)
                    continue
            while self._buffer:
                yield self._buffer.pop(0)

    async def run(self, handler: Callable[[Received], Awaitable[None]], *, stop: asyncio.Event,
                  retry_after_ms: int = 1000) -> None:
        """Callback runner: ack after the handler returns, nack (retry later) if it raises."""
        while not stop.is_set():
            try:
                batch = await self.pull()
            except E.Unavailable:
                await asyncio.sleep(0.2)
                continue
            done, failed = [], []
            for msg in batch:
                try:
                    await handler(msg)
                    done.append(msg)
                except Exception:
                    log.exception("handler failed id=%s; retry in %d ms", msg.id, retry_after_ms)
                    failed.append(msg)
            await self.ack(done)
            if failed:
                await self.nack(failed, retry_after_ms=retry_after_ms)

    async def close(self) -> None:
        self._closed = True
        await self.channels.close()
