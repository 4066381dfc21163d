"""Scrubbing: re-check the CRCs of segments at rest, a bounded number of bytes at a time.

A flipped bit in a segment nobody reads stays silent until the day it is read (a failover,
a restore, the hour its messages fall due). The scrub reads every segment over and over,
at a bounded rate, so corruption is found while a healthy copy still exists.

Two halves:

* ``ScrubPlan`` - the pure core: given the list of segments to check (``ScrubTarget``),
  the time (``now_ms``) and what the last step checked, it says what to read next (a
  ``ScrubStep``: file, position, at most ``step_bytes_max`` bytes) or how long to wait. The
  rate is a token bucket of ``rate_bytes_per_s`` holding at most one step's worth. The
  cursor is (target key, position): targets deleted meanwhile (retention, a rebuilt bucket)
  are skipped, new ones are picked up in key order; after the last target a pass ends and
  the next one starts from the first, at least ``pass_interval_min_ms`` after the previous
  pass started; a step costs at least ``step_cost_min_bytes`` of the rate. So a node at rest
  holding little data re-checks it once a minute instead of in a busy loop.
* ``check_span`` - the file side, safe on a worker thread (its own descriptor, no shared
  state): decode the frames of ``[pos, pos + max_bytes)`` of one segment file (at least one
  whole frame) and report how far it got and the first ``CorruptRecord``.

Example: with ``rate_bytes_per_s=1 MiB`` and ``step_bytes_max=256 KiB`` a node with 10 GiB of
segments finishes a pass in about three hours and never reads more than 1 MiB a second.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

from cluster.errors import CorruptRecord

from .log import HEADER, HEADER_SIZE, RECORD_BYTES_MAX_DEFAULT, TornRecord, decode_frame
from .settings import SCRUB_DEFAULTS

SCRUB_IDLE_WAIT_MS = 1000  # nothing to scrub: look again after this long
STEP_COST_MIN_BYTES = 64 * 1024    # a step costs at least this much of the rate (a tiny segment too)
TARGET_DONE = 1 << 62  # cursor position: the current target is finished for this pass


@dataclass(frozen=True, slots=True)
class ScrubTarget:
    """One segment file to check: ``key`` orders and identifies it (stable across passes),
    ``base`` is its global offset (for error offsets), ``size`` how many bytes to check.
    ``growing``: the file may still be appended to (a bucket's last segment): a frame cut
    by ``size`` is the end of what is written, not corruption."""

    key: str
    path: str
    base: int
    size: int
    kind: str               # "messages" | "dispatch" | "schedule" | ...
    growing: bool = False


@dataclass(frozen=True, slots=True)
class ScrubStep:
    target: ScrubTarget
    pos: int        # position in the file
    max_bytes: int


@dataclass(slots=True)
class ScrubProgress:
    passes: int = 0                  # passes finished
    bytes_checked: int = 0           # every byte checked since start
    pass_bytes: int = 0              # bytes checked in the current pass
    ratio: float = 0.0               # how far the current pass is (by bytes, 0..1)


@dataclass(slots=True)
class ScrubPlan:
    """The pure scrub core (see module docstring). No I/O, no clock."""

    # defaults: node/store/settings.py ``ScrubSettings``. Paced by time as well as by bytes
    # (issue 28: a node holding little data made 161,031 passes in 50 s, 76% of a core at
    # rest, each tiny pass costing almost nothing of the byte budget)
    rate_bytes_per_s: int = SCRUB_DEFAULTS.rate_bytes_per_s
    step_bytes_max: int = SCRUB_DEFAULTS.step_bytes_max
    pass_interval_min_ms: int = SCRUB_DEFAULTS.pass_interval_ms
    step_cost_min_bytes: int = STEP_COST_MIN_BYTES
    progress: ScrubProgress = field(default_factory=ScrubProgress)
    _pass_started_ms: int | None = None
    _key: str = ""              # current target ("" = before the first)
    _pos: int = 0
    _tokens: float = 0.0
    _last_ms: int | None = None
    _index_of: list | None = None
    _index: tuple = ((), (), (0,))

    def __post_init__(self) -> None:
        assert self.rate_bytes_per_s > 0 and self.step_bytes_max > 0

    def _refill(self, now_ms: int) -> None:
        if self._last_ms is not None and now_ms > self._last_ms:
            self._tokens = min(float(self.step_bytes_max),
                               self._tokens + (now_ms - self._last_ms) * self.rate_bytes_per_s / 1000)
        if self._last_ms is None or now_ms > self._last_ms:
            self._last_ms = now_ms

    def _indexed(self, targets: list[ScrubTarget]) -> tuple[list[ScrubTarget], list[str], list[int]]:
        """Targets sorted by key, their keys and prefix sums of sizes; computed once per
        list (the shell lists targets every few seconds, steps come many times a second)."""
        if self._index_of is not targets:
            live = sorted((t for t in targets if t.size > 0), key=lambda t: t.key)
            sums = [0]
            for t in live:
                sums.append(sums[-1] + t.size)
            self._index_of = targets
            self._index = (live, [t.key for t in live], sums)
        return self._index

    def next(self, targets: list[ScrubTarget], now_ms: int) -> ScrubStep | int:
        """The next step, or the milliseconds to wait before asking again."""
        self._refill(now_ms)
        live, keys, _sums = self._indexed(targets)
        if not live:
            return SCRUB_IDLE_WAIT_MS
        i = bisect.bisect_left(keys, self._key)
        if i == len(live) or (keys[i] == self._key and self._pos >= live[i].size):
            # the current target is done: the next one, or a new pass
            i = bisect.bisect_right(keys, self._key)
            if i == len(live):
                if self._pass_started_ms is not None and self._key:
                    wait = self._pass_started_ms + self.pass_interval_min_ms - now_ms
                    if wait > 0:
                        return min(wait, SCRUB_IDLE_WAIT_MS * 10)
                self._finish_pass()
                self._pass_started_ms = now_ms
                i = 0
            self._pos = 0
        elif keys[i] != self._key:
            self._pos = 0  # the target we were in is gone: start the next one
        cur = live[i]
        self._key = cur.key
        want = min(self.step_bytes_max, cur.size - self._pos)
        if self._tokens < want:
            return max(1, int((want - self._tokens) * 1000 / self.rate_bytes_per_s) + 1)
        return ScrubStep(cur, self._pos, want)

    def done(self, step: ScrubStep, checked_bytes: int, targets: list[ScrubTarget], *, at_end: bool = False) -> None:
        """``checked_bytes`` of ``step`` were read (possibly more than asked: one large
        record); the cursor moves past them (``at_end``: past the whole target, this pass)."""
        # may go below zero: the next step waits longer; a small step costs a minimum, so
        # many tiny segments are not checked thousands of times a second
        self._tokens -= max(checked_bytes, min(self.step_cost_min_bytes, self.step_bytes_max))
        if step.target.key == self._key:
            self._pos = TARGET_DONE if at_end else step.pos + max(checked_bytes, 0)
        p = self.progress
        p.bytes_checked += checked_bytes
        p.pass_bytes += checked_bytes
        _live, keys, sums = self._indexed(targets)
        before = sums[bisect.bisect_left(keys, self._key)]
        p.ratio = min(1.0, (before + min(self._pos, step.target.size)) / sums[-1]) if sums[-1] else 1.0

    def skip_target(self, step: ScrubStep) -> None:
        """The rest of this target is not worth reading (it is corrupt and being healed, or gone)."""
        if step.target.key == self._key:
            self._pos = TARGET_DONE

    def _finish_pass(self) -> None:
        if self._key:  # the first call starts pass 0 without finishing one
            self.progress.passes += 1
        self.progress.pass_bytes = 0
        self.progress.ratio = 0.0


# ---------------------------------------------------------------------- file side


@dataclass(frozen=True, slots=True)
class SpanResult:
    checked_bytes: int                  # whole frames checked from pos
    corrupt: CorruptRecord | None = None
    gone: bool = False                  # the file no longer exists
    at_end: bool = False                # a growing file ends inside a frame: done for this pass


def check_span(target: ScrubTarget, pos: int, max_bytes: int,
               record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT) -> SpanResult:
    """Check the frames of ``target`` in ``[pos, pos + max_bytes)`` (at least one whole frame,
    never past ``target.size``). Runs on any thread."""
    try:
        fd = os.open(target.path, os.O_RDONLY)
    except FileNotFoundError:
        return SpanResult(0, gone=True)
    try:
        end = min(target.size, pos + max_bytes)
        buf = os.pread(fd, end - pos, pos)
        cut = 0
        while cut < len(buf):
            try:
                _, nxt = decode_frame(buf, cut, target.path, target.base + pos, record_bytes_max)
            except TornRecord:
                if cut == 0 and len(buf) >= HEADER_SIZE and pos + len(buf) < target.size:
                    # one frame larger than the step: read it whole (never past the target)
                    body_len = HEADER.unpack_from(buf, 0)[0]
                    whole = os.pread(fd, min(HEADER_SIZE + body_len, target.size - pos), pos)
                    try:
                        _, nxt = decode_frame(whole, 0, target.path, target.base + pos, record_bytes_max)
                        return SpanResult(nxt)
                    except TornRecord:
                        pass  # it runs past the target's end: below
                    except CorruptRecord as e:
                        return SpanResult(0, e)
                elif pos + len(buf) < target.size:
                    break  # the step ended inside a frame: the next step starts at it
                if target.growing:
                    return SpanResult(cut, at_end=True)  # the end of what is written so far
                return SpanResult(cut, CorruptRecord(target.path, target.base + pos + cut,
                                                     "record ends past end of segment"))
            except CorruptRecord as e:
                return SpanResult(cut, e)
            cut = nxt
        return SpanResult(cut)
    finally:
        os.close(fd)

