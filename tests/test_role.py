"""``Role`` (node/role.py): what one term of a node owns, and how it ends. A switch ends the
old role for good: its loops are gone, every write waiting on its committer fails with a
retryable error, and nothing of it runs outside the node's root TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from cluster.errors import NotLeader, Unavailable
from node.role import Role, off_loop
from node.store.group_commit import GroupCommitter
from node.store.log import SegmentedLog

pytestmark = pytest.mark.unit
GUARD_S = 10  # bounds a wait that must end long before it (a hang fails instead)


def role_on(tmp_path, mode="master") -> Role:
    log = SegmentedLog.open(tmp_path / "log")
    return Role(mode, log, GroupCommitter(log))  # the log stands in for a store (``store.messages``)


async def test_ending_a_role_stops_its_loops_and_fails_its_waiting_writes(tmp_path):
    role = role_on(tmp_path)
    ran = asyncio.Event()

    async def loop_forever():
        ran.set()
        await asyncio.Event().wait()

    async with asyncio.TaskGroup() as root:
        role.start(root, lambda tg: tg.create_task(loop_forever()))  # no committer loop: nothing fsyncs
        await asyncio.wait_for(ran.wait(), GUARD_S)
        role.store.append([b"x"])
        waiting = role.committer.sync_to(role.store.end_offset)
        await role.end(NotLeader("n2:1"))
        assert not role.running
        with pytest.raises(NotLeader):
            await asyncio.wait_for(waiting, GUARD_S)
    with pytest.raises(NotLeader):
        role.check()  # a handler that still holds it answers NotLeader (retryable)
    assert isinstance(NotLeader(), Unavailable)


async def test_the_fsync_round_in_flight_is_answered_when_a_role_ends(tmp_path):
    role = role_on(tmp_path)
    release, in_fsync = threading.Event(), threading.Event()
    real_flush = role.store.flush

    def slow_flush():
        in_fsync.set()
        release.wait(GUARD_S)
        real_flush()
    role.store.flush = slow_flush
    async with asyncio.TaskGroup() as root:
        role.start(root, lambda tg: tg.create_task(role.committer.run()))
        role.store.append([b"x"])
        in_round = role.committer.sync_to(role.store.end_offset)
        await asyncio.get_running_loop().run_in_executor(None, in_fsync.wait, GUARD_S)
        role.store.append([b"y"])
        queued = role.committer.sync_to(role.store.end_offset)
        ending = asyncio.create_task(role.end(NotLeader()))
        await asyncio.sleep(0)
        assert not ending.done()  # the fsync in flight is waited for before the role is gone
        release.set()
        await asyncio.wait_for(ending, GUARD_S)
    results = await asyncio.gather(in_round, queued, return_exceptions=True)
    assert isinstance(results[1], NotLeader)
    assert results[0] is None or isinstance(results[0], NotLeader)  # durable, or answered retryable


async def test_role_tasks_need_the_root_task_group_and_an_ended_role_never_starts_again(tmp_path):
    role = role_on(tmp_path)
    with pytest.raises(AssertionError):
        role.start(None, lambda tg: None)
    await role.end(NotLeader())
    async with asyncio.TaskGroup() as root:
        with pytest.raises(AssertionError):
            role.start(root, lambda tg: None)


async def test_a_failing_role_task_stops_the_root_task_group(tmp_path):
    role = role_on(tmp_path)

    async def broken():
        raise RuntimeError("a master that does nothing")

    with pytest.raises(ExceptionGroup) as e:
        async with asyncio.TaskGroup() as root:
            role.start(root, lambda tg: tg.create_task(broken()))
            await asyncio.Event().wait()
    assert "does nothing" in repr(e.value.exceptions[0])


async def test_stopped_tasks_start_again_under_the_same_role(tmp_path):
    """A handover that did not complete restarts the master's loops."""
    role = role_on(tmp_path)
    starts = []

    async with asyncio.TaskGroup() as root:
        role.start(root, lambda tg: starts.append(tg.create_task(asyncio.Event().wait())))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await role.stop_tasks()
        role.start(root, lambda tg: starts.append(tg.create_task(asyncio.Event().wait())))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert role.running and len(starts) == 2
        await role.end(NotLeader())
    assert not role.running


async def test_work_off_the_loop_that_outlives_its_caller_is_handed_back():
    """A switch cancelled while its thread opens a store (the node stops): the thread is
    waited for and what it made goes to ``abandon`` (closed), never leaked half-owned."""
    started, release = threading.Event(), threading.Event()
    abandoned = []

    def open_store():
        started.set()
        release.wait(GUARD_S)
        return "store"

    task = asyncio.create_task(off_loop(open_store, abandoned.append))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, GUARD_S)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, GUARD_S)
    assert abandoned == ["store"]
    assert await off_loop(lambda: 7, abandoned.append) == 7


