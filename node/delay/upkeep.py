"""The delay node's upkeep on a timer: checkpoints (planned on the loop, fsynced on a worker
thread, skipped at rest), the free-space watch, retention rounds and, between them, the
fetches of missing records of rebuilt buckets.

A mixin of ``DelayNode`` (node/delay/service.py): it reads the node's ``store``, ``settings``,
``clock``, ``disk``, ``metrics``, ``scrubber`` and ``_checkpoint_wake``; the replicated node
overrides ``_checkpointed``, ``_dispatch_appended``, ``_retention_slave_holds`` and
``fetch_lost_buckets`` (node/replication/delay.py). Invariants: fsyncs, deletions and
compactions run on a worker thread, never on the event loop; a store replaced while that
thread ran (a role switch) is not touched afterwards (``self.store is store``); a round that
meets a full disk changes nothing and is tried again.
"""

from __future__ import annotations

import asyncio
import logging

from node.aio import finish_then_cancel, wait_event
from node.delay import retention
from node.store.diskspace import is_enospc

log = logging.getLogger("hourglass.delay")

HEAL_POLL_S = 0.2             # missing records of a rebuilt bucket are asked for this soon (node/delay/heal.py)
HEAL_IDLE_POLL_S = 1.0        # ... and a bucket newly found missing records within this (none missing now)


class DelayUpkeep:
    async def _checkpoint_loop(self) -> None:
        """Planned on the loop, fsynced on a worker thread: a checkpoint's disk time never
        stalls the messages due meanwhile. One that would only move ``completed_ms`` (an
        unchanged ``DelayStore.checkpoint_key``: the node is at rest) is written every
        ``checkpoint_idle_interval_ms`` instead: a node at rest fsyncs nothing for seconds
        (issue 28). At rest the loop does not look every ``checkpoint_interval_ms`` either:
        it sleeps until a durable write, a dispatch record or a replicated answer sets
        ``_checkpoint_wake``, then checkpoints ``checkpoint_interval_ms`` later as usual
        (a rebuilt bucket or a retention round waits for the idle checkpoint at most).
        ``_checkpointed`` is told whether the key changed."""
        loop = asyncio.get_running_loop()
        idle_s = self.settings.delay.checkpoint_idle_interval_ms / 1000
        last: tuple[object, tuple] | None = None  # (store, key) of the last checkpoint written
        last_at = loop.time()
        resting = False
        while True:
            if resting:  # nothing changed at the last look: sleep until a write or the idle checkpoint
                await wait_event(self._checkpoint_wake, max(0.0, last_at + idle_s - loop.time()))
            await asyncio.sleep(self.settings.delay.checkpoint_interval_ms / 1000)
            store = self.store
            self._checkpoint_wake.clear()  # before the key: a write from here on wakes the next rest
            key = store.checkpoint_key()
            changed = last is None or last[0] is not store or last[1] != key
            resting = not changed
            if not changed and loop.time() - last_at < idle_s:
                continue
            plan = store.checkpoint_plan()
            try:
                # a role switch waits for the thread (it then works on this store itself)
                await finish_then_cancel(loop.run_in_executor(None, plan.run))
            except OSError as e:
                if not is_enospc(e):
                    raise
                self.disk.note_enospc("checkpoint")  # the previous checkpoint stands; next round tries again
                log.error("checkpoint not written (no space left) path=%s", self.settings.server.data_dir)
                continue
            if self.store is store:
                plan.finish()
                last, last_at = (store, key), loop.time()
                self._checkpointed(changed)

    def _dispatch_appended(self) -> None:
        """A dispatch record was appended: the checkpoint loop wakes if it rests (a replicated
        master also wakes its slaves' idle polls)."""
        self._checkpoint_wake.set()

    def _checkpointed(self, changed: bool) -> None:
        """A checkpoint was written (``changed``: beyond the clock); a master wakes its slaves'
        long polls then (node/replication/delay.py)."""

    async def _disk_loop(self) -> None:
        """Free space, every ``disk_check_interval_ms`` (statvfs off the loop): the watermark."""
        await self.disk.run(self.settings.disk.check_interval_ms / 1000, self.metrics)

    def _retention_slave_holds(self) -> dict[str, dict[str, int]] | None:
        return None  # no replicas (ReplicatedDelayNode: its registered slaves)

    async def _retention_loop(self) -> None:
        """Every ``retention_interval_ms``: decide and detach on the loop, delete and compact
        on a worker thread (node/delay/retention.py), then report sizes and what holds data.
        In between, every ``HEAL_POLL_S`` while some are missing (``HEAL_IDLE_POLL_S``
        otherwise, so a node at rest wakes once a second for it): missing records of rebuilt
        schedule buckets are asked for (``fetch_lost_buckets``, node/delay/heal.py) and the
        healing metrics brought up to date. Nothing healing meets stops this loop: it is reported (log, metrics)."""
        loop = asyncio.get_running_loop()
        interval_s = self.settings.disk.retention_interval_ms / 1000
        next_round = loop.time() + interval_s
        while True:
            poll_s = HEAL_POLL_S if self.store.healer.missing else HEAL_IDLE_POLL_S
            await asyncio.sleep(max(0.0, min(poll_s, next_round - loop.time())))
            if self.store.healer.fetch_due(int(loop.time() * 1000)):
                await self.fetch_lost_buckets()
            self.scrubber.sync_heal_metrics()
            if loop.time() >= next_round:
                await self.retention_once(loop)
                self.store.healer.forget_deleted()
                next_round = loop.time() + interval_s

    async def fetch_lost_buckets(self) -> None:
        """Missing records of rebuilt buckets (``BucketHealer.missing``): a replicated node
        fetches them from a member (node/replication/delay.py); a single node has nowhere to
        ask: they are lost (``give_up``: an ERROR line with their ids, the metric
        ``hourglass_lost_records``, ``admin verify``)."""
        healer = self.store.healer
        for start, m in list(healer.missing.items()):
            if not m.lost:
                healer.give_up(start, "no replica: this node is its group's only member")

    async def retention_once(self, loop=None) -> retention.Report:
        loop = loop or asyncio.get_running_loop()
        store = self.store
        s = store.settings
        work, report = retention.plan(store, now_ms=self.clock.now_ms(), slave_holds=self._retention_slave_holds(),
                                      dedupe_window_ms=s.dedupe_window_ms, id_compact_ratio_min=s.id_compact_ratio_min)
        try:
            if work:
                await finish_then_cancel(loop.run_in_executor(None, work.run))  # (as the checkpoint's)
        finally:
            retention.finish(store, work, same_store=self.store is store)
        self.metrics.retention_freed.inc(work.freed_bytes)
        sizes = await asyncio.to_thread(retention.disk_usage, store.root)
        for name, n in sizes.items():
            self.metrics.disk_bytes.labels(log=name).set(n)
        self.last_retention = (report, sizes)
        self.metrics.set_retention_held(retention.held_ages(store, report, now_ms=self.clock.now_ms()))
        return report
