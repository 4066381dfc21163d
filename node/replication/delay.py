"""A delay node in a replicated group: master or slave, chosen by election.

The pure rules live in ``node/replication/core.py``; this is the asyncio/grpc.aio shell:

* **role loop** - watches the group's leader through the meta server; when the seat is
  empty it campaigns (after ``campaign_delay_ms``: the most caught-up slave first) with
  its registration lease; leadership dies with that lease. ``Member`` says whether this
  node may act as master *now* (its lease surely alive by its own clock).
* **master** - the plain ``DelayNode`` loops (ingest, iterate, wheel, dispatch,
  checkpoint) plus the ``Replicate`` stream: slaves fetch message-log and dispatch-log
  bytes by offset; each answer carries the live tick state (iterate offset,
  completed_ms, dispatch offset) at most ``replication_wait_ms`` (50 ms) apart. In
  ``sync`` ack mode SendBatch answers only once every slave of the group holds the bytes.
* **slave** - one follower task per log: CRC-checked ``append_raw``, fsync, then the next
  fetch (its acknowledgement); the message log is filed into the slave's own schedule
  log under the master's tick state (``DelayStore`` follower mode).
* **promotion** - ``DelayStore.promote`` turns the follower store into the master in place
  (no close, no reopen; one new store epoch): the wheel restarts from the replicated
  completed_ms and the dispatch log, and aligns to the wall clock (behind: everything
  overdue fires at once; ahead: it waits). The node opens its store once, as a follower
  (every node starts as a slave). **Demotion** (rare: a master deposed while running)
  closes the store and opens it as a follower; a returning old master truncates the
  suffix the new master never had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import grpc
import numpy as np

from cluster.codec import Batch
from cluster.errors import CorruptRecord, DiskFull, HourglassError, StorageError
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from node.delay.heal import HealFault
from node.delay.missing import Missing
from node.delay.service import DelayNode
from node.delay.store import DelayStore
from node.replication.ackjournal import AckJournal
from node.replication.core import SyncTracker
from node.replication.history import HistoryFile
from node.replication.repair import REPAIR_TIMEOUT_S, SegmentRepair
from node.replication.roles import ReplicaRoles, mono_ms
from node.replication.shipping import REST_AFTER_S, LogShipping
from node.role import Role
from node.store.log import decode_frame
from node.store import retention
from node.store.group_commit import GroupCommitter
from node.aio import wait_event

log = logging.getLogger("hourglass.replication")

LOGS = ("messages", "dispatch")
BUCKET_LOG_PREFIX = "schedule:"  # ReadLog of a schedule bucket's data log
FENCED_DELIVERY_POLL_S = 0.05  # how often a fenced dispatch looks again (the role loop ends it by cancelling)
BUCKET_FETCH_CHUNKS_MAX = 1 << 16  # ReadLog calls for one bucket (x replication_chunk_bytes)
NO_BUCKET = "no bucket"  # ReadLog's answer when this member has no such bucket


class ReplicatedDelayNode(ReplicaRoles, LogShipping, SegmentRepair, DelayNode, rpc.ReplicationServicer):
    ROLE = "delay"
    DISCOVERY_KIND = mpb.DELAYED_PRODUCER

    STORE_FOLLOWER = True  # every node starts as a slave: DelayNode opens the store once, as a follower

    def __init__(self, settings, **kw) -> None:
        super().__init__(settings, **kw)
        self.store.follow()  # the election decides; promote() makes it the master in place
        self.role = Role("opening", self.store, GroupCommitter(self.store.messages))  # the first _switch ends it
        root = Path(settings.server.data_dir)
        self._init_replica(settings, {name: HistoryFile(root / f"{name}.epochs") for name in LOGS})
        self.tracker = SyncTracker(timeout_ms=settings.replication.sync_timeout_ms)
        self.scrubber.repair = self.repair_segment  # a corrupt sealed segment: fetched again from a member
        self.ack_journal = AckJournal.from_settings(settings)  # off unless HOURGLASS_ACK_JOURNAL is set
        self._active_at = time.monotonic()  # last append, dispatch or checkpoint beyond the clock (_poll_cap_ms)
        self._promote_steps: dict[str, float] = {}  # milliseconds of the last promotion's steps (logged)

    # ------------------------------------------------------------------ hooks of ReplicaRoles

    def _trackers(self) -> dict[str, SyncTracker]:
        return {"bytes": self.tracker}

    def _role_log_end(self) -> int:
        return self.store.messages.end_offset

    def _store_epoch_floor(self) -> int:
        return self.store.epoch_floor()

    def _grpc_services(self) -> dict:
        return {"producer": self, "admin": self}

    async def _close_clients(self) -> None:
        if hasattr(self.router, "close"):
            await self.router.close()

    def _log(self, name: str):
        return self.store.messages if name == "messages" else self.store.dispatch

    # ------------------------------------------------------------------ bucket fetch (healing)

    async def ReadLog(self, request: pb.ReadLogRequest, context) -> pb.ReadLogResponse:
        """Also ``schedule:{bucket start}``: raw frames of this member's copy of a schedule
        bucket's data log (a member whose rebuilt bucket lacks records asks)."""
        if not request.log.startswith(BUCKET_LOG_PREFIX):
            return await super().ReadLog(request, context)
        if self.mode == "switching":  # a worker thread promotes or opens the store now: ask again
            return pb.ReadLogResponse(error="switching roles; ask again")
        try:
            start = int(request.log[len(BUCKET_LOG_PREFIX):])
            b = self.store.schedule.bucket(start, create=False) if self.store.schedule.exists(start) else None
            if b is None:
                return pb.ReadLogResponse(error=f"{NO_BUCKET} {start} here")
            data = b.data.read_bytes(request.offset, min(request.max_bytes or (1 << 20),
                                                         self.settings.replication.chunk_bytes))
        except (ValueError, HourglassError) as e:
            return pb.ReadLogResponse(error=str(e))
        return pb.ReadLogResponse(data=data)

    async def _fetch_bucket_frames(self, address: str, start: int, missing: Missing,
                                   below_seq: int | None) -> list[Batch]:
        """A member's records of bucket ``start`` that ``missing`` wants (``Missing.wanted``),
        read chunk by chunk, every frame CRC-checked (a bad one: ``CorruptRecord``). [] when
        the member has no such bucket."""
        stub = rpc.ReplicationStub(self.channels.get(address))
        out: list[Batch] = []
        offset = 0
        async with asyncio.timeout(REPAIR_TIMEOUT_S):
            for _ in range(BUCKET_FETCH_CHUNKS_MAX):
                r = await stub.ReadLog(pb.ReadLogRequest(log=f"{BUCKET_LOG_PREFIX}{start}", offset=offset,
                                                         max_bytes=self.settings.replication.chunk_bytes),
                                       timeout=10)
                if r.error.startswith(NO_BUCKET):
                    return []
                if r.error:
                    raise CorruptRecord(address, offset, r.error)
                if not r.data:
                    return out
                pos = 0
                while pos < len(r.data):
                    body, pos = decode_frame(r.data, pos, address, offset, self.store.messages.record_bytes_max)
                    b = Batch.decode(body)
                    b = b.take(np.flatnonzero(missing.wanted(b.seq, below_seq)))
                    if b.n:
                        out.append(b)
                offset += len(r.data)
        raise CorruptRecord(address, offset, f"bucket larger than {BUCKET_FETCH_CHUNKS_MAX} chunks")

    async def fetch_lost_buckets(self) -> None:
        """Missing records of rebuilt buckets (``BucketHealer.missing``, node/delay/heal.py)
        from the other members of the group, one after the other: a member's copy of the
        bucket is read (``ReadLog`` "schedule:{start}"), every frame CRC-checked, and the bucket
        rebuilt again with the records it lacks. A member that cannot answer (unreachable, its
        copy corrupt too) is a fault: logged, counted, and the bucket is asked for again later
        (backoff). Once every member answered and none had them, they are lost (``give_up``)."""
        role = self.role  # a role switch ends it: nothing is rebuilt on a store a switch works on
        store = role.store
        healer = store.healer
        loop = asyncio.get_running_loop()
        due = healer.fetch_due(int(loop.time() * 1000))
        if not due or self.registrar is None:
            return
        try:
            members = await self._member_addresses()
        except (grpc.RpcError, HourglassError) as e:
            healer.fault(HealFault("fetch", "meta servers", 0, f"cannot list the group's members: {e}"))
            for start in due:
                healer.fetch_failed(start, int(loop.time() * 1000))
            return
        for start in due:
            unanswered = 0
            for address in members:
                m = healer.missing.get(start)
                if self.role is not role or role.ended or m is None or m.lost:
                    break
                try:
                    frames = await self._fetch_bucket_frames(address, start, m, healer.first_log_seq())
                except (grpc.RpcError, HourglassError, TimeoutError, OSError) as e:
                    healer.fault(HealFault("fetch", address, 0, f"bucket {start}: {e}"))
                    unanswered += 1
                    continue
                if self.role is not role or role.ended:
                    return  # a role switch meanwhile: the next role's healer asks again
                if not frames:
                    continue  # this member does not have them
                try:
                    healer.rebuild(start, CorruptRecord(address, 0, "records fetched from a member"), extra=frames,
                                   source=address)
                except (HourglassError, OSError) as e:
                    healer.fault(HealFault("rebuild", str(store.schedule.bucket_path(start)), 0, str(e)))
                    unanswered += 1
                    break
            m = healer.missing.get(start)
            if self.role is not role or role.ended or m is None or m.lost:
                continue
            if unanswered or not members:
                if not members:
                    log.warning("bucket fetch: no other member of group %s is registered; asking again later bucket=%d",
                                self.settings.server.group, start)
                healer.fetch_failed(start, int(loop.time() * 1000))
            else:
                healer.give_up(start, f"no member of group {self.settings.server.group} has them "
                                      f"(asked {', '.join(members)})")

    def _note_durable(self) -> None:
        super()._note_durable()
        self._active_at = time.monotonic()
        self._changed.set()

    # ------------------------------------------------------------------ at rest (issue 28)

    def _dispatch_appended(self) -> None:
        """Dispatch records reach the slaves as soon as before: at once when their polls wait
        with the idle cap, within ``replication_wait_ms`` otherwise (as always)."""
        super()._dispatch_appended()
        self._active_at = time.monotonic()
        if self._idle_polls:
            self._changed.set()

    def _checkpointed(self, changed: bool) -> None:
        """A checkpoint beyond the clock (something filed, dispatched, cancelled): its tick
        state goes to the slaves at once, not at the end of their long polls."""
        if changed and self.mode == "master":
            self._active_at = time.monotonic()
            self._changed.set()

    def _poll_cap_ms(self) -> int:
        """``replication_idle_wait_ms`` (1 s) once nothing was appended, dispatched or
        checkpointed beyond the clock for a second (docs/replication.md, "At rest"): a
        master at rest answers its slaves' polls once a second instead of 20 times. What
        ends the rest wakes the polls at once (``_note_durable``, ``_dispatch_appended``,
        ``_checkpointed``), so bytes and tick states never wait for the longer cap."""
        s = self.settings
        if time.monotonic() - self._active_at < REST_AFTER_S:
            return s.replication.wait_ms
        return max(s.replication.wait_ms, s.replication.idle_wait_ms)

    # ------------------------------------------------------------------ producer API (master only)

    async def SendBatch(self, request, context):
        batch, now = await self._authorized_batch(request, context)  # who may, before who is master
        await self._serving(context, request.epoch)
        term, tracker = self._term(), self.tracker
        resp, end = await self._ingest(batch, now, context)
        await self._confirm_ack(term, tracker, "bytes", end, context)
        if self.ack_journal.enabled:  # chaos checker: who acked when (off: nothing on the send path)
            self.ack_journal.note(self.member.epoch, time.time_ns() // 1_000_000)
        return resp

    async def Cancel(self, request, context):
        await self._serving(context)
        await self._may_cancel(context, request.id)
        term, tracker = self._term(), self.tracker
        resp, end = await self._cancel(request, context)
        if resp.code == pb.OK:
            await self._confirm_ack(term, tracker, "bytes", end, context)
        return resp

    async def _deliver_once(self, unit, b, idx):
        # fencing: a master whose lease is not surely alive (after a pause, a late keepalive)
        # sends nothing until it is again, or until the role loop stands it down (which
        # cancels this task and reopens the store: the messages are loaded again from the
        # schedule log). Returning instead would leave them in flight for good when the
        # lease is confirmed again without a demotion: they never fired (chaos finding 4).
        while not self.is_master():
            await asyncio.sleep(FENCED_DELIVERY_POLL_S)
        return await super()._deliver_once(unit, b, idx)

    # ------------------------------------------------------------------ master side of replication

    def _tick_doc(self) -> str:
        # acked_offset: what every required slave holds (sync mode); a slave never cuts below it
        acked = self.tracker.acked_offset if self.settings.replication.ack_mode == "sync" else -1
        doc = json.dumps({**self.store.replication_doc(), "acked_offset": acked})
        return doc[:-1] + ', "terms": ' + self.terms.encoded() + "}"  # the term table, kept encoded

    async def Replicate(self, request_iterator, context):
        async for req in request_iterator:
            base, early = await self._fetch_preamble(req, context, {n: self._log(n) for n in LOGS})
            if early is not None:
                yield early
                continue
            lg = self._log(req.log)
            if req.log == "messages":
                self._release("bytes", self.tracker.on_fetch(req.node_id, req.offset, mono_ms()))
            await self._wait_for_change(req, lg)
            data = b""
            if req.offset < lg.end_offset:
                data = lg.read_bytes(req.offset, min(req.max_bytes or (1 << 20), self.settings.replication.chunk_bytes))
            yield pb.FetchResponse(**dict(base, end_offset=lg.end_offset, data=data, checkpoint=self._tick_doc(),
                                          tick_state=self.store.tick_state().encode()))

    # ------------------------------------------------------------------ slave side

    def _on_truncate(self, name: str, cut: int) -> None:
        if name == "messages":
            voided = self.store.truncate_messages(cut)
            self.metrics.records_voided.inc(voided)
        else:
            self.store.truncate_dispatch(cut)

    def _on_reset(self, name: str, offset: int) -> None:
        if name == "messages" and self.store.iterate_offset < offset:
            # retention on the master deleted records this replica never filed: their only copy
            # is the master's schedule log, which replication does not ship
            raise StorageError(f"the master's message log starts at {offset}, past this replica's filed offset "
                               f"{self.store.iterate_offset}: rebuild this replica from a copy of the master's "
                               f"data folder (docs/operations.md, Disk)")
        log.warning("replica %s too far behind: log restarts at %d", name, offset)
        self._log(name).reset(offset)

    def _before_data(self, name: str, resp: pb.FetchResponse) -> None:
        # the master's term table before its bytes: this member never holds a record of a term
        # it cannot name (node/delay/terms.py)
        if name == "messages" and resp.checkpoint:
            self.terms.adopt(json.loads(resp.checkpoint).get("terms"))

    async def _on_data(self, name: str) -> None:
        if name == "messages":
            self.store.appended()

    def _on_answer(self, name: str, resp: pb.FetchResponse) -> None:
        self._checkpoint_wake.set()  # bytes or a tick state came: the slave's checkpoint looks again
        if name == "messages":
            if resp.checkpoint:
                doc = json.loads(resp.checkpoint)
                doc.pop("terms", None)  # adopted before the bytes (_before_data); not tick state
                self.store.follow(doc)  # the master's live tick state
                acked = int(doc.get("acked_offset", -1))
                if 0 <= acked <= self.store.messages.end_offset:
                    self._note_acked(name, acked)
            self._caught_up(resp.end_offset, self.store.messages.end_offset)
            self._durable_moved.set()

    async def _slave_iterate_loop(self) -> None:
        while True:
            await wait_event(self._durable_moved, 1.0)  # every answer sets it; the timeout is a safety net
            self._durable_moved.clear()
            try:
                while self.store.iterate(limit=self.settings.store.follower_file_step_max):
                    await asyncio.sleep(0)
            except DiskFull as e:  # filing waits for space; the replicated bytes are safe in the log
                self.disk.note_enospc(str(e))
                await asyncio.sleep(self.settings.disk.check_interval_ms / 1000)

    def _retention_slave_holds(self) -> dict[str, dict[str, int]] | None:
        """A master keeps message-log and dispatch-log segments until every registered slave
        has fetched them (a slave seen fetching but not registered any more holds nothing: it
        is dead or gone; if it returns behind the log start it must be rebuilt)."""
        if self.mode != "master":
            return None
        peers = sorted(self._peers)
        return {name: retention.slave_holds(peers, self.slave_offsets, name, known=self._peers_read) for name in LOGS}

    # ------------------------------------------------------------------ roles

    def _master_tasks(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.committer.run(self.metrics.observe_commit), name="group-commit")
        tg.create_task(self._iterator_loop(), name="iterator")
        tg.create_task(self._wheel_loop(), name="wheel")
        tg.create_task(self._checkpoint_loop(), name="checkpoint")
        tg.create_task(self._sync_expiry_loop(), name="sync-expiry")
        tg.create_task(self._disk_loop(), name="disk")
        tg.create_task(self._retention_loop(), name="retention")
        tg.create_task(self.drain.run(), name="drain")  # a new master carries on a drain (node/delay/drain.py)
        for i in range(self.settings.delay.dispatch_concurrency_max):
            tg.create_task(self._dispatch_worker(), name=f"dispatch-{i}")

    def _slave_tasks(self, tg: asyncio.TaskGroup) -> None:
        for name in LOGS:
            tg.create_task(self._follow(name), name=f"follow-{name}")
        tg.create_task(self._slave_iterate_loop(), name="slave-iterate")
        tg.create_task(self._checkpoint_loop(), name="checkpoint")
        tg.create_task(self._disk_loop(), name="disk")
        tg.create_task(self._retention_loop(), name="retention")

    def _role_store(self, mode: str, store: DelayStore, now_ms: int, store_epoch: int) -> DelayStore:
        """Promotion turns the follower store into the master in place (``DelayStore.promote``:
        one epoch bump, no close and open). Demotion (a master deposed while running, rare)
        still closes the store and opens it as a follower: its in-flight state goes with it.
        On a worker thread (``ReplicaRoles._switch``)."""
        if mode == "master":
            t0 = time.perf_counter()
            self._promote_steps = store.promote(now_ms, store_epoch) if store.follower else {}
            self.terms.take(store.epoch, self.settings.server.node_id)  # before this term accepts a record
            self._promote_steps["total"] = round((time.perf_counter() - t0) * 1000, 1)
            return store
        if not store.follower:
            store.checkpoint()
            store.close()
            store = DelayStore.open(self.settings.server.data_dir, self.settings.store_settings(), now_ms=now_ms,
                                    follower=True)
        store.follow()
        return store

    def _recover_store(self, store: DelayStore, now_ms: int) -> DelayStore:
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - the half-promoted store is dropped either way
            log.warning("closing a half-promoted store: %r", e)
        store = DelayStore.open(self.settings.server.data_dir, self.settings.store_settings(), now_ms=now_ms,
                                follower=True)
        store.follow()
        return store

    def _role_began(self, mode: str) -> None:
        # a new term's dispatch queue: what the old one held was loaded by the old wheel
        self._dispatch_q = asyncio.Queue()
        self._dispatch_slots = asyncio.Semaphore(self.settings.delay.dispatch_concurrency_max)
        if mode != "master":
            return
        self._master_history_begins({n: self._log(n).end_offset for n in LOGS})
        self.tracker = SyncTracker(timeout_ms=self.settings.replication.sync_timeout_ms)
        self.tracker.set_slaves(self._required_slaves())
        self._term_start_ms = mono_ms()
        now, steps = self.clock.now_ms(), self._promote_steps
        log.warning("became MASTER group=%s epoch=%d store_epoch=%d completed_ms=%d (now %d, %+d ms) pending=%d "
                    "promote_ms=%.1f steps_ms=%s", self.settings.server.group, self.member.epoch, self.store.epoch,
                    self.store.completed_ms, now, now - self.store.completed_ms,
                    sum(self.store.pending_by_bucket().values()), steps.get("total", 0.0), json.dumps(steps))

    # ------------------------------------------------------------------ handover

    async def Handover(self, request, context) -> pb.HandoverResponse:
        """Graceful handover: stop dispatching, let the slaves take the final bytes and tick
        state, resign; a caught-up slave wins the next election."""
        if not self.is_master():
            return pb.HandoverResponse(done=False, error="not the master")
        if not self._peers:
            return pb.HandoverResponse(done=False, error="no slave to hand over to")
        # stop the role tasks (no more dispatch, no more ingest) but keep serving Replicate
        role = self.role
        await role.stop_tasks()
        self.store.checkpoint()
        self._active_at = time.monotonic()  # polls at the short cap while the slaves take the final state
        self._changed.set()
        deadline = time.monotonic() + min(request.wait_ms or 5000, 30_000) / 1000
        ends = {n: self._log(n).end_offset for n in LOGS}
        while time.monotonic() < deadline:
            if any(all(offs.get(n, -1) >= ends[n] for n in LOGS) for offs in self.slave_offsets.values()):
                break
            await asyncio.sleep(0.02)
        else:
            if self.role is role and not role.ended:  # the role loop may have stood it down meanwhile
                role.start(self._tg, self._master_tasks)
            return pb.HandoverResponse(done=False, error="no slave caught up in time; still master")
        await asyncio.sleep(2 * self.settings.replication.wait_ms / 1000)  # the final tick state reaches them
        return await self._resign_and_follow()
