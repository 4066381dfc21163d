"""Real-time node process: the asyncio/grpc.aio shell around ``RealtimeStore`` (wire protocol v2).

* SendBatch (immediate messages, from producers and from delay nodes dispatching; the part
  both node kinds share is ``SendIntake``, ``node/intake.py``): the request's batch
  (``cluster.wire.request_batch``) is appended as one frame, one group-commit fsync covers
  it, then the columnar ``BatchResult`` is answered. A request over ``batch_messages_max``
  is refused whole (INVALID_ARGUMENT); a message due later is refused (INVALID_ARGUMENT:
  send it to a delay node) unless ``immediate`` is set (the rule:
  ``node/realtime/immediate.py``); a duplicate id inside the dedup window is answered
  OK/duplicate and stored once.
* Pull is a long poll over one or more subjects: it answers at once when there is
  something to hand out; else it waits, up to ``min(wait_ms, pull_wait_ms_max)``, until
  **any** of them gets data (or at least once a second, since ack timeouts make
  redeliveries due), and answers ``PullResponse(batch, handles)``.
* Ack takes handle ranges per subject; the groups it moved are group-committed before
  the answer: acks that arrive while a commit runs share the next one, and a commit is
  one offsets-log record and one fsync on the store's writer thread, however many
  groups it holds. The periodic flush commits the positions pulls moved the same way.
* Nack sends the in-flight messages of its ranges to a delay node as one v2 batch, due
  ``retry_after_ms`` later, or to the dead-letter subject once ``max_attempts`` is reached:
  the copies (attempts + 1, a new id, the original in ``hourglass.origin_id``) and that
  decision are ``node/realtime/nack.py``; the handles are acked only after both succeeded.
* New subjects (``node/realtime/creator.py``): the subjects of a SendBatch or Pull that the
  store does not know are created first, in a round shared with every request that asks
  meanwhile, on a worker thread (one fsync of ``index/`` and one subjects-journal record
  per round), so sends to existing subjects never wait behind them. Each principal is held
  to ``subjects_new_per_minute_max`` and ``subjects_owned_max`` (``cluster/quota.py``);
  messages of a subject past a quota are refused (OVERLOADED, "quota exceeded: ...").
  Nodes (a delay node's dispatch with a node certificate) count against no principal.
* Disk (``docs/operations.md``, "Disk"): a SendBatch whose bound (``write_bytes_bound``)
  would take free space below the watermark, or that comes while the node refuses writes
  (``DiskMonitor``: a reading every ``disk_check_interval_ms`` plus what was admitted since),
  is refused whole with ``DiskFull`` (RESOURCE_EXHAUSTED, "disk full: node ADDRESS has N
  bytes ..."), and a write that hits ENOSPC answers the same; pulls, acks and retention go
  on. Every ``retention_interval_ms`` retention decides and detaches on the loop
  (``RealtimeStore.retention_plan``), deletes and copies on a worker thread, swaps compacted
  index files in on the loop, then reports sizes and what holds data.
"""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np

from cluster import security, status
from cluster.clock import Clock, SystemClock
from cluster.codec import Batch, check_subject
from cluster.quota import SubjectQuota, SubjectQuotas
from cluster.discovery import MetaResolver
from cluster.errors import HourglassError, InvalidArgument, NotLeader, UnknownSubject
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.security import Action
from cluster.transport import Channels
from cluster.wire import BatchResult, pack_ranges, serve_ordered, unpack_ranges
from node.aio import wait_event
from node.config import NodeSettings
from node.grpcserver import start_grpc
from node.intake import SendIntake
from node.lifecycle import side_tasks
from node.metrics import NodeMetrics
from node.nodestatus import disk_status
from node.realtime.creator import SubjectCreator
from node.realtime.immediate import due_later, refuse_due_later
from node.realtime.nack import nack_copies
from node.realtime.retries import send_retries
from node.realtime.store import DLQ_SUBJECT, RealtimeStore, RetentionReport
from node.realtime.upkeep import RealtimeUpkeep
from node.role import SINGLE, Role
from node.realtime.fence import CONSUMERS_REVISION_KEY, FENCE_REVISION_KEY, NodeFences
from node.store.diskspace import DiskMonitor, is_enospc
from node.store.group_commit import GroupCommitter
from node.store.scrubtask import ScrubTask
from node.store.verify import verify_dir

