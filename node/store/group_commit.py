"""Group commit: many appends share one fsync.

``await GroupCommitter.append(bodies)`` writes the records to the log at once
(page cache, in arrival order) and returns their offsets only after an fsync
that covers them. One flusher task runs fsync in a worker thread; while it runs,
new appends pile up and the next fsync covers all of them (the worker is a thread of
the committer's own, ``SyncThread``: a handoff costs the loop a future and a queue put,
about a third of ``run_in_executor``'s machinery, and it is paid once per commit round,
hundreds of times a second under load). ``durable_offset``
is the end of the bytes known to be on disk: the iterator and replication never
go past it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from cluster.errors import Closed
from node.aio import finish_then_cancel

from .log import SegmentedLog

log = logging.getLogger("hourglass.store.group_commit")


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class SyncThread:
    """One thread that runs blocking calls (fsyncs) for an event loop, in submission order.
    ``await sync.call(fn)``; ``stop()`` ends the thread after the calls already queued."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((fn, fut, loop))
        return fut

    def _serve(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut, loop = item
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to the waiter, raised there
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    def stop(self) -> None:
        self._q.put(None)


class GroupCommitter:
    def __init__(self, seglog: SegmentedLog) -> None:
        self.log = seglog
        self.durable_offset = seglog.end_offset
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._dirty = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None
        self._stop_error: BaseException | None = None  # what a cancelled committer answers (``fail_waiting``)
        self.fsyncs = 0

    def start(self) -> asyncio.Task:
        """Run the flusher as a free task (benchmarks); services use ``run()`` in their TaskGroup."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="group-commit")
        return self._task

    def append_nowait(self, bodies: list[bytes]) -> tuple[list[int], asyncio.Future]:
        """Write now; return offsets and a future resolved when they are durable."""
        if self._closed:
            raise Closed("log is closed")
        offsets = self.log.append(bodies)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((self.log.end_offset, fut))
        self._dirty.set()
        return offsets, fut

    def sync_to(self, offset: int) -> asyncio.Future:
        """A future resolved once an fsync covers every byte before ``offset``
        (bytes the caller already wrote with ``log.append``)."""
        fut = asyncio.get_running_loop().create_future()
        if offset <= self.durable_offset:
            fut.set_result(None)
            return fut
        if self._closed:
            raise Closed("log is closed")
        self._waiters.append((offset, fut))
        self._dirty.set()
        return fut

    async def append(self, bodies: list[bytes]) -> list[int]:
        offsets, fut = self.append_nowait(bodies)
        await fut
        return offsets

    async def run(self) -> None:
        sync = SyncThread("group-commit")
        try:
            await self._run(sync)
        finally:
            sync.stop()

    async def _run(self, sync: SyncThread) -> None:
        waiters: list[tuple[int, asyncio.Future]] = []
        try:
            await self._commit_rounds(sync, waiters)
        except asyncio.CancelledError:
            # a role switch cancelled the committer: no fsync will come for the writes still
            # waiting, so each is answered now (retryable; a retry is de-duplicated by id)
            # instead of hanging until its caller's deadline (issue 29)
            self._settle_all(waiters, self._stop_error or Closed("the log's committer stopped (a role change): "
                                                                 "the write's outcome is not known; retry it"))
            raise
        except Exception as e:  # an fsync failed: the writes queued behind it are not durable either
            self._settle_all(waiters, e)
            raise

    def fail_waiting(self, err: BaseException) -> None:
        """Fail every write queued for the next fsync with ``err`` (its role ended: no fsync
        of this committer will answer them). The round in flight, if any, is answered by
        ``_run`` when its task is cancelled, with ``err`` too."""
        self._stop_error = err
        self._settle_all([], err)

    def _settle_all(self, waiters: list[tuple[int, asyncio.Future]], err: BaseException) -> None:
        pending, self._waiters = [*waiters, *self._waiters], []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(err)

    async def _commit_rounds(self, sync: SyncThread, waiters: list[tuple[int, asyncio.Future]]) -> None:
        """The commit loop; ``waiters`` holds the round in flight (for ``_run`` to settle if
        the task is cancelled)."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            target = self.log.end_offset
            waiters[:], self._waiters = self._waiters, []
            try:
                # a cancelled committer (a role switch) waits for the fsync in flight before
                # the store is closed or cut: the thread holds the log's descriptor
                await finish_then_cancel(sync.call(self.log.flush))
            except Exception as e:  # fsync failed: nothing in this group is acknowledged (_run answers them)
                log.error("fsync failed path=%s error=%r", self.log.directory, e)
                raise
            self.fsyncs += 1
            self.durable_offset = max(self.durable_offset, target)
            for _, fut in waiters:
                if not fut.done():
                    fut.set_result(None)
            if self._closed and not self._waiters:
                return

    async def close(self) -> None:
        self._closed = True
        self._dirty.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.CancelledError, TimeoutError):
                self._task.cancel()
