"""A node's role: what serves one term of a node, as one object.

A ``Role`` owns the store of its term, that store's ``GroupCommitter`` and, once started,
one task of the node's root TaskGroup that runs a child TaskGroup with the role's loops
(the committer among them). A node holds exactly one role at a time (``node.role``);
``node.store`` and ``node.committer`` are the current role's. A plain node holds one role
for its whole life (``SINGLE``); a replicated node (node/replication/roles.py) holds a
master's or a slave's and replaces it on every role switch.

Invariants:

* a handler captures the role once (``role = node.role``) and uses ``role.store`` and
  ``role.committer`` for its whole call; after each await it checks the role still serves
  (``node.role is role and not role.ended``) before it touches the store again, and
  answers ``NotLeader`` (retryable: ids and acks are idempotent) otherwise;
* ``end(err)`` is final: the role's tasks are cancelled and awaited (a child TaskGroup:
  nothing outlives it), and every write still waiting on its committer is failed with
  ``err``; an ended role is never started again;
* a role's tasks always live in the node's root TaskGroup (``start`` takes it): a role
  task that fails stops the node with its error instead of leaving a master that does
  nothing. There is no fallback to a free task.

Lifecycle of a switch (``ReplicaRoles._switch``)::

    old.end(NotLeader)              # the old term's loops stop; its waiters answered
    store = await off_loop(open)    # promote / close+open on a worker thread
    node.role = Role(mode, store, GroupCommitter(store.messages))
    node.role.start(root_tg, tasks) # the new term's loops
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from cluster.errors import NotLeader
from node.store.group_commit import GroupCommitter

T = TypeVar("T")

SINGLE = "single"  # the one role of a node without replication


class Role:
    def __init__(self, mode: str, store: Any, committer: GroupCommitter) -> None:
        self.mode = mode
        self.store = store
        self.committer = committer
        self.ended = False
        self.started = False
        self._task: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"Role({self.mode}{', ended' if self.ended else ''})"

    def check(self) -> None:
        """NotLeader once the role ended (a switch is under way or done)."""
        if self.ended:
            raise NotLeader()

    def start(self, tg: asyncio.TaskGroup, tasks: Callable[[asyncio.TaskGroup], None]) -> None:
        """Run ``tasks(child_tg)`` (it creates the role's loops in the child TaskGroup) as a
        task of the node's root TaskGroup ``tg``. Also restarts the loops of a role whose
        tasks were stopped (``stop_tasks``: a handover that did not complete)."""
        if self.ended:
            raise AssertionError(f"{self!r}: an ended role is never started again")
        if tg is None:
            raise AssertionError("role tasks live in the node's root TaskGroup: start the node with run()")
        if self._task is not None and not self._task.done():
            raise AssertionError(f"{self!r}: its tasks run already")
        self.started = True
        self._task = tg.create_task(self._run(tasks), name=f"role-{self.mode}")

    async def _run(self, tasks: Callable[[asyncio.TaskGroup], None]) -> None:
        async with asyncio.TaskGroup() as tg:
            tasks(tg)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def cancel_tasks(self) -> None:
        """Ask the role's loops to stop (the node stops; its root TaskGroup awaits them)."""
        if self._task is not None:
            self._task.cancel()

    async def stop_tasks(self) -> None:
        """Cancel the role's loops and wait until they are gone (the role itself goes on)."""
        t = self._task
        if t is None or t.done():  # a failed one: the root TaskGroup holds its error
            return
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # this task is being cancelled itself (the node stops): never swallow that
        except Exception:  # noqa: BLE001 - its error reached the root TaskGroup, which stops the node
            pass

    async def end(self, err: Exception) -> None:
        """End the role for good: handlers that hold it answer ``err`` from their next check,
        its loops are cancelled and awaited, and every write still waiting on its committer
        (queued, or in the fsync round a cancelled committer answers itself) fails."""
        self.ended = True
        self.committer.fail_waiting(err)  # queued writes: err (the round in flight: the committer's own)
        await self.stop_tasks()
        self.committer.fail_waiting(err)  # anything queued while the loops stopped


async def off_loop(fn: Callable[[], T], abandon: Callable[[T], None]) -> T:
    """``fn()`` on a worker thread (opening or promoting a store: seconds of file work the
    event loop must not wait for). If the caller is cancelled meanwhile, the thread is waited
    for (it cannot be stopped, and holds the store's files) and what it made is handed to
    ``abandon`` (closed) before the cancellation goes on."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        if not fut.cancelled() and fut.exception() is None:
            abandon(fut.result())
        raise
