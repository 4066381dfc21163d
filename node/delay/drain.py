"""Draining a delay group: its pending messages move to the other delay groups.

An operator runs ``hourglass admin drain GROUP``; the meta server writes the drain to etcd
(``metaserver/drains.py``) and leaves the group out of ``GetServers`` for producers. The
group's master (``DrainTask``, one of its master tasks, so a new master after a failover
carries on) learns it from the meta servers within ``drain_idle_poll_ms`` (5 s; a slave does
not ask) and then, every ``drain_poll_ms`` (1 s):

1. refuses ``SendBatch`` (``Unavailable``, naming the drain: a producer with a stale view
   refreshes and sends elsewhere; ``check_accepting``);
2. walks its schedule log second by second from now on (what is due before
   ``now + drain_horizon_ms`` is only counted: *near*, fired here), and for each other
   pending message (a message record, not cancelled, not fired, not voided) picks its
   target: ``group_for(id)`` over the delay groups not draining, the SDK's own rule, so the
   SDK's cancel and lookup ask that group first (``plan_moves``, pure);
3. sends the records as they are (same id, payload, subject, extras, and the absolute
   ``deliver_at_ms`` column: due times unchanged) to each target's master, one ``SendBatch``
   per target of at most ``drain_batch_max``; the target answers after its fsync (and, with
   ``sync`` acks, after a slave has it): durable there;
4. only then appends a *moved* tombstone for each acknowledged message to its own message
   log (a cancel tombstone whose extras carry ``hourglass.moved_to = TARGET``): replicated
   like every record, it takes the message out of the wheel and the pending count, and it
   answers later cancels and lookups of the id (forwarded to the target, ``forward``).

Order of writes: target durable, then the tombstone. A crash between the two leaves the
message in both groups; the next master sends it again and the target answers it as a
duplicate (same id, same content: de-duplicated), then the tombstone is written. Messages due
within the horizon are not moved: the group fires them itself (a move could race the wheel,
which loads a second ``window_ms`` before it). The group is *empty* when nothing is pending,
in flight or waiting to be filed (``empty``).

Worked example (``plan_moves``): groups ``delay-g1`` (master a), ``delay-g3`` (master "");
now 1_000_000, horizon 5_000; a batch of three pending messages due 1_002_000, 1_010_000
and 1_020_000, whose ids hash to g1, g1 and g3: the first is *near* (fired here), the second
moves to ``delay-g1``, the third is *unplaced* (its target has no master: next round).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import dataclass, field

import grpc
import numpy as np

from cluster import status
from cluster.codec import KIND_CANCEL, KIND_MESSAGE, Batch, encode_extra
from cluster.errors import HourglassError, Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import meta_pb2 as mpb
from cluster.wire import BatchResult, make_request
from node.delay import lookup
from node.store.records import Message

log = logging.getLogger("hourglass.delay.drain")

MOVED_TO = "hourglass.moved_to"   # property of a moved tombstone: the group that holds the message now
SEND_TIMEOUT_S = 10.0             # one move (SendBatch to the target's master)
YIELD_SECONDS = 64                # seconds of the schedule log walked between yields to the loop


# ---------------------------------------------------------------------- pure rules


def moved_extra(group: str) -> bytes:
    """The extras of a moved tombstone."""
    return encode_extra((), [(MOVED_TO, group)])


def moved_to(m: object) -> str | None:
    """The group a record's message moved to, if the record is a moved tombstone."""
    if not isinstance(m, Message) or m.kind != KIND_CANCEL:
        return None
    return dict(m.properties).get(MOVED_TO)


def group_index(ids: list[str], n: int) -> np.ndarray:
    """``cluster.client.group_for`` over a batch: crc32 of each id modulo the group count."""
    return np.fromiter(map(zlib.crc32, map(str.encode, ids)), np.int64, len(ids)) % n


@dataclass(frozen=True, slots=True)
class Plan:
    moves: dict[str, np.ndarray] = field(default_factory=dict)  # target group -> record indices
    near: int = 0       # pending, due within the horizon: fired by this group
    unplaced: int = 0   # pending, its target has no master now: a later round


