"""Real-time node process: the asyncio/grpc.aio shell around ``RealtimeStore``.

* SendBatch (immediate messages, from producers and from delay nodes dispatching):
  append, one group-commit fsync, then answer; a duplicate id inside the dedup
  window is answered OK/duplicate and stored once.
* Pull is a long poll: it waits on the subject's "new data" event up to
  ``min(wait_ms, pull_wait_ms_max)``.
* Nack sends the messages to a delay node due ``retry_after_ms`` later (attempts
  + 1, a new id ``{id}~r{n}`` with the original in property ``hourglass.origin_id``,
  since both sides de-duplicate by id), or to the dead-letter subject once
  ``max_attempts`` is reached; the handles are acked only after that succeeded.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from cluster import status
from cluster.clock import Clock, SystemClock
from cluster.convert import batch_from_pb, merge_results, message_to_pb
from cluster.errors import HourglassError, InvalidArgument, Unavailable, UnknownSubject
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.transport import Channels
from node.config import NodeSettings
from node.metrics import NodeMetrics
from node.realtime.store import DLQ_SUBJECT, RealtimeStore
from node.store.group_commit import GroupCommitter
from node.store.records import Message
from node.aio import wait_event

log = logging.getLogger("hourglass.realtime")

ORIGIN_ID = "hourglass.origin_id"


def retry_copy(m: Message, *, now_ms: int, retry_after_ms: int, dead: bool) -> Message:
    origin = dict(m.properties).get(ORIGIN_ID, m.msg_id)
    props = dict(m.properties)
    props[ORIGIN_ID] = origin
    if dead:
        props["dlq.subject"] = m.subject
        props["dlq.reason"] = f"{m.attempts + 1} delivery attempts"
    return Message(seq=0, store_ms=now_ms, deliver_at_ms=now_ms if dead else now_ms + retry_after_ms,
                   msg_id=f"{origin[:100]}~r{m.attempts + 1}", subject=DLQ_SUBJECT if dead else m.subject,
                   payload=m.payload, tags=m.tags, properties=tuple(sorted(props.items())), attempts=m.attempts + 1)


class RealtimeNode(rpc.ProducerServicer, rpc.ConsumerServicer, rpc.AdminServicer):
    def __init__(self, settings: NodeSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock(settings.clock_offset_ms)
        self.store = RealtimeStore.open(settings.data_dir, settings.realtime_settings(), now_ms=self.clock.now_ms())
        for s in settings.subjects:
            self.store.create_subject(s)
        self.committer = GroupCommitter(self.store.messages)
        self.channels = Channels()
        self.metrics = NodeMetrics("realtime", settings.node_id)
        self._new_data: dict[str, asyncio.Event] = {}
        self._groups_dirty: set[tuple[str, str]] = set()
        self._groups_lock = asyncio.Lock()
        self._groups_rounds_started = 0
        self._groups_rounds_done = 0
        self.address = ""
        self.registrar = None
        self.resolver = None
        if settings.meta_servers:
            from cluster.discovery import MetaResolver  # delay nodes for nacks through the meta server
            self.resolver = MetaResolver(settings.meta_servers, refresh_ms=settings.meta_refresh_ms,
                                         timeout_s=settings.meta_timeout_ms / 1000)

    # ------------------------------------------------------------------ producer side

    async def SendBatch(self, request: pb.SendBatchRequest, context) -> pb.SendBatchResponse:
        if len(request.messages) > self.settings.batch_messages_max:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.messages)} messages exceeds batch_messages_max")
        now = self.clock.now_ms()
        def immediate_only(m: pb.Message) -> None:
            if not request.immediate and (m.delay_ms or m.deliver_at_ms > now):
                raise InvalidArgument("delay_ms", "a real-time node takes immediate messages; "
                                                  "send delayed ones to a delay node")

        converted = batch_from_pb(request.messages, now_ms=now, immediate=True, check=immediate_only)
        try:
            stored = self.store.append([m for m in converted if isinstance(m, Message)], now_ms=now)
        except HourglassError as e:
            await context.abort(status.to_grpc(e), str(e))
        merged = merge_results(converted, stored)
        await self.committer.sync_to(self.store.messages.end_offset)
        out = pb.SendBatchResponse()
        subjects = set()
        for m, r in zip(converted, merged):
            if isinstance(r, Exception):
                self.metrics.errors.labels(kind=type(r).__name__).inc()
                out.statuses.add(code=status.to_code(r), error=str(r))
            else:
                out.statuses.add(code=pb.OK, id=r.msg_id, seq=r.seq, deliver_at_ms=m.deliver_at_ms,
                                 duplicate=r.duplicate)
                if not r.duplicate:
                    subjects.add(m.subject)
                    self.metrics.ingested.inc()
        for s in subjects:
            ev = self._new_data.pop(s, None)
            if ev is not None:
                ev.set()
        return out

    async def Cancel(self, request, context):
        return pb.CancelResponse(code=pb.INVALID_ARGUMENT, error="cancel is answered by delay nodes")

    async def Lookup(self, request, context):
        return pb.LookupResponse(code=pb.INVALID_ARGUMENT, error="lookup is answered by delay nodes")

    # ------------------------------------------------------------------ consumer side

    async def Pull(self, request: pb.PullRequest, context) -> pb.PullResponse:
        if not request.group:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group is required")
        max_messages = min(request.max_messages or self.settings.pull_max, self.settings.pull_max)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.wait_ms, self.settings.pull_wait_ms_max) / 1000
        store = self.store  # a replicated node may reopen its store (role change): stop polling then
        got = []
        created = False
        while self.store is store:
            ev = self._new_data.setdefault(request.subject, asyncio.Event())
            try:
                got = self.store.pull(request.subject, request.group, request.consumer_id or "anonymous",
                                      max_messages=max_messages, tags=list(request.tags), now_ms=self.clock.now_ms())
            except UnknownSubject as e:
                if not self.settings.auto_create_subjects or created:
                    await context.abort(status.to_grpc(e), str(e))
                try:  # consumers may subscribe before the first message of a subject arrives
                    self.store.create_subject(request.subject)
                except HourglassError as e2:
                    await context.abort(status.to_grpc(e2), str(e2))
                created = True
                continue
            except HourglassError as e:
                await context.abort(status.to_grpc(e), str(e))
            left = deadline - loop.time()
            if got or left <= 0:
                break
            # wake at new data, or at least every second (ack timeouts make redeliveries due)
            await wait_event(ev, min(left, 1.0))
        self.metrics.delivered.inc(len(got))
        return pb.PullResponse(deliveries=[
            pb.Delivery(message=message_to_pb(d.message), handle=d.handle, deliver_at_ms=d.message.deliver_at_ms,
                        available_ms=d.message.store_ms) for d in got])

    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        try:
            n = self.store.ack(request.subject, request.group, list(request.handles), now_ms=self.clock.now_ms())
        except HourglassError as e:
            await context.abort(status.to_grpc(e), str(e))
        await self._groups_durable(request.subject, request.group)  # durable before the answer
        self.metrics.acked.inc(n)
        return pb.AckResponse(acked=n)

    async def _groups_durable(self, subject: str, group: str) -> None:
        """Group commit of consumer-group files: acks that arrive while a write is running are
        written together by the next one (one file write per group per round, on the store's
        group-writer thread, never blocking the event loop)."""
        self._groups_dirty.add((subject, group))
        registered_at = self._groups_rounds_started
        async with self._groups_lock:
            if self._groups_rounds_done > registered_at:
                return  # a round that started after this ack was registered has written it
            self._groups_rounds_started += 1
            keys, self._groups_dirty = self._groups_dirty, set()
            items = self.store.snapshot_groups(keys)
            if items:
                await asyncio.wrap_future(self.store.write_groups_async(items))
            self._groups_rounds_done = self._groups_rounds_started

    async def Nack(self, request: pb.NackRequest, context) -> pb.NackResponse:
        now = self.clock.now_ms()
        try:
            got = self.store.nack(request.subject, request.group, list(request.handles), now_ms=now)
        except HourglassError as e:
            await context.abort(status.to_grpc(e), str(e))
        retried, dead = [], []
        for d in got:
            is_dead = d.message.attempts + 1 >= self.settings.max_attempts
            copy = retry_copy(d.message, now_ms=now, retry_after_ms=max(0, request.retry_after_ms), dead=is_dead)
            (dead if is_dead else retried).append((d, copy))
        if retried:
            await self._send_to_delay([c for _, c in retried])
        if dead:
            res = self.store.append([c for _, c in dead], now_ms=now)
            await self.committer.sync_to(self.store.messages.end_offset)
            bad = [r for r in res if isinstance(r, Exception)]
            if bad:
                await context.abort(grpc.StatusCode.INTERNAL, f"dead-letter append failed: {bad[0]}")
            self.metrics.dead_lettered.inc(len(dead))
            ev = self._new_data.pop(DLQ_SUBJECT, None)
            if ev:
                ev.set()
        self.store.ack(request.subject, request.group, [d.handle for d, _ in retried + dead], now_ms=now)
        await self._groups_durable(request.subject, request.group)
        return pb.NackResponse(retried=len(retried), dead_lettered=len(dead))

    async def _send_to_delay(self, msgs: list[Message]) -> None:
        nodes = self.settings.delay_nodes
        if not nodes and self.resolver is not None:
            nodes = await self.resolver.delay_nodes()
        if not nodes:
            raise Unavailable("no delay node configured for retries")
        req = pb.SendBatchRequest(messages=[message_to_pb(m) for m in msgs])
        last: Exception | None = None
        for address in nodes:
            try:
                resp = await self.channels.producer(address).SendBatch(req, timeout=10)
            except grpc.RpcError as e:
                last = status.from_rpc_error(e)
                continue
            bad = [s for s in resp.statuses if s.code != pb.OK]
            if bad:
                raise status.from_code(bad[0].code, bad[0].error)
            return
        raise Unavailable(f"no delay node took the retries: {last}")

    # ------------------------------------------------------------------ admin

    def stats(self) -> dict:
        return {"role": "realtime", "node_id": self.settings.node_id, "group": self.settings.group,
                "epoch": self.store.epoch, "address": self.address, "now_ms": self.clock.now_ms(),
                "subjects": self.store.subjects(), "message_log_end": self.store.messages.end_offset,
                "fsyncs": self.committer.fsyncs}

    def registration_info(self) -> dict:
        return {"master": True, "epoch": self.store.epoch,
                "offsets": {"message_log_end": self.store.messages.end_offset}}

    async def Status(self, request, context) -> pb.StatusResponse:
        return pb.StatusResponse(node_id=self.settings.node_id, role="realtime", group=self.settings.group,
                                 master=True, epoch=self.store.epoch, json=json.dumps(self.stats()))

    # ------------------------------------------------------------------ lifecycle

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_interval_ms / 1000)
            self.store.flush()

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        from node.server import start_grpc

        server, self.address = await start_grpc(self.settings, producer=self, consumer=self, admin=self)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.committer.run(), name="group-commit"),
                         tg.create_task(self._flush_loop(), name="flush")]
                if self.settings.meta_servers:
                    from node.registration import Registrar
                    self.registrar = Registrar(self.settings, self.address, describe=self.registration_info)
                    tasks.append(tg.create_task(self.registrar.run(), name="registration"))
                self.metrics.start(self.settings.metrics_port)
                log.info("real-time node serving node_id=%s address=%s epoch=%d", self.settings.node_id,
                         self.address, self.store.epoch)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                if self.registrar is not None:
                    await self.registrar.close()
                await server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
        finally:
            await self.channels.close()
            if self.resolver is not None:
                await self.resolver.close()
            await server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
