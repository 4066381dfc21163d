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