def plan_moves(batch: Batch, live: np.ndarray, *, now_ms: int, horizon_ms: int,
               groups: list[tuple[str, str]]) -> Plan:
    """Where each live record of ``batch`` goes. ``live``: a mask of the pending messages
    (the shell's: message records, not cancelled, not fired); ``groups``: the delay groups
    not draining as sorted ``(name, master or "")``. Pure: time comes in as ``now_ms``."""
    assert len(live) == batch.n
    if not groups:
        return Plan(near=int(np.count_nonzero(live & (batch.effective_ms < now_ms + horizon_ms))))
    far = live & (batch.effective_ms >= now_ms + horizon_ms)
    near = int(np.count_nonzero(live)) - int(np.count_nonzero(far))
    idx = np.flatnonzero(far)
    if not len(idx):
        return Plan(near=near)
    gi = group_index([batch.id(int(i)) for i in idx], len(groups))
    moves, unplaced = {}, 0
    for k in np.unique(gi).tolist():
        name, master = groups[k]
        if master:
            moves[name] = idx[gi == k]
        else:
            unplaced += int(np.count_nonzero(gi == k))
    return Plan(moves, near, unplaced)


def live_mask(batch: Batch, *, cancelled: set[int], status_of) -> np.ndarray:
    """Pending messages of a schedule frame: message records whose seq no tombstone names
    (``cancelled``: the targets of the tombstones filed in the same second, and those not
    filed yet) and whose status (``status_of(seq, eff)``) is pending."""
    out = batch.kind == KIND_MESSAGE
    for i in np.flatnonzero(out).tolist():
        seq = int(batch.seq[i])
        if seq in cancelled or status_of(seq, int(batch.effective_ms[i])) != "pending":
            out[i] = False
    return out


def tombstone_targets(batch: Batch) -> set[int]:
    """Seqs named by the tombstones of a frame (payload: the target's seq, little endian)."""
    out = set()
    for i in np.flatnonzero(batch.kind == KIND_CANCEL).tolist():
        out.add(int.from_bytes(batch.payload(i)[:8], "little"))
    return out


def state_of(draining: bool, pending: int, in_flight: int, unfiled: int) -> str:
    if not draining:
        return "serving"
    return "empty" if pending == 0 and in_flight == 0 and unfiled == 0 else "draining"


# ---------------------------------------------------------------------- the shell


class _RaiseContext:
    """A servicer context for calls made outside a request: ``abort`` raises the error."""

    async def abort(self, code, details, trailing_metadata=None):
        raise Unavailable(f"drain: {details}")


_RAISE = _RaiseContext()


