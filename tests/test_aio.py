"""node.aio.StallWatch: a loop held longer than the threshold is reported once, with the
stack of the call that held it; a loop that keeps turning is not reported."""

from __future__ import annotations

import asyncio
import logging
import time

from node.aio import StallWatch


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # blocks the event loop thread, as a long synchronous call would


async def test_a_held_loop_is_reported_with_the_holding_call(caplog):
    log = logging.getLogger("test.stall")
    watch = StallWatch(20, log)
    task = asyncio.create_task(watch.run())
    try:
        with caplog.at_level(logging.WARNING, logger="test.stall"):
            for _ in range(10):  # turning normally: nothing to report
                await asyncio.sleep(0.01)
            assert watch.stalls == 0
            _hold_the_loop(0.2)
            await asyncio.sleep(0.05)
        assert watch.stalls == 1  # one report per stall, not one per check
        (rec,) = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
        assert "_hold_the_loop" in rec.getMessage()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_trim_memory_loop_gives_freed_heap_back(monkeypatch):
    """After a burst of heap buffers is freed, RSS stays up until ``malloc_trim`` runs; the
    node's trim loop runs it on a worker thread."""
    import pytest

    from node import aio

    trim = aio._malloc_trim()
    if trim is None:
        pytest.skip("not glibc: no malloc_trim")
    calls = []

    def counting_trim(pad):
        calls.append(pad)
        return trim(pad)

    monkeypatch.setattr(aio, "_malloc_trim", lambda: counting_trim)
    bufs = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB from the heap (below the mmap threshold)
    for b in bufs:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    bufs.reverse()
    del bufs[1:]  # freed, but the arena keeps the pages (one live buffer pins the top of the heap)
    before = _rss_bytes()
    task = asyncio.create_task(aio.trim_memory_loop(interval_s=0.05))
    for _ in range(100):  # bounded: 5 s
        await asyncio.sleep(0.05)
        if calls:
            break
    await asyncio.sleep(0.1)
    task.cancel()
    assert calls and before - _rss_bytes() > 100 * 1024 * 1024
