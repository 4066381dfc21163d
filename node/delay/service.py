"""Delay node process: the asyncio/grpc.aio shell around ``DelayStore``.

Background loops, all children of one TaskGroup owned by ``run``:

* group commit  - one fsync for many SendBatch calls (``GroupCommitter``);
* iterator      - files durable records into the schedule log;
* wheel         - every ``tick_ms / 2``: loads seconds ahead, takes what is due;
* dispatcher    - sends due messages to the real-time node of their subject, in
                  batches, retrying transient failures with backoff for as long as it
                  takes (the message stays in flight; nothing is dropped) and permanent
                  ones (unknown subject, rejected message) at most
                  ``dispatch_attempts_max`` times before the dead-letter subject;
* checkpoint    - every ``checkpoint_interval_ms``: flush and record tick state.

No business rule lives in the servicer methods: they translate, call the store,
and translate back through ``cluster.status``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import zlib
from collections import defaultdict

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from cluster import status
from cluster.clock import Clock, SystemClock
from cluster.convert import batch_from_pb, merge_results, message_to_pb
from cluster.errors import HourglassError, Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.transport import Channels
from node.config import NodeSettings
from node.delay.store import DelayStore, Due
from node.metrics import NodeMetrics
from node.realtime.store import DLQ_SUBJECT
from node.store.group_commit import GroupCommitter
from node.store.records import Dispatched, Message
from node.aio import wait_event

log = logging.getLogger("hourglass.delay")

PERMANENT_CODES = {pb.INVALID_ARGUMENT, pb.PAYLOAD_TOO_LARGE, pb.UNKNOWN_SUBJECT, pb.ALREADY_EXISTS}


class StaticRouter:
    """subject -> real-time node address, by a stable hash (before the meta server)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)

    def realtime_for(self, subject: str) -> str:
        if not self.addresses:
            raise Unavailable("no real-time node configured")
        return self.addresses[zlib.crc32(subject.encode()) % len(self.addresses)]

    def invalidate(self, subject: str) -> None:
        pass


