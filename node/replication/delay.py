"""A delay node in a replicated group: master or slave, chosen by election.

The pure rules live in ``node/replication/core.py``; this is the asyncio/grpc.aio shell:

* **role loop** - watches the group's leader through the meta server; when the seat is
  empty it campaigns (after ``campaign_delay_ms``: the most caught-up slave first) with
  its registration lease; leadership dies with that lease. ``Member`` says whether this
  node may act as master *now* (its lease surely alive by its own clock).
* **master** - the plain ``DelayNode`` loops (ingest, iterate, wheel, dispatch,
  checkpoint) plus the ``Replicate`` stream: slaves fetch message-log and dispatch-log
  bytes by offset; each answer carries the live tick state (iterate offset,
  completed_ms, dispatch offset) at most ``replication_wait_ms`` (50 ms) apart. In
  ``sync`` ack mode SendBatch answers only once every slave of the group holds the bytes.
* **slave** - one follower task per log: CRC-checked ``append_raw``, fsync, then the next
  fetch (its acknowledgement); the message log is filed into the slave's own schedule
  log under the master's tick state (``DelayStore`` follower mode).
* **promotion** - close the follower store, open it as master: the wheel restarts from
  the replicated completed_ms and the dispatch log, and aligns to the wall clock (behind:
  everything overdue fires at once; ahead: it waits). **Demotion** - the reverse; a
  returning old master truncates the suffix the new master never had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import grpc

from cluster import errors as E
from cluster import status
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from node.delay.service import DelayNode
from node.delay.store import DelayStore
from node.replication.core import EpochHistory, Member, SyncTracker, campaign_delay_ms, divergence
from node.store import checkpoint
from node.store.group_commit import GroupCommitter

log = logging.getLogger("hourglass.replication")

LOGS = ("messages", "dispatch")


def _mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class HistoryFile:
    """A log's epoch history, persisted atomically beside the data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = checkpoint.read(path)
        self.history = EpochHistory([tuple(x) for x in doc["entries"]]) if doc else EpochHistory()

    def save(self) -> None:
        checkpoint.write_atomic(self.path, {"entries": [list(x) for x in self.history.entries]})


