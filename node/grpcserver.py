"""The gRPC server of a node: one ``grpc.aio`` server with the role's services, the
standard health service, and the node's message size limits. Role services call
``start_grpc`` from their ``run``; ``node/server.py`` (the process root) picks the role."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.security import ServerSecurity, open_warning
from cluster.transport import add_probe_server, listen
from cluster.wire import UndecodableRequests
from node.config import NodeSettings

log = logging.getLogger("hourglass.node")

READY_SERVICE = "hourglass.v1.Node"  # grpc.health.v1 service name of the readiness probe


async def start_grpc(settings: NodeSettings, *, producer=None, consumer=None, admin=None, extra=()) -> tuple[grpc.aio.Server, str]:
    security = ServerSecurity.from_settings()  # HOURGLASS_TLS_* and HOURGLASS_AUTH_FILE (docs/security.md)
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", settings.limits.request_bytes_max),
        ("grpc.max_receive_message_length", settings.limits.request_bytes_max),
        ("grpc.so_reuseport", 0),
    ], interceptors=[*security.interceptors(),  # who calls, may they call this method
                     UndecodableRequests()])    # unparseable bytes: INVALID_ARGUMENT, not UNKNOWN
    if producer is not None:
        rpc.add_ProducerServicer_to_server(producer, server)
    if consumer is not None:
        rpc.add_ConsumerServicer_to_server(consumer, server)
    if admin is not None:
        rpc.add_AdminServicer_to_server(admin, server)
    for add in extra:
        add(server)
    # standard grpc.health.v1.Health (Kubernetes `grpc:` probes); overall status "" is SERVING once started
    probes = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(probes, server)
    # readiness (READY_SERVICE): SERVING once the node is registered with the meta servers (the
    # Registrar sets it), at once without them; "" (liveness) is SERVING while the process runs
    await probes.set(READY_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING if settings.meta.servers
                     else health_pb2.HealthCheckResponse.SERVING)
    port = listen(server, settings.server.host, settings.server.port, security)
    if not security.tls:
        sv = settings.server
        log.warning(open_warning(f"{sv.role} node {sv.node_id} on {sv.host}:{port}"))
    await server.start()
    address = settings.server.advertise or f"{settings.server.host}:{port}"
    server = await add_probe_server(server, settings.server.host, settings.server.health_port, probes)
    server.health = probes  # the Registrar reports readiness through it
    return server, address
