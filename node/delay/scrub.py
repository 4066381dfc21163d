"""The delay node's scrub task: ``node.store.scrubtask.ScrubTask`` over its message and
dispatch logs, plus every data segment of every schedule bucket (a bucket's last segment as
far as it is written). What a corrupt record leads to:

* schedule data (derived): the bucket is rebuilt from the message log at once
  (``BucketHealer.rebuild``), counted as found and repaired;
* a message-log or dispatch-log segment: ``repair`` is asked (a replicated master fetches
  the segment's bytes from a slave and swaps them in); without one, or when it cannot, the
  segment is logged at ERROR and reported by ``admin verify`` and the metrics until it is
  repaired or deleted by retention.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from cluster.errors import CorruptRecord
from node.store.log import SegmentedLog
from node.store.scrub import ScrubTarget
from node.store.scrubtask import ScrubTask, log_targets  # noqa: F401  (log_targets: re-exported for tests)
from node.store.verify import VerifyReport, verify_dir

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


class DelayScrubTask(ScrubTask):
    """The message and dispatch logs' sealed segments and the schedule buckets' data."""

    def __init__(self, node, **kw) -> None:
        super().__init__(node, **kw)
        self._healed_seen: dict[int, tuple[int, int]] = {}  # id(healer) -> (found, rebuilt) counted
        self._ids_seen: set[int] = set()  # id(healer) whose id-index rebuilds at open are counted

    def logs(self) -> list[tuple[SegmentedLog, str]]:
        s = self.node.store
        return [(s.messages, "messages"), (s.dispatch, "dispatch")]

    async def more_targets(self) -> list[ScrubTarget]:
        # one folder per bucket (17k for two years of hours): listed off the event loop
        return await asyncio.get_running_loop().run_in_executor(None, schedule_targets, self.node.store.schedule.root)

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
        ids = h.counters.get("id_files_rebuilt", 0)
        if ids and id(h) not in self._ids_seen:  # once per store opened
            m.corrupt_found.labels(kind="ids").inc(ids)
            m.corrupt_repaired.labels(kind="ids").inc(ids)
        self._ids_seen = {id(h)}

    async def on_derived_corrupt(self, target: ScrubTarget, err: CorruptRecord) -> bool:
        if target.kind != "schedule":
            return False
        start = bucket_of(target)
        store = self.node.store
        if store.schedule.bucket_start(start) == start and Path(target.path).exists():
            store.healer.rebuild(start, err)  # derived data: rebuilt from the message log now
        self.sync_heal_metrics()
        return True


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
        start = _bucket_in_path(f.path)
        if start is not None:
            if start not in rebuilt:
                node.store.healer.rebuild(start, CorruptRecord(f.path, f.offset, f.reason))
                rebuilt.add(start)
            f.repaired = True
    await node.scrubber.take_findings(report)
    node.scrubber.sync_heal_metrics()
    return report
