"""The registration task a node runs when ``meta_servers`` is set.

    registrar = Registrar(settings, address, describe=node.registration_info)
    tg.create_task(registrar.run())      # register, then heartbeat every ttl/3
    ...
    await registrar.close()              # clean stop: revoke the lease, the node disappears at once

The record (role, group, node_id, address, master, log offsets, lag, epoch) is
rebuilt from ``describe()`` on every heartbeat. Any meta server will do: the lease
lives in etcd, so when one meta server dies the next heartbeat goes to the next
address (``MetaClient``) with the same lease.

Answers and what the task does about them:

* ``NotFound`` (the lease expired: the node was frozen, or etcd lost it) -> register again at once;
* ``AlreadyExists`` (another live process holds this node id) -> log an error and
  retry every ``heartbeat`` until that lease is gone; the node keeps serving;
* ``Unavailable`` (no meta server answers, or etcd is down) -> retry with backoff
  up to the heartbeat interval; the node keeps serving with the routes it has;
* ``InvalidArgument`` (this node's own settings are malformed) -> raised: a node
  that cannot describe itself must not run silently unregistered.
"""

from __future__ import annotations

import asyncio
import time
import logging
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from cluster import errors as E
from cluster.discovery import MetaClient
from cluster.proto import meta_pb2 as mpb
from node.config import NodeSettings
from node.grpcserver import READY_SERVICE

log = logging.getLogger("hourglass.registration")

BACKOFF_MS_MIN = 100


def node_info(settings: NodeSettings, address: str, info: dict) -> mpb.NodeInfo:
    return mpb.NodeInfo(role=settings.role, group=settings.group, node_id=settings.node_id, address=address,
                        master=bool(info.get("master", True)),
                        offsets={k: int(v) for k, v in info.get("offsets", {}).items()},
                        lag_ms=int(info.get("lag_ms", 0)), lag_bytes=int(info.get("lag_bytes", 0)),
                        epoch=int(info.get("epoch", 0)))


class Registrar:
    def __init__(self, settings: NodeSettings, address: str, *, describe: Callable[[], dict], health=None) -> None:
        self.settings = settings
        self.address = address
        self.describe = describe
        self.meta = MetaClient(settings.meta_servers, timeout_s=settings.meta_timeout_ms / 1000)
        self.lease_id: int | None = None
        self.heartbeat_ms = settings.meta_heartbeat_ms or max(BACKOFF_MS_MIN, settings.meta_lease_ttl_ms // 3)
        self.registered = asyncio.Event()
        self.heartbeats = 0
        self.on_lost: Callable[[int], None] | None = None  # called with the lease found lost, before registering again
        self.on_beat: Callable[[int], None] | None = None  # called with the send time (monotonic ms) of a confirmed beat
        # the node's grpc.health.v1 servicer (start_grpc's): its readiness service follows the registration
        self.health = health

    def _info(self) -> mpb.NodeInfo:
        return node_info(self.settings, self.address, self.describe())

    async def _beat(self) -> None:
        sent_ms = time.monotonic_ns() // 1_000_000
        await self._beat_once()
        if self.on_beat is not None:
            self.on_beat(sent_ms)

    async def _beat_once(self) -> None:
        if self.lease_id is None:
            resp = await self.meta.call("Register", mpb.RegisterRequest(node=self._info(),
                                                                        ttl_ms=self.settings.meta_lease_ttl_ms))
            self.lease_id = resp.lease_id
            if not self.settings.meta_heartbeat_ms:
                self.heartbeat_ms = max(BACKOFF_MS_MIN, resp.heartbeat_ms)
            log.info("registered node_id=%s lease=%x ttl_ms=%d via=%s", self.settings.node_id, resp.lease_id,
                     resp.ttl_ms, self.meta.current)
            self.registered.set()
            await self._ready(True)
        else:
            await self.meta.call("Heartbeat", mpb.HeartbeatRequest(lease_id=self.lease_id, node=self._info()))
        self.heartbeats += 1

    async def run(self) -> None:
        failures = 0
        while True:
            delay_ms = self.heartbeat_ms
            try:
                await self._beat()
                failures = 0
            except E.NotFound as e:
                log.warning("registration lost node_id=%s (%s); registering again", self.settings.node_id, e)
                if self.on_lost is not None and self.lease_id is not None:
                    self.on_lost(self.lease_id)  # before registering again: that revokes the old lease
                self.lease_id = None
                self.registered.clear()
                await self._ready(False)
                delay_ms = 0
            except E.AlreadyExists as e:
                log.error("node id %s is in use by another live node: %s", self.settings.node_id, e)
                self.lease_id = None
            except E.InvalidArgument:
                raise
            except E.HourglassError as e:  # Unavailable and anything unexpected from the meta side
                failures += 1
                delay_ms = min(self.heartbeat_ms, BACKOFF_MS_MIN * 2 ** min(failures, 8))
                log.warning("heartbeat failed node_id=%s attempt=%d: %s", self.settings.node_id, failures, e)
            await asyncio.sleep(delay_ms / 1000)

    async def _ready(self, ready: bool) -> None:
        if self.health is not None:
            await self.health.set(READY_SERVICE, health_pb2.HealthCheckResponse.SERVING if ready
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def close(self) -> None:
        """Revoke the lease (best effort, bounded): a cleanly stopped node disappears at once."""
        try:
            if self.lease_id is not None:
                await self.meta.call("Deregister", mpb.DeregisterRequest(lease_id=self.lease_id,
                                                                         node_id=self.settings.node_id),
                                     timeout_s=1.0)
        except E.HourglassError as e:
            log.info("deregister failed node_id=%s: %s (the lease will expire)", self.settings.node_id, e)
        finally:
            self.lease_id = None
            await self.meta.close()
