"""Process root of a node: settings -> the role's node object -> gRPC server -> run until a signal."""

from __future__ import annotations

import asyncio
import signal

from cluster.process import dump_tasks, write_ready_file
from node.config import NodeSettings
from node.delay.service import DelayNode
from node.realtime.service import RealtimeNode
from node.replication.delay import ReplicatedDelayNode
from node.replication.realtime import ReplicatedRealtimeNode


def build(settings: NodeSettings):
    if settings.role == "delay":
        return ReplicatedDelayNode(settings) if settings.replicated else DelayNode(settings)
    return ReplicatedRealtimeNode(settings) if settings.replicated else RealtimeNode(settings)


async def serve(settings: NodeSettings) -> None:
    """Run one node until SIGINT/SIGTERM; then stop cleanly (checkpoint, close files)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # operators: `kill -USR1 <pid>` logs every task's stack
    node = build(settings)

    await node.run(stop, on_ready=lambda address: write_ready_file(settings.ready_file, address))
