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

from cluster.errors import CorruptRecord, HourglassError, Unavailable
from node.delay.heal import HealFault
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
        self._healer_id = 0  # id() of the healer whose counters _seen holds
        self._seen: dict[str, int] = {}  # its counters as last put into the metrics

    def logs(self) -> list[tuple[SegmentedLog, str]]:
        s = self.node.store
        return [(s.messages, "messages"), (s.dispatch, "dispatch")]

    async def more_targets(self) -> list[ScrubTarget]:
        # one folder per bucket (17k for two years of hours): listed off the event loop
        return await asyncio.get_running_loop().run_in_executor(None, schedule_targets, self.node.store.schedule.root)

    def sync_heal_metrics(self) -> None:
        """Count what the store's healer did on its own (rebuilds at open and on failed reads,
        records fetched or lost, faults) in the metrics."""
        h = self.node.store.healer
        m = self.node.metrics
        if self._healer_id != id(h):  # a store opened again (demotion): its healer counts from 0
            self._healer_id, self._seen = id(h), {}
            ids = h.counters.get("id_files_rebuilt", 0)
            if ids:  # once per store opened
                m.corrupt_found.labels(kind="ids").inc(ids)
                m.corrupt_repaired.labels(kind="ids").inc(ids)
        now = {**h.counters, **{f"fault:{k}": n for k, n in h.fault_counts.items()}}
        for key, metric in (("corrupt_found", m.corrupt_found.labels(kind="schedule")),
                            ("buckets_rebuilt", m.corrupt_repaired.labels(kind="schedule")),
                            ("lost_records", m.lost_records), ("fetched_records", m.fetched_records)):
            if now.get(key, 0) > self._seen.get(key, 0):
                metric.inc(now[key] - self._seen.get(key, 0))
        for key, n in now.items():
            if key.startswith("fault:") and n > self._seen.get(key, 0):
                m.heal_faults.labels(kind=key[6:]).inc(n - self._seen.get(key, 0))
        m.missing_records.set(h.counters["missing_records"])
        self._seen = now

    def rebuild(self, start: int, err: CorruptRecord) -> bool:
        """Rebuild bucket ``start`` (derived data: from the message log); a rebuild that fails
        (a dying disk, a bucket failing again and again) is a fault reported by the healer, not
        a reason to stop the node: the bucket stays as it was, and is found again later.
        True when it was rebuilt. Not while a role switch works on the store (off the loop):
        the bucket is found again later."""
        if self.node.role.ended:
            return False
        store = self.node.store
        try:
            store.healer.rebuild(start, err)
            return True
        except (HourglassError, OSError) as e:
            store.healer.fault(HealFault("rebuild", str(store.schedule.bucket_path(start)), err.offset,
                                         f"{e} (found: {err.reason})"))
            return False

    async def on_derived_corrupt(self, target: ScrubTarget, err: CorruptRecord) -> bool:
        if target.kind != "schedule":
            return False
        start = bucket_of(target)
        store = self.node.store
        if store.schedule.bucket_start(start) == start and Path(target.path).exists():
            self.rebuild(start, err)  # derived data: rebuilt from the message log now
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
    segment goes to the scrub task's repair, missing records are asked for at once (a single
    node: declared lost). Returns the report, findings marked repaired, and the node's
    missing and lost records (``lost``)."""
    role = node.role  # healing below writes the store: only the role the check began on
    role.check()
    store = role.store
    loop = asyncio.get_running_loop()
    report = await loop.run_in_executor(None, lambda: verify_dir(
        store.root, online=True, rate_bytes_per_s=rate_bytes_per_s, record_bytes_max=store.messages.record_bytes_max))
    if node.role is not role or role.ended:  # a role switch meanwhile (it may be working on the store now)
        raise Unavailable("the node switched roles while verifying; run verify again")
    rebuilt: dict[int, bool] = {}
    for f in report.corrupt:
        start = _bucket_in_path(f.path)
        if start is not None:
            if start not in rebuilt:
                rebuilt[start] = node.scrubber.rebuild(start, CorruptRecord(f.path, f.offset, f.reason))
            f.repaired = rebuilt[start]
    await node.scrubber.take_findings(report)
    if node.store.healer.fetch_due(int(loop.time() * 1000)):
        await node.fetch_lost_buckets()
    node.scrubber.sync_heal_metrics()
    report.lost = node.store.healer.report()
    return report