class ReplicatedDelayNode(DelayNode, rpc.ReplicationServicer):
    def __init__(self, settings, **kw) -> None:
        super().__init__(settings, **kw)
        # start as a slave: the election decides; reopen the store in follower mode
        self.store.close()
        self.store = DelayStore.open(settings.data_dir, settings.store_settings(), now_ms=self.clock.now_ms(),
                                     follower=True)
        self.store.follow()
        self.committer = GroupCommitter(self.store.messages)
        self.mode = "slave"
        self.member = Member(settings.node_id, lease_ttl_ms=settings.meta_lease_ttl_ms,
                             margin_ms=max(200, settings.meta_lease_ttl_ms // 5))
        root = Path(settings.data_dir)
        self.histories = {name: HistoryFile(root / f"{name}.epochs") for name in LOGS}
        self.member.epoch = max(h.history.last_epoch for h in self.histories.values()) if any(
            h.history.entries for h in self.histories.values()) else 0
        self.tracker = SyncTracker(timeout_ms=settings.sync_timeout_ms)
        self._tickets: dict[int, asyncio.Future] = {}
        self._changed = asyncio.Event()
        self._role_task: asyncio.Task | None = None
        self._switch_lock = asyncio.Lock()
        self._no_campaign_until = 0
        self._lease_seen: int | None = None
        self._campaigned_lease: int | None = None
        self.slave_offsets: dict[str, dict[str, int]] = {}   # slave -> log -> offset (master view)
        self.lag_bytes = 0
        self._caught_up_at = time.monotonic()
        self.failovers = 0

    # ------------------------------------------------------------------ helpers

    def is_master(self) -> bool:
        return self.mode == "master" and self.member.is_master(_mono_ms())

    async def _not_master(self, context):
        hint = self.member.leader_address if self.member.leader and self.member.leader != self.settings.node_id else ""
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the master; leader_hint={hint or 'unknown'}")

    def _note_durable(self) -> None:
        super()._note_durable()
        self._changed.set()

    def lag_ms(self) -> int:
        if self.mode == "master" or self.lag_bytes == 0:
            return 0
        return int((time.monotonic() - self._caught_up_at) * 1000)

    async def _metrics_loop(self) -> None:
        while True:
            self.metrics.is_master.set(1 if self.is_master() else 0)
            self.metrics.replication_lag_bytes.set(0 if self.mode == "master" else self.lag_bytes)
            self.metrics.replication_lag_seconds.set(self.lag_ms() / 1000)
            self.metrics.election_epoch.set(self.member.epoch)
            await asyncio.sleep(0.5)

    def registration_info(self) -> dict:
        info = super().registration_info()
        info["master"] = self.mode == "master"
        info["epoch"] = self.member.epoch
        info["lag_bytes"] = self.lag_bytes
        return info

    def stats(self) -> dict:
        s = super().stats()
        s.update({"mode": self.mode, "election_epoch": self.member.epoch, "leader": self.member.leader,
                  "ack_mode": self.settings.ack_mode, "replication_lag_bytes": self.lag_bytes,
                  "replication_lag_ms": self.lag_ms(),
                  "slaves": self.slave_offsets, "failovers": self.failovers})
        return s

    async def Status(self, request, context) -> pb.StatusResponse:
        return pb.StatusResponse(node_id=self.settings.node_id, role="delay", group=self.settings.group,
                                 master=self.mode == "master", epoch=self.member.epoch,
                                 json=json.dumps(self.stats()))

    # ------------------------------------------------------------------ producer API (master only)

    async def SendBatch(self, request, context):
        if not self.is_master():
            await self._not_master(context)
        if request.epoch > self.member.epoch:
            # the caller has seen a newer term than this node: this node was deposed
            self.member.deposed(request.epoch)
            await self._not_master(context)
        resp = await super().SendBatch(request, context)
        if self.settings.ack_mode == "sync":
            await self._wait_replicated(self.store.messages.end_offset, context)
        return resp

    async def Cancel(self, request, context):
        if not self.is_master():
            await self._not_master(context)
        resp = await super().Cancel(request, context)
        if self.settings.ack_mode == "sync" and resp.code == pb.OK:
            await self._wait_replicated(self.store.messages.end_offset, context)
        return resp

    async def Lookup(self, request, context):
        if not self.is_master():
            await self._not_master(context)
        return await super().Lookup(request, context)

    async def _dispatch(self, batch) -> None:
        # fencing: a deposed master (lease not surely alive, e.g. after a long pause) sends
        # nothing; the messages stay in flight until the demotion reopens the store
        if not self.is_master():
            return
        await super()._dispatch(batch)

    async def _wait_replicated(self, offset: int, context) -> None:
        if self.tracker.slaves is not None and not self.tracker.slaves:
            err = E.ReplicationTimeout("no live slave in the group (ack_mode=sync): the message is stored on the "
                                       "master and may still be delivered; retry with the same id")
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await context.abort(status.to_grpc(err), str(err))
        t = self.tracker.wait(offset, _mono_ms())
        if t is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._tickets[t] = fut
        try:
            err = await fut
        finally:
            self._tickets.pop(t, None)
        if err is not None:
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await context.abort(status.to_grpc(err), str(err))

    def _release(self, tickets: list[int], err: Exception | None = None) -> None:
        for t in tickets:
            fut = self._tickets.get(t)
            if fut is not None and not fut.done():
                fut.set_result(err)

    async def _sync_expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self._release(self.tracker.expire(_mono_ms()), E.ReplicationTimeout(
                f"no slave confirmed within {self.settings.sync_timeout_ms} ms (ack_mode=sync); "
                "the message is stored on the master and may still be delivered: retry with the same id"))
            if not self.is_master():
                self._release(self.tracker.drop_all(), E.NotLeader(self.member.leader_address or None))

    # ------------------------------------------------------------------ master side of replication

    def _tick_doc(self) -> str:
        st = self.store.tick_state()
        return json.dumps({"iterate_offset": self.store.iterate_offset,
                           "completed_ms": (st.tick + 1) * self.settings.tick_ms,
                           "dispatch_offset": st.dispatch_offset})

    async def Replicate(self, request_iterator, context):
        async for req in request_iterator:
            if req.epoch > self.member.epoch:
                self.member.deposed(req.epoch)  # someone saw a newer term: stop acting at once
            if not self.is_master() or req.epoch < self.member.epoch:
                await self._not_master(context)
            if req.log not in LOGS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown log {req.log!r}")
            lg = self.store.messages if req.log == "messages" else self.store.dispatch
            hist = self.histories[req.log].history
            try:
                theirs = EpochHistory.decode(req.history or "[]")
            except (ValueError, TypeError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad history: {e}")
            base = dict(epoch=self.member.epoch, offset=req.offset, end_offset=lg.end_offset, truncate_to=-1,
                        reset_to=-1, history=json.dumps(hist.entries))
            cut = divergence(theirs, req.offset, hist, lg.end_offset)
            if cut is None and req.offset > lg.end_offset:
                cut = lg.end_offset
            if cut is not None:
                yield pb.FetchResponse(**dict(base, truncate_to=cut))
                continue
            if req.offset < lg.start_offset:
                yield pb.FetchResponse(**dict(base, reset_to=lg.start_offset))
                continue
            now = _mono_ms()
            offs = self.slave_offsets.setdefault(req.node_id, {})
            offs[req.log] = req.offset
            if req.log == "messages":
                self._release(self.tracker.on_fetch(req.node_id, req.offset, now))
            if req.offset >= lg.end_offset and req.wait_ms:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(),
                                           min(req.wait_ms, self.settings.replication_wait_ms) / 1000)
                except TimeoutError:
                    pass
            data = b""
            if req.offset < lg.end_offset:
                data = lg.read_bytes(req.offset, min(req.max_bytes or (1 << 20), self.settings.replication_chunk_bytes))
            yield pb.FetchResponse(**dict(base, end_offset=lg.end_offset, data=data, checkpoint=self._tick_doc(),
                                          tick_state=self.store.tick_state().encode()))

    # ------------------------------------------------------------------ slave side

    async def _follow(self, name: str) -> None:
        backoff = 0.05
        while True:
            addr = self.member.leader_address
            if not addr or self.member.leader == self.settings.node_id:
                await asyncio.sleep(0.05)
                continue
            stub = rpc.ReplicationStub(self.channels.get(addr))
            call = stub.Replicate()
            try:
                while True:
                    lg = self.store.messages if name == "messages" else self.store.dispatch
                    hf = self.histories[name]
                    await call.write(pb.FetchRequest(
                        node_id=self.settings.node_id, epoch=self.member.epoch, log=name, offset=lg.end_offset,
                        max_bytes=self.settings.replication_chunk_bytes, wait_ms=self.settings.replication_wait_ms,
                        history=hf.history.encode()))
                    resp = await asyncio.wait_for(call.read(), 10)
                    if resp is grpc.aio.EOF:
                        break
                    if resp.epoch < self.member.epoch:
                        break
                    self.member.epoch = max(self.member.epoch, resp.epoch)
                    if resp.truncate_to >= 0:
                        if name == "messages":
                            self.store.truncate_messages(resp.truncate_to)
                        else:
                            self.store.truncate_dispatch(resp.truncate_to)
                        hf.history.truncate(resp.truncate_to)
                        hf.save()
                        continue
                    if resp.reset_to >= 0:
                        log.warning("replica %s too far behind: log restarts at %d", name, resp.reset_to)
                        lg.reset(resp.reset_to)
                        continue
                    if resp.data:
                        lg.append_raw(resp.offset, resp.data)  # checks every record's CRC
                        await asyncio.to_thread(lg.flush)
                        if name == "messages":
                            self.store.appended()
                    before = list(hf.history.entries)
                    hf.history.adopt([tuple(x) for x in json.loads(resp.history)], lg.end_offset)
                    if hf.history.entries != before:
                        hf.save()
                    if name == "messages":
                        if resp.checkpoint:
                            self.store.follow(json.loads(resp.checkpoint))
                        self.lag_bytes = max(0, resp.end_offset - lg.end_offset)
                        if self.lag_bytes == 0:
                            self._caught_up_at = time.monotonic()
                        self._durable_moved.set()
                    backoff = 0.05
            except (grpc.RpcError, TimeoutError, E.HourglassError) as e:
                log.info("replication of %s from %s interrupted: %s", name, addr, e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                call.cancel()

    async def _slave_iterate_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._durable_moved.wait(), 0.2)
            except TimeoutError:
                pass
            self._durable_moved.clear()
            while self.store.iterate(limit=5000):
                await asyncio.sleep(0)

    # ------------------------------------------------------------------ roles

    async def _master_tasks(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.committer.run(), name="group-commit")
            tg.create_task(self._iterator_loop(), name="iterator")
            tg.create_task(self._wheel_loop(), name="wheel")
            tg.create_task(self._checkpoint_loop(), name="checkpoint")
            tg.create_task(self._sync_expiry_loop(), name="sync-expiry")
            for i in range(self.settings.dispatch_concurrency_max):
                tg.create_task(self._dispatch_worker(), name=f"dispatch-{i}")

    async def _slave_tasks(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for name in LOGS:
                tg.create_task(self._follow(name), name=f"follow-{name}")
            tg.create_task(self._slave_iterate_loop(), name="slave-iterate")
            tg.create_task(self._checkpoint_loop(), name="checkpoint")

    async def _switch(self, mode: str) -> None:
        async with self._switch_lock:
            if self.mode == mode and self._role_task is not None:
                return
            if self._role_task is not None:
                self._role_task.cancel()
                try:
                    await self._role_task
                except (asyncio.CancelledError, Exception):
                    pass
            self._release(self.tracker.drop_all(), E.NotLeader(self.member.leader_address or None))
            self._dispatch_q = asyncio.Queue(maxsize=self.settings.dispatch_concurrency_max * 4)
            self.store.checkpoint()
            self.store.close()
            now = self.clock.now_ms()
            if mode == "master":
                self.store = DelayStore.open(self.settings.data_dir, self.settings.store_settings(), now_ms=now)
                for name, hf in self.histories.items():
                    lg = self.store.messages if name == "messages" else self.store.dispatch
                    hf.history.begin(self.member.epoch, lg.end_offset)
                    hf.save()
                self.tracker = SyncTracker(timeout_ms=self.settings.sync_timeout_ms)
                self.tracker.set_slaves(set(self._peers))
                self.failovers += 1
                log.warning("became MASTER group=%s epoch=%d completed_ms=%d (now %d, %+d ms) pending=%d",
                            self.settings.group, self.member.epoch, self.store.completed_ms, now,
                            now - self.store.completed_ms, sum(self.store.pending_by_bucket().values()))
            else:
                self.store = DelayStore.open(self.settings.data_dir, self.settings.store_settings(), now_ms=now,
                                             follower=True)
                self.store.follow()
                log.warning("became SLAVE group=%s epoch=%d leader=%s", self.settings.group, self.member.epoch,
                            self.member.leader_address)
            self.committer = GroupCommitter(self.store.messages)
            self.mode = mode
            self._role_task = asyncio.create_task(self._master_tasks() if mode == "master" else self._slave_tasks())

    _peers: dict[str, int] = {}

    async def _role_loop(self) -> None:
        meta = self.registrar.meta
        role, group = "delay", self.settings.group
        await self._switch("slave")
        next_peers = 0.0
        while True:
            await self.registrar.registered.wait()
            lease = self.registrar.lease_id
            if lease != self._lease_seen:
                self.member.lease_lost()  # leadership died with the old lease
                self._lease_seen = lease
            loop_now = time.monotonic()
            try:
                if loop_now >= next_peers:
                    resp = await meta.call("GetServers", mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER))
                    peers = {}
                    for g in resp.groups:
                        if g.name == group:
                            peers = {m.node_id: int(m.offsets.get("message_log_end", 0)) for m in g.members
                                     if m.node_id != self.settings.node_id}
                    self._peers = peers
                    if self.mode == "master":
                        self._release(self.tracker.set_slaves(set(peers)))
                    next_peers = loop_now + 1.0
                lr = await meta.call("Leader", mpb.LeaderRequest(role=role, group=group))
                if lr.present and lr.leader.node_id == self.settings.node_id and self.mode != "master" \
                        and lease is not None and self._campaigned_lease == lease:
                    # the key is ours, on our lease: our campaign's answer was lost, or we stepped down
                    # because a heartbeat confirmation came late (etcd busy) while the lease lived on.
                    # Take the seat back once the lease is confirmed again; never leave it empty.
                    self.member.won(lr.leader.epoch, self.address)
                    if self.member.is_master(_mono_ms()):
                        await self._switch("master")
                elif lr.present:
                    self.member.observed(lr.leader.node_id, lr.leader.address, lr.leader.epoch)
                elif self.member.leader is not None and self.member.leader != self.settings.node_id:
                    self.member.observed(None, "", self.member.epoch)
                if not lr.present and self.mode != "master" and _mono_ms() >= self._no_campaign_until \
                        and lease is not None:
                    wait = campaign_delay_ms(self.store.messages.end_offset, self._peers,
                                             step_ms=self.settings.campaign_step_ms)
                    if wait:
                        await asyncio.sleep(wait / 1000)
                    self._campaigned_lease = lease
                    cr = await meta.call("Campaign", mpb.CampaignRequest(role=role, group=group,
                                                                         node_id=self.settings.node_id,
                                                                         lease_id=lease, wait_ms=0))
                    if cr.elected:
                        self.member.won(cr.leader.epoch, self.address)
                        await self._switch("master")
                    else:
                        self.member.observed(cr.leader.node_id, cr.leader.address, cr.leader.epoch)
            except E.HourglassError as e:
                log.info("role loop: %s", e)
            if self.mode == "master" and not self.member.is_master(_mono_ms()):
                await self._switch("slave")
            elif self.mode != "slave" and self.member.leader not in (None, self.settings.node_id):
                await self._switch("slave")
            await asyncio.sleep(self.settings.leader_poll_ms / 1000)

    def _on_beat(self, sent_at_ms: int) -> None:
        self.member.keepalive_sent(sent_at_ms)

    # ------------------------------------------------------------------ handover

    async def Handover(self, request, context) -> pb.HandoverResponse:
        """Graceful handover: stop dispatching, let the slaves take the final bytes and tick
        state, resign; a caught-up slave wins the next election."""
        if not self.is_master():
            return pb.HandoverResponse(done=False, error="not the master")
        if not self._peers:
            return pb.HandoverResponse(done=False, error="no slave to hand over to")
        # stop the role tasks (no more dispatch, no more ingest) but keep serving Replicate
        self._role_task.cancel()
        try:
            await self._role_task
        except (asyncio.CancelledError, Exception):
            pass
        self.store.checkpoint()
        self._changed.set()
        deadline = time.monotonic() + min(request.wait_ms or 5000, 30_000) / 1000
        ends = {"messages": self.store.messages.end_offset, "dispatch": self.store.dispatch.end_offset}
        while time.monotonic() < deadline:
            if any(all(offs.get(n, -1) >= ends[n] for n in LOGS) for offs in self.slave_offsets.values()):
                break
            await asyncio.sleep(0.02)
        else:
            self._role_task = asyncio.create_task(self._master_tasks())
            return pb.HandoverResponse(done=False, error="no slave caught up in time; still master")
        await asyncio.sleep(2 * self.settings.replication_wait_ms / 1000)  # the final tick state reaches them
        self._no_campaign_until = _mono_ms() + 3 * self.settings.meta_lease_ttl_ms
        try:
            await self.registrar.meta.call("Resign", mpb.ResignRequest(role="delay", group=self.settings.group,
                                                                       node_id=self.settings.node_id,
                                                                       epoch=self.member.epoch))
        except E.HourglassError as e:
            return pb.HandoverResponse(done=False, error=f"resign failed: {e}")
        self.member.lease_lost()
        self._role_task = None
        self.mode = "handing-over"
        await self._switch("slave")
        return pb.HandoverResponse(done=True)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        from node.registration import Registrar
        from node.server import start_grpc

        if not self.settings.meta_servers:
            raise E.InvalidArgument("meta_servers", "a replicated node needs meta servers (election)")
        self.server, self.address = await start_grpc(self.settings, producer=self, admin=self,
                                                     extra=[lambda srv: rpc.add_ReplicationServicer_to_server(self, srv)])
        self.registrar = Registrar(self.settings, self.address, describe=self.registration_info)
        self.registrar.on_beat = self._on_beat
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.registrar.run(), name="registration"),
                         tg.create_task(self._role_loop(), name="roles"),
                         tg.create_task(self._metrics_loop(), name="metrics")]
                self.metrics.start(self.settings.metrics_port)
                log.info("replicated delay node serving node_id=%s group=%s address=%s ack_mode=%s",
                         self.settings.node_id, self.settings.group, self.address, self.settings.ack_mode)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                await self.registrar.close()
                await self.server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
                if self._role_task is not None:
                    self._role_task.cancel()
        finally:
            if self._role_task is not None:
                self._role_task.cancel()
                try:
                    await self._role_task
                except (asyncio.CancelledError, Exception):
                    pass
            await self.channels.close()
            if hasattr(self.router, "close"):
                await self.router.close()
            if self.server is not None:
                await self.server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
            log.info("delay node stopped node_id=%s", self.settings.node_id)
