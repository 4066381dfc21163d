"""node.aio.StallWatch: a loop held longer than the threshold is reported once, naming the
call that held it, and measured in the stall histogram; the malloc trim loop."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from node.aio import StallWatch


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # blocks the event loop thread, as a long synchronous call would


async def test_a_held_loop_is_reported_with_the_holding_call(caplog):
    """One line for the stall, naming the call that held the loop, and the stall in the
    histogram. (Other stalls may be reported too on a busy machine: the process itself may
    wait for a CPU that long; they name something else.)"""
    from prometheus_client import CollectorRegistry, Histogram

    log = logging.getLogger("test.stall")
    hist = Histogram("stall_seconds", "test", buckets=(0.1, 1), registry=CollectorRegistry())
    watch = StallWatch(50, log, histogram=hist)
    task = asyncio.create_task(watch.run())
    try:
        with caplog.at_level(logging.WARNING, logger="test.stall"):
            for _ in range(10):  # turning
                await asyncio.sleep(0.01)
            _hold_the_loop(0.3)
            await asyncio.sleep(0.05)
        held = [r.getMessage() for r in caplog.records if "_hold_the_loop" in r.getMessage()]
        assert len(held) == 1, held  # one report per stall, not one per check
        assert held[0].startswith("event loop stalled stall_ms=")
        over = {s.labels["le"]: s.value for m in hist.collect() for s in m.samples if s.name.endswith("_bucket")}
        assert over["+Inf"] - over["0.1"] >= 1  # the held loop is in the histogram, above 100 ms
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_watch_adds_no_wake_up_to_a_loop_at_rest():
    """The watch measures each turn of the loop from its selector: a loop with nothing to
    do sleeps in ``select`` until its next timer, not every 50 ms for the watch, and the
    selector is its own again once the watch stops."""
    loop = asyncio.get_running_loop()
    watch = StallWatch(200, logging.getLogger("test.stall.rest"))
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0)  # the watch wraps the selector
    selects = []
    inner = loop._selector.select
    loop._selector.select = lambda timeout=None: (selects.append(timeout), inner(timeout))[1]
    try:
        await asyncio.sleep(0.6)  # one timer: a couple of turns, whatever the machine's load
    finally:
        loop._selector.select = inner
    assert len(selects) <= 4, selects  # the 50 ms watch made 12 or more
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "select" not in vars(loop._selector)


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


@pytest.mark.parametrize("first_stops_first", [True, False])
async def test_two_watches_on_one_loop_stop_in_any_order(first_stops_first):
    """Several nodes of one test process share a loop: each watch wraps the selector; a watch
    stopped under another passes through, and the selector is its own once both stopped."""
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(StallWatch(200, logging.getLogger("test.stall.a")).run())
    await asyncio.sleep(0)
    second = asyncio.create_task(StallWatch(200, logging.getLogger("test.stall.b")).run())
    await asyncio.sleep(0.01)
    for task in ((first, second) if first_stops_first else (second, first)):
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)  # the loop still turns through what is left
    assert "select" not in vars(loop._selector)


def test_a_long_collection_is_logged_with_its_generation_and_a_short_one_is_not(caplog):
    """``GcPauses`` (issue 28): a cyclic collection holds the GIL, so the stall watch cannot
    name it; the callback does. Clock driven by hand: the outcome, not a time."""
    from node import aio

    clock = iter([10.0, 10.0005, 20.0, 20.150])
    watch = aio.GcPauses(logging.getLogger("test.gc"), report_ms=20)
    real = aio.time.perf_counter
    aio.time.perf_counter = lambda: next(clock)
    try:
        with caplog.at_level(logging.WARNING, logger="test.gc"):
            watch("start", {"generation": 0})
            watch("stop", {"generation": 0, "collected": 3, "uncollectable": 0})
            watch("start", {"generation": 2})
            watch("stop", {"generation": 2, "collected": 7, "uncollectable": 0})
    finally:
        aio.time.perf_counter = real
    lines = [r.getMessage() for r in caplog.records if r.name == "test.gc"]
    assert len(lines) == 1
    assert lines[0].startswith("gc pause generation=2 ms=150 collected=7 uncollectable=0 collections=")
    assert round(watch.longest_ms) == 150


def test_tune_gc_keeps_one_pause_callback_however_often_it_runs():
    import gc

    from node import aio

    before = gc.get_threshold()
    try:
        aio.tune_gc(logging.getLogger("test.gc"))
        aio.tune_gc(logging.getLogger("test.gc"))
        assert sum(isinstance(cb, aio.GcPauses) for cb in gc.callbacks) == 1
        aio.tune_gc()
        assert not any(isinstance(cb, aio.GcPauses) for cb in gc.callbacks)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
