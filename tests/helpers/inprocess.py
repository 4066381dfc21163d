"""A node object run in the test's own event loop on a real port (``node.run``), with a channel to it."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc

START_TIMEOUT_S = 10
STOP_TIMEOUT_S = 10


@asynccontextmanager
async def serving(node):
    """Start ``node`` (a ``DelayNode`` or ``RealtimeNode``); yield a channel to it; stop it."""
    stop = asyncio.Event()
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(node.run(stop, on_ready=ready.set_result))
    address = await asyncio.wait_for(ready, START_TIMEOUT_S)
    channel = grpc.aio.insecure_channel(address)
    try:
        yield channel
    finally:
        await channel.close()
        stop.set()
        await asyncio.wait_for(task, STOP_TIMEOUT_S)
