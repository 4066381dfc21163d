"""The ``hourglass.meta.v1.Meta`` servicer: translate, call ``Registry``/``Election``, translate back.

Errors go through ``cluster.status`` (InvalidArgument -> INVALID_ARGUMENT,
AlreadyExists -> ALREADY_EXISTS, NotFound -> NOT_FOUND, Unavailable (etcd down)
-> UNAVAILABLE, NotLeader -> UNAVAILABLE with the leader hint).
"""

from __future__ import annotations

import asyncio
import logging

from aetcd import exceptions as aex

from cluster import security, status
from cluster.errors import HourglassError, InvalidArgument, NotLeader, QuotaExceeded, Unavailable
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.routes import FENCE_REVISION_KEY
from metaserver import keyspace as ks
from metaserver.config import MetaSettings
from metaserver.drains import Drains
from metaserver.election import Election
from metaserver.fences import Fences, report_refusal
from metaserver.etcd import EtcdClient
from metaserver.registry import Registry

log = logging.getLogger("hourglass.meta")

HEARTBEAT_MS_MAX = 1000     # renewal interval told to nodes: a third of the TTL, at most this (docs/replication.md)
CAMPAIGN_CAS_TRIES_MAX = 3   # a campaign retries when the in-sync set changed between its read and its transaction
LEADER_READS_MAX = 3         # a Leader read retries when the seat was taken between its two reads (then it answers at once)
DEAD_PROBES = 2              # refused TCP connects before a reported master counts as dead
DEAD_PROBE_GAP_S = 0.1
DEAD_PROBE_TIMEOUT_S = 0.5
FINISH_TASKS_MAX = 16        # drains being finished at once (metaserver/fences.py), off the heartbeat's path
FINISH_PER_BEAT_MAX = 4      # drained subjects one heartbeat may start finishing


