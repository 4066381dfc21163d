"""A real-time node in a replicated group: master or slave, chosen by election.

Same rules (``node/replication/core.py``) and the same shape as ``ReplicatedDelayNode``:

* **role loop** - role ``realtime``, group ``settings.group``: watch the leader through the
  meta server, campaign with the registration lease when the seat is empty (most
  caught-up slave first), act as master only while the lease is surely alive (``Member``).
* **master** - the plain ``RealtimeNode`` (SendBatch, Pull, Ack, Nack) plus ``Replicate``
  for the one log ``messages``. Each ``FetchResponse`` also carries, in ``checkpoint``,
  ``{"groups": [doc, ...]}``: the consumer-group documents written since the previous
  answer on that stream (the first answers of a stream carry all of them, paged). The
  docs are exactly what ``RealtimeStore`` writes to ``groups/{subject}/{group}.json``.
  Every group write has a store-local seq (``RealtimeStore.group_seq``); a slave's next
  request on a stream acknowledges everything the previous answer carried.
* **sync ack mode** - SendBatch answers once every slave holds the bytes (byte offset,
  ``SyncTracker``); Ack (and Nack) answers once every slave holds the group document that
  records it (group seq, a second ``SyncTracker``). No live slave, or a timeout: the
  caller gets ``REPLICATION_TIMEOUT``, never a silent downgrade.
* **slave** - CRC-checked ``append_raw``, fsync, ``index_appended`` (consume index and
  dedup map, as the store's own replay does), then the shipped group documents are
  written; then the next fetch (the acknowledgement). Pull/Ack/Nack/SendBatch answer
  ``UNAVAILABLE "not the master; leader_hint=..."``: clients re-resolve the subject's
  route through the meta server, which names the group's elected master.
* **promotion / demotion** - close the store and reopen it: the epoch goes above every
  seq in the log, groups load from the replicated files (in-flight handles redelivered at
  once: at-least-once), the dedup map is rebuilt from the log. A returning old master
  truncates the suffix the new master never had (``truncate_log``: log, index entries
  past the cut, dedup entries).
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
from node.realtime.service import RealtimeNode
from node.realtime.store import RealtimeStore
from node.replication.core import EpochHistory, Member, SyncTracker, campaign_delay_ms, divergence
from node.replication.delay import HistoryFile, _mono_ms
from node.store.group_commit import GroupCommitter

log = logging.getLogger("hourglass.replication.realtime")

LOG = "messages"
GROUP_DOCS_BYTES_MAX = 512 * 1024   # group documents one FetchResponse carries (the rest follow)
ROLE = "realtime"


class ReplicatedRealtimeNode(RealtimeNode, rpc.ReplicationServicer):
    def __init__(self, settings, **kw) -> None:
        super().__init__(settings, **kw)
        self.mode = "slave"
        self.member = Member(settings.node_id, lease_ttl_ms=settings.meta_lease_ttl_ms,
                             margin_ms=max(200, settings.meta_lease_ttl_ms // 5))
        self.history = HistoryFile(Path(settings.data_dir) / f"{LOG}.epochs")
        self.member.epoch = self.history.history.last_epoch if self.history.history.entries else 0
        self.tracker = SyncTracker(timeout_ms=settings.sync_timeout_ms)    # message-log bytes
        self.gtracker = SyncTracker(timeout_ms=settings.sync_timeout_ms)   # group documents (store group_seq)
        self._tickets: dict[tuple[str, int], asyncio.Future] = {}
        self._changed = asyncio.Event()
        self._role_task: asyncio.Task | None = None
        self._switch_lock = asyncio.Lock()
        self._no_campaign_until = 0
        self._lease_seen: int | None = None
        self._campaigned_lease: int | None = None
        self._peers: dict[str, int] = {}
        self.slave_offsets: dict[str, dict[str, int]] = {}
        self.lag_bytes = 0
        self._caught_up_at = time.monotonic()
        self.failovers = 0
        self.server = None
        self._handing_over = False

    # ------------------------------------------------------------------ helpers

    def is_master(self) -> bool:
        return self.mode == "master" and self.member.is_master(_mono_ms())

    def _may_serve(self) -> bool:
        """Clients are served by the master, except while it hands over (it still serves Replicate)."""
        return self.is_master() and not self._handing_over

    async def _not_master(self, context):
        hint = self.member.leader_address if self.member.leader and self.member.leader != self.settings.node_id else ""
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the master; leader_hint={hint or 'unknown'}")

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
                  "replication_lag_ms": self.lag_ms(), "slaves": self.slave_offsets, "failovers": self.failovers,
                  "group_seq": self.store.group_seq})
        return s

    async def Status(self, request, context) -> pb.StatusResponse:
        return pb.StatusResponse(node_id=self.settings.node_id, role=ROLE, group=self.settings.group,
                                 master=self.mode == "master", epoch=self.member.epoch,
                                 json=json.dumps(self.stats()))

    # ------------------------------------------------------------------ client API (master only)

    async def SendBatch(self, request, context):
        if not self._may_serve():
            await self._not_master(context)
        if request.epoch > self.member.epoch:
            # the caller has seen a newer term of this group than this node: it was deposed
            self.member.deposed(request.epoch)
            await self._not_master(context)
        resp = await super().SendBatch(request, context)
        self._changed.set()
        if self.settings.ack_mode == "sync":
            await self._wait(self.tracker, "bytes", self.store.messages.end_offset, context)
        return resp

    async def Pull(self, request, context):
        if not self._may_serve():
            await self._not_master(context)
        return await super().Pull(request, context)

    async def Ack(self, request, context):
        if not self._may_serve():
            await self._not_master(context)
        resp = await super().Ack(request, context)  # the group file is written before this returns
        await self._groups_replicated(request.subject, request.group, context)
        return resp

    async def Nack(self, request, context):
        if not self._may_serve():
            await self._not_master(context)
        resp = await super().Nack(request, context)
        if self.settings.ack_mode == "sync":
            await self._wait(self.tracker, "bytes", self.store.messages.end_offset, context)  # dead letters
        await self._groups_replicated(request.subject, request.group, context)
        return resp

    async def _groups_replicated(self, subject: str, group: str, context) -> None:
        self._changed.set()
        if self.settings.ack_mode == "sync":
            seq = self.store.group_written_seq(subject, group)
            if seq:
                await self._wait(self.gtracker, "groups", seq, context)

    async def _wait(self, tracker: SyncTracker, kind: str, offset: int, context) -> None:
        if tracker.slaves is not None and not tracker.slaves:
            err = E.ReplicationTimeout("no live slave in the group (ack_mode=sync): stored on the master only; "
                                       "retry (message ids and acks are idempotent)")
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await context.abort(status.to_grpc(err), str(err))
        t = tracker.wait(offset, _mono_ms())
        if t is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._tickets[(kind, t)] = fut
        try:
            err = await fut
        finally:
            self._tickets.pop((kind, t), None)
        if err is not None:
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await context.abort(status.to_grpc(err), str(err))

    def _release(self, kind: str, tickets: list[int], err: Exception | None = None) -> None:
        for t in tickets:
            fut = self._tickets.get((kind, t))
            if fut is not None and not fut.done():
                fut.set_result(err)

    def _release_all(self, err: Exception) -> None:
        self._release("bytes", self.tracker.drop_all(), err)
        self._release("groups", self.gtracker.drop_all(), err)

    async def _sync_expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = _mono_ms()
            err = E.ReplicationTimeout(f"no slave confirmed within {self.settings.sync_timeout_ms} ms "
                                       "(ack_mode=sync); stored on the master: retry")
            self._release("bytes", self.tracker.expire(now), err)
            self._release("groups", self.gtracker.expire(now), err)
            if not self.is_master():
                self._release_all(E.NotLeader(self.member.leader_address or None))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_interval_ms / 1000)
            seq = self.store.group_seq
            self.store.flush()
            if self.store.group_seq != seq:
                self._changed.set()  # pulls moved group positions: ship them

    # ------------------------------------------------------------------ master side of replication

    async def Replicate(self, request_iterator, context):
        store: RealtimeStore | None = None
        sent_seq, backlog, complete = -1, [], None
        async for req in request_iterator:
            if req.epoch > self.member.epoch:
                self.member.deposed(req.epoch)  # someone saw a newer term: stop acting at once
            if not self.is_master() or req.epoch < self.member.epoch:
                await self._not_master(context)
            if req.log != LOG:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown log {req.log!r}")
            if self.store is not store:  # (re)opened: group seqs start again, send every document
                store, sent_seq, backlog, complete = self.store, -1, [], None
            lg = store.messages
            hist = self.history.history
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
            self.slave_offsets.setdefault(req.node_id, {})[LOG] = req.offset
            self._release("bytes", self.tracker.on_fetch(req.node_id, req.offset, now))
            if complete is not None:  # this request says the previous answer's documents are written
                self._release("groups", self.gtracker.on_fetch(req.node_id, complete, now))
            if req.offset >= lg.end_offset and req.wait_ms and not backlog and store.group_seq == sent_seq:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(),
                                           min(req.wait_ms, self.settings.replication_wait_ms) / 1000)
                except TimeoutError:
                    pass
                if self.store is not store:
                    await self._not_master(context)
            data = b""
            if req.offset < lg.end_offset:
                data = lg.read_bytes(req.offset, min(req.max_bytes or (1 << 20), self.settings.replication_chunk_bytes))
            upto = store.group_seq
            keys = backlog + [k for k in store.changed_groups(sent_seq) if k not in set(backlog)]
            docs, size, backlog = [], 0, []
            for i, k in enumerate(keys):
                doc = store.group_doc(*k)
                if doc is None:
                    continue
                text = json.dumps(doc)
                if docs and size + len(text) > GROUP_DOCS_BYTES_MAX:
                    backlog = keys[i:]
                    break
                docs.append(text)
                size += len(text)
            sent_seq, complete = upto, (upto if not backlog else None)
            yield pb.FetchResponse(**dict(base, end_offset=lg.end_offset, data=data,
                                          checkpoint='{"groups": [' + ", ".join(docs) + "]}" if docs else ""))

    # ------------------------------------------------------------------ slave side

    async def _follow(self) -> None:
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
                    lg = self.store.messages
                    hf = self.history
                    await call.write(pb.FetchRequest(
                        node_id=self.settings.node_id, epoch=self.member.epoch, log=LOG, offset=lg.end_offset,
                        max_bytes=self.settings.replication_chunk_bytes, wait_ms=self.settings.replication_wait_ms,
                        history=hf.history.encode()))
                    resp = await asyncio.wait_for(call.read(), 10)
                    if resp is grpc.aio.EOF or resp.epoch < self.member.epoch:
                        break
                    self.member.epoch = max(self.member.epoch, resp.epoch)
                    if resp.truncate_to >= 0:
                        self.store.truncate_log(resp.truncate_to)
                        hf.history.truncate(resp.truncate_to)
                        hf.save()
                        continue
                    if resp.reset_to >= 0:
                        raise E.StorageError(f"the master no longer holds offset {lg.end_offset} of {LOG} "
                                             f"(starts at {resp.reset_to}): rebuild this replica from an empty "
                                             "data folder")
                    if resp.data:
                        lg.append_raw(resp.offset, resp.data)  # checks every record's CRC
                        await asyncio.to_thread(lg.flush)
                        self.store.index_appended(now_ms=self.clock.now_ms())
                    before = list(hf.history.entries)
                    hf.history.adopt([tuple(x) for x in json.loads(resp.history)], lg.end_offset)
                    if hf.history.entries != before:
                        hf.save()
                    if resp.checkpoint:
                        for doc in json.loads(resp.checkpoint).get("groups", []):
                            self.store.apply_group_doc(doc)  # fsynced file: acknowledged by the next fetch
                    self.lag_bytes = max(0, resp.end_offset - lg.end_offset)
                    if self.lag_bytes == 0:
                        self._caught_up_at = time.monotonic()
                    backoff = 0.05
            except (grpc.RpcError, TimeoutError, E.HourglassError) as e:
                log.info("replication of %s from %s interrupted: %s", LOG, addr, e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                call.cancel()

    # ------------------------------------------------------------------ roles

    async def _master_tasks(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.committer.run(), name="group-commit")
            tg.create_task(self._flush_loop(), name="flush")
            tg.create_task(self._sync_expiry_loop(), name="sync-expiry")

    async def _slave_tasks(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._follow(), name="follow")
            tg.create_task(self._flush_loop(), name="flush")

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
            self._release_all(E.NotLeader(self.member.leader_address or None))
            self.store.close()
            self.store = RealtimeStore.open(self.settings.data_dir, self.settings.realtime_settings(),
                                            now_ms=self.clock.now_ms())
            self.committer = GroupCommitter(self.store.messages)
            for ev in self._new_data.values():
                ev.set()  # long polls re-check (and answer NOT_LEADER on a slave)
            self._new_data.clear()
            if mode == "master":
                self.history.history.begin(self.member.epoch, self.store.messages.end_offset)
                self.history.save()
                self.tracker = SyncTracker(timeout_ms=self.settings.sync_timeout_ms)
                self.gtracker = SyncTracker(timeout_ms=self.settings.sync_timeout_ms)
                self.tracker.set_slaves(set(self._peers))
                self.gtracker.set_slaves(set(self._peers))
                self.slave_offsets = {}
                self.failovers += 1
                log.warning("became MASTER group=%s epoch=%d store_epoch=%d log_end=%d groups=%d",
                            self.settings.group, self.member.epoch, self.store.epoch,
                            self.store.messages.end_offset, self.store.group_seq)
            else:
                log.warning("became SLAVE group=%s epoch=%d leader=%s", self.settings.group, self.member.epoch,
                            self.member.leader_address)
            self.mode = mode
            self._role_task = asyncio.create_task(self._master_tasks() if mode == "master" else self._slave_tasks())

    async def _role_loop(self) -> None:
        meta = self.registrar.meta
        group = self.settings.group
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
                    resp = await meta.call("GetServers", mpb.GetServersRequest(kind=mpb.CONSUMER))
                    peers = {}
                    for g in resp.groups:
                        if g.name == group:
                            peers = {m.node_id: int(m.offsets.get("message_log_end", 0)) for m in g.members
                                     if m.node_id != self.settings.node_id}
                    self._peers = peers
                    if self.mode == "master":
                        self._release("bytes", self.tracker.set_slaves(set(peers)))
                        self._release("groups", self.gtracker.set_slaves(set(peers)))
                    next_peers = loop_now + 1.0
                lr = await meta.call("Leader", mpb.LeaderRequest(role=ROLE, group=group))
                if lr.present and lr.leader.node_id == self.settings.node_id and self.mode != "master" \
                        and lease is not None and self._campaigned_lease == lease:
                    # the key is ours, on our lease: our campaign's answer was lost, or we stepped down
                    # because a heartbeat confirmation came late while the lease lived on
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
                    cr = await meta.call("Campaign", mpb.CampaignRequest(role=ROLE, group=group,
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
        """Graceful handover: stop serving clients, wait until a slave holds the whole log
        and every group document, resign; that slave wins the next election."""
        if not self.is_master():
            return pb.HandoverResponse(done=False, error="not the master")
        if not self._peers:
            return pb.HandoverResponse(done=False, error="no slave to hand over to")
        self._handing_over = True  # clients get NOT_LEADER from now on; Replicate is still served below
        self._role_task.cancel()
        try:
            await self._role_task
        except (asyncio.CancelledError, Exception):
            pass
        self.store.flush()
        self._changed.set()
        end, seq = self.store.messages.end_offset, self.store.group_seq
        deadline = time.monotonic() + min(request.wait_ms or 5000, 30_000) / 1000
        while time.monotonic() < deadline:
            if self.tracker.acked_offset >= end and self.gtracker.acked_offset >= seq:
                break
            await asyncio.sleep(0.02)
        else:
            self._handing_over = False
            self._role_task = asyncio.create_task(self._master_tasks())
            return pb.HandoverResponse(done=False, error="no slave caught up in time; still master")
        self._no_campaign_until = _mono_ms() + 3 * self.settings.meta_lease_ttl_ms
        try:
            await self.registrar.meta.call("Resign", mpb.ResignRequest(role=ROLE, group=self.settings.group,
                                                                       node_id=self.settings.node_id,
                                                                       epoch=self.member.epoch))
        except E.HourglassError as e:
            return pb.HandoverResponse(done=False, error=f"resign failed: {e}")
        self.member.lease_lost()
        self._role_task = None
        self.mode = "handing-over"
        self._handing_over = False
        await self._switch("slave")
        return pb.HandoverResponse(done=True)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        from node.registration import Registrar
        from node.server import start_grpc

        if not self.settings.meta_servers:
            raise E.InvalidArgument("meta_servers", "a replicated node needs meta servers (election)")
        self.server, self.address = await start_grpc(
            self.settings, producer=self, consumer=self, admin=self,
            extra=[lambda srv: rpc.add_ReplicationServicer_to_server(self, srv)])
        self.registrar = Registrar(self.settings, self.address, describe=self.registration_info)
        self.registrar.on_beat = self._on_beat
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.registrar.run(), name="registration"),
                         tg.create_task(self._role_loop(), name="roles"),
                         tg.create_task(self._metrics_loop(), name="metrics")]
                self.metrics.start(self.settings.metrics_port)
                log.info("replicated real-time node serving node_id=%s group=%s address=%s ack_mode=%s",
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
            if self.resolver is not None:
                await self.resolver.close()
            if self.server is not None:
                await self.server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
            log.info("real-time node stopped node_id=%s", self.settings.node_id)
