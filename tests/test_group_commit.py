"""GroupCommitter (node/store/group_commit.py): a cancelled committer (a role switch) or a
failed fsync answers every write still waiting, instead of leaving it to its caller's deadline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.errors import Closed
from node.store.group_commit import GroupCommitter
from node.store.log import SegmentedLog
from tests.helpers.fsync import held_fsync

pytestmark = pytest.mark.unit
GUARD_S = 10  # bounds a wait that must end long before it (a hang fails instead)


async def started_with_one_write_in_fsync(gc: GroupCommitter, in_fsync: threading.Event):
    """Start the committer, append one write and wait until its fsync runs: (task, its future)."""
    task = gc.start()
    _, first = gc.append_nowait([b"a"])
    await asyncio.wait_for(asyncio.to_thread(in_fsync.wait, GUARD_S), GUARD_S)
    return task, first


async def test_cancelling_the_committer_answers_every_waiting_write(tmp_path):
    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    release, in_fsync = held_fsync(log)  # the fsync in flight when the switch comes
    task, first = await started_with_one_write_in_fsync(gc, in_fsync)
    _, second = gc.append_nowait([b"b"])  # queued behind the fsync in flight
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, GUARD_S)
    for fut in (first, second):
        with pytest.raises(Closed, match="role change"):
            await asyncio.wait_for(fut, GUARD_S)
    del log.flush
    log.close()


async def test_a_failed_fsync_answers_the_writes_queued_behind_it(tmp_path):
    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    release, in_fsync = held_fsync(log, OSError(5, "I/O error"))
    task, first = await started_with_one_write_in_fsync(gc, in_fsync)
    _, second = gc.append_nowait([b"b"])
    release.set()
    with pytest.raises(OSError):
        await asyncio.wait_for(task, GUARD_S)
    for fut in (first, second):
        with pytest.raises(OSError, match="I/O error"):
            await asyncio.wait_for(fut, GUARD_S)
    del log.flush  # the real one again, for close
    log.close()


async def test_writes_that_come_during_an_fsync_share_the_next_one(tmp_path):
    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    release, in_fsync = held_fsync(log)
    task, first = await started_with_one_write_in_fsync(gc, in_fsync)
    later = [gc.append_nowait([bytes([65 + i])])[1] for i in range(5)]  # queued behind the fsync in flight
    release.set()
    await asyncio.wait_for(asyncio.gather(first, *later), GUARD_S)
    assert gc.fsyncs == 2 and gc.durable_offset == log.end_offset
    await gc.close()
    assert task.done() and not task.cancelled()
    del log.flush
    log.close()


async def test_after_a_failed_fsync_no_later_write_is_acknowledged(tmp_path):
    """fsync failed once: the kernel may have dropped the dirty pages, and a later fsync can
    report success for them. Every write after it fails with the first error."""
    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    calls = []

    def flush_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "I/O error")
    log.flush = flush_failing_once
    task = gc.start()
    _, first = gc.append_nowait([b"a"])
    with pytest.raises(OSError):
        await asyncio.wait_for(task, GUARD_S)
    _, later = gc.append_nowait([b"b"])
    for fut in (first, later):
        with pytest.raises(OSError, match="I/O error"):
            await asyncio.wait_for(fut, GUARD_S)
    assert calls == [1] and gc.fsyncs == 0
    del log.flush
    log.close()


async def test_each_round_reports_its_fsync_and_the_wait_for_the_loop(tmp_path):
    """``run(observe)`` gets one (fsync_s, handback_s) per round; a loop held after the fsync
    returned shows in the sum (a lower bound, whatever the machine's load)."""
    import time

    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    seen: list[tuple[float, float]] = []
    task = asyncio.get_running_loop().create_task(gc.run(lambda f, h: seen.append((f, h))))
    await asyncio.sleep(0)
    release, in_fsync = held_fsync(log)
    _, first = gc.append_nowait([b"a"])
    await asyncio.wait_for(asyncio.to_thread(in_fsync.wait, GUARD_S), GUARD_S)
    _, second = gc.append_nowait([b"b"])  # the next round
    release.set()
    time.sleep(0.05)  # the loop held: the first round's completion waits for it
    await asyncio.wait_for(asyncio.gather(first, second), GUARD_S)
    assert len(seen) == gc.fsyncs == 2
    assert all(f >= 0 and h >= 0 for f, h in seen) and sum(seen[0]) >= 0.05
    await gc.close()
    await asyncio.wait_for(task, GUARD_S)
    del log.flush
    log.close()


async def test_a_failing_observer_never_stops_the_rounds(tmp_path, caplog):
    log = SegmentedLog.open(tmp_path / "log")
    gc = GroupCommitter(log)
    calls = []

    def broken(f, h):
        calls.append(f)
        raise RuntimeError("metrics broke")
    task = asyncio.get_running_loop().create_task(gc.run(broken))
    for i in range(3):  # three rounds, each answered
        await asyncio.wait_for(gc.append([bytes([65 + i])]), GUARD_S)
    assert gc.fsyncs == 3 and len(calls) == 1 and "timing off" in caplog.text
    await gc.close()
    await asyncio.wait_for(task, GUARD_S)
    log.close()
