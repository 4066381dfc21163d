"""The real-time node's upkeep on a timer: the periodic flush (message log, index checkpoint,
consumer positions), the free-space watch, and retention rounds with their metrics.

A mixin of ``RealtimeNode`` (node/realtime/service.py): it reads the node's ``store``,
``settings``, ``clock``, ``disk``, ``metrics`` and ``_groups_durable``. Invariants: fsyncs,
deletions and copies run on a worker thread, never on the event loop; a store replaced while
that thread ran (a role switch) is left to its own flush (``self.store is not store``); a
round that meets a full disk changes nothing and is tried again by the next one.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.errors import DiskFull
from node.aio import finish_then_cancel
from node.realtime.store import RetentionReport
from node.store.diskspace import is_enospc

log = logging.getLogger("hourglass.realtime")


class RealtimeUpkeep:
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.delay.checkpoint_interval_ms / 1000)
            await self._flush_once(at_rest_skip=True)

    async def _flush_once(self, *, at_rest_skip: bool = False) -> None:
        """Periodic flush: the message log, the index checkpoint once enough was appended
        (``checkpoint_bytes_min``), and the positions pulls moved, committed with the ack rounds.
        ``at_rest_skip``: nothing to do when ``RealtimeStore.flush_key`` is what it was after
        the last flush, except once every ``checkpoint_idle_interval_ms`` (the dedup window's
        oldest offset may have moved with the clock): a node at rest fsyncs nothing (issue 28)."""
        store = self.store
        loop = asyncio.get_running_loop()
        key = store.flush_key()
        last = self._flushed
        if at_rest_skip and last is not None and last[0] is store and last[1] == key \
                and loop.time() - last[2] < self.settings.delay.checkpoint_idle_interval_ms / 1000:
            return
        plan = store.flush_plan(index_bytes_min=store.settings.checkpoint_bytes_min,
                                fsyncs_max=store.settings.checkpoint_index_fsyncs_max)
        try:
            # fsyncs off the loop; a role switch waits for the thread (it then closes this store)
            await finish_then_cancel(asyncio.get_running_loop().run_in_executor(None, plan.run))
        except OSError as e:
            if not is_enospc(e):
                raise
            self.disk.note_enospc("checkpoint")  # the previous checkpoint stands; the next flush tries again
            log.error("checkpoint not written (no space left) path=%s", self.settings.server.data_dir)
            return
        if self.store is not store:
            return  # reopened meanwhile (a role change): its own flush covers it
        plan.finish()
        dirty = store.dirty_groups()
        if dirty:
            try:
                await self._groups_durable(set(dirty))
            except DiskFull as e:  # positions stay dirty: the next flush writes them again
                self.disk.note_enospc(str(e))
                return
        if self.store is store:
            self._flushed = (store, key, loop.time())

    async def _disk_loop(self) -> None:
        """Free space, every ``disk_check_interval_ms`` (statvfs off the loop): the watermark."""
        await self.disk.run(self.settings.disk.check_interval_ms / 1000, self.metrics)

    def _retention_slave_holds(self) -> dict[str, int] | None:
        return None  # no replicas (ReplicatedRealtimeNode: its registered slaves)

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.disk.retention_interval_ms / 1000)
            try:
                await self.retention_once()
            except OSError as e:  # ENOSPC renaming or copying: nothing was half done; next round again
                log.error("retention round failed path=%s error=%s", self.settings.server.data_dir, e)

    async def retention_once(self) -> RetentionReport:
        """One retention round (node/realtime/retention.py): decide and detach on the loop,
        delete and copy on a worker thread, swap compacted index files in on the loop."""
        store = self.store
        work, report = store.retention_plan(now_ms=self.clock.now_ms(), slave_holds=self._retention_slave_holds())
        try:
            if work:
                await finish_then_cancel(asyncio.get_running_loop().run_in_executor(None, work.run))
        finally:
            store.retention_finish(work)  # a store closed meanwhile (role change) only drops temp files
        self.metrics.retention_freed.inc(work.freed_bytes)
        self.metrics.idle_groups.set(report.idle_groups)
        self.metrics.set_retention_held({"messages": (report.held_by, report.held_age_ms / 1000)})
        prev_store, prev = self._counted
        if prev_store is not store:
            prev = {}
        c = store.counters
        for event, key in (("idle", "groups_idled"), ("resumed", "groups_resumed")):
            self.metrics.idle_group_events.labels(event=event).inc(max(0, c[key] - prev.get(key, 0)))
        self.metrics.retention_skipped.inc(max(0, c["resumed_skipped_messages"] - prev.get("resumed_skipped_messages", 0)))
        self._counted = (store, dict(c))
        sizes = await asyncio.to_thread(store.disk_bytes)
        for name, n in sizes.items():
            self.metrics.disk_bytes.labels(log=name).set(n)
        self.last_retention = (report, sizes)
        return report
