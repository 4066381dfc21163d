"""The ``hourglass.meta.v1.Meta`` servicer: translate, call ``Registry``/``Election``, translate back.

Errors go through ``cluster.status`` (InvalidArgument -> INVALID_ARGUMENT,
AlreadyExists -> ALREADY_EXISTS, NotFound -> NOT_FOUND, Unavailable (etcd down)
-> UNAVAILABLE, NotLeader -> UNAVAILABLE with the leader hint).
"""

from __future__ import annotations

import asyncio
import logging


from cluster import status
from cluster.errors import HourglassError, InvalidArgument, NotLeader, Unavailable
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from metaserver import keyspace as ks
from metaserver.config import MetaSettings
from metaserver.election import Election
from metaserver.etcd import EtcdClient
from metaserver.registry import Registry

log = logging.getLogger("hourglass.meta")

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


def group_to_pb(g: ks.GroupView) -> mpb.Group:
    return mpb.Group(role=g.role, name=g.name, master=g.master, epoch=g.epoch,
                     members=[record_to_pb(m) for m in g.members])


def leader_to_pb(info: ks.LeaderInfo) -> mpb.Leader:
    return mpb.Leader(node_id=info.node_id, address=info.address, epoch=info.epoch)


class MetaService(mrpc.MetaServicer):
    def __init__(self, settings: MetaSettings, etcd: EtcdClient) -> None:
        self.settings = settings
        self.etcd = etcd
        self.registry = Registry(etcd, default_ttl_s=-(-settings.node_ttl_ms // 1000))
        self.healthy = False
        self.health_error = "not checked yet"

    async def _fail(self, context, e: HourglassError):
        if isinstance(e, Unavailable) and not isinstance(e, NotLeader):
            self.healthy, self.health_error = False, str(e)
        await status.abort(context, e)

    # ------------------------------------------------------------------ registration

    async def Register(self, request: mpb.RegisterRequest, context) -> mpb.RegisterResponse:
        try:
            ttl_s = Registry.ttl_s(request.ttl_ms, self.registry.default_ttl_s)
            record = record_from_pb(request.node)
            lease_id = await self.registry.register(record, ttl_s=ttl_s)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.RegisterResponse(lease_id=lease_id, ttl_ms=ttl_s * 1000, heartbeat_ms=ttl_s * 1000 // 3)

    async def Heartbeat(self, request: mpb.HeartbeatRequest, context) -> mpb.HeartbeatResponse:
        try:
            if request.lease_id <= 0:
                raise InvalidArgument("lease_id", "must be > 0")
            ttl = await self.registry.heartbeat(request.lease_id, record_from_pb(request.node))
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.HeartbeatResponse(ttl_ms=ttl * 1000)

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
            groups, revision = await self.registry.groups(role_for_kind(request.kind))
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.GetServersResponse(groups=[group_to_pb(g) for g in groups], revision=revision)

    async def Route(self, request: mpb.RouteRequest, context) -> mpb.RouteResponse:
        try:
            if role_for_kind(request.kind) != "realtime":
                raise InvalidArgument("kind", "subjects route to real-time groups; delayed messages go to any "
                                              "delay group (GetServers DELAYED_PRODUCER)")
            group = await self.registry.route(request.subject)
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.RouteResponse(group=group_to_pb(group))

    # ------------------------------------------------------------------ election

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
            try:
                epoch = await election.campaign(request.node_id, address, lease_id=request.lease_id,
                                                timeout_s=wait_s, guards=[(ks.id_key(request.node_id), claim)])
            except NotLeader:
                current = await election.leader()
                if current is None:
                    raise InvalidArgument("lease_id", f"lease {request.lease_id:x} does not hold node id "
                                                      f"{request.node_id!r}") from None
                return mpb.CampaignResponse(elected=False, leader=leader_to_pb(current))
        except HourglassError as e:
            await self._fail(context, e)
        return mpb.CampaignResponse(elected=True, leader=mpb.Leader(node_id=request.node_id, address=address,
                                                                    epoch=epoch))

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
        try:
            ks.check_role(request.role)
            ks.check_name("group", request.group)
            current = await Election(self.etcd, request.role, request.group).leader()
        except HourglassError as e:
            await self._fail(context, e)
        if current is None:
            return mpb.LeaderResponse(present=False)
        return mpb.LeaderResponse(present=True, leader=leader_to_pb(current))

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
