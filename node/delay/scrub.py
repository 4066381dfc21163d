"""The delay node's scrub task: the thin asyncio shell around ``node.store.scrub``.

Every ``ScrubPlan`` step reads at most ``step_bytes_max`` bytes of one segment on a worker
thread (``check_span``); the plan keeps the rate under ``rate_bytes_per_s``. Targets:
sealed segments of the message and dispatch logs, and every data segment of every schedule
bucket (a bucket's last segment as far as it is written). What a corrupt record leads to:

* schedule data (derived): the bucket is rebuilt from the message log at once
  (``BucketHealer.rebuild``), counted as found and repaired;
* a message-log or dispatch-log segment: ``repair`` is asked (a replicated master fetches
  the segment's bytes from a slave and swaps them in); without one, or when it cannot, the
  segment is logged at ERROR and reported by ``admin verify`` and the metrics until it is
  repaired or deleted by retention.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from cluster.errors import CorruptRecord
from node.store.log import SegmentedLog
from node.store.scrub import RATE_BYTES_PER_S_DEFAULT, ScrubPlan, ScrubTarget, check_span
from node.store.verify import VerifyReport, verify_dir

log = logging.getLogger("hourglass.delay.scrub")

TARGETS_REFRESH_MS = 30_000  # the segment list is listed again this often (and after a pass or a change)


def log_targets(lg: SegmentedLog, kind: str) -> list[ScrubTarget]:
    """The sealed segments of a segmented log (the active one was checked when it was opened)."""
    bases = lg.segment_bases()
    return [ScrubTarget(f"{kind}/{b:020d}", str(lg.directory / f"{b:020d}.log"), b, nxt - b, kind)
            for b, nxt in zip(bases, bases[1:])]


def schedule_targets(root: Path) -> list[ScrubTarget]:
    """Every data segment of every schedule bucket, from the directory listing."""
    out: list[ScrubTarget] = []
    try:
        buckets = sorted((p for p in os.scandir(root) if p.name.isdigit() and p.is_dir()), key=lambda e: e.name)
    except FileNotFoundError:
        return out
    for b in buckets:
        try:
            segs = sorted((e for e in os.scandir(os.path.join(b.path, "data")) if e.name.endswith(".log")
                           and e.name[:-4].isdigit()), key=lambda e: e.name)
            sizes = [e.stat().st_size for e in segs]
        except FileNotFoundError:
            continue  # deleted or swapped meanwhile
        for i, (e, size) in enumerate(zip(segs, sizes)):
            base = int(e.name[:-4])
            out.append(ScrubTarget(f"schedule/{b.name}/{base:020d}", e.path, base, size, "schedule",
                                   growing=i == len(segs) - 1))
    return out


def bucket_of(target: ScrubTarget) -> int:
    return int(target.key.split("/")[1])


class ScrubTask:
    """Runs a ``ScrubPlan`` against the files of the node's current store."""

    def __init__(self, node, *, rate_bytes_per_s: int, step_bytes_max: int,
                 repair: Callable[[str, int, CorruptRecord], Awaitable[bool]] | None = None) -> None:
        self.node = node  # .store (may be replaced by a role change), .metrics
        # rate 0 = no background scrub (the node does not run ``run``); the task still repairs
        # what ``admin verify`` finds, so it exists with a placeholder rate
        self.plan = ScrubPlan(rate_bytes_per_s=rate_bytes_per_s or RATE_BYTES_PER_S_DEFAULT,
                              step_bytes_max=step_bytes_max)
        self.repair = repair
        self.unrepaired: dict[str, str] = {}  # target key -> error, segments still corrupt
        self._targets: list[ScrubTarget] = []
        self._listed_ms = -TARGETS_REFRESH_MS
        self._listed_pass = 0  # listed again at the end of every pass, too
        self._healed_seen: dict[int, tuple[int, int]] = {}  # id(healer) -> (found, rebuilt) counted

    async def targets(self, now_ms: int, *, force: bool = False) -> list[ScrubTarget]:
        passes = self.plan.progress.passes
        if force or now_ms - self._listed_ms >= TARGETS_REFRESH_MS or passes != self._listed_pass \
                or not self._targets:
            self._listed_pass = passes
            s = self.node.store
            logs = log_targets(s.messages, "messages") + log_targets(s.dispatch, "dispatch")
            # one folder per bucket (17k for two years of hours): listed off the event loop
            buckets = await asyncio.get_running_loop().run_in_executor(None, schedule_targets, s.schedule.root)
            self._targets = logs + buckets
            self._listed_ms = now_ms
            live = {t.key for t in self._targets}
            for k in [k for k in self.unrepaired if k not in live]:
                del self.unrepaired[k]  # deleted by retention or replaced
        return self._targets

    def sync_heal_metrics(self) -> None:
        """Count rebuilds the store did on its own (at open, on a failed read) in the metrics."""
        h = self.node.store.healer
        m = self.node.metrics
        found0, rebuilt0 = self._healed_seen.get(id(h), (0, 0))
        found, rebuilt = h.counters["corrupt_found"], h.counters["buckets_rebuilt"]
        if found > found0:
            m.corrupt_found.labels(kind="schedule").inc(found - found0)
        if rebuilt > rebuilt0:
            m.corrupt_repaired.labels(kind="schedule").inc(rebuilt - rebuilt0)
        self._healed_seen = {id(h): (found, rebuilt)}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        m = self.node.metrics
        while True:
            self.sync_heal_metrics()
            now = int(time.monotonic() * 1000)
            targets = await self.targets(now)
            step = self.plan.next(targets, now)
            if isinstance(step, int):
                await asyncio.sleep(step / 1000)
                continue
            record_max = self.node.store.messages.record_bytes_max
            r = await loop.run_in_executor(None, check_span, step.target, step.pos, step.max_bytes, record_max)
            self.plan.done(step, r.checked_bytes, targets, at_end=r.at_end)
            m.scrub_bytes.inc(r.checked_bytes)
            m.scrub_passes.set(self.plan.progress.passes)
            m.scrub_progress.set(self.plan.progress.ratio)
            if r.gone:
                self.plan.skip_target(step)
                await self.targets(now, force=True)
            elif r.corrupt is not None:
                self.plan.skip_target(step)
                await self.on_corrupt(step.target, r.corrupt)
                await self.targets(now, force=True)

    async def on_corrupt(self, target: ScrubTarget, err: CorruptRecord) -> None:
        if self.unrepaired.get(target.key) == str(err):
            return  # found in an earlier pass, already reported (and counted) once
        log.error("scrub found a corrupt record kind=%s path=%s offset=%d reason=%r", target.kind, err.path,
                  err.offset, err.reason)
        if target.kind == "schedule":
            start = bucket_of(target)
            store = self.node.store
            if store.schedule.bucket_start(start) == start and Path(target.path).exists():
                store.healer.rebuild(start, err)  # derived data: rebuilt from the message log now
            self.sync_heal_metrics()
            return
        m = self.node.metrics
        m.corrupt_found.labels(kind=target.kind).inc()
        if self.repair is not None and await self.repair(target.kind, target.base, err):
            m.corrupt_repaired.labels(kind=target.kind).inc()
            self.unrepaired.pop(target.key, None)
            log.warning("corrupt segment repaired kind=%s path=%s", target.kind, target.path)
            return
        self.unrepaired[target.key] = str(err)
        log.error("corrupt segment NOT repaired kind=%s path=%s offset=%d: no healthy copy here; see "
                  "docs/operations.md, \"Self-healing and scrubbing\"", target.kind, err.path, err.offset)


