"""Delay node process: the asyncio/grpc.aio shell around ``DelayStore``.

Background loops, all children of one TaskGroup owned by ``run``:

* group commit  - one fsync for many SendBatch calls (``GroupCommitter``);
* iterator      - files durable batches into the schedule log;
* wheel         - sleeps until the earliest due message or the next second to load (at
                  most ``wheel_idle_wait_ms_max``), takes what is due as one batch;
* dispatcher    - splits a due batch by the real-time node of each subject and sends
                  **one SendBatch per real-time node** carrying every subject, retrying
                  transient failures with backoff for as long as it takes (the messages
                  stay in flight; nothing is dropped) and permanent ones (unknown
                  subject, rejected message) at most ``dispatch_attempts_max`` times
                  before the dead-letter subject;
* checkpoint    - every ``checkpoint_interval_ms``: flush and record tick state.

No business rule lives in the servicer methods: they translate, call the store,
and translate back through ``cluster.wire`` / ``cluster.status``. The part of ``SendBatch``
both node kinds share (authorization, the batch and disk limits, the error answer,
``SendBatchStream``) is ``SendIntake`` (``node/intake.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import numpy as np
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from cluster import security, status
from cluster.client import StaticResolver, route_of
from cluster.clock import Clock, SystemClock
from cluster.codec import OUTCOME_DEAD_LETTER, Batch
from cluster.discovery import MetaResolver
from cluster.errors import DiskFull, HourglassError, Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.security import Action
from cluster.transport import Channels
from cluster.wire import BatchResult, make_request
from node.aio import wait_event
from node.config import NodeSettings
from node.delay import deadletter, retention
from node.delay import pacing
from node.delay.drain import DrainTask
from node.delay.schedule_status import ScheduleStatus
from node.delay.upkeep import DelayUpkeep
from node.delay.scrub import DelayScrubTask, verify_online
from node.delay.store import DelayStore
from node.delay.targets import realtime_target
from node.delay.targets import split as targets_split
from node.delay.terms import TermTable
from node.grpcserver import start_grpc
from node.intake import SendIntake
from node.lifecycle import side_tasks
from node.metrics import NodeMetrics
from node.nodestatus import disk_status
from node.realtime.store import DLQ_SUBJECT
from node.role import SINGLE, Role
from node.store.diskspace import DiskMonitor
from node.store.group_commit import GroupCommitter

log = logging.getLogger("hourglass.delay")

PERMANENT_CODES = np.array([pb.INVALID_ARGUMENT, pb.PAYLOAD_TOO_LARGE, pb.UNKNOWN_SUBJECT, pb.ALREADY_EXISTS],
                           np.uint8)
METRICS_INTERVAL_S = 0.1
FILE_URGENT_MARGIN_MS = 50   # the filer's linger ends this far before a waiting record's due time minus the lead
ITERATE_IDLE_S = 1.0          # the filer looks again this often though no write woke it (a safety net)
DISPATCH_TIMEOUT_S = 10.0     # one dispatch round's answer from a real-time node
MIB = 1 << 20


class DelayNode(SendIntake, DelayUpkeep, rpc.ProducerServicer, rpc.AdminServicer):
    STORE_FOLLOWER = False  # a replicated node opens its store as a follower: the election decides

    def __init__(self, settings: NodeSettings, *, clock: Clock | None = None, router=None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock(settings.clock.offset_ms)
        store = DelayStore.open(settings.server.data_dir, settings.store_settings(), now_ms=self.clock.now_ms(),
                                follower=self.STORE_FOLLOWER)
        # the store and its committer belong to the node's role (node/role.py); a replicated
        # node replaces the role on a switch, so a handler captures it once per call
        self.role = Role(SINGLE, store, GroupCommitter(store.messages))
        # store epoch -> the node that took it: a lookup names the node that accepted a message
        # (node/delay/terms.py); a group of one took its epoch at open, a replica at promotion
        self.terms = TermTable(settings.server.data_dir)
        if not self.STORE_FOLLOWER:
            self.terms.take(store.epoch, settings.server.node_id)
        self.channels = Channels()
        if router is None and settings.meta.servers:
            router = MetaResolver(  # subject -> real-time group through the meta server
                settings.meta.servers, refresh_ms=settings.meta.refresh_ms, timeout_s=settings.meta.timeout_ms / 1000)
        # subject -> real-time node: the SDK's resolvers, one hash rule (cluster.client)
        self.router = router or StaticResolver(realtime=settings.meta.realtime_nodes)
        self.registrar = None
        self.metrics = NodeMetrics("delay", settings.server.node_id)
        # the filer writes a batch's schedule copy after its group commit: a disk reading begun
        # before that cannot show it (node/store/diskspace.py)
        self.disk = DiskMonitor(settings.server.data_dir, settings.disk_watermark(), address=lambda: self.address,
                                pending=lambda: self.store.unfiled_bytes_bound())
        self.last_retention: tuple[retention.Report, dict[str, int]] | None = None
        self._durable_moved = asyncio.Event()
        self._wheel_wake = asyncio.Event()
        self._checkpoint_wake = asyncio.Event()  # something a checkpoint records changed (_checkpoint_loop)
        self._dispatch_q: asyncio.Queue[tuple[int, np.ndarray, bool]] = asyncio.Queue()
        # a dispatch round holds a slot until it is settled: while every slot is taken, due
        # messages gather in the wheel and go out together in the next round (batches grow
        # with load, a lone message still leaves at once)
        self._dispatch_slots = asyncio.Semaphore(settings.delay.dispatch_concurrency_max)
        self._permanent_failures: dict[int, int] = {}  # seq -> permanent refusals so far (rare path)
        self.schedule_status = ScheduleStatus(settings)  # what the console's Schedule page reads (Status)
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.drain = DrainTask(self)  # moves pending messages away while an operator drains the group
        # background CRC re-checks of segments at rest (node/delay/scrub.py)
        self.scrubber = DelayScrubTask(self, rate_bytes_per_s=int(settings.scrub.rate_mib_s * MIB),
                                  step_bytes_max=settings.scrub.step_bytes_max,
                                  pass_interval_ms=settings.scrub.pass_interval_ms)

    @property
    def store(self) -> DelayStore:
        return self.role.store

    @property
    def committer(self) -> GroupCommitter:
        return self.role.committer

    # ------------------------------------------------------------------ gRPC: producer

    async def SendBatch(self, request: pb.SendBatchRequest, context) -> pb.SendBatchResponse:
        batch, now = await self._authorized_batch(request, context)
        await self._serving(context, request.epoch)
        res, _ = await self._ingest(batch, now, context)
        return res

    async def _ingest(self, batch: Batch, now: int, context) -> tuple[pb.SendBatchResponse, int]:
        """Append and fsync one authorized batch: ``(answer, end offset of this write)``. The
        end offset is taken right after the append, before any await: a replicated master
        waits for exactly these bytes, whatever the log does meanwhile."""
        role = self.role  # this call's store and committer, whatever a role switch does meanwhile
        try:
            role.check()
            if role.store.epoch not in self.terms.terms:  # never: taken at open or promotion (a safety net)
                self.terms.take(role.store.epoch, self.settings.server.node_id)
            self.drain.check_accepting()  # a draining group takes nothing new (node/delay/drain.py)
            self._admit_batch(batch, role.store.write_bytes_bound)  # refused whole, nothing stored
            res = role.store.accept(batch, now_ms=now)
            end = role.store.messages.end_offset
            await role.committer.sync_to(end)  # a switch meanwhile: NotLeader (role.end)
        except HourglassError as e:
            await status.abort(context, self._refusal(e))
        self._note_durable()
        self._count_refusals(res)
        self.metrics.ingested.inc(int(np.count_nonzero((res.codes == pb.OK) & (res.duplicates == 0))))
        return res.to_pb(), end

    def _count_refusals(self, res: BatchResult) -> None:
        if not res.errors:
            return
        codes, counts = np.unique(res.codes[res.codes != pb.OK], return_counts=True)
        for code, n in zip(codes.tolist(), counts.tolist()):
            self.metrics.errors.labels(kind=pb.Code.Name(code)).inc(n)

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        # the interceptor checked the caller holds a cancel grant; the subject is known only
        # from the stored message, which only the master answers for
        await self._serving(context)
        await self._may_cancel(context, request.id)
        resp, _ = await self._cancel(request, context)
        return resp

    async def _forwarded(self, method: str, request, context):
        """The answer of the group an id's message moved to (a drain), or None."""
        group = self.drain.moved(request.id)
        if group is None:
            return None
        try:
            return await self.drain.forward(group, method, request)
        except HourglassError as e:
            await status.abort(context, e)

    async def _cancel(self, request: pb.CancelRequest, context) -> tuple[pb.CancelResponse, int]:
        """Cancel one id (the caller may: ``_may_cancel``): ``(answer, end offset of the
        tombstone's write or -1)``."""
        role = self.role  # this call's store and committer, whatever a role switch does meanwhile
        moved = await self._forwarded("Cancel", request, context)
        if moved is not None:
            return moved, -1
        try:
            role.check()
            self.disk.admit(role.store.cancel_bytes_bound(request.id))
            seq = role.store.cancel(request.id, now_ms=self.clock.now_ms())
        except HourglassError as e:
            e = self._refusal(e)
            return pb.CancelResponse(code=status.to_code(e), error=str(e)), -1
        end = role.store.messages.end_offset
        try:
            await role.committer.sync_to(end)  # a switch meanwhile: NotLeader (role.end)
        except HourglassError as e:
            await status.abort(context, e)
        self._note_durable()
        return pb.CancelResponse(code=pb.OK, seq=seq), end

    async def _may_cancel(self, context, id_: str) -> None:
        """Cancel and lookup are granted per subject: the subject of the stored message. An id
        this node does not know is answered NOT_FOUND whoever asks."""
        if security.caller() is None:
            return
        try:
            subject = self.store.lookup(id_).subject
        except HourglassError:
            return
        await security.require(context, Action.CANCEL, [subject])

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        await self._serving(context)  # as Cancel: the subject is the stored message's
        if self.drain.moved(request.id) is not None:  # checked as Cancel, then asked there
            await self._may_cancel(context, request.id)
            return await self._forwarded("Lookup", request, context)
        self.file_waiting()  # a message whose send was answered reads as filed, as before the linger
        try:
            r = self.store.lookup(request.id)
        except HourglassError as e:
            return pb.LookupResponse(code=status.to_code(e), error=str(e))
        await security.require(context, Action.CANCEL, [r.subject])
        rt_group, rt_address = await realtime_target(self.router, r.subject, request.id)
        return pb.LookupResponse(code=pb.OK, status=r.status, seq=r.seq, deliver_at_ms=r.deliver_at_ms,
                                 subject=r.subject, accepted_ms=r.accepted_ms, effective_ms=r.effective_ms,
                                 cancelled_ms=r.cancelled_ms, store_epoch=r.store_epoch,
                                 dispatched_ms=r.dispatched_ms, dead_lettered=r.dead_lettered,
                                 realtime_group=rt_group, realtime_address=rt_address,
                                 group=self.settings.server.group, node_id=self.settings.server.node_id,
                                 accepted_node_id=self.terms.node_of(r.store_epoch))

    # ------------------------------------------------------------------ gRPC: admin

    def file_waiting(self) -> None:
        """File now what the filer's linger holds back (``file_linger_ms``), so that what a
        status read counts, and a lookup's filing time, include every acknowledged message. A
        full disk is left to the filer's loop, which waits for space."""
        if self.store.follower or not self.store.unfiled:
            return
        try:
            self.store.iterate(limit=None)
        except DiskFull:
            return
        self._wake_wheel()

    def stats(self, subject: str = "") -> dict:
        self.file_waiting()
        s = self.store
        now = self.clock.now_ms()
        return {
            "role": "delay", "node_id": self.settings.server.node_id, "group": self.settings.server.group,
            "epoch": s.epoch, "address": self.address, "now_ms": now,
            "counters": dict(s.counters), "wheel_held": len(s.wheel), "in_flight": s.inflight,
            "pending": sum(s.pending_by_bucket().values()),
            "completed_ms": s.completed_ms, "dispatch_lag_ms": s.dispatch_lag_ms(now),
            **self.schedule_status.stats(s, now_ms=now, subject=subject), "master_changes_1h": 0,
            "disk": disk_status(self.disk, None if self.last_retention is None else self.last_retention[1]),
            "message_log_end": s.messages.end_offset, "iterate_offset": s.iterate_offset,
            "dispatch_log_end": s.dispatch.end_offset, "fsyncs": self.committer.fsyncs,
            "drain": self.drain.status(),
            **self.health_stats(),
        }

    def registration_info(self) -> dict:
        """What the registration carries (snapshot twice a heartbeat): only these fields, not
        the whole ``stats()`` (its pending count and health sums cost more than all the rest
        of a node at rest)."""
        s = self.store
        return {"master": True, "epoch": s.epoch, "lag_ms": s.dispatch_lag_ms(self.clock.now_ms()),
                "offsets": {"message_log_end": s.messages.end_offset, "iterate_offset": s.iterate_offset,
                            "dispatch_log_end": s.dispatch.end_offset}}

    async def Status(self, request, context) -> pb.StatusResponse:
        return pb.StatusResponse(node_id=self.settings.server.node_id, role="delay", group=self.settings.server.group,
                                 master=True, epoch=self.store.epoch, json=json.dumps(self.stats(request.subject)))

    def health_stats(self) -> dict:
        """Scrub progress and what healing did (part of ``stats``)."""
        return {"scrub": self.scrubber.status(),
                "healing": self.store.healer.status()}

    async def Verify(self, request, context) -> pb.VerifyResponse:
        """Check this node's files now (throttled, on a worker thread), heal derived data."""
        report = await verify_online(self, self.settings.scrub.verify_rate_mib_s * MIB)
        return pb.VerifyResponse(summary=report.summary(), corrupt=report.corrupt_count,
                                 unrepaired=report.unrepaired, json=report.to_json())

    # ------------------------------------------------------------------ loops

    def _note_durable(self) -> None:
        if self.committer.durable_offset > self.store.durable_offset:
            self.store.durable_offset = self.committer.durable_offset
            self._durable_moved.set()
            self._checkpoint_wake.set()

    async def _iterator_loop(self) -> None:
        while True:
            # every durable write sets the event (_note_durable); the timeout is a safety net
            await wait_event(self._durable_moved, ITERATE_IDLE_S)
            await self._file_linger()
            self._durable_moved.clear()
            self.store.durable_offset = max(self.store.durable_offset, self.committer.durable_offset)
            try:
                while self.store.iterate(limit=self.settings.store.file_step_max):
                    self._wake_wheel()
                    await asyncio.sleep(0)
            except DiskFull as e:  # accepted records are durable in the message log: filing waits for space
                self.disk.note_enospc(str(e))
                self._durable_moved.set()
                await asyncio.sleep(self.settings.disk.check_interval_ms / 1000)
            self._wake_wheel()

    async def _file_linger(self) -> None:
        """Before a filing round: wait up to ``file_linger_ms`` for more writes, so that the
        round files them together (a frame per due second per round: under load the producers'
        calls of 10 ms apart become one round, and fewer, fuller frames are also fewer wheel
        chunks to fire), but never while a record waiting is due within the dispatch lead plus
        the linger plus ``FILE_URGENT_MARGIN_MS`` (a short delay is filed at once, as before).
        Bounded by the linger; each durable write looks again."""
        linger_ms = self.settings.delay.file_linger_ms
        if not linger_ms or self.store.follower:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger_ms / 1000
        room_ms = self.settings.delay.dispatch_lead_ms + linger_ms + FILE_URGENT_MARGIN_MS
        while True:
            earliest = self.store.unfiled.earliest_due_ms()  # wall clock; the deadline loop time: ms from now
            wait = pacing.linger_wait_ms(0.0, (deadline - loop.time()) * 1000,
                                         None if earliest is None else self.clock.seconds_until(earliest) * 1000,
                                         room_ms)
            if wait <= 0:
                return
            self._durable_moved.clear()
            await wait_event(self._durable_moved, wait / 1000)

    def _wake_wheel(self) -> None:
        if self.store.wheel_changed:
            self.store.wheel_changed = False
            self._wheel_wake.set()

    async def _wheel_loop(self) -> None:
        """Fire at the due time: sleep until the earliest held entry is due or the next
        second becomes loadable (``DelayStore.wheel_wake_ms``; woken early when filing or a
        release puts an entry in the wheel, or a dispatch round settles), at most
        ``wheel_idle_wait_ms_max`` (1 s): a node at rest wakes about once a second, not
        every tick (issue 28, docs/operations.md "Idle"). Rounds that fire are at least
        ``dispatch_round_interval_ms`` apart, and ``dispatch_round_interval_busy_ms`` after a round of
        ``dispatch_round_busy_messages`` or more: a round costs about the same CPU (a few
        hundred microseconds of gRPC on each side, docs/benchmarks.md) whether it carries one
        message or a thousand, so under load messages due within that interval leave together
        and the CPU per message falls, while at low rates a message leaves within a couple
        of milliseconds of its due time (a lone message at its due time)."""
        idle_s = max(self.settings.store.tick_ms, self.settings.delay.wheel_idle_wait_ms_max) / 1000
        round_s = self.settings.delay.dispatch_round_interval_ms / 1000
        busy_s = max(round_s, self.settings.delay.dispatch_round_interval_busy_ms / 1000)
        busy_n = self.settings.delay.dispatch_round_busy_messages
        lead = self.settings.delay.dispatch_lead_ms
        # a held message never waits for the spacing past the point where it would leave less
        # than this before its due time: one filed late (a short delay, a catch-up) fires at once;
        # in the steady state (due times entering the lead in order) the spacing alone leaves
        # every message at least this early, so the rule does not add rounds
        urgent_ms = max(0, lead - self.settings.delay.dispatch_round_interval_busy_ms)
        loop = asyncio.get_running_loop()
        next_metrics = next_pending = next_round = 0.0
        while True:
            self._wheel_wake.clear()
            t = loop.time()
            while t < next_round:  # the spacing (bounded by it); filing wakes it to look again
                nxt = self.store.next_due_ms()  # wall clock, as the spacing is loop time: both as ms from now
                held = None if nxt is None else self.clock.seconds_until(nxt) * 1000
                wait = pacing.round_wait_ms(0.0, (next_round - t) * 1000, held, urgent_ms)
                if wait <= 0:
                    break
                self._wheel_wake.clear()
                await wait_event(self._wheel_wake, wait / 1000)
                t = loop.time()
            await self._dispatch_slots.acquire()
            now = self.clock.now_ms()
            due = self.store.poll_due(now_ms=now + lead)  # the real-time node holds them until due
            if due:
                fired = sum(d.batch.n for d in due)
                next_round = loop.time() + (busy_s if fired >= busy_n else round_s)
                for d in due:  # one unit per poll
                    self._dispatch_q.put_nowait((d.unit, np.arange(d.batch.n), True))
            else:
                self._dispatch_slots.release()
            t = loop.time()
            if t >= next_metrics:
                self.metrics.wheel_held.set(len(self.store.wheel))
                self.metrics.in_flight.set(self.store.inflight)
                self.metrics.dispatch_lag.set(self.store.dispatch_lag_ms(now) / 1000)
                next_metrics = t + METRICS_INTERVAL_S
            if t >= next_pending:
                self.metrics.set_pending(self.store.pending_by_bucket())
                next_pending = t + 1.0
            wake = self.store.wheel_wake_ms()
            wait = idle_s if wake is None else min(idle_s, max(0.0, self.clock.seconds_until(wake - lead)))
            if wait > 0:
                await wait_event(self._wheel_wake, wait)
            else:
                await asyncio.sleep(0)

    async def _dispatch_worker(self) -> None:
        while True:
            unit, idx, slot = await self._dispatch_q.get()
            try:
                await self._deliver(unit, idx)
            except asyncio.CancelledError:
                raise
            except DiskFull as e:  # the dispatch record could not be written: deliver again later
                self.disk.note_enospc(str(e))
                self.store.release(unit, idx)
                await asyncio.sleep(self.settings.disk.check_interval_ms / 1000)
            except Exception:  # a bug: give the messages back rather than lose them
                log.exception("dispatch failed; messages go back to the wheel")
                self.store.release(unit, idx)
            finally:
                if slot:
                    self._dispatch_slots.release()
                    self._wheel_wake.set()
                else:
                    self._wake_wheel()  # a requeued round that released messages back to the wheel

    async def _route(self, subject: str) -> str:
        return await self.router.realtime_for(subject)

    async def _deliver(self, unit: int, idx: np.ndarray) -> None:
        """Deliver messages ``idx`` of an in-flight unit: one SendBatch per real-time node,
        transient failures retried (only the parts that failed) until they go through."""
        b = self.store.unit_batch(unit)
        if b is None:
            return
        try:  # the first round without a retry object: most rounds need none (it is the hot path)
            idx = await self._deliver_once(unit, b, idx)
        except Unavailable:
            pass  # no route yet: everything is left for the retries
        if not len(idx):
            return
        left = [idx]
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Unavailable),
            wait=wait_exponential(multiplier=0.05, max=self.settings.delay.dispatch_backoff_ms_max / 1000),
            reraise=True,
        )
        async for attempt in retrying:  # transient failures: keep trying, the messages stay in flight
            with attempt:
                left[0] = await self._deliver_once(unit, b, left[0])
                if len(left[0]):
                    raise Unavailable(f"{len(left[0])} messages not delivered yet")

    async def _deliver_once(self, unit: int, b: Batch, idx: np.ndarray) -> np.ndarray:
        """One round: route, send every target its part at once; returns what is left."""
        # route each entry of the subject table once, then group the messages with numpy;
        # a subject over several real-time groups: by id hash (node/delay/targets.py)
        targets, stuck = targets_split(b, idx, [await route_of(self.router, s) for s in b.subjects])
        step = self.settings.delay.dispatch_batch_max  # a real-time node refuses larger batches whole
        parts = [(addr, part[i:i + step]) for addr, part in targets.items() for i in range(0, len(part), step)]
        results = await asyncio.gather(*(self._send_part(addr, unit, b, part) for addr, part in parts),
                                       return_exceptions=True)
        left = []
        if len(stuck):  # their group has no master now: asked again, and tried again
            for s in {b.subject(int(i)) for i in stuck[:64]}:
                self.router.invalidate(s)
            left.append(stuck)
        for (addr, part), r in zip(parts, results):
            if isinstance(r, Unavailable):
                for s in {b.subject(int(i)) for i in part[:64]}:
                    self.router.invalidate(s)
                left.append(part)
            elif isinstance(r, BaseException):
                raise r
        return np.concatenate(left) if left else np.zeros(0, np.int64)

    async def _send_part(self, address: str, unit: int, b: Batch, part: np.ndarray) -> None:
        sub = b if len(part) == b.n else b.take(part)
        try:
            resp = await self.channels.send_stream(address).call(make_request(sub, immediate=True),
                                                                 timeout=DISPATCH_TIMEOUT_S)
            res = BatchResult.from_pb(resp, sub.n)
        except grpc.RpcError as e:
            err = status.from_rpc_error(e)
            if isinstance(err, Unavailable):
                raise err from None
            res = BatchResult.sized(sub.n)  # the whole request was refused: every message is
            res.codes[:] = status.to_code(err)
            res.errors = {i: str(err) for i in range(sub.n)}
        now = self.clock.now_ms()
        ok = res.codes == pb.OK
        if ok.any():
            self.store.ack_dispatched(unit, part[ok], now_ms=now)
            self._dispatch_appended()
            if self._permanent_failures:  # delivered after earlier refusals: forget them
                for seq in sub.seq[ok].tolist():
                    self._permanent_failures.pop(seq, None)
            self.metrics.dispatched.inc(int(ok.sum()))
            late_ms = np.maximum(0, now - sub.deliver_at_ms[ok])
            self.metrics.observe_lateness(late_ms / 1000)
            self.schedule_status.lateness.observe(late_ms, now_ms=now)
        if ok.all():  # the common case: nothing refused (np.isin alone costs ~30 us a round)
            return
        perm = np.isin(res.codes, PERMANENT_CODES)
        if perm.any():
            await self._handle_permanent(unit, b, part[perm], {int(part[i]): (int(res.codes[i]), res.errors.get(i, ""))
                                                              for i in np.flatnonzero(perm).tolist()})
        rest = ~ok & ~perm
        if rest.any():
            note = getattr(self.router, "route_moved", None)
            if note is not None and res.errors:  # a narrowing moved the route: ask for it before the retry
                for s in {sub.subject(i) for i, e in res.errors.items() if e.startswith(status.ROUTE_MOVED_PREFIX)}:
                    note(s)
            self.store.release(unit, part[rest])

    async def _handle_permanent(self, unit: int, b: Batch, idx: np.ndarray, why: dict[int, tuple[int, str]]) -> None:
        """Refused for good by the real-time side (rare): retry a few times, then dead letter
        (the rule: node/delay/deadletter.py)."""
        for i in idx.tolist():
            self.metrics.errors.labels(kind=pb.Code.Name(why[i][0])).inc()
        refused = deadletter.sort_refused(b, idx, self._permanent_failures,
                                          attempts_max=self.settings.delay.dispatch_attempts_max,
                                          backoff_ms_max=self.settings.delay.dispatch_backoff_ms_max)
        dead = refused.dead
        if refused.again:
            asyncio.get_running_loop().call_later(refused.again_ms / 1000, self._requeue, unit,
                                                  np.array(refused.again, np.int64))
        if not dead:
            return
        dlq = deadletter.dead_letters(b, dead, why)
        retrying = AsyncRetrying(retry=retry_if_exception_type(Unavailable),
                                 wait=wait_exponential(multiplier=0.05, max=2), reraise=True)
        async for attempt in retrying:
            with attempt:
                try:
                    resp = await self.channels.producer(await self._route(DLQ_SUBJECT)).SendBatch(
                        make_request(dlq, immediate=True), timeout=10)
                except grpc.RpcError as e:
                    raise status.from_rpc_error(e) from None
        res = BatchResult.from_pb(resp, dlq.n)
        dead_idx = np.array(dead, np.int64)
        ok = res.codes == pb.OK
        self.store.ack_dispatched(unit, dead_idx[ok], now_ms=self.clock.now_ms(), outcome=OUTCOME_DEAD_LETTER)
        self._dispatch_appended()
        self.metrics.dead_lettered.inc(int(ok.sum()))
        for i, good in zip(dead, ok.tolist()):
            self._permanent_failures.pop(int(b.seq[i]), None)
            if good:
                log.warning("dead-lettered id=%s subject=%s", b.id(i), b.subject(i))
            else:  # even the dead-letter subject refused: keep it, log loudly
                log.error("dead letter refused seq=%d id=%s", int(b.seq[i]), b.id(i))
        if not ok.all():
            self.store.release(unit, dead_idx[~ok])

    def _requeue(self, unit: int, idx: np.ndarray) -> None:
        self._dispatch_q.put_nowait((unit, idx, False))

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        try:
            self.server, self.address = await start_grpc(self.settings, producer=self, admin=self)
        except BaseException:  # the port is taken (or the start was cut): close the files opened for it
            self.store.close()
            raise
        self.health = self.server.health
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self.committer.run(self.metrics.observe_commit), name="group-commit"),
                    tg.create_task(self._iterator_loop(), name="iterator"),
                    tg.create_task(self._wheel_loop(), name="wheel"),
                    tg.create_task(self._checkpoint_loop(), name="checkpoint"),
                    tg.create_task(self._disk_loop(), name="disk"),
                    tg.create_task(self._retention_loop(), name="retention"),
                    tg.create_task(self.drain.run(), name="drain"),
                    *[tg.create_task(self._dispatch_worker(), name=f"dispatch-{i}")
                      for i in range(self.settings.delay.dispatch_concurrency_max)],
                ]
                tasks += side_tasks(tg, self, log)
                log.info("delay node serving node_id=%s address=%s epoch=%d data=%s", self.settings.server.node_id,
                         self.address, self.store.epoch, self.settings.server.data_dir)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                if self.registrar is not None:
                    await self.registrar.close()
                await self.server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
        finally:
            await self.channels.close()
            if hasattr(self.router, "close"):
                await self.router.close()
            if self.server is not None:
                await self.server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
            log.info("delay node stopped node_id=%s", self.settings.server.node_id)