class HeldSwitch:
    """A replicated node of ``mode`` whose switch to master waits on its worker thread
    (``entered`` is set once the thread is in) until ``finish_promotion``; ``slave`` is its
    role before (``held_switch``)."""

    def __init__(self, node) -> None:
        self.node = node
        self.slave = None
        self.entered, self.release = threading.Event(), threading.Event()
        real = node._role_store

        def held(mode, store, now_ms, store_epoch):
            if mode == "master":
                self.entered.set()
                self.release.wait(GUARD_S)
            return real(mode, store, now_ms, store_epoch)
        node._role_store = held

    async def start_promotion(self) -> asyncio.Task:
        """The switch to master, begun: returns once its worker thread holds (the loop turns)."""
        promoting = asyncio.create_task(self.node._switch("master"))
        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, GUARD_S)
        return promoting

    async def finish_promotion(self, promoting: asyncio.Task):
        """Let the held switch go on; the master role once it is in."""
        self.release.set()
        await asyncio.wait_for(promoting, GUARD_S)
        return self.node.role


@contextlib.asynccontextmanager
async def held_switch(tmp_path, mode: str):
    """A replicated node built for ``mode`` (no election, no metaserver), switched to slave in
    a root TaskGroup, as a ``HeldSwitch``; on the way out its store, channels and clients are
    closed."""
    from node.config import NodeSettings
    from node.replication.delay import ReplicatedDelayNode
    from node.replication.realtime import ReplicatedRealtimeNode

    node_id, cls = {"delay": ("d1", ReplicatedDelayNode), "realtime": ("r1", ReplicatedRealtimeNode)}[mode]
    node = cls(NodeSettings(role=mode, node_id=node_id, data_dir=tmp_path / node_id, port=0,
                            meta_servers=["127.0.0.1:1"]))
    held = HeldSwitch(node)
    try:
        async with asyncio.TaskGroup() as root:
            node._tg = root
            await node._switch("slave")
            held.slave = node.role
            yield held
    finally:
        node._tg = None
        node.store.close()
        await node.channels.close()
        await node._close_clients()


async def test_a_promotion_runs_off_the_loop_and_serves_nobody_until_the_master_role_is_in(tmp_path):
    """A replicated delay node promoted by hand (no election): while its store is promoted on
    a worker thread the event loop goes on, no client is served, the registration does not
    read the store, and the old role is over; then the master's role owns the same store (in
    place) with a new committer, and its loops run in the root TaskGroup."""
    async with held_switch(tmp_path, "delay") as held:
        node, slave = held.node, held.slave
        assert slave.mode == "slave" and slave.running and node.mode == "slave"
        described = node.registration_info()
        promoting = await held.start_promotion()
        assert node.mode == "switching" and slave.ended and not slave.running
        assert not node._may_serve()
        with pytest.raises(NotLeader):
            slave.check()
        assert node.registration_info() == dict(described, master=False, epoch=node.member.epoch)
        master = await held.finish_promotion(promoting)
        assert master is not slave and master.mode == "master" and master.running
        assert master.store is slave.store and master.committer is not slave.committer  # promoted in place
        assert not master.store.follower and node.mode == "master"
        await node._switch("master")  # already: nothing happens
        assert node.role is master
        await master.end(NotLeader())


async def test_a_realtime_switch_opens_a_new_store_off_the_loop_and_ends_the_pulls_of_the_old_role(tmp_path):
    """The real-time store is closed and opened again on a worker thread; a long poll that
    began under the old role stops (it never reads the store the thread closes)."""
    async with held_switch(tmp_path, "realtime") as held:
        node, slave = held.node, held.slave
        waiting = asyncio.create_task(node._wait_new_data(["orders"], GUARD_S))  # a pull's long poll
        await asyncio.sleep(0)
        promoting = await held.start_promotion()
        assert node.mode == "switching" and slave.ended and not node._may_serve()
        node.registration_info()  # answers from what it knew: never reads the store being closed
        master = await held.finish_promotion(promoting)
        await asyncio.wait_for(waiting, GUARD_S)  # woken by the new role: the pull looks again and stops
        assert master.mode == "master" and master.running and master.store is not slave.store
        await master.end(NotLeader())


def test_role_gauges_are_read_when_scraped():
    """A replicated node's role gauges follow its state with no loop setting them
    (``ReplicaRoles._bind_metrics``): a scrape reads the role and lag of that moment."""
    from types import SimpleNamespace

    from node.metrics import NodeMetrics
    from node.replication.roles import ReplicaRoles

    metrics = NodeMetrics("delay", "n1")
    node = SimpleNamespace(metrics=metrics, mode="slave", lag_bytes=4096, member=SimpleNamespace(epoch=3))
    node.is_master = lambda: node.mode == "master"
    node.lag_ms = lambda: 0 if node.mode == "master" else 1500
    ReplicaRoles._bind_metrics(node)

    def read() -> dict[str, float]:
        return {s.name: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name in ("hourglass_is_master", "hourglass_replication_lag_bytes",
                              "hourglass_replication_lag_seconds", "hourglass_election_epoch")}

    assert read() == {"hourglass_is_master": 0, "hourglass_replication_lag_bytes": 4096,
                      "hourglass_replication_lag_seconds": 1.5, "hourglass_election_epoch": 3}
    node.mode, node.member.epoch = "master", 4
    assert read() == {"hourglass_is_master": 1, "hourglass_replication_lag_bytes": 0,
                      "hourglass_replication_lag_seconds": 0, "hourglass_election_epoch": 4}
