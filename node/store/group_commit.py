"""Group commit: many appends share one fsync.

``await GroupCommitter.append(bodies)`` writes the records to the log at once
(page cache, in arrival order) and returns their offsets only after an fsync
that covers them. The fsync runs in a worker thread; while it runs, new appends pile
up and the next fsync covers all of them (the worker is a thread of the committer's
own, ``SyncThread``: a handoff costs the loop a queue put and one wake-up, far less
than ``run_in_executor``'s machinery, and it is paid once per commit round, hundreds of
times a second under load). ``durable_offset``
is the end of the bytes known to be on disk: the iterator and replication never
go past it.

``run(observe)`` hands each round's timing to ``observe(fsync_s, handback_s)``: how long the
fsync took on the thread, and how long its completion then waited for the event loop (the
loop busy with other work). The node exports both (``hourglass_wal_fsync_seconds``,
``hourglass_wal_fsync_handback_seconds``, docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

from cluster.errors import Closed

from .log import SegmentedLog

log = logging.getLogger("hourglass.store.group_commit")


class SyncThread:
    """One thread that runs blocking calls (fsyncs) for an event loop, in submission order:
    ``sync.submit(fn, done)`` has ``done(result, error)`` run on the loop when ``fn`` returns
    (one loop wake-up, no future in between); ``stop()`` ends the thread after the calls
    already queued."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], done: Callable[[object, BaseException | None], None]) -> None:
        self._q.put((fn, done, asyncio.get_running_loop()))

    def _serve(self) -> None:
        while (item := self._q.get()) is not None:
            fn, done, loop = item
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to the waiter, raised there
                result, error = None, e
            try:
                loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    def stop(self) -> None:
        self._q.put(None)