class DelayNode(rpc.ProducerServicer, rpc.AdminServicer):
    def __init__(self, settings: NodeSettings, *, clock: Clock | None = None, router=None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock(settings.clock_offset_ms)
        self.store = DelayStore.open(settings.data_dir, settings.store_settings(), now_ms=self.clock.now_ms())
        self.committer = GroupCommitter(self.store.messages)
        self.channels = Channels()
        if router is None and settings.meta_servers:
            from cluster.discovery import MetaResolver  # subject -> real-time group through the meta server
            router = MetaResolver(settings.meta_servers, refresh_ms=settings.meta_refresh_ms,
                                  timeout_s=settings.meta_timeout_ms / 1000)
        self.router = router or StaticRouter(settings.realtime_nodes)
        self.registrar = None
        self.metrics = NodeMetrics("delay", settings.node_id)
        self._filed = asyncio.Event()
        self._durable_moved = asyncio.Event()
        self._dispatch_q: asyncio.Queue[list[Due]] = asyncio.Queue(maxsize=settings.dispatch_concurrency_max * 4)
        self._permanent_failures: dict[int, int] = {}
        self.address = ""
        self.server: grpc.aio.Server | None = None

    # ------------------------------------------------------------------ gRPC: producer

    async def SendBatch(self, request: pb.SendBatchRequest, context) -> pb.SendBatchResponse:
        if len(request.messages) > self.settings.batch_messages_max:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.messages)} messages exceeds batch_messages_max "
                                f"{self.settings.batch_messages_max}")
        now = self.clock.now_ms()
        converted = batch_from_pb(request.messages, now_ms=now, immediate=request.immediate)
        try:
            stored = self.store.accept([m for m in converted if isinstance(m, Message)], now_ms=now)
        except HourglassError as e:
            await context.abort(status.to_grpc(e), str(e))
        merged = merge_results(converted, stored)
        end = self.store.messages.end_offset
        await self.committer.sync_to(end)
        self._note_durable()
        out = pb.SendBatchResponse()
        accepted = 0
        for r in merged:
            if isinstance(r, Exception):
                self.metrics.errors.labels(kind=type(r).__name__).inc()
                out.statuses.add(code=status.to_code(r), error=str(r))
            else:
                accepted += 0 if r.duplicate else 1
                out.statuses.add(code=pb.OK, id=r.msg_id, seq=r.seq, deliver_at_ms=r.deliver_at_ms,
                                 duplicate=r.duplicate)
        self.metrics.ingested.inc(accepted)
        return out

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        try:
            seq = self.store.cancel(request.id, now_ms=self.clock.now_ms())
        except HourglassError as e:
            return pb.CancelResponse(code=status.to_code(e), error=str(e))
        await self.committer.sync_to(self.store.messages.end_offset)
        self._note_durable()
        return pb.CancelResponse(code=pb.OK, seq=seq)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        try:
            r = self.store.lookup(request.id)
        except HourglassError as e:
            return pb.LookupResponse(code=status.to_code(e), error=str(e))
        return pb.LookupResponse(code=pb.OK, status=r.status, seq=r.seq, deliver_at_ms=r.deliver_at_ms,
                                 subject=r.subject)

    # ------------------------------------------------------------------ gRPC: admin

    def stats(self) -> dict:
        s = self.store
        now = self.clock.now_ms()
        return {
            "role": "delay", "node_id": self.settings.node_id, "group": self.settings.group,
            "epoch": s.epoch, "address": self.address, "now_ms": now,
            "counters": dict(s.counters), "wheel_held": len(s.wheel), "in_flight": s.inflight,
            "completed_ms": s.completed_ms, "dispatch_lag_ms": max(0, now - s.completed_ms),
            "message_log_end": s.messages.end_offset, "iterate_offset": s.iterate_offset,
            "dispatch_log_end": s.dispatch.end_offset, "fsyncs": self.committer.fsyncs,
        }

    def registration_info(self) -> dict:
        s = self.stats()
        return {"master": True, "epoch": s["epoch"], "lag_ms": s["dispatch_lag_ms"],
                "offsets": {"message_log_end": s["message_log_end"], "iterate_offset": s["iterate_offset"],
                            "dispatch_log_end": s["dispatch_log_end"]}}

    async def Status(self, request, context) -> pb.StatusResponse:
        return pb.StatusResponse(node_id=self.settings.node_id, role="delay", group=self.settings.group,
                                 master=True, epoch=self.store.epoch, json=json.dumps(self.stats()))

    # ------------------------------------------------------------------ loops

    def _note_durable(self) -> None:
        if self.committer.durable_offset > self.store.durable_offset:
            self.store.durable_offset = self.committer.durable_offset
            self._durable_moved.set()

    async def _iterator_loop(self) -> None:
        while True:
            try:
                await wait_event(self._durable_moved, self.settings.iterate_interval_ms / 1000 * 50)
            except TimeoutError:
                pass
            self._durable_moved.clear()
            self.store.durable_offset = max(self.store.durable_offset, self.committer.durable_offset)
            while self.store.iterate(limit=5000):
                await asyncio.sleep(0)

    async def _wheel_loop(self) -> None:
        interval = self.settings.tick_ms / 2000
        next_pending_update = 0.0
        loop = asyncio.get_running_loop()
        while True:
            due = self.store.poll_due(now_ms=self.clock.now_ms())
            if due:
                by_target: dict[str, list[Due]] = defaultdict(list)
                for d in due:
                    by_target[d.message.subject].append(d)
                for items in by_target.values():
                    for i in range(0, len(items), self.settings.dispatch_batch_max):
                        await self._dispatch_q.put(items[i:i + self.settings.dispatch_batch_max])
            self.metrics.wheel_held.set(len(self.store.wheel))
            self.metrics.in_flight.set(self.store.inflight)
            self.metrics.dispatch_lag.set(max(0, self.clock.now_ms() - self.store.completed_ms) / 1000)
            if loop.time() >= next_pending_update:
                self.metrics.set_pending(self.store.pending_by_bucket())
                next_pending_update = loop.time() + 1.0
            await asyncio.sleep(interval)

    async def _dispatch_worker(self) -> None:
        while True:
            batch = await self._dispatch_q.get()
            try:
                await self._dispatch(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: give the messages back rather than lose them
                log.exception("dispatch failed; messages go back to the wheel")
                self.store.release([d.seq for d in batch])

    async def _send(self, subject: str, msgs: list[Message]) -> pb.SendBatchResponse:
        address = self.router.realtime_for(subject)
        if inspect.isawaitable(address):  # MetaResolver answers asynchronously
            address = await address
        stub = self.channels.producer(address)
        req = pb.SendBatchRequest(messages=[message_to_pb(m) for m in msgs], immediate=True)
        try:
            return await stub.SendBatch(req, timeout=10)
        except grpc.RpcError as e:
            self.router.invalidate(subject)
            raise status.from_rpc_error(e) from None

    async def _dispatch(self, batch: list[Due]) -> None:
        subject = batch[0].message.subject
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Unavailable),
            wait=wait_exponential(multiplier=0.05, max=self.settings.dispatch_backoff_ms_max / 1000),
            reraise=True,
        )
        async for attempt in retrying:  # transient failures: keep trying, the message stays in flight
            with attempt:
                resp = await self._send(subject, [d.message for d in batch])
        now = self.clock.now_ms()
        delivered, failed = [], []
        for d, st in zip(batch, resp.statuses):
            if st.code == pb.OK:
                delivered.append(d)
            elif st.code in PERMANENT_CODES:
                failed.append((d, st))
            else:
                self.store.release([d.seq])
        if delivered:
            self.store.ack_dispatched([(d.seq, d.effective_ms) for d in delivered], now_ms=now)
            for d in delivered:
                self.metrics.lateness.observe(max(0, now - d.message.deliver_at_ms) / 1000)
                self._permanent_failures.pop(d.seq, None)
            self.metrics.dispatched.inc(len(delivered))
        if failed:
            await self._handle_permanent(failed)

    async def _handle_permanent(self, failed: list[tuple[Due, pb.SendStatus]]) -> None:
        dead: list[tuple[Due, pb.SendStatus]] = []
        for d, st in failed:
            n = self._permanent_failures.get(d.seq, 0) + 1
            self._permanent_failures[d.seq] = n
            self.metrics.errors.labels(kind=pb.Code.Name(st.code)).inc()
            if n >= self.settings.dispatch_attempts_max or d.message.subject == DLQ_SUBJECT:
                dead.append((d, st))
            else:
                delay = min(self.settings.dispatch_backoff_ms_max, 50 * 2 ** n) / 1000
                asyncio.get_running_loop().call_later(delay, self._requeue, d)
        if dead:
            msgs = [Message(seq=0, store_ms=0, deliver_at_ms=d.message.deliver_at_ms, msg_id=d.message.msg_id,
                            subject=DLQ_SUBJECT, payload=d.message.payload, tags=d.message.tags,
                            properties=tuple(sorted(dict(d.message.properties, **{
                                "dlq.subject": d.message.subject, "dlq.reason": st.error[:500],
                                "dlq.code": pb.Code.Name(st.code)}).items())),
                            attempts=d.message.attempts) for d, st in dead]
            retrying = AsyncRetrying(retry=retry_if_exception_type(Unavailable),
                                     wait=wait_exponential(multiplier=0.05, max=2), reraise=True)
            async for attempt in retrying:
                with attempt:
                    resp = await self._send(DLQ_SUBJECT, msgs)
            ok = [(d.seq, d.effective_ms) for (d, _), st in zip(dead, resp.statuses) if st.code == pb.OK]
            self.store.ack_dispatched(ok, now_ms=self.clock.now_ms(), outcome=Dispatched.DEAD_LETTER)
            self.metrics.dead_lettered.inc(len(ok))
            for (d, _), st in zip(dead, resp.statuses):
                self._permanent_failures.pop(d.seq, None)
                if st.code != pb.OK:  # even the dead-letter subject refused: keep it, log loudly
                    log.error("dead letter refused seq=%d id=%s code=%s", d.seq, d.message.msg_id, st.code)
                    self.store.release([d.seq])
            for d, _ in dead:
                log.warning("dead-lettered id=%s subject=%s", d.message.msg_id, d.message.subject)

    def _requeue(self, d: Due) -> None:
        try:
            self._dispatch_q.put_nowait([d])
        except asyncio.QueueFull:
            self.store.release([d.seq])

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_interval_ms / 1000)
            self.store.checkpoint()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        from node.server import start_grpc  # local import: server wires every role

        self.server, self.address = await start_grpc(self.settings, producer=self, admin=self)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self.committer.run(), name="group-commit"),
                    tg.create_task(self._iterator_loop(), name="iterator"),
                    tg.create_task(self._wheel_loop(), name="wheel"),
                    tg.create_task(self._checkpoint_loop(), name="checkpoint"),
                    *[tg.create_task(self._dispatch_worker(), name=f"dispatch-{i}")
                      for i in range(self.settings.dispatch_concurrency_max)],
                ]
                if self.settings.meta_servers:
                    from node.registration import Registrar
                    self.registrar = Registrar(self.settings, self.address, describe=self.registration_info)
                    tasks.append(tg.create_task(self.registrar.run(), name="registration"))
                self.metrics.start(self.settings.metrics_port)
                log.info("delay node serving node_id=%s address=%s epoch=%d data=%s", self.settings.node_id,
                         self.address, self.store.epoch, self.settings.data_dir)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                if self.registrar is not None:
                    await self.registrar.close()
                await self.server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
        finally:
            await self.channels.close()
            if hasattr(self.router, "close"):
                await self.router.close()
            if self.server is not None:
                await self.server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
            log.info("delay node stopped node_id=%s", self.settings.node_id)
