"""Process root of a node: settings -> the role's node object -> gRPC server -> run until a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc

from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.wire import UndecodableRequests
from node.config import NodeSettings

log = logging.getLogger("hourglass.node")


async def start_grpc(settings: NodeSettings, *, producer=None, consumer=None, admin=None, extra=()) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", settings.request_bytes_max),
        ("grpc.max_receive_message_length", settings.request_bytes_max),
        ("grpc.so_reuseport", 0),
    ], interceptors=[UndecodableRequests()])  # unparseable bytes: INVALID_ARGUMENT, not UNKNOWN
    if producer is not None:
        rpc.add_ProducerServicer_to_server(producer, server)
    if consumer is not None:
        rpc.add_ConsumerServicer_to_server(consumer, server)
    if admin is not None:
        rpc.add_AdminServicer_to_server(admin, server)
    for add in extra:
        add(server)
    # standard grpc.health.v1.Health (Kubernetes `grpc:` probes); overall status "" is SERVING once started
    from grpc_health.v1 import health, health_pb2_grpc
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise OSError(f"cannot bind {settings.host}:{settings.port}")
    await server.start()
    return server, settings.advertise or f"{settings.host}:{port}"


def build(settings: NodeSettings):
    if settings.role == "delay" and settings.replicated:
        from node.replication.delay import ReplicatedDelayNode
        return ReplicatedDelayNode(settings)
    if settings.role == "realtime" and settings.replicated:
        from node.replication.realtime import ReplicatedRealtimeNode
        return ReplicatedRealtimeNode(settings)
    if settings.role == "delay":
        from node.delay.service import DelayNode
        return DelayNode(settings)
    from node.realtime.service import RealtimeNode
    return RealtimeNode(settings)


def write_ready_file(path, address: str) -> None:
    """Atomically write "host:port" once serving (``hourglass dev``/tests wait for it)."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, path)


def dump_tasks() -> None:
    """Log the stack of every asyncio task (a stuck node tells where it waits)."""
    for t in asyncio.all_tasks():
        frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in t.get_stack(limit=30)]
        logging.getLogger("hourglass.tasks").warning("task %s:\n  %s", t.get_name(), "\n  ".join(frames))


async def serve(settings: NodeSettings) -> None:
    """Run one node until SIGINT/SIGTERM; then stop cleanly (checkpoint, close files)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # operators: `kill -USR1 <pid>` logs every task's stack
    node = build(settings)

    await node.run(stop, on_ready=lambda address: write_ready_file(settings.ready_file, address))


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
