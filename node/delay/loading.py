"""Loading seconds of the schedule log into the timing wheel, a few frames per poll.

A second is loaded ``window_ms`` ahead of its time: its frame chain is walked once
(``ScheduleLog.second_entries``), its frames are read and merged oldest first, at most
``LOAD_STEP_FRAMES`` per poll, so that loading a busy second (hundreds of frames, 20,000
messages) is spread over several polls instead of holding the event loop for ~10 ms once a
second (seen as a lateness spike). At the end the frames filed into the second since the
walk (the chain's newer entries) are taken too, and the second becomes **one** wheel chunk
whose entries are ordered by due time through the chunk's index (an argsort): the messages
are not moved at load; each firing round gathers only what it fires.

A bucket rebuilt meanwhile (healing: ``ScheduleLog.rebuilds`` moved, its offsets with it)
restarts the second, at most ``LOAD_RESTARTS_MAX`` times in one poll. Which messages of the
merged second enter the wheel is the core's rule (``DelayCore.chunk``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.codec import KIND_CANCEL, Batch
from node.delay.core import DelayCore
from node.store.schedule import FrameRef, ScheduleLog

LOAD_STEP_FRAMES = 64  # filed frames merged per poll while a second is loaded
LOAD_RESTARTS_MAX = 2  # second loads started over (bucket rebuilt meanwhile) in one poll at most


@dataclass(slots=True)
class SecondLoad:
    """A second being loaded into the wheel a few frames at a time."""

    second: int
    rebuilds: int                       # ScheduleLog.rebuilds when its chain was walked
    head: int                           # the chain's newest entry then: later ones are taken at the end
    todo: list[tuple[int, int, int]]    # (entry, data_offset, frame_size) not merged yet, oldest first
    parts: list[Batch] = field(default_factory=list)
    cancels: list[np.ndarray] = field(default_factory=list)


class SecondLoader:
    """Loads the wheel of ``core`` from ``schedule`` (module docs); ``current`` is the second
    half loaded, if any."""

    def __init__(self, schedule: ScheduleLog, core: DelayCore) -> None:
        self.schedule = schedule
        self.core = core
        self.current: SecondLoad | None = None

    def load(self, *, step_frames: int | None = LOAD_STEP_FRAMES) -> None:
        """Load the next seconds into the wheel, at most ``step_frames`` filed frames per call
        (None: no limit) and ``seconds_load_max`` seconds."""
        wheel, schedule = self.core.wheel, self.schedule
        budget = step_frames
        seconds = restarts = 0
        while restarts <= LOAD_RESTARTS_MAX:  # past it: the next poll tries again (each rebuild is logged)
            ld = self.current
            if ld is None:
                if seconds >= self.core.settings.seconds_load_max:
                    return
                nxt = wheel.seconds_to_load(1)
                if not nxt:
                    return
                second = nxt[0]
                entries = schedule.second_entries(second)
                if not entries:
                    wheel.load_second(second, [])
                    seconds += 1
                    continue
                ld = self.current = SecondLoad(second, schedule.rebuilds, entries[0][0], entries[::-1])
            if budget is None:
                take, ld.todo = ld.todo, []
            else:
                take, ld.todo = ld.todo[:budget], ld.todo[budget:]
                budget -= len(take)
            if not self._merge(ld, take):
                self.current = None  # the bucket was rebuilt (healing): its offsets moved, start over
                restarts += 1
                continue
            if ld.todo:
                return
            self.current = None
            if schedule.rebuilds != ld.rebuilds or wheel.seconds_to_load(1) != [ld.second]:
                restarts += 1  # the bucket was rebuilt (offsets moved) or the wheel moved on: start over
                continue
            if not self._merge(ld, schedule.second_entries(ld.second, newer_than=ld.head)[::-1]):
                restarts += 1
                continue
            merged = Batch.concat(ld.parts)
            targets = np.concatenate(ld.cancels) if ld.cancels else None
            chunk = self.core.chunk(FrameRef(-1, -1, 0, merged), reload=True, cancelled=targets,
                                    order=np.argsort(merged.effective_ms, kind="stable"))
            wheel.load_second(ld.second, [] if chunk is None else [chunk])
            seconds += 1
            if budget is not None and budget <= 0:
                return

    def _merge(self, ld: SecondLoad, entries: list[tuple[int, int, int]]) -> bool:
        """Frames ``entries`` (oldest first) of the second being loaded: one merged part, and
        the targets of their (not voided) cancel records. False when a frame was corrupt and
        its bucket got rebuilt (the load must start over)."""
        if not entries:
            return True
        schedule = self.schedule
        if schedule.rebuilds != ld.rebuilds:
            return False
        refs = schedule.frames_of(schedule.bucket_start(ld.second * 1000), entries)
        if refs is None:
            return False
        batches = [r.batch for r in refs]
        for b in batches:
            cancels = b.kind == KIND_CANCEL
            if bool(cancels.any()):
                ld.cancels.append(b.cancel_targets()[cancels & ~self.core.voided_mask(b.seq)])
        ld.parts.append(Batch.concat(batches))
        return True