log = logging.getLogger("hourglass.realtime")

_EMPTY_BATCH = Batch.empty()
_NO_HANDLES = np.zeros(0, np.uint64)
ANONYMOUS = "anonymous"        # the one tenant of an open cluster (no authentication), for the quotas
POLL_RECHECK_S = 1.0          # a waiting pull looks again at least this often (redeliveries fall due)
LOOKAHEAD_MS_MAX = 100        # a pull's lookahead_ms is cut to this (and to visible_hold_ms_max)
GOOD_NAMES_MAX = 4096         # subject and group names a pull or ack found valid, not checked again (the rule is pure)


class RealtimeNode(SendIntake, RealtimeUpkeep, rpc.ProducerServicer, rpc.ConsumerServicer, rpc.AdminServicer):
    def __init__(self, settings: NodeSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock(settings.clock.offset_ms)
        store = RealtimeStore.open(settings.server.data_dir, settings.realtime_settings(), now_ms=self.clock.now_ms())
        store.create_subjects(settings.realtime.subjects, now_ms=self.clock.now_ms())
        # the store and its committer belong to the node's role (node/role.py); a replicated
        # node replaces the role on a switch, so a handler captures it once per call
        self.role = Role(SINGLE, store, GroupCommitter(store.messages))
        self._flushed: tuple | None = None  # (store, flush_key, loop time) of the last periodic flush
        self.creator = SubjectCreator(lambda: self.store, self._new_quotas(), self.clock,
                                      round_max=settings.realtime.subjects_round_max)
        # background CRC re-checks of the message log's sealed segments (node/store/scrubtask.py)
        self.scrubber = ScrubTask(self, rate_bytes_per_s=int(settings.scrub.rate_mib_s * (1 << 20)),
                                  step_bytes_max=settings.scrub.step_bytes_max,
                                  pass_interval_ms=settings.scrub.pass_interval_ms)
        self.channels = Channels()
        self.metrics = NodeMetrics("realtime", settings.server.node_id)
        self.disk = DiskMonitor(settings.server.data_dir, settings.disk_watermark(), address=lambda: self.address)
        self.last_retention: tuple[RetentionReport, dict[str, int]] | None = None
        self._counted: tuple[object, dict[str, int]] = (None, {})  # store counters already put into metrics
        self._new_data: dict[str, set[asyncio.Event]] = {}  # subject -> events of the pulls waiting on it
        self._groups_dirty: set[tuple[str, str]] = set()
        self._groups_lock = asyncio.Lock()
        self._groups_rounds_started = 0
        self._groups_rounds_done = 0
        self._good_names: set[str] = set()  # ``_authorize_consume``: names that follow the subject rule
        self.calls = {"send": 0, "pull": 0, "pull_polls": 0, "pull_messages": 0, "ack": 0, "ack_on_pull": 0, "ack_rounds": 0,
                      "browse": 0, "trace": 0}
        self.address = ""
        self.registrar = None
        # subjects this group no longer takes (a narrowing): from the meta server's answers
        self.fences = NodeFences(settings.server.group, required=bool(settings.meta.servers))
        self.resolver = None
        if settings.meta.servers:
            self.resolver = MetaResolver(  # delay nodes for nacks through the meta server
                settings.meta.servers, refresh_ms=settings.meta.refresh_ms, timeout_s=settings.meta.timeout_ms / 1000)

    @property
    def store(self) -> RealtimeStore:
        return self.role.store

    @property
    def committer(self) -> GroupCommitter:
        return self.role.committer

    def _new_quotas(self) -> SubjectQuotas:
        """Quotas counting what the store's subjects journal says each principal owns."""
        s = self.settings
        return SubjectQuotas(SubjectQuota(s.realtime.subjects_new_per_minute_max, s.realtime.subjects_owned_max),
                             self.store.owned_counts(), where="on this node")

    @staticmethod
    def _quota_owner() -> str | None:
        """Whom a new subject of this call counts against: the caller's principal name, the
        one anonymous tenant when security is off, nobody (None) for a node certificate."""
        p = security.caller()
        if p is None:
            return ANONYMOUS
        return None if p.node else p.name

    async def _create_subjects(self, subjects) -> dict[str, HourglassError]:
        """Create the subjects the store lacks (a shared round, off the loop); returns those refused."""
        if not self.settings.realtime.auto_create_subjects or not self.store.missing_subjects(subjects):
            return {}
        return await self.creator.create(subjects, self._quota_owner())

    # ------------------------------------------------------------------ producer side

    async def SendBatch(self, request: pb.SendBatchRequest, context) -> pb.SendBatchResponse:
        batch, now = await self._authorized_batch(request, context)
        await self._serving(context, request.epoch)
        return await self._store_batch(batch, now, request.immediate, context)

    async def _store_batch(self, batch: Batch, now: int, immediate: bool, context) -> pb.SendBatchResponse:
        """Append and fsync one authorized batch, wake the pulls waiting for its subjects."""
        self.calls["send"] += 1
        role = self.role  # this call's store and committer, whatever a role switch does meanwhile
        try:
            role.check()
            self.fences.check_loaded()  # after a (re)start: not before the meta server said what is fenced
            self._admit_batch(batch, role.store.write_bytes_bound)  # refused whole, nothing stored
            new = self.store.missing_subjects(batch.subjects)
            refused = await self._create_subjects(batch.subjects) if new else {}
            self._still_serving(role)  # from here on self.store is role.store until the next await
            if refused:
                self.metrics.errors.labels(kind="subject_refused").inc(len(refused))
            slices = self._frame_slices(batch, new)
            if slices is None:
                res = self._append(batch, now_ms=self.clock.now_ms(), immediate=immediate, refused=refused)
                first_visible = self.store.appended_visible_ms
            else:
                res, first_visible = await self._append_slices(batch, slices, immediate, refused)
        except HourglassError as e:
            await status.abort(context, self._refusal(e))
        stored = (res.codes == pb.OK) & (res.duplicates == 0)
        if self._new_data and stored.any():  # a long poll waits: wake it for the subjects that got messages
            # before the fsync: a pull may hand out what is not durable yet (at least once:
            # the sender is answered only after the fsync and sends again after a crash;
            # an ack is made durable only after the messages it covers, _groups_durable).
            # Messages dispatched ahead of their due time (dispatch_lead_ms) wake it when
            # the first of them is due.
            hit = np.bincount(batch.subject_idx[stored], minlength=len(batch.subjects))
            subjects = [batch.subjects[k] for k in np.flatnonzero(hit).tolist()]
            first = first_visible
            wait_s = self.clock.seconds_until(first) if first > now else 0.0
            if wait_s > 0:
                asyncio.get_running_loop().call_later(wait_s, self._wake, subjects)
            else:
                self._wake(subjects)
        try:
            await role.committer.sync_to(role.store.messages.end_offset)  # a switch meanwhile: NotLeader
        except HourglassError as e:
            await status.abort(context, e)
        self.metrics.ingested.inc(int(stored.sum()))
        if res.errors:
            self.metrics.errors.labels(kind="refused_message").inc(len(res.errors))
        return res.to_pb()

    def _frame_slices(self, batch: Batch, new: list[str]) -> list[np.ndarray] | None:
        """Issue 27: each subject of a frame costs an index write on the event loop (a write to
        its index file, about 5-7 us, more for a new subject's empty file or while the disk
        journal commits, and an open when its descriptor was evicted). A send of more than
        ``subjects_per_frame_max`` subjects, or that created more than
        ``subjects_new_per_frame_max``, is therefore stored as several frames, each within
        both limits, the loop serving other calls between them (one send of 300 subjects
        held every other send for 8-10 ms); returns the message indexes of each, in order,
        or None for one frame. A subject's messages all stay in one frame, in their order, so
        de-duplication inside the batch and per-subject order are those of one frame."""
        per_new = self.settings.realtime.subjects_new_per_frame_max
        per_all = self.settings.realtime.subjects_per_frame_max
        if len(new) <= per_new and len(batch.subjects) <= per_all:
            return None
        fresh = set(new)
        slice_of = np.zeros(len(batch.subjects), np.int64)
        k = n_all = n_new = 0
        for i, s in enumerate(batch.subjects):
            is_new = s in fresh
            if n_all >= per_all or (is_new and n_new >= per_new):
                k, n_all, n_new = k + 1, 0, 0
            slice_of[i] = k
            n_all += 1
            n_new += is_new
        of_msg = slice_of[batch.subject_idx]
        order = np.argsort(of_msg, kind="stable")
        cuts = np.flatnonzero(np.diff(of_msg[order])) + 1
        return [part for part in np.split(order, cuts) if len(part)]

    async def _append_slices(self, batch: Batch, slices: list[np.ndarray], immediate: bool,
                             refused: dict[str, HourglassError]) -> tuple[BatchResult, int]:
        """Append ``batch`` as one frame per slice (``_frame_slices``), letting the loop serve
        other calls between them. Every message gets its own answer, as in one frame: a
        refusal of the first slice refuses the call (nothing stored); a failure of a later one
        (the disk, the store closed by a role change) refuses that slice's messages and the
        rest with that error, and the messages already stored stay answered OK (a retry of
        the refused ones is de-duplicated by id as always). Returns the result and the
        earliest visible time of what was stored."""
        role = self.role
        store = role.store
        res = BatchResult.sized(batch.n)
        res.deliver_at_ms[:] = batch.deliver_at_ms
        first_visible: int | None = None
        for j, idx in enumerate(slices):
            if j:
                await asyncio.sleep(0)  # the other calls' turn: at most one slice of new subjects per step
            try:
                self._still_serving(role)  # a role change ended this call's role meanwhile: not the master now
                part = self._append(batch.take(idx), now_ms=self.clock.now_ms(), immediate=immediate,
                                    refused=refused)
            except HourglassError as e:
                if not j:
                    raise
                e = self._refusal(e)
                rest = np.concatenate(slices[j:])
                code, text = status.to_code(e), str(e)
                for i in rest.tolist():
                    res.refuse(i, code, text)
                break
            res.place(idx, part)
            if first_visible is None or store.appended_visible_ms < first_visible:
                first_visible = store.appended_visible_ms
        return res, first_visible if first_visible is not None else 0

    def _append(self, batch: Batch, *, now_ms: int, immediate: bool,
                refused: dict[str, HourglassError] | None = None) -> BatchResult:
        """Append what a real-time node takes (``node/realtime/immediate.py``: without
        ``immediate``, messages due later are refused, they belong on a delay node); messages
        of ``refused`` subjects (a quota) are refused with their error, those of fenced
        subjects with ``RouteMoved`` (``node/realtime/fence.py``; no await before the append)."""
        late = due_later(batch.deliver_at_ms, now_ms=now_ms, immediate=immediate)
        fenced = self.fences.fenced(batch)
        if not len(late) and not len(fenced):
            return self.store.append(batch, now_ms=now_ms, refused_subjects=refused)
        keep = np.setdiff1d(np.arange(batch.n), np.union1d(late, fenced))
        part = self.store.append(batch.take(keep), now_ms=now_ms, refused_subjects=refused)
        res = refuse_due_later(batch.deliver_at_ms, keep, part, late)
        self.metrics.errors.labels(kind="route_moved").inc(self.fences.refuse(res, batch, fenced))
        return res

    async def _wait_new_data(self, subjects: list[str], timeout_s: float) -> None:
        """Wait until a SendBatch stores a message of one of ``subjects`` (or ``timeout_s``).
        Only an empty pull registers: a pull that found data answers without an event."""
        ev = asyncio.Event()
        for s in subjects:
            self._new_data.setdefault(s, set()).add(ev)
        try:
            await wait_event(ev, timeout_s)
        finally:
            for s in subjects:
                waiting = self._new_data.get(s)
                if waiting is not None:
                    waiting.discard(ev)
                    if not waiting:
                        del self._new_data[s]

    def _wake(self, subjects) -> None:
        for s in subjects:
            for ev in self._new_data.pop(s, ()):
                ev.set()

    async def Cancel(self, request, context):
        return pb.CancelResponse(code=pb.INVALID_ARGUMENT, error="cancel is answered by delay nodes")

    async def Lookup(self, request, context):
        return pb.LookupResponse(code=pb.INVALID_ARGUMENT, error="lookup is answered by delay nodes")

    # ------------------------------------------------------------------ consumer side

    async def _authorize_consume(self, context, group: str, subjects) -> None:
        """First thing of Pull, Ack and Nack: the group and every subject follow the subject
        rule (INVALID_ARGUMENT), the caller may consume them in that group (PERMISSION_DENIED;
        naming no subject, as an empty Ack does, needs a consume grant for the group all the
        same), and only then this node says whether it serves (``_serving``)."""
        subjects = list(subjects)
        limit = self.settings.limits.subject_bytes_max
        good = self._good_names
        try:
            if not group:
                raise InvalidArgument("group", "is required")
            if group not in good:
                check_subject(group, "group", limit)
            for s in subjects:
                if s not in good:
                    check_subject(s, "subject", limit)
                    if len(good) < GOOD_NAMES_MAX:
                        good.add(s)
            if len(good) < GOOD_NAMES_MAX:
                good.add(group)
        except HourglassError as e:
            await status.abort(context, e)
        await security.require(context, Action.CONSUME, subjects, group)
        await self._serving(context)

    async def Pull(self, request: pb.PullRequest, context) -> pb.PullResponse:
        subjects = list(dict.fromkeys([*([request.subject] if request.subject else []), *request.subjects]))
        if not subjects:
            await status.abort(context, InvalidArgument("subject", "name a subject (subject or subjects)"))
        await self._authorize_consume(context, request.group, [*subjects, *(sh.subject for sh in request.acks)])
        max_messages = min(request.max_messages or self.settings.realtime.pull_max, self.settings.realtime.pull_max)
        lookahead = min(request.lookahead_ms, self.settings.realtime.visible_hold_ms_max, LOOKAHEAD_MS_MAX)
        group, consumer, tags = request.group, request.consumer_id or "anonymous", list(request.tags)
        role = self.role  # a replicated node may switch roles meanwhile: this call stops polling then
        store = role.store
        if request.acks:  # acks riding on this pull: committed with the next round, not awaited
            try:
                n = store.ack_many(group, [(sh.subject, sh.ranges) for sh in request.acks],
                                        now_ms=self.clock.now_ms())
            except HourglassError as e:
                await status.abort(context, e)
            self.calls["ack_on_pull"] += 1
            self.metrics.acked.inc(n)
        try:  # consumers may subscribe before the first message of a subject arrives
            refused = await self._create_subjects(subjects)
        except HourglassError as e:
            await status.abort(context, e)
        if refused:
            await status.abort(context, next(iter(refused.values())))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.wait_ms, self.settings.realtime.pull_wait_ms_max) / 1000
        batch, handles = _EMPTY_BATCH, _NO_HANDLES
        created: set[str] = set()
        while self.role is role and not role.ended:
            self.calls["pull_polls"] += 1
            try:
                now = self.clock.now_ms()
                if lookahead:  # answers once something is a third of the lookahead from visible
                    batch, handles = store.pull_ahead(subjects, group, consumer, max_messages=max_messages,
                                                      tags=tags, now_ms=now, lookahead_ms=lookahead)
                else:
                    batch, handles = store.pull(subjects, group, consumer, max_messages=max_messages, tags=tags,
                                                now_ms=now)
            except UnknownSubject as e:
                if not self.settings.realtime.auto_create_subjects or e.subject in created:
                    await status.abort(context, e)
                try:  # the store was swapped (a role change) after the round above: one subject, here
                    store.create_subject(e.subject, owner=self._quota_owner() or "", now_ms=self.clock.now_ms())
                except HourglassError as e2:
                    await status.abort(context, e2)
                created.add(e.subject)
                continue
            except HourglassError as e:
                await status.abort(context, e)
            left = deadline - loop.time()
            if batch.n or left <= 0:
                break
            wait_s = min(left, POLL_RECHECK_S)
            if store.held_next_ms is not None:  # messages stored ahead of their due time: until the first is due
                # (a lookahead pull: until it is a third of the lookahead from visible, then it takes
                # what is visible within the lookahead: about two thirds of it per answer)
                at = store.held_next_ms - lookahead // 3
                wait_s = max(0.0, min(wait_s, self.clock.seconds_until(at)))
            await self._wait_new_data(subjects, wait_s)
        self.calls["pull"] += 1
        self.calls["pull_messages"] += batch.n
        self.metrics.delivered.inc(batch.n)
        return pb.PullResponse(batch=batch.encode(), handles=handles.astype("<u8").tobytes())

    async def PullStream(self, requests, context):
        """Pull on an ordered stream (docs/api.md): each pull is answered before the next is read."""
        async for resp in serve_ordered(requests, context, self.Pull, pb.PullResponse, window=1):
            yield resp

    def _ranges(self, items) -> list[tuple[str, np.ndarray]]:
        """(subject, (k, 2) ranges) of the SubjectHandles of an Ack or Nack."""
        return [(sh.subject, unpack_ranges(sh.ranges)) for sh in items]

    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        await self._authorize_consume(context, request.group, {sh.subject for sh in request.acks})
        self.calls["ack"] += 1
        now = self.clock.now_ms()
        role = self.role  # this call's store and committer, whatever a role switch does meanwhile
        try:
            n = role.store.ack_many(request.group, [(sh.subject, sh.ranges) for sh in request.acks], now_ms=now)
        except HourglassError as e:
            await status.abort(context, e)
        try:  # durable before the answer
            await self._groups_durable({(sh.subject, request.group) for sh in request.acks}, role)
        except HourglassError as e:  # DiskFull: the offsets record hit ENOSPC; the ack is not durable
            await status.abort(context, self._refusal(e))
        self.metrics.acked.inc(n)
        return pb.AckResponse(acked=n)

    async def Browse(self, request: pb.BrowseRequest, context) -> pb.BrowseResponse:
        """What the group has not acked, read without consuming (``node/realtime/browse.py``)."""
        await self._authorize_consume(context, request.group, [request.subject])
        self.calls["browse"] += 1
        max_messages = min(request.max_messages or self.settings.realtime.pull_max, self.settings.realtime.pull_max)
        try:
            batch, positions, nxt, end = self.role.store.browse(request.subject, request.group,
                                                                from_position=request.from_position,
                                                                max_messages=max_messages)
        except HourglassError as e:
            await status.abort(context, e)
        return pb.BrowseResponse(batch=batch.encode() if batch is not None else b"",
                                 positions=positions.astype("<u8").tobytes(), next_position=nxt, end_position=end)

    async def Trace(self, request: pb.TraceRequest, context) -> pb.TraceResponse:
        """Consumer/Trace (the real-time lookup): where one message is here and what each group did with it
        (``node/realtime/lookup.py``). A cancel or consume grant on the subject."""
        try:
            check_subject(request.subject, "subject", self.settings.limits.subject_bytes_max)
            if not request.id:
                raise InvalidArgument("id", "is required")
        except HourglassError as e:
            await status.abort(context, e)
        await security.require(context, (Action.CANCEL, Action.CONSUME), [request.subject])
        await self._serving(context)
        self.calls["trace"] += 1
        try:
            f = self.role.store.lookup(request.subject, request.id, around_ms=request.around_ms)
        except HourglassError as e:
            await status.abort(context, e)
        return pb.TraceResponse(
            position=f.position, seq=f.seq, stored_ms=f.stored_ms, node_id=self.settings.server.node_id,
            group=self.settings.server.group, attempts=f.attempts, found_by=f.found_by,
            groups=[pb.GroupTrace(group=g.group, state=g.state, copy_id=g.copy_id, copy_subject=g.copy_subject,
                                  copy_ms=g.copy_ms) for g in f.groups])

    async def _groups_durable(self, keys: set[tuple[str, str]], role: Role | None = None) -> None:
        """Group commit of consumer-group positions: acks that arrive while a commit is running
        are committed together by the next one (one offsets-log record and one fsync per
        round, on the store's writer thread, never blocking the event loop). ``role``: the
        role the caller acked on (default: the current one); NotLeader once it ended."""
        role = role or self.role
        self._groups_dirty |= keys
        registered_at = self._groups_rounds_started
        async with self._groups_lock:
            if self._groups_rounds_done > registered_at:
                return  # a round that started after this ack was registered has written it
            self._still_serving(role)  # a role switch meanwhile: never written to another term's store
            store, committer = role.store, role.committer
            self._groups_rounds_started += 1
            keys, self._groups_dirty = self._groups_dirty, set()
            items = store.snapshot_groups(keys)
            if items:
                # a pull may hand out messages before their fsync (SendBatch): a position is
                # never durable before the messages it passes, or a crash would skip new ones
                await committer.sync_to(store.messages.end_offset)
                self.calls["ack_rounds"] += 1
                try:
                    await asyncio.wrap_future(store.write_groups_async(items))
                except BaseException:
                    # not known durable: a later round must write these again, and no ack
                    # may be answered OK on the strength of this one
                    store.unpersist_groups(items)
                    self._groups_dirty |= keys
                    raise
            self._groups_rounds_done = self._groups_rounds_started

    async def Nack(self, request: pb.NackRequest, context) -> pb.NackResponse:
        await self._authorize_consume(context, request.group, {sh.subject for sh in request.nacks})
        now = self.clock.now_ms()
        retried = dead = 0
        # the role this call nacks on: a role change may end it at any await below; the call
        # then stops with NOT_LEADER (retryable; the handles it did not ack come again)
        # instead of acking on another term's store (issue 29)
        role = self.role
        store, committer = role.store, role.committer
        for subject, ranges in self._ranges(request.nacks):
            try:
                got, handles = store.nack(subject, request.group, ranges, now_ms=now)
                to_retry, to_dlq = nack_copies(got, now_ms=now, retry_after_ms=request.retry_after_ms,
                                               max_attempts=self.settings.realtime.max_attempts, group=request.group)
                if to_retry.n:
                    await self._send_to_delay(to_retry)
                    self._still_serving(role)
                if to_dlq.n:
                    res = store.append(to_dlq, now_ms=now)
                    await committer.sync_to(store.messages.end_offset)
                    self._still_serving(role)
                    if res.errors:
                        raise HourglassError(f"dead-letter append failed: {next(iter(res.errors.values()))}")
                    self.metrics.dead_lettered.inc(to_dlq.n)
                    self._wake([DLQ_SUBJECT])
                if handles.size:
                    store.ack(subject, request.group, unpack_ranges(pack_ranges(handles)), now_ms=now)
            except HourglassError as e:
                await status.abort(context, e)
            retried += to_retry.n
            dead += to_dlq.n
        await self._groups_durable({(sh.subject, request.group) for sh in request.nacks}, role)
        return pb.NackResponse(retried=retried, dead_lettered=dead)

    def _still_serving(self, role: Role) -> None:
        """After an await of a call that began on ``role``: NotLeader if a role change has
        ended or replaced it meanwhile."""
        if self.role is not role or role.ended:
            raise NotLeader()

    async def _send_to_delay(self, batch: Batch) -> None:
        nodes = self.settings.meta.delay_nodes
        if not nodes and self.resolver is not None:
            nodes = await self.resolver.delay_nodes()
        await send_retries(self.channels, nodes, batch)

    # ------------------------------------------------------------------ admin

    def stats(self) -> dict:
        return {"role": "realtime", "node_id": self.settings.server.node_id, "group": self.settings.server.group,
                "epoch": self.store.epoch, "address": self.address, "now_ms": self.clock.now_ms(),
                "subjects": self.store.subjects(), "message_log_end": self.store.messages.end_offset,
                "fsyncs": self.committer.fsyncs, "counters": dict(self.store.counters), "calls": dict(self.calls),
                "subject_rounds": self.creator.rounds, "subjects_created": self.creator.created,
                "scrub": self.scrubber.status(), **self._group_stats(), "master_changes_1h": 0,
                "route_drains": self.fences.progress(self.store),
                "disk": disk_status(self.disk, None if self.last_retention is None else self.last_retention[1])}

    def _group_stats(self) -> dict:
        rows, left_out = self.store.group_rows(self.settings.status.groups_max)
        return {"groups": rows, "groups_left_out": left_out}

    def registration_info(self) -> dict:
        return {"master": True, "epoch": self.store.epoch,
                "offsets": {"message_log_end": self.store.messages.end_offset,
                            FENCE_REVISION_KEY: self.fences.revision,
                            CONSUMERS_REVISION_KEY: self.fences.consumers_revision}}

    async def Status(self, request, context) -> pb.StatusResponse:
        sv = self.settings.server
        return pb.StatusResponse(node_id=sv.node_id, role="realtime", group=sv.group, master=True,
                                 epoch=self.store.epoch, json=json.dumps(self.stats()))

    async def Verify(self, request, context) -> pb.VerifyResponse:
        """Check this node's files now (throttled, on a worker thread); a corrupt sealed
        message-log segment goes to the scrub task's repair (a replicated node fetches it
        from a member of its group)."""
        store = self.store
        report = await asyncio.get_running_loop().run_in_executor(None, lambda: verify_dir(
            store.root, online=True, rate_bytes_per_s=self.settings.scrub.verify_rate_mib_s * (1 << 20),
            record_bytes_max=store.messages.record_bytes_max))
        await self.scrubber.take_findings(report)
        return pb.VerifyResponse(summary=report.summary(), corrupt=report.corrupt_count,
                                 unrepaired=report.unrepaired, json=report.to_json())

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        try:
            server, self.address = await start_grpc(self.settings, producer=self, consumer=self, admin=self)
        except BaseException:  # the port is taken (or the start was cut): close the files opened for it
            self.store.close()
            raise
        self.health = server.health
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.committer.run(self.metrics.observe_commit), name="group-commit"),
                         tg.create_task(self.creator.run(), name="subjects"),
                         tg.create_task(self._flush_loop(), name="flush"),
                         tg.create_task(self._disk_loop(), name="disk"),
                         tg.create_task(self._retention_loop(), name="retention")]
                tasks += side_tasks(tg, self, log)
                log.info("real-time node serving node_id=%s address=%s epoch=%d", self.settings.server.node_id,
                         self.address, self.store.epoch)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                if self.registrar is not None:
                    await self.registrar.close()
                await server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
        finally:
            await self.channels.close()
            if self.resolver is not None:
                await self.resolver.close()
            await server.stop(grace=None)
            try:
                self.store.close()
            except OSError as e:  # the last checkpoint cannot be written: the log is fsynced, replay covers it
                if not is_enospc(e):
                    raise
                log.error("checkpoint at close not written (no space left) path=%s", self.settings.server.data_dir)
            self.metrics.stop()
