"""Small asyncio helpers the node loops share.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation when the awaited thing
finishes at the same moment (CPython gh-86296): a loop that waits on an event with
``wait_for`` may then never stop, and a TaskGroup waiting for it hangs (seen in the
chaos runs: a slave elected master never finished stopping its follower tasks).
``asyncio.timeout`` does not have that problem; these helpers use it.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import threading
import time
import traceback
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


async def finish_then_cancel(aw: Awaitable[T]) -> T:
    """``await aw``, but when the caller is cancelled meanwhile, wait for ``aw`` to finish
    before the cancellation goes on. For work handed to a thread (an fsync): the thread
    cannot be stopped, so a role switch that cancels the caller must not go on to close,
    truncate or reopen the file while that thread still uses its descriptor."""
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        try:
            await asyncio.wait([fut])  # bounded by the work itself (one fsync)
        except BaseException:  # noqa: BLE001 - the cancellation below is what the caller gets
            pass
        raise


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


MALLOC_TRIM_INTERVAL_S = 2.0  # how often a node hands freed heap back to the OS (malloc_trim)


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


async def trim_memory_loop(interval_s: float = MALLOC_TRIM_INTERVAL_S) -> None:
    """Every ``interval_s``, give freed heap back to the OS (on a worker thread). Ingest builds
    and frees large buffers (a 4,000-message request, its frames, numpy temporaries); glibc
    keeps what was freed in its arenas, so after a burst a node's RSS stayed tens of bytes
    per pending message higher than what it holds (``docs/benchmarks.md``, phase 2)."""
    trim = _malloc_trim()
    if trim is None:
        return
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        await loop.run_in_executor(None, trim, 0)


class StallWatch:
    """Reports event-loop stalls (setting ``loop_stall_report_ms``; 0 = off): a task on the
    loop marks a heartbeat every quarter of the threshold, and a thread that finds the
    heartbeat older than the threshold logs the loop thread's stack once per stall (WARNING
    ``event loop stalled``): the call that held the loop, named while it holds it. Every
    message due during a stall is late by it, so this is where a p99 comes from."""

    def __init__(self, threshold_ms: int, log: logging.Logger) -> None:
        self.threshold_s = threshold_ms / 1000
        self.log = log
        self.beat = time.monotonic()
        self.stalls = 0
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()

    async def run(self) -> None:
        interval = self.threshold_s / 4
        thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        thread.start()
        try:
            while True:
                self.beat = time.monotonic()
                await asyncio.sleep(interval)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        reported_beat = None
        while not self._stop.wait(self.threshold_s / 4):
            beat = self.beat
            late = time.monotonic() - beat - self.threshold_s / 4
            if late < self.threshold_s or beat == reported_beat:
                continue
            reported_beat = beat
            self.stalls += 1
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(no stack)"
            self.log.warning("event loop stalled for more than %.0f ms; the loop thread is at:\n%s",
                             late * 1000, stack)
