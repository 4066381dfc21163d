"""Process root of a node: settings -> the role's node object -> gRPC server -> run until a signal."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal

from cluster.process import dump_tasks, write_ready_file
from node.config import NodeSettings
from node.delay.service import DelayNode
from node.realtime.service import RealtimeNode
from node.replication.delay import ReplicatedDelayNode
from node.replication.realtime import ReplicatedRealtimeNode


log = logging.getLogger("hourglass.node")

FDS_RESERVED = 512  # descriptors kept for sockets, segments, journals beside the index files


def raise_fd_limit(settings: NodeSettings) -> NodeSettings:
    """A real-time node keeps up to ``index_files_open_max`` index files open (a send over more
    subjects than that reopens files on the event loop, issue 27): raise the soft
    RLIMIT_NOFILE to what that needs (at most the hard limit), and lower
    ``index_files_open_max`` when the hard limit does not allow it, saying so."""
    if settings.server.role != "realtime":
        return settings
    want = settings.realtime.index_files_open_max + FDS_RESERVED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            soft = ceiling
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, ceiling, e)
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = max(16, soft - FDS_RESERVED)
        log.warning("open-files limit %d (hard %s): index_files_open_max lowered from %d to %d", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, want - FDS_RESERVED, fit)
        return settings.replace(index_files_open_max=fit)
    return settings


def build(settings: NodeSettings):
    if settings.server.role == "delay":
        return ReplicatedDelayNode(settings) if settings.replication.enabled else DelayNode(settings)
    return ReplicatedRealtimeNode(settings) if settings.replication.enabled else RealtimeNode(settings)


async def serve(settings: NodeSettings) -> None:
    """Run one node until SIGINT/SIGTERM; then stop cleanly (checkpoint, close files)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # operators: `kill -USR1 <pid>` logs every task's stack
    node = build(raise_fd_limit(settings))

    await node.run(stop, on_ready=lambda address: write_ready_file(settings.server.ready_file, address))
