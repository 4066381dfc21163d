"""A node's scrub task: the thin asyncio shell around ``node.store.scrub``, shared by both roles.

Every ``ScrubPlan`` step reads at most ``step_bytes_max`` bytes of one segment on a worker
thread (``check_span``); the plan keeps the rate under ``rate_bytes_per_s``. The base class
scrubs the sealed segments of the logs ``logs()`` names (a real-time node: its message log);
``node.delay.scrub.DelayScrubTask`` adds the dispatch log and the schedule buckets. A corrupt
segment goes to ``repair`` (a replicated node fetches the segment's bytes from another
member of its group and swaps them in, ``node/replication/repair.py``); without one, or when
it cannot, the segment is logged at ERROR and reported by ``admin verify``, ``Status`` and the
metrics until it is repaired or deleted by retention.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from cluster.errors import CorruptRecord
from node.store.log import SegmentedLog
from node.store.scrub import ScrubPlan, ScrubTarget, check_span
from node.store.settings import SCRUB_DEFAULTS

log = logging.getLogger("hourglass.scrub")

TARGETS_REFRESH_MS = 30_000  # the segment list is listed again this often (and after a pass or a change)


def log_targets(lg: SegmentedLog, kind: str) -> list[ScrubTarget]:
    """The sealed segments of a segmented log (the active one was checked when it was opened)."""
    bases = lg.segment_bases()
    return [ScrubTarget(f"{kind}/{b:020d}", str(lg.directory / f"{b:020d}.log"), b, nxt - b, kind)
            for b, nxt in zip(bases, bases[1:])]


class ScrubTask:
    """Runs a ``ScrubPlan`` against the files of the node's current store."""

    def __init__(self, node, *, rate_bytes_per_s: int, step_bytes_max: int, pass_interval_ms: int = SCRUB_DEFAULTS.pass_interval_ms,
                 repair: Callable[[str, int, CorruptRecord], Awaitable[bool]] | None = None) -> None:
        self.node = node  # .store (may be replaced by a role change), .metrics
        # rate 0 = no background scrub (the node does not run ``run``); the task still repairs
        # what ``admin verify`` finds, so it exists with a placeholder rate
        self.plan = ScrubPlan(rate_bytes_per_s=rate_bytes_per_s or SCRUB_DEFAULTS.rate_bytes_per_s,
                              step_bytes_max=step_bytes_max, pass_interval_min_ms=pass_interval_ms)
        self.repair = repair
        self.unrepaired: dict[str, str] = {}  # target key -> error, segments still corrupt
        self._targets: list[ScrubTarget] = []
        self._listed_ms = -TARGETS_REFRESH_MS
        self._listed_pass = 0  # listed again at the end of every pass, too

    def logs(self) -> list[tuple[SegmentedLog, str]]:
        """(log, kind) of the segmented logs whose sealed segments are scrubbed."""
        return [(self.node.store.messages, "messages")]

    async def more_targets(self) -> list[ScrubTarget]:
        """Targets beyond the logs' sealed segments (a subclass's derived files)."""
        return []

    async def targets(self, now_ms: int, *, force: bool = False) -> list[ScrubTarget]:
        passes = self.plan.progress.passes
        if force or now_ms - self._listed_ms >= TARGETS_REFRESH_MS or passes != self._listed_pass \
                or not self._targets:
            self._listed_pass = passes
            self._targets = [t for lg, kind in self.logs() for t in log_targets(lg, kind)] + await self.more_targets()
            self._listed_ms = now_ms
            live = {t.key for t in self._targets}
            for k in [k for k in self.unrepaired if k not in live]:
                del self.unrepaired[k]  # deleted by retention or replaced
        return self._targets

    def sync_heal_metrics(self) -> None:
        """Count repairs the store did on its own in the metrics (a subclass's derived data)."""

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
        if await self.on_derived_corrupt(target, err):
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

    async def on_derived_corrupt(self, target: ScrubTarget, err: CorruptRecord) -> bool:
        """A subclass heals derived data itself: True when ``target`` was such a file."""
        return False

    async def take_findings(self, report) -> None:
        """``admin verify`` found these (a ``VerifyReport``): a corrupt sealed segment of one of
        ``logs()`` goes to ``on_corrupt`` (repair from a member), and the finding is marked
        repaired when that worked."""
        for f in report.corrupt:
            if f.repaired:
                continue
            p = Path(f.path)
            for lg, kind in self.logs():
                if p.parent == lg.directory and p.stem.isdigit() and int(p.stem) in lg.segment_bases()[:-1]:
                    t = ScrubTarget(f"{kind}/{int(p.stem):020d}", f.path, int(p.stem), 0, kind)
                    await self.on_corrupt(t, CorruptRecord(f.path, f.offset, f.reason))
                    f.repaired = t.key not in self.unrepaired
                    break

    def status(self) -> dict:
        p = self.plan.progress
        return {"passes": p.passes, "pass_progress": round(p.ratio, 4), "bytes_checked": p.bytes_checked,
                "unrepaired": dict(self.unrepaired)}