class GroupCommitter:
    """Commit rounds driven by callbacks (issue 28): a write that finds no fsync in flight
    hands one to the thread at once, and the thread's completion, run on the loop, marks the
    round durable, answers its writers and starts the next round for the writes that came
    meanwhile. A write is answered two loop wake-ups after its fsync returns (the completion,
    then its caller's task); a committer task between them (woken by an event, waiting on the
    thread's future through a shield) cost three more, each a wait behind whatever else the
    loop was running. ``run()`` owns the thread and ends with the committer: on a fsync error
    (raised, after failing every waiting write) or cancelled (a role switch: it waits for the
    fsync in flight, then fails every waiting write with the stop error)."""

    def __init__(self, seglog: SegmentedLog) -> None:
        self.log = seglog
        self.durable_offset = seglog.end_offset
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._closed = False
        self._task: asyncio.Task | None = None
        self._stop_error: BaseException | None = None  # what a cancelled committer answers (``fail_waiting``)
        self._sync: SyncThread | None = None  # while run() runs
        self._round: asyncio.Future | None = None  # the round in flight: resolved when its fsync returned
        self._ended: asyncio.Future | None = None  # run()'s end: closed and idle, or the fsync error
        self._cancelled = False
        self._failed: BaseException | None = None  # a failed fsync: no later one may acknowledge anything
        self.fsyncs = 0
        self._observe: Callable[[float, float], None] | None = None  # run()'s: each round's timing

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
        self._kick()
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
        self._kick()
        return fut

    async def append(self, bodies: list[bytes]) -> list[int]:
        offsets, fut = self.append_nowait(bodies)
        await fut
        return offsets

    def _kick(self) -> None:
        """Start a round for the writes waiting (and, once closed, for bytes appended without
        a waiter), unless one is in flight (its completion starts the next) or the committer
        does not run. After a failed fsync, writes fail with its error: a later fsync may
        report success for pages the kernel already dropped."""
        if self._failed is not None:
            self._settle_all([], self._failed)
            return
        if self._cancelled:  # a role switch: run() answers what waits once the fsync in flight returned
            if self._sync is None:  # it has ended: nothing else will answer
                self._settle_all([], self._stop_answer())
            return
        if self._round is not None or self._sync is None:
            return
        if not self._waiters and not (self._closed and self.log.end_offset > self.durable_offset):
            return
        target = self.log.end_offset
        waiters, self._waiters = self._waiters, []
        self._round = asyncio.get_running_loop().create_future()
        self._sync.submit(self._timed_flush, functools.partial(self._round_done, target, waiters))

    def _timed_flush(self) -> tuple[float, float]:
        """On the thread: the fsync, and when it began and returned (``perf_counter``)."""
        began = time.perf_counter()
        self.log.flush()
        return began, time.perf_counter()

    def _round_done(self, target: int, waiters: list[tuple[int, asyncio.Future]], timing: tuple[float, float] | None,
                    error: BaseException | None) -> None:
        """On the loop, when a round's fsync returned."""
        handed_back = time.perf_counter()
        done, self._round = self._round, None
        done.set_result(None)
        if self._cancelled:  # a role switch came while the fsync ran: run() answers them (stop error)
            self._waiters[:0] = waiters
            return
        if error is not None:  # nothing in this round is acknowledged, nor anything queued behind it
            log.error("fsync failed path=%s error=%r", self.log.directory, error)
            self._failed = error
            self._settle_all(waiters, error)
            if self._ended is not None and not self._ended.done():
                self._ended.set_exception(error)
            return
        self.fsyncs += 1
        self.durable_offset = max(self.durable_offset, target)
        for _, fut in waiters:
            if not fut.done():
                fut.set_result(None)
        self._kick()
        self._end_if_idle()
        if timing is not None and self._observe is not None:  # last: the round is answered whatever it does
            began, returned = timing
            try:
                self._observe(returned - began, handed_back - returned)
            except Exception:  # noqa: BLE001 - a metrics fault must not stop commit rounds
                log.exception("group-commit timing off from now on path=%s", self.log.directory)
                self._observe = None  # said once, not once per round

    def _end_if_idle(self) -> None:
        if self._closed and self._round is None and not self._waiters and self._ended is not None \
                and self.durable_offset >= self.log.end_offset and not self._ended.done():
            self._ended.set_result(None)

    async def run(self, observe: Callable[[float, float], None] | None = None) -> None:
        """Serve commit rounds until closed and idle (or cancelled: module docstring);
        ``observe(fsync_s, handback_s)`` gets each round's timing."""
        loop = asyncio.get_running_loop()
        self._observe = observe
        sync = SyncThread("group-commit")
        self._sync, self._ended, self._cancelled = sync, loop.create_future(), False
        try:
            self._kick()
            self._end_if_idle()
            await self._ended
        except asyncio.CancelledError:
            # a role switch cancelled the committer: no fsync will come for the writes still
            # waiting, so each is answered now (retryable; a retry is de-duplicated by id)
            # instead of hanging until its caller's deadline (issue 29). The fsync in flight
            # is waited for first: the thread holds the log's descriptor, and the store is
            # closed or cut after this
            self._cancelled = True
            if self._round is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait([self._round])  # bounded by the work itself (one fsync)
            self._settle_all([], self._stop_answer())
            raise
        finally:
            self._sync = None
            sync.stop()

    def _stop_answer(self) -> BaseException:
        return self._stop_error or Closed("the log's committer stopped (a role change): "
                                          "the write's outcome is not known; retry it")

    def fail_waiting(self, err: BaseException) -> None:
        """Fail every write queued for the next fsync with ``err`` (its role ended: no fsync
        of this committer will answer them). The round in flight, if any, is answered by
        ``run`` when its task is cancelled, with ``err`` too."""
        self._stop_error = err
        self._settle_all([], err)

    def _settle_all(self, waiters: list[tuple[int, asyncio.Future]], err: BaseException) -> None:
        pending, self._waiters = [*waiters, *self._waiters], []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(err)

    async def close(self) -> None:
        """Fsync what was appended, then end ``run()`` (bounded: 10 s, then it is cancelled)."""
        self._closed = True
        self._kick()
        self._end_if_idle()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.CancelledError, TimeoutError):
                self._task.cancel()
