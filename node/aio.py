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


GC_PAUSE_REPORT_MS = 20  # a collection that held the process this long is logged (it holds the GIL throughout)


def tune_gc(log: logging.Logger | None = None, report_ms: float = GC_PAUSE_REPORT_MS) -> None:
    """The cyclic GC ran ~10% of this process's CPU: every call allocates coroutines,
    futures and protobuf objects, and each collection walked the objects of the loaded
    modules again. ``freeze`` moves what exists once serving (modules, the store's
    tables) out of collection; a larger gen-0 threshold collects less often. Reference
    cycles are rare on the hot path, so memory does not grow for it.

    With ``log``, a collection that takes ``report_ms`` or more is logged with its
    generation and what it found (``GcPauses``): a collection holds the GIL throughout, so
    the stall watch's sampler cannot say what held the loop (``samples=0/0``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, GcPauses)]  # one, however often tuned
    if log is not None:
        gc.callbacks.append(GcPauses(log, report_ms))


class GcPauses:
    """A ``gc.callbacks`` entry: times each collection, logs the long ones, keeps the longest."""

    def __init__(self, log: logging.Logger, report_ms: float) -> None:
        self.log, self.report_ms = log, report_ms
        self.started = 0.0
        self.longest_ms = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1000
        gen = info.get("generation", -1)
        self.longest_ms = max(self.longest_ms, ms)
        if ms >= self.report_ms:
            self.log.warning("gc pause generation=%d ms=%.0f collected=%d uncollectable=%d collections=%s",
                             gen, ms, info.get("collected", 0), info.get("uncollectable", 0),
                             "/".join(str(g["collections"]) for g in gc.get_stats()))


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


STALL_OBSERVE_MS_MIN = 5     # loop turns at least this long go into the histogram (its first bucket)
STALL_STACK_FRAMES = 6       # frames named in a stall's log line, innermost first
STALL_STILL_MS = 5000        # a stall this long is also logged while it lasts, with the whole stack
STALL_PARKED_S_MAX = 1.0     # the sampler thread, parked while the loop waits for I/O, looks again this often


def _where(frame) -> str:
    """One line naming a stack, innermost first: ``store.py:412 promote < delay.py:88 _switch``."""
    frames = traceback.extract_stack(frame, limit=STALL_STACK_FRAMES)
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))


class StallWatch:
    """Reports event-loop stalls (setting ``loop_stall_report_ms``; 0 = off), with no wake-up
    of its own: it wraps the loop's selector.

    A turn of the loop runs from the moment ``select`` returns to the next call of
    ``select``: the callbacks that were ready ran in between, and nothing else on the loop
    could. A turn at or past the threshold is a stall of the loop. ``select`` returning
    later than the timeout it was given (by the threshold or more) is a stall too: the
    process got no CPU while it waited (``at=selectors.py select``, as a sampled wait).
    Every turn of ``STALL_OBSERVE_MS_MIN`` or more, and every such late return, goes into
    ``histogram`` (``hourglass_event_loop_stall_seconds``); a stall is logged when it
    ends, once, with its duration, the task that was running and where the loop thread was
    (WARNING ``event loop stalled stall_ms=612 task=role-master at=store.py:412 promote <
    ... samples=11/12``). "Where" is sampled by a thread every quarter of the threshold (at
    most 50 ms) once a turn has run for half the threshold; the place seen most often is
    named, with how many of the samples saw it: the call that held the loop. ``at=-`` means
    the sampler got no CPU either. A stall that lasts ``STALL_STILL_MS`` is also logged while
    it lasts, with the whole stack: a wedged loop is named even if it never returns. While
    the loop waits in ``select`` the thread is parked (woken when the wait ends, or after
    ``STALL_PARKED_S_MAX``), so a node at rest pays no wake-up for the watch (issue 28:
    it woke 20 times a second before). Every message due during a stall is late by it, so
    this is where a p99 comes from."""

    def __init__(self, threshold_ms: int, log: logging.Logger, histogram=None) -> None:
        self.threshold_s = threshold_ms / 1000
        self.tick_s = min(self.threshold_s / 4, 0.05)
        self.observe_min_s = min(STALL_OBSERVE_MS_MIN / 1000, self.threshold_s)
        self.log = log
        self.histogram = histogram
        self.turn_from = time.monotonic()  # when the current turn started (select returned)
        self.in_select = False
        self.stalls = 0
        self._parked = False
        self._unpark = threading.Event()
        self._sampled_turn: float | None = None  # the turn the samples below belong to
        self._samples: Counter[tuple[str, str]] = Counter()  # (task, where) -> times seen during it
        self._samples_lock = threading.Lock()
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        selector = getattr(loop, "_selector", None)
        if selector is None or not callable(getattr(selector, "select", None)):
            self.log.warning("stall watch off: this event loop has no selector to watch")
            await asyncio.Event().wait()
        inner = selector.select
        self.turn_from = time.monotonic()  # the first turn measured starts now, not at construction
        mine = selector.select = self._watched(inner)
        self._loop_thread = threading.get_ident()
        thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()  # the work is in the selector's wrapper and the thread
        finally:
            self._stop.set()
            self._unpark.set()
            if vars(selector).get("select") is mine:  # what was there before, less stopped watches
                below = inner
                while getattr(below, "stall_watch_stopped", None) is not None and below.stall_watch_stopped.is_set():
                    below = below.__wrapped__
                del selector.select
                if below != selector.select:
                    selector.select = below
            # wrapped over meanwhile (another watch on this loop): ours passes through until unwrapped

    def _watched(self, inner):
        stopped = self._stop

        def select(timeout=None):
            if stopped.is_set():
                return inner(timeout)
            return self._timed(inner, timeout)
        select.__wrapped__, select.stall_watch_stopped = inner, stopped
        return select

    def _timed(self, inner, timeout):
        t0 = time.monotonic()
        self._turn_ended(t0 - self.turn_from)
        self.in_select = True
        try:
            return inner(timeout)
        finally:
            t1 = time.monotonic()
            self.turn_from = t1
            self.in_select = False
            if self._parked:
                self._unpark.set()
            if timeout is not None and t1 - t0 - timeout >= self.observe_min_s:
                self._waited_late(t0, t1 - t0 - timeout)

    def _turn_ended(self, turn_s: float) -> None:
        if turn_s < self.observe_min_s:  # the usual case: one comparison a turn
            return
        if self.histogram is not None:
            self.histogram.observe(turn_s)
        if turn_s >= self.threshold_s:
            self._report(self.turn_from, turn_s)

    def _waited_late(self, began: float, late_s: float) -> None:
        if self.histogram is not None:
            self.histogram.observe(late_s)
        if late_s >= self.threshold_s:
            self.stalls += 1
            self.log.warning("event loop stalled stall_ms=%.0f task=- at=selectors.py select samples=0/0 "
                             "(the process got no CPU while the loop waited)", late_s * 1000)

    def _report(self, turn: float, late_s: float) -> None:
        self.stalls += 1
        with self._samples_lock:
            seen = self._samples.most_common(1) if self._sampled_turn == turn else []
            n = sum(self._samples.values()) if seen else 0
        (task, where), k = seen[0] if seen else (("-", "-"), 0)
        self.log.warning("event loop stalled stall_ms=%.0f task=%s at=%s samples=%d/%d", late_s * 1000, task,
                         where, k, n)

    def _watch(self) -> None:
        still_reported = None
        wait_s = self.tick_s
        while not self._stop.wait(wait_s):
            self._parked = True  # set before reading in_select; the wrapper reads it after clearing in_select
            if self.in_select:
                self._unpark.wait(STALL_PARKED_S_MAX)
                self._unpark.clear()
                self._parked = False
                wait_s = self.threshold_s / 2  # a turn just begun: nothing to sample before half a threshold
                continue
            self._parked = False
            turn = self.turn_from
            ran = time.monotonic() - turn
            if ran < self.threshold_s / 2:  # sampled early: a stall just past the threshold is named too
                wait_s = max(self.tick_s, self.threshold_s / 2 - ran)
                continue
            wait_s = self.tick_s
            frame = sys._current_frames().get(self._loop_thread)
            task = asyncio.current_task(self._loop) if self._loop is not None else None
            sample = (task.get_name() if task is not None else "-", _where(frame) if frame is not None else "-")
            with self._samples_lock:
                if self._sampled_turn != turn:
                    self._sampled_turn, self._samples = turn, Counter()
                self._samples[sample] += 1
            if ran * 1000 >= STALL_STILL_MS and still_reported != turn:
                still_reported = turn
                stack = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(no stack)"
                self.log.warning("event loop still stalled stall_ms=%.0f; the loop thread is at:\n%s",
                                 ran * 1000, stack)
