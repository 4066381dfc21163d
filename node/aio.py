"""Small asyncio helpers the node loops share.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation when the awaited thing
finishes at the same moment (CPython gh-86296): a loop that waits on an event with
``wait_for`` may then never stop, and a TaskGroup waiting for it hangs (seen in the
chaos runs: a slave elected master never finished stopping its follower tasks).
``asyncio.timeout`` does not have that problem; these helpers use it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(ev: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``ev`` is set or ``timeout_s`` passed; True if it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await ev.wait()
        return True
    except TimeoutError:
        return False


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` with a deadline (TimeoutError), cancellation-safe."""
    async with asyncio.timeout(timeout_s):
        return await aw


GC_GEN0_THRESHOLD = 20_000  # allocations between gen-0 collections (CPython's default: 700)


def tune_gc() -> None:
    """The cyclic GC ran ~10% of this process's CPU: every call allocates coroutines,
    futures and protobuf objects, and each collection walked the objects of the loaded
    modules again. ``freeze`` moves what exists once serving (modules, the store's
    tables) out of collection; a larger gen-0 threshold collects less often. Reference
    cycles are rare on the hot path, so memory does not grow for it."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
