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
from collections import Counter
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
MALLOC_TRIM_CHANGE_BYTES = 1 << 20  # ... when the heap in use moved this much since the last trim
MALLOC_TRIM_IDLE_S = 60.0           # ... or this long after the last trim whatever it did


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use():
    """A callable giving the bytes malloc has handed out (glibc's ``mallinfo2``: small
    chunks plus mmap'd ones), or None where there is no ``mallinfo2`` (glibc < 2.33)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        m = fn()
        return m.uordblks + m.hblkhd
    return in_use


async def trim_memory_loop(interval_s: float = MALLOC_TRIM_INTERVAL_S) -> None:
    """Every ``interval_s``, give freed heap back to the OS (on a worker thread). Ingest builds
    and frees large buffers (a 4,000-message request, its frames, numpy temporaries); glibc
    keeps what was freed in its arenas, so after a burst a node's RSS stayed tens of bytes
    per pending message higher than what it holds (``docs/benchmarks.md``, phase 2).

    A trim walks the whole heap and madvises its free pages again even when they were
    given back already, so it runs only when the heap in use moved by
    ``MALLOC_TRIM_CHANGE_BYTES`` since the last one, or ``MALLOC_TRIM_IDLE_S`` after it: a
    node at rest trims once a minute, not every two seconds (issue 28)."""
    trim = _malloc_trim()
    if trim is None:
        return
    in_use = _heap_in_use()
    loop = asyncio.get_running_loop()
    after: int | None = None  # heap in use right after the last trim
    last_at = loop.time()
    while True:
        await asyncio.sleep(interval_s)
        if in_use is not None and after is not None and abs(in_use() - after) < MALLOC_TRIM_CHANGE_BYTES \
                and loop.time() - last_at < MALLOC_TRIM_IDLE_S:
            continue
        await loop.run_in_executor(None, trim, 0)
        after, last_at = (in_use() if in_use is not None else None), loop.time()


STALL_TICK_MS_MAX = 50       # the stall watch wakes at least this often (its histogram's resolution)
STALL_STACK_FRAMES = 6       # frames named in a stall's log line, innermost first
STALL_STILL_MS = 5000        # a stall this long is also logged while it lasts, with the whole stack


def _where(frame) -> str:
    """One line naming a stack, innermost first: ``store.py:412 promote < delay.py:88 _switch``."""
    frames = traceback.extract_stack(frame, limit=STALL_STACK_FRAMES)
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))


class StallWatch:
    """Reports event-loop stalls (setting ``loop_stall_report_ms``; 0 = off).

    A task on the loop wakes every ``tick`` (a quarter of the threshold, at most 50 ms) and
    measures how late it woke: that lateness is how long the loop was held (or the process
    got no CPU). Every lateness goes into ``histogram``
    (``hourglass_event_loop_stall_seconds``); one at or past the threshold is logged when it
    ends, once, with its duration, the task that was running and where the loop thread was
    (WARNING ``event loop stalled stall_ms=612 task=role-master at=store.py:412 promote <
    ... samples=11/12``). "Where" is sampled by a thread every tick while the task's mark is
    older than half the threshold (before that the thread sleeps until it could be); the place
    seen most often during the stall is named, with
    how many of the samples saw it: the call that held the loop. ``at=selectors.py ... select``
    means the loop was idle and the process got no CPU; ``at=-`` that the sampler got none
    either. A stall that lasts ``STALL_STILL_MS`` is also logged
    while it lasts, with the whole stack: a wedged loop is named even if it never returns.
    Every message due during a stall is late by it, so this is where a p99 comes from."""

    def __init__(self, threshold_ms: int, log: logging.Logger, histogram=None) -> None:
        self.threshold_s = threshold_ms / 1000
        self.tick_s = min(self.threshold_s / 4, STALL_TICK_MS_MAX / 1000)
        self.log = log
        self.histogram = histogram
        self.beat = time.monotonic()
        self.stalls = 0
        self._sampled_beat: float | None = None  # the stall (its mark) the samples below belong to
        self._samples: Counter[tuple[str, str]] = Counter()  # (task, where) -> times seen during it
        self._samples_lock = threading.Lock()
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        thread.start()
        try:
            while True:
                before = time.monotonic()
                self.beat = before
                await asyncio.sleep(self.tick_s)
                late_s = max(0.0, time.monotonic() - before - self.tick_s)
                if self.histogram is not None:
                    self.histogram.observe(late_s)
                if late_s >= self.threshold_s:
                    self._report(before, late_s)
        finally:
            self._stop.set()

    def _report(self, beat: float, late_s: float) -> None:
        self.stalls += 1
        with self._samples_lock:
            seen = self._samples.most_common(1) if self._sampled_beat == beat else []
            n = sum(self._samples.values()) if seen else 0
        (task, where), k = seen[0] if seen else (("-", "-"), 0)
        self.log.warning("event loop stalled stall_ms=%.0f task=%s at=%s samples=%d/%d", late_s * 1000, task,
                         where, k, n)

    def _watch(self) -> None:
        still_reported = None
        wait_s = self.tick_s
        while not self._stop.wait(wait_s):
            beat = self.beat
            late = time.monotonic() - beat - self.tick_s
            if late < self.threshold_s / 2:  # sampled early: a stall just past the threshold is named too
                # nothing to sample before the mark is half a threshold late: sleep until then (at
                # least a tick), not a tick at a time: at rest this thread wakes a few times a second
                wait_s = max(self.tick_s, self.threshold_s / 2 - late)
                continue
            wait_s = self.tick_s
            frame = sys._current_frames().get(self._loop_thread)
            task = asyncio.current_task(self._loop) if self._loop is not None else None
            sample = (task.get_name() if task is not None else "-", _where(frame) if frame is not None else "-")
            with self._samples_lock:
                if self._sampled_beat != beat:
                    self._sampled_beat, self._samples = beat, Counter()
                self._samples[sample] += 1
            if late * 1000 >= STALL_STILL_MS and still_reported != beat:
                still_reported = beat
                stack = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(no stack)"
                self.log.warning("event loop still stalled stall_ms=%.0f; the loop thread is at:\n%s",
                                 late * 1000, stack)