class DrainTask:
    """The drained group's side: state from the meta servers, moves, forwarding. Owned by a
    ``DelayNode`` (``node.drain``); ``run`` is one of its master tasks."""

    def __init__(self, node) -> None:
        self.node = node
        self.draining = False          # sticky: a drain is never undone while the node runs
        self.groups: list[tuple[str, str]] = []      # delay groups not draining, sorted
        self.masters: dict[str, str] = {}            # every delay group -> master ("" none)
        self.counters = {"moved": 0, "duplicates": 0, "refused": 0, "raced": 0, "rounds": 0}
        self.near = 0
        self.unplaced = 0
        self._resume = 0   # epoch second the next round starts at (0: now)

    # ------------------------------------------------------------------ what the servicer asks

    def check_accepting(self) -> None:
        """``Unavailable`` while draining: the producer refreshes its view and sends elsewhere."""
        if self.draining:
            raise Unavailable(f"delay group {self.node.settings.server.group!r} is draining (hourglass admin drain): "
                              f"send to another delay group")

    def moved(self, msg_id: str) -> str | None:
        """The group an id's message moved to (its newest record is a moved tombstone). Asked
        on every cancel and lookup, draining or not: after a restart the node learns that it
        drains only at its first poll, and a moved tombstone must never answer as a cancel."""
        try:
            found = lookup.find(self.node.store, msg_id)
        except HourglassError:
            return None
        return moved_to(found[0]) if found else None

    async def forward(self, group: str, method: str, request):
        """A cancel or lookup of a moved message, answered by the group that holds it."""
        master = self.masters.get(group, "")
        if not master:
            await self.refresh()
            master = self.masters.get(group, "")
        if not master:
            raise Unavailable(f"message moved to delay group {group!r}, which has no master now")
        try:
            return await getattr(self.node.channels.producer(master), method)(request, timeout=SEND_TIMEOUT_S)
        except grpc.RpcError as e:
            raise status.from_rpc_error(e) from None

    def status(self) -> dict:
        s = self.node.store
        pending = sum(s.pending_by_bucket().values())
        unfiled = len(s.unfiled.frames)
        return {"state": state_of(self.draining, pending, s.inflight, unfiled), "pending": pending,
                "in_flight": s.inflight, "unfiled_frames": unfiled,
                "near": self.near, "unplaced": self.unplaced, **self.counters}

    # ------------------------------------------------------------------ the loop

    async def refresh(self) -> None:
        router = self.node.router
        meta = getattr(router, "meta", None)
        if meta is None:  # static lists: no meta server, no drain
            return
        resp = await meta.call("GetServers", mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER, include_draining=True))
        me = self.node.settings.server.group
        self.masters = {g.name: g.master for g in resp.groups}
        self.groups = sorted((g.name, g.master) for g in resp.groups if not g.draining and g.name != me)
        if any(g.name == me and g.draining for g in resp.groups) and not self.draining:
            self.draining = True
            log.warning("draining group=%s: moving pending messages to %s", me, ",".join(n for n, _ in self.groups))

    async def run(self) -> None:
        """Ask, and move a round while draining: every ``drain_poll_ms`` (1 s) while the group
        drains, every ``drain_idle_poll_ms`` (5 s) while it does not (a drain starts at most
        that much later; a message accepted meanwhile is moved by a later round), and not at
        all on a slave (a node at rest makes no call a second of its own: issue 28)."""
        d = self.node.settings.delay
        busy_s = d.drain_poll_ms / 1000
        idle_s = max(busy_s, d.drain_idle_poll_ms / 1000)
        while True:
            try:
                if self._master():
                    await self.refresh()
                    if self.draining:
                        await self.round()
            except HourglassError as e:
                log.info("drain round: %s", e)
            await asyncio.sleep(busy_s if self.draining else idle_s)

    def _master(self) -> bool:
        is_master = getattr(self.node, "is_master", None)
        return True if is_master is None else is_master()

    async def round(self) -> None:
        """One step of the walk of the schedule log from now on: every pending message due
        past the horizon is sent to its target, in batches of ``drain_batch_max``, at most
        ``drain_round_max`` a round (the next round resumes at the second this one stopped in;
        a round that reaches the end starts the next walk from now again)."""
        st = self.node.settings
        now = self.node.clock.now_ms()
        self.counters["rounds"] += 1
        near = unplaced = queued = sent = walked = 0
        todo: dict[str, list[Batch]] = {}
        bucket_ms = self.node.store.schedule.bucket_ms
        begin = max(now // 1000, self._resume)  # the seconds before the horizon only count (near)
        self._resume = 0
        for start, count in sorted(self.node.store.pending_by_bucket().items()):
            if count <= 0 or start + bucket_ms <= begin * 1000:
                continue
            for second in range(max(start // 1000, begin), (start + bucket_ms) // 1000):
                walked += 1
                if walked % YIELD_SECONDS == 0:
                    await asyncio.sleep(0)
                store = self.node.store  # a role switch replaces it: take it afresh after a yield
                frames = store.schedule.load_second(second)
                if not frames:
                    continue
                cancelled = set(store.core.unfiled_cancels)
                for f in frames:
                    cancelled |= tombstone_targets(f.batch)
                for f in frames:
                    b = f.batch
                    live = live_mask(b, cancelled=cancelled, status_of=store.core.status)
                    voided = store.voided_mask(b.seq)
                    if voided is not None:
                        live &= ~voided
                    plan = plan_moves(b, live, now_ms=now, horizon_ms=st.delay.drain_horizon_ms, groups=self.groups)
                    near += plan.near
                    unplaced += plan.unplaced
                    for target, idx in plan.moves.items():
                        todo.setdefault(target, []).append(b.take(idx))
                        queued += len(idx)
                if queued >= st.delay.drain_batch_max:
                    await self._send_all(todo)
                    sent, todo, queued = sent + queued, {}, 0
                    if sent >= st.delay.drain_round_max:
                        self._resume = second  # the rest next round
                        self.near, self.unplaced = near, unplaced
                        return
        if queued:
            await self._send_all(todo)
        self.near, self.unplaced = near, unplaced

    async def _send_all(self, todo: dict[str, list[Batch]]) -> None:
        await asyncio.gather(*(self._move(t, Batch.concat(bs) if len(bs) > 1 else bs[0]) for t, bs in todo.items()))

    async def _move(self, target: str, batch: Batch) -> None:
        """Send ``batch`` to ``target``'s master; for what it holds durably now, append moved
        tombstones here (after its answer, never before)."""
        master = self.masters.get(target, "")
        if not master:
            return
        try:
            resp = await self.node.channels.producer(master).SendBatch(make_request(batch), timeout=SEND_TIMEOUT_S)
            res = BatchResult.from_pb(resp, batch.n)
        except grpc.RpcError as e:
            log.info("drain: move of %d messages to %s (%s) failed: %s", batch.n, target, master,
                     status.from_rpc_error(e))
            return
        held = res.codes == pb.OK
        self.counters["duplicates"] += int(np.count_nonzero(held & (res.duplicates != 0)))
        refused = np.flatnonzero(~held)
        for i in refused.tolist():  # ALREADY_EXISTS: maybe cancelled there after an earlier move
            if await self._held_cancelled(master, batch.id(i)):
                held[i] = True
            else:
                self.counters["refused"] += 1
                log.warning("drain: %s refused id=%s: %s", target, batch.id(i), res.errors.get(i, res.codes[i]))
        await self._tombstones(target, master, batch, np.flatnonzero(held))

    async def _held_cancelled(self, master: str, msg_id: str) -> bool:
        try:
            r = await self.node.channels.producer(master).Lookup(pb.LookupRequest(id=msg_id), timeout=SEND_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return r.code == pb.OK and r.status == "cancelled"

    async def _tombstones(self, target: str, master: str, batch: Batch, idx: np.ndarray) -> None:
        node = self.node
        role = node.role  # this round's store and committer
        confirm = getattr(node, "_confirm_ack", None)  # a replicated master: as a client's cancel
        term = (node._term(), node.tracker) if confirm is not None else None
        extra = moved_extra(target)
        now = node.clock.now_ms()
        undo = []  # held there, but no longer pending here: cancelled or fired meanwhile
        wrote = 0
        for i in idx.tolist():
            msg_id, seq = batch.id(i), int(batch.seq[i])
            try:
                r = role.store.lookup(msg_id)
            except HourglassError:
                continue
            if r.seq != seq or r.status != "pending":
                undo.append(msg_id)  # a cancel honoured here, or fired here: not there too
                continue
            node.disk.admit(role.store.cancel_bytes_bound(msg_id))
            role.store.cancel(msg_id, now_ms=now, extra=extra)
            wrote += 1
        if wrote:
            end = role.store.messages.end_offset
            await role.committer.sync_to(end)
            node._note_durable()
            self.counters["moved"] += wrote
            log.info("drain: moved %d messages to group=%s (%s)", wrote, target, master)
            if confirm is not None:
                # sync acks: wait until a slave holds the tombstones too, so a failover now
                # leaves at most the moves of this batch to send again (de-duplicated there).
                # Not needed for safety: without a slave (ReplicationTimeout) the moves stand
                try:
                    await confirm(*term, "bytes", end, _RAISE)
                except HourglassError as e:
                    log.info("drain: tombstones of %d moves not confirmed by a slave: %s", wrote, e)
        for msg_id in undo:
            self.counters["raced"] += 1
            try:
                await node.channels.producer(master).Cancel(pb.CancelRequest(id=msg_id), timeout=SEND_TIMEOUT_S)
            except grpc.RpcError as e:
                log.warning("drain: cancel of raced id=%s at %s failed: %s", msg_id, target, e)