def _bucket_in_path(path: str) -> int | None:
    parts = Path(path).parts
    for a, b in zip(parts, parts[1:]):
        if a == "schedule" and b.isdigit():
            return int(b)
    return None


async def verify_online(node, rate_bytes_per_s: float) -> VerifyReport:
    """``admin verify`` on a running node: check its files on a worker thread (throttled), then
    heal what can be healed: a schedule bucket is rebuilt, a corrupt sealed message/dispatch
    segment goes to the scrub task's repair. Returns the report, findings marked repaired."""
    store = node.store
    loop = asyncio.get_running_loop()
    report = await loop.run_in_executor(None, lambda: verify_dir(
        store.root, online=True, rate_bytes_per_s=rate_bytes_per_s, record_bytes_max=store.messages.record_bytes_max))
    rebuilt: set[int] = set()
    for f in report.corrupt:
        err = CorruptRecord(f.path, f.offset, f.reason)
        start = _bucket_in_path(f.path)
        if start is not None:
            if start not in rebuilt:
                node.store.healer.rebuild(start, err)
                rebuilt.add(start)
            f.repaired = True
            continue
        p = Path(f.path)
        for lg, kind in ((node.store.messages, "messages"), (node.store.dispatch, "dispatch")):
            if p.parent == lg.directory and p.stem.isdigit() and int(p.stem) in lg.segment_bases()[:-1]:
                t = ScrubTarget(f"{kind}/{int(p.stem):020d}", f.path, int(p.stem), 0, kind)
                await node.scrubber.on_corrupt(t, err)
                f.repaired = t.key not in node.scrubber.unrepaired
    node.scrubber.sync_heal_metrics()
    return report