async def port_refuses(address: str, timeout_s: float) -> bool:
    """True when a TCP connect to ``address`` is refused (nothing listens). A timeout or any
    other error is not proof of death (a paused process still accepts)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, int(port))
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return False


KIND_ROLE = {mpb.DELAYED_PRODUCER: "delay", mpb.IMMEDIATE_PRODUCER: "realtime", mpb.CONSUMER: "realtime"}


def role_for_kind(kind: int) -> str:
    role = KIND_ROLE.get(kind)
    if role is None:
        name = mpb.Kind.Name(kind) if kind in mpb.Kind.values() else str(kind)
        raise InvalidArgument("kind", f"unknown kind {name}; expected DELAYED_PRODUCER, IMMEDIATE_PRODUCER "
                                      f"or CONSUMER")
    return role


def record_from_pb(n: mpb.NodeInfo) -> ks.NodeRecord:
    return ks.NodeRecord.parse(role=n.role, group=n.group, node_id=n.node_id, address=n.address, master=n.master,
                               offsets=dict(n.offsets), lag_ms=n.lag_ms, lag_bytes=n.lag_bytes, epoch=n.epoch)


def record_to_pb(r: ks.NodeRecord) -> mpb.NodeInfo:
    return mpb.NodeInfo(role=r.role, group=r.group, node_id=r.node_id, address=r.address, master=r.master,
                        offsets=r.offsets, lag_ms=r.lag_ms, lag_bytes=r.lag_bytes, epoch=r.epoch,
                        updated_ms=r.updated_ms)


def group_to_pb(g: ks.GroupView, draining: bool = False) -> mpb.Group:
    return mpb.Group(role=g.role, name=g.name, master=g.master, epoch=g.epoch,
                     members=[record_to_pb(m) for m in g.members], draining=draining)


def leader_to_pb(info: ks.LeaderInfo) -> mpb.Leader:
    return mpb.Leader(node_id=info.node_id, address=info.address, epoch=info.epoch)


class MetaService(mrpc.MetaServicer):
    def __init__(self, settings: MetaSettings, etcd: EtcdClient) -> None:
        self.settings = settings
        self.etcd = etcd
        self.registry = Registry(etcd, settings)
        self.drains = Drains(etcd)
        self.fences = Fences(etcd)
        self._finishing: dict[tuple[str, str], asyncio.Task] = {}  # (group, subject) -> its finishing try
        self.healthy = False
        self.health_error = "not checked yet"
        self.leader_waits = 0  # Leader long polls waiting now (at most settings.leader_waits_max)

    async def _fail(self, context, e: HourglassError):
        if isinstance(e, Unavailable) and not isinstance(e, (NotLeader, QuotaExceeded)):  # a quota is the caller's
            self.healthy, self.health_error = False, str(e)
        await status.abort(context, e)

    # ------------------------------------------------------------------ registration

    async def Register(self, request: mpb.RegisterRequest, context) -> mpb.RegisterResponse:
        try:
            ttl_s = Registry.ttl_s(request.ttl_ms, self.registry.default_ttl_s)
            record = record_from_pb(request.node)
            lease_id = await self.registry.register(record, ttl_s=ttl_s)
            fences, watch, revision, _ = await self._fences_of(record)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.RegisterResponse(lease_id=lease_id, ttl_ms=ttl_s * 1000,
                                    heartbeat_ms=min(HEARTBEAT_MS_MAX, ttl_s * 1000 // 3),
                                    fences=fences, fence_revision=revision, watch=watch)

    async def Heartbeat(self, request: mpb.HeartbeatRequest, context) -> mpb.HeartbeatResponse:
        try:
            if request.lease_id <= 0:
                raise InvalidArgument("lease_id", "must be > 0")
            record = record_from_pb(request.node)
            ttl = await self.registry.heartbeat(request.lease_id, record)
            fences, watch, revision, stored = await self._fences_of(record)
            merged = 0
            if record.role == "realtime" and request.watch_revision > 0:
                reported = {c.subject: list(c.groups) for c in request.consumers}
                why = report_refusal(reported)
                if why:  # not merged: the drains of these subjects wait (the node keeps its registration)
                    log.error("consumer groups reported by node_id=%s not recorded: %s", record.node_id, why[:300])
                elif await self.fences.merge_consumers(stored, reported):
                    merged = request.watch_revision
        except HourglassError as e:
            await self._fail(context, e)
        if request.drained and record.role == "realtime":
            self._finish_drains(record, list(request.drained), {f.subject for f in fences if f.draining})
        return mpb.HeartbeatResponse(ttl_ms=ttl * 1000, fences=fences, fence_revision=revision, watch=watch,
                                     consumers_merged=merged)

    async def _fences_of(self, record: ks.NodeRecord) -> tuple[list[mpb.Fence], list[str], int, list]:
        """A real-time node's group's fences, the subjects draining in any group (``watch``),
        the revision they were read at and every fence as stored (others: none)."""
        if record.role != "realtime":
            return [], [], 0, []
        stored, revision = await self.fences.read_all()
        own, watch = self.fences.answer(stored, record.group)
        return ([mpb.Fence(subject=s, draining=d, consumers=c, released=r) for s, d, c, r in own], watch, revision,
                stored)

    def _finish_drains(self, record: ks.NodeRecord, drained: list[str], draining: set[str]) -> None:
        """A real-time master says these draining subjects hold nothing unacknowledged: try to
        finish them off the heartbeat's path (at most ``FINISH_TASKS_MAX`` at once; one that
        is not started now is tried on a later heartbeat)."""
        for subject in drained[:FINISH_PER_BEAT_MAX]:
            key = (record.group, subject)
            if subject not in draining or key in self._finishing or len(self._finishing) >= FINISH_TASKS_MAX:
                continue
            revision = record.offsets.get(FENCE_REVISION_KEY, 0)

            async def run(key=key, subject=subject, revision=revision) -> None:
                try:
                    await self.fences.try_finish(self.registry, record.group, subject, record.address, revision)
                except (HourglassError, aex.ClientError, ValueError) as e:
                    log.info("finishing the drain of subject=%s group=%s failed: %s", subject[:200], record.group, e)
                finally:
                    self._finishing.pop(key, None)
            self._finishing[key] = asyncio.get_running_loop().create_task(run(), name=f"finish-{record.group}")

    async def Deregister(self, request: mpb.DeregisterRequest, context) -> mpb.DeregisterResponse:
        try:
            ks.check_name("node_id", request.node_id)
            await self.registry.deregister(request.lease_id, request.node_id)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.DeregisterResponse()

    # ------------------------------------------------------------------ discovery

    async def GetServers(self, request: mpb.GetServersRequest, context) -> mpb.GetServersResponse:
        try:
            role = role_for_kind(request.kind)
            groups, revision = await self.registry.groups(role)
            draining = await self.drains.draining() if role == "delay" else {}
        except HourglassError as e:
            await self._fail(context, e)
        # a draining delay group takes no new messages: left out unless asked for (marked)
        return mpb.GetServersResponse(groups=[group_to_pb(g, g.name in draining) for g in groups
                                              if request.include_draining or g.name not in draining],
                                      revision=revision)

    async def Route(self, request: mpb.RouteRequest, context) -> mpb.RouteResponse:
        """The real-time group of a subject, chosen and written to etcd on its first use.
        Before anything is read or written: the subject must follow the subject rule
        (INVALID_ARGUMENT) and the caller must hold a produce or consume grant on it
        (PERMISSION_DENIED); a route is a permanent etcd key, so no other caller makes one."""
        try:
            ks.check_subject(request.subject)
            security.check((security.Action.PRODUCE, security.Action.CONSUME), [request.subject])
            if role_for_kind(request.kind) != "realtime":
                raise InvalidArgument("kind", "subjects route to real-time groups; delayed messages go to any "
                                              "delay group (GetServers DELAYED_PRODUCER)")
            route, views, views_all = await self.registry.route(request.subject)
        except HourglassError as e:
            await self._fail(context, e)
        groups = [group_to_pb(g) for g in views]
        draining = [group_to_pb(g) for g in ks.route_views(route, views_all, draining=True)] if route.draining else []
        return mpb.RouteResponse(group=groups[0], groups=groups, epoch=route.epoch, draining=draining)

    async def SetRoute(self, request: mpb.SetRouteRequest, context) -> mpb.SetRouteResponse:
        """An operator widens a subject's route (``hourglass admin route``). Admin only (the
        interceptor's table, ``cluster/security.py``): a tenant's produce or consume grant
        on the subject is not enough, a route decides where everybody's messages go."""
        try:
            before, after = await self.registry.set_route(request.subject, list(request.groups), narrowing=True)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.SetRouteResponse(groups=list(after.groups), epoch=after.epoch,
                                    previous=list(before.groups) if before else [], changed=after is not before,
                                    draining=list(after.draining))

    async def Drain(self, request: mpb.DrainRequest, context) -> mpb.DrainResponse:
        """An operator drains a delay group (``hourglass admin drain``). Admin only, like
        ``SetRoute`` (``cluster/security.py``); the rules are ``metaserver/drains.py``."""
        try:
            registered = {g.name for g in (await self.registry.groups("delay"))[0]}
            since, changed = await self.drains.drain(request.group, registered)
            others = sorted(registered - set(await self.drains.draining()))
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.DrainResponse(group=request.group, since_ms=since, changed=changed, others=others)

    async def ReleaseConsumerGroup(self, request: mpb.ReleaseRequest, context) -> mpb.ReleaseResponse:
        """An operator releases a consumer group from a subject's drains (``hourglass admin
        release``). Admin only, like ``SetRoute``: it gives up that group's unacked messages on
        the draining groups; the rules are ``metaserver/fences.py`` (``released_after``)."""
        try:
            groups, changed = await self.fences.release(request.subject, request.consumer_group)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.ReleaseResponse(groups=groups, changed=changed)

    # ------------------------------------------------------------------ election

    async def _read_in_sync(self, role: str, group: str) -> tuple[ks.InSync | None, int]:
        """The group's in-sync set and the mod revision it was read at (0: none yet)."""
        kv = await self.etcd.call(lambda c: c.get(ks.in_sync_key(role, group)))
        return (None, 0) if kv is None else (ks.InSync.decode(kv.value), kv.mod_revision)

    async def Campaign(self, request: mpb.CampaignRequest, context) -> mpb.CampaignResponse:
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            ks.check_name("node_id", request.node_id)
            if request.lease_id <= 0:
                raise InvalidArgument("lease_id", "campaign with the node's registration lease")
            node = await self.etcd.call(lambda c: c.get(ks.node_key(request.role, request.group, request.node_id)))
            claim = ks.claim_value(request.lease_id, request.role, request.group)
            held = await self.etcd.call(lambda c: c.get(ks.id_key(request.node_id)))
            if node is None or held is None or held.value != claim:
                raise InvalidArgument("node_id", f"{request.node_id!r} is not registered in "
                                                 f"{request.role}/{request.group} under lease {request.lease_id:x}")
            address = ks.NodeRecord.from_value(node.value).address
            election = Election(self.etcd, request.role, request.group)
            wait_s = min(request.wait_ms, self.settings.campaign_wait_ms_max) / 1000
            isr_key = ks.in_sync_key(request.role, request.group)
            for _ in range(CAMPAIGN_CAS_TRIES_MAX):
                # the seat and the in-sync set in one transaction: only a member of the set is
                # elected, and the term's store epoch is handed out with the seat
                isr, rev = await self._read_in_sync(request.role, request.group)
                why, after = ks.campaign_in_sync(isr, request.node_id, request.store_epoch_min)
                if why:
                    current = await election.leader()
                    log.warning("campaign refused role=%s group=%s node_id=%s: %s", request.role, request.group,
                                request.node_id, why)
                    return mpb.CampaignResponse(elected=False, refused=why,
                                                leader=leader_to_pb(current) if current else mpb.Leader())
                try:
                    epoch = await election.campaign(
                        request.node_id, address, lease_id=request.lease_id, timeout_s=wait_s,
                        guards=[(ks.id_key(request.node_id), claim)],
                        compares=lambda c, r=rev: [c.transactions.mod(isr_key) == r],
                        puts=lambda c, v=after.encode(): [c.transactions.put(isr_key, v)])
                except NotLeader:
                    current = await election.leader()
                    if current is None:
                        continue  # the seat is free but a guard failed: the set changed, or the claim
                    return mpb.CampaignResponse(elected=False, leader=leader_to_pb(current))
                now_isr, _ = await self._read_in_sync(request.role, request.group)
                store_epoch = now_isr.store_epoch if now_isr else after.store_epoch
                break
            else:
                raise InvalidArgument("lease_id", f"lease {request.lease_id:x} does not hold node id "
                                                  f"{request.node_id!r}")
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.CampaignResponse(elected=True, store_epoch=store_epoch,
                                    leader=mpb.Leader(node_id=request.node_id, address=address, epoch=epoch))

    async def UpdateInSync(self, request: mpb.UpdateInSyncRequest, context) -> mpb.UpdateInSyncResponse:
        """The master of ``epoch`` sets its group's in-sync set (it shrinks the set before it
        acknowledges without a member, and grows it once a member holds everything)."""
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            ks.check_name("node_id", request.node_id)
            members = sorted(set(request.members))
            for m in members:
                ks.check_name("node_id", m)
            if request.node_id not in members:
                raise InvalidArgument("members", "the in-sync set must hold the master asking")
            lkey = ks.leader_key(request.role, request.group)
            isr_key = ks.in_sync_key(request.role, request.group)
            isr, rev = await self._read_in_sync(request.role, request.group)
            after = ks.InSync(tuple(members), isr.store_epoch if isr else 0)
            ok, _ = await self.etcd.call(lambda c: c.transaction(
                compare=[c.transactions.create(lkey) == request.epoch, c.transactions.mod(isr_key) == rev],
                success=[c.transactions.put(isr_key, after.encode())], failure=[]))
            leader = await Election(self.etcd, request.role, request.group).leader()
            if ok and (leader is None or leader.node_id != request.node_id):
                ok = False  # cannot happen: the seat of that epoch is the asker's
            if ok:
                log.info("in-sync set role=%s group=%s epoch=%d members=%s", request.role, request.group,
                         request.epoch, members)
            now, _ = await self._read_in_sync(request.role, request.group)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.UpdateInSyncResponse(updated=ok, members=list(now.members) if now else [])

    async def ForceInSync(self, request: mpb.ForceInSyncRequest, context) -> mpb.ForceInSyncResponse:
        """An operator's unclean election: the set becomes ``{node_id}`` alone, so that member
        may be elected although it may lack acknowledged records."""
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            ks.check_name("node_id", request.node_id)
            isr_key = ks.in_sync_key(request.role, request.group)
            isr, rev = await self._read_in_sync(request.role, request.group)
            after = ks.InSync((request.node_id,), isr.store_epoch if isr else 0)
            ok, _ = await self.etcd.call(lambda c: c.transaction(
                compare=[c.transactions.mod(isr_key) == rev], success=[c.transactions.put(isr_key, after.encode())],
                failure=[]))
            if not ok:
                raise Unavailable("the in-sync set changed meanwhile; try again")
            log.warning("UNCLEAN: in-sync set of %s/%s forced to [%s] (was %s): acknowledged records only the "
                        "others held may be lost", request.role, request.group, request.node_id,
                        list(isr.members) if isr else [])
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.ForceInSyncResponse(previous=list(isr.members) if isr else [], members=[request.node_id])

    async def ReportDead(self, request: mpb.ReportDeadRequest, context) -> mpb.ReportDeadResponse:
        """A slave says its master's port refuses connections. Checked here (a refused TCP
        connect, twice): a refused port means no process listens there (a paused one still
        accepts), so the term ends at once (leader key deleted, guarded by the epoch, and the
        dead process's lease revoked) instead of after the lease's TTL."""
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            lkey = ks.leader_key(request.role, request.group)
            kv = await self.etcd.call(lambda c: c.get(lkey))
            if kv is None or kv.create_revision != request.epoch:
                return mpb.ReportDeadResponse(ended=False, reason="that term is over already")
            leader = ks.LeaderInfo.from_kv(kv.value, kv.create_revision)
            for i in range(DEAD_PROBES):
                if not await port_refuses(leader.address, DEAD_PROBE_TIMEOUT_S):
                    return mpb.ReportDeadResponse(ended=False, reason=f"{leader.address} accepts connections")
                if i + 1 < DEAD_PROBES:
                    await asyncio.sleep(DEAD_PROBE_GAP_S)
            ok, _ = await self.etcd.call(lambda c: c.transaction(
                compare=[c.transactions.create(lkey) == request.epoch], success=[c.transactions.delete(lkey)],
                failure=[]))
            if ok and kv.lease:
                try:
                    await self.etcd.call(lambda c: c.revoke_lease(kv.lease))
                except Exception as e:  # noqa: BLE001 - already gone is fine; the key is deleted either way
                    log.info("revoke of a dead master's lease=%x: %s", kv.lease, e)
            if ok:
                log.warning("term ended role=%s group=%s epoch=%d: master %s (%s) refuses connections, reported "
                            "by %s", request.role, request.group, request.epoch, leader.node_id, leader.address,
                            request.reporter)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.ReportDeadResponse(ended=ok, reason="" if ok else "the term changed meanwhile")

    async def Resign(self, request: mpb.ResignRequest, context) -> mpb.ResignResponse:
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            ks.check_name("node_id", request.node_id)
            election = Election(self.etcd, request.role, request.group)
            current = await election.leader()
            if current is None or current.node_id != request.node_id or current.epoch != request.epoch:
                return mpb.ResignResponse(resigned=False)
            election.epoch = request.epoch
            ok = await election.resign()
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.ResignResponse(resigned=ok)

    async def Leader(self, request: mpb.LeaderRequest, context) -> mpb.LeaderResponse:
        """Who leads the group, and its in-sync set. A long poll when the caller gives
        ``wait_ms`` and the token of its last answer (``known``): answered when either key
        changes or after the wait, whichever is first."""
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            current, in_sync, token, revision = await self._leader_state(request.role, request.group)
            wait_s = min(request.wait_ms, self.settings.leader_wait_ms_max) / 1000
            if wait_s > 0 and request.known == token and self.leader_waits < self.settings.leader_waits_max:
                self.leader_waits += 1
                try:
                    await self._leader_changed(request.role, request.group, revision + 1, wait_s)
                finally:
                    self.leader_waits -= 1
                current, in_sync, token, _ = await self._leader_state(request.role, request.group)
        except HourglassError as e:
            await self._fail(context, e)
        if current is None:
            return mpb.LeaderResponse(present=False, in_sync=in_sync, token=token)
        return mpb.LeaderResponse(present=True, leader=leader_to_pb(current), in_sync=in_sync, token=token)

    async def _leader_state(self, role: str, group: str) -> tuple[ks.LeaderInfo | None, list[str], str, int]:
        """The leader (or None), the in-sync set, the token naming both keys' versions, and
        the etcd revision they were read at (a watch from the next one misses no change of
        either key made after these reads)."""
        lkey, ikey = ks.leader_key(role, group), ks.in_sync_key(role, group)
        for _ in range(LEADER_READS_MAX):
            # both keys in one transaction: two reads could pair an empty seat with the in-sync
            # set written when it was taken in between (present=False, in_sync=[the new master])
            _, (lkvs, ikvs) = await self.etcd.call(lambda c: c.transaction(
                compare=[], success=[c.transactions.get(lkey), c.transactions.get(ikey)], failure=[]))
            current, lcreate, lmod, isr, isr_mod, revision = None, 0, 0, None, 0, 0
            if lkvs:
                kv = lkvs[0][1]
                current, lcreate, lmod = ks.LeaderInfo.from_kv(kv.value, kv.create_revision), kv.create_revision, kv.mod_revision
                revision = kv.header.revision
            if ikvs:
                kv = ikvs[0][1]
                isr, isr_mod, revision = ks.InSync.decode(kv.value), kv.mod_revision, kv.header.revision
            if not revision:
                # neither key exists, so the answer names no revision: take a later read's,
                # which holds while the seat is still empty there (else read both again)
                r = await self.etcd.call(lambda c: c.get_range(lkey, lkey + b"\0"))
                if r.count:
                    continue
                revision = r.header.revision
            break
        return current, (list(isr.members) if isr else []), f"{lcreate}.{lmod}.{isr_mod}", revision

    async def _leader_changed(self, role: str, group: str, from_revision: int, wait_s: float) -> None:
        """Returns when the leader key or the in-sync set of the group changes at or after
        ``from_revision``, or after ``wait_s``; an etcd error ends the wait too (the caller
        reads again, and that read reports the error)."""
        async def watch(key: bytes) -> None:
            try:
                await self.etcd.call(lambda c: c.watch_once(key, timeout=wait_s, start_revision=from_revision),
                                     wait_s=wait_s)
            except (aex.WatchTimeoutError, aex.RevisionCompactedError, Unavailable, aex.ClientError):
                pass

        tasks = [asyncio.ensure_future(watch(k)) for k in (ks.leader_key(role, group), ks.in_sync_key(role, group))]
        try:
            await asyncio.wait(tasks, timeout=wait_s + 1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ health

    async def check_health(self) -> bool:
        try:
            await asyncio.wait_for(self.etcd.status(), self.settings.etcd_timeout_ms / 1000)
            self.healthy, self.health_error = True, ""
        except Exception as e:  # any failure to reach etcd is "unhealthy", reported as text
            self.healthy, self.health_error = False, f"{type(e).__name__}: {e}"[:500]
        return self.healthy

    async def Health(self, request, context) -> mpb.HealthResponse:
        await self.check_health()
        return mpb.HealthResponse(healthy=self.healthy, etcd_endpoint=self.etcd.endpoint, error=self.health_error)

    async def health_loop(self) -> None:
        interval = self.settings.health_check_interval_ms / 1000
        was = None
        while True:
            now = await self.check_health()
            if now != was:
                (log.info if now else log.warning)("meta server healthy=%s etcd=%s %s", now, self.etcd.endpoint,
                                                   self.health_error)
                was = now
            await asyncio.sleep(interval)
