"""Process root of a meta server: settings -> etcd client -> gRPC server -> run until a signal.

Stateless: every answer is read from etcd, so any number of replicas can run
behind a list of addresses; clients move to the next one when one dies.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.metricsserver import MetricsEndpoint
from cluster.process import write_ready_file
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.security import ServerSecurity, TlsFiles, open_warning
from cluster.transport import CHANNEL_OPTIONS, add_probe_server, listen
from cluster.wire import UndecodableRequests
from metaserver.config import MetaSettings
from metaserver.etcd import EtcdClient
from metaserver.metrics import MetaMetrics
from metaserver.service import MetaService

log = logging.getLogger("hourglass.meta")


async def run(settings: MetaSettings, stop: asyncio.Event, *, on_ready=None) -> None:
    tls = TlsFiles(settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file, check_every_s=0) \
        if settings.etcd_ca_file else None
    etcd = EtcdClient(settings.etcd_endpoints, timeout_s=settings.etcd_timeout_ms / 1000, tls=tls)
    service = MetaService(settings, etcd)
    metrics = MetaMetrics(lambda: service.healthy)
    security = ServerSecurity.from_settings()  # HOURGLASS_TLS_* and HOURGLASS_AUTH_FILE (docs/security.md)
    server = grpc.aio.server(options=[o for o in CHANNEL_OPTIONS if "max_" in o[0]] + [("grpc.so_reuseport", 0)],
                             interceptors=[*security.interceptors(),
                                           UndecodableRequests()])  # unparseable bytes: INVALID_ARGUMENT
    mrpc.add_MetaServicer_to_server(service, server)
    # grpc.health.v1 for Kubernetes probes: "" (liveness) SERVING while the process runs;
    # "hourglass.meta.v1.Meta" (readiness) follows the etcd health check
    probes = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(probes, server)
    port = listen(server, settings.host, settings.port, security)
    if not security.tls:
        log.warning(open_warning(f"meta server on {settings.host}:{port}"))
    await server.start()
    server = await add_probe_server(server, settings.host, settings.health_port, probes)
    address = settings.advertise or f"{settings.host}:{port}"
    metrics.start(MetricsEndpoint(settings.metrics_host, settings.metrics_port, settings.metrics_tls_cert_file,
                                  settings.metrics_tls_key_file, settings.metrics_token_file))
    try:
        async with asyncio.TaskGroup() as tg:
            checks = tg.create_task(service.health_loop(), name="health")
            mirror = tg.create_task(_mirror_health(service, probes, settings.health_check_interval_ms / 1000,
                                                   health_pb2.HealthCheckResponse), name="health-mirror")
            log.info("meta server serving address=%s etcd=%s", address, ",".join(settings.etcd_endpoints))
            if on_ready:
                on_ready(address)
            await stop.wait()
            await server.stop(grace=1.0)
            checks.cancel()
            mirror.cancel()
    finally:
        await server.stop(grace=None)
        metrics.stop()
        await etcd.close()
        log.info("meta server stopped address=%s", address)


async def _mirror_health(service: MetaService, probes, interval_s: float, status) -> None:
    while True:
        await probes.set("hourglass.meta.v1.Meta", status.SERVING if service.healthy else status.NOT_SERVING)
        await asyncio.sleep(interval_s)


async def serve(settings: MetaSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    await run(settings, stop, on_ready=lambda address: write_ready_file(settings.ready_file, address))
