"""What every replicated node shares: the election role loop, role switches, fencing
answers, sync-ack waits, metrics, status and lifecycle.

``ReplicaRoles`` is a mixin for a node class (``ReplicatedDelayNode``,
``ReplicatedRealtimeNode``, beside ``LogShipping`` of node/replication/shipping.py) that
provides:

* ``ROLE`` ("delay" | "realtime") and ``DISCOVERY_KIND`` (the GetServers kind that lists
  its groups);
* ``_switch(mode)``: end the node's current ``Role`` (node/role.py: its store, committer and
  loops) and install a master's or a slave's: the store is promoted or reopened off the
  event loop (``_role_store``), and the new role's loops (``_master_tasks`` /
  ``_slave_tasks``) run in a child TaskGroup that is always a task of the node's root
  TaskGroup (a role task that fails stops the node with its error, instead of leaving a
  master that does nothing; there is no free-task fallback: a switch needs ``run``);
* the term token of a call is its role (``_term``): an answer begun under one role is never
  given under another (``_confirm_ack``);
* ``_role_log_end()``: its message-log end (the most caught-up slave campaigns first);
* ``_grpc_services()``: keyword arguments for ``start_grpc``; ``_close_clients()``.

The pure rules are in ``node/replication/core.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from cluster import errors as E
from cluster import status
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from node.aio import wait_event, within
from node.grpcserver import start_grpc
from node.lifecycle import side_tasks
from node.nodestatus import RoleChanges
from node.registration import Registrar
from node.replication.core import (LeaderKey, Member, SyncTracker, campaign_delay_ms, in_sync_change,
                                   leader_wait_ms, may_campaign, role_step, steady_turn)
from node.replication.history import HistoryFile
from node.role import Role, off_loop
from node.store.group_commit import GroupCommitter

log = logging.getLogger("hourglass.replication")


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class ReplicaRoles:
    ROLE = ""
    DISCOVERY_KIND = 0

    # ------------------------------------------------------------------ state

    def _init_replica(self, settings, histories: dict[str, HistoryFile]) -> None:
        self.mode = "slave"
        self.member = Member(settings.server.node_id, lease_ttl_ms=settings.meta.lease_ttl_ms,
                             margin_ms=max(200, settings.meta.lease_ttl_ms // 5))
        self.histories = histories
        known = [h.history.last_epoch for h in histories.values() if h.history.entries]
        self.member.epoch = max(known) if known else 0
        self._tickets: dict[tuple[str, int], asyncio.Future] = {}
        self._changed = asyncio.Event()
        self._idle_polls = 0  # slaves' long polls waiting with the idle cap (``_poll_cap_ms``)
        self._ticket_added = asyncio.Event()  # a sync write waits for its slaves (``_sync_expiry_loop``)
        self._tg: asyncio.TaskGroup | None = None  # the root TaskGroup of ``run``: role tasks are its children
        self._switch_lock = asyncio.Lock()
        self._no_campaign_until = 0
        self._handover_until = 0   # after a graceful handover: no campaign at all until then
        self._term_checked_at = -(1 << 62)  # mono ms of the last _check_term
        self._lease_seen: int | None = None
        self._campaigned_lease: int | None = None
        self._leader_token = ""            # the token of the last Leader answer (its long poll's ``known``)
        self._leader_steady = False        # the last turn changed nothing: the next Leader call may wait
        self._in_sync: list[str] = []      # the group's in-sync set as last read (Leader answer)
        self._store_epoch = 0              # the store epoch the election handed to this node's term
        self._term_start_ms = 0
        self._refusals = 0                 # refused connects to the master in a row (dead-master report)
        self._reported_dead: int | None = None
        self._refused_logged = False
        self._peers: dict[str, int] = {}
        self._peers_read = False
        self.slave_offsets: dict[str, dict[str, int]] = {}   # slave -> log -> offset (master view)
        self.lag_bytes = 0
        self._caught_up_at = time.monotonic()
        self.failovers = 0
        self.role_changes = RoleChanges(window_ms=settings.status.master_changes_window_ms,
                                        kept_max=settings.status.master_changes_kept_max)
        self.acked_known = {name: h.acked for name, h in histories.items()}  # slave: acknowledged point per log
        self._member_lock = threading.Lock()  # the heartbeat thread renews the member's lease (_on_beat)
        self._described: dict = {}  # the last registration_info (what a switch in progress answers)

    def is_master(self) -> bool:
        return self.mode == "master" and self.member.is_master(mono_ms())

    def _may_serve(self) -> bool:
        """Whether clients are served now (the master; ``ReplicatedRealtimeNode``: not while
        it hands over)."""
        return self.is_master()

    async def _serving(self, context, epoch: int = 0) -> None:
        """Every client call, right after its authorization (the caller may do this, on these
        subjects) and before anything else: NotLeader unless this node serves clients now,
        and a request that claims a newer term (``epoch``, nodes only: authorization said so)
        is refused (``_refuse_newer_term``)."""
        if not self._may_serve():
            await self._not_master(context)
        await self._refuse_newer_term(epoch, context)

    async def _not_master(self, context):
        leader = self.member.leader
        hint = self.member.leader_address if leader and leader != self.settings.server.node_id else ""
        await status.abort(context, E.NotLeader(hint or None))

    async def _refuse_newer_term(self, request_epoch: int, context) -> None:
        """The caller claims a newer term of this group than this node knows: the request is
        refused. The claim alone deposes nobody (any client could send ``epoch=2**63``): it
        is checked with the election first (``_check_term``), and only a newer term that the
        election confirms makes this node stop acting as master."""
        if request_epoch > self.member.epoch:
            await self._check_term(request_epoch)
            await self._not_master(context)

    async def _check_term(self, claimed: int) -> None:
        """Ask the election (the meta server, etcd behind it) who leads this group now; at
        most once per ``leader_poll_ms`` (the role loop asks that often anyway), so a flood of
        such claims costs the meta server nothing more."""
        now = mono_ms()
        if now < self._term_checked_at + self.settings.replication.leader_poll_ms:
            return
        self._term_checked_at = now
        try:
            lr = await self.registrar.meta.call("Leader",
                                                mpb.LeaderRequest(role=self.ROLE, group=self.settings.server.group))
        except E.HourglassError as e:
            log.warning("a request claimed epoch %d of group %s; the election could not be asked: %s",
                        claimed, self.settings.server.group, e)
            return
        if lr.present and lr.leader.epoch > self.member.epoch:
            self.member.observed(lr.leader.node_id, lr.leader.address, lr.leader.epoch)
            log.warning("a request showed a newer term of group %s; the election confirms epoch %d (leader %s)",
                        self.settings.server.group, lr.leader.epoch, lr.leader.node_id)
        else:
            self.metrics.errors.labels(kind="UnconfirmedEpoch").inc()
            log.warning("a request claimed epoch %d of group %s; the election says %d: not believed",
                        claimed, self.settings.server.group, lr.leader.epoch if lr.present else self.member.epoch)

    def lag_ms(self) -> int:
        if self.mode == "master" or self.lag_bytes == 0:
            return 0
        return int((time.monotonic() - self._caught_up_at) * 1000)

    # ------------------------------------------------------------------ visibility

    def _bind_metrics(self) -> None:
        """The role gauges are read when scraped (on the metrics endpoint's thread: plain
        attribute reads), not set by a loop: a node at rest wakes for nothing here."""
        m = self.metrics
        m.is_master.set_function(lambda: 1 if self.is_master() else 0)
        m.replication_lag_bytes.set_function(lambda: 0 if self.mode == "master" else self.lag_bytes)
        m.replication_lag_seconds.set_function(lambda: self.lag_ms() / 1000)
        m.election_epoch.set_function(lambda: self.member.epoch)

    def registration_info(self) -> dict:
        if self.mode == "switching" and self._described:
            # a worker thread promotes or opens the store now: nothing reads it meanwhile
            # (the registration's snapshot must not fail: it would stop the node)
            return dict(self._described, master=False, epoch=self.member.epoch)
        info = super().registration_info()
        info.update(master=self.mode == "master", epoch=self.member.epoch, lag_bytes=self.lag_bytes)
        self._described = info
        return info

    def stats(self, *asked) -> dict:
        """``asked``: what the Status request asks for (a delay node's subject)."""
        if self.mode == "switching":  # the store is the switch's worker thread's now (registration_info)
            s = {"role": self.ROLE, "node_id": self.settings.server.node_id, "group": self.settings.server.group}
        else:
            s = super().stats(*asked)
        s.update({"mode": self.mode, "election_epoch": self.member.epoch, "leader": self.member.leader,
                  "ack_mode": self.settings.replication.ack_mode, "replication_lag_bytes": self.lag_bytes,
                  "replication_lag_ms": self.lag_ms(), "slaves": self.slave_offsets, "failovers": self.failovers,
                  "master_changes_1h": self.role_changes.count(mono_ms())})
        return s

    async def Status(self, request, context) -> pb.StatusResponse:
        asked = (request.subject,) if request.subject and self.ROLE == "delay" else ()  # a subject's schedule
        return pb.StatusResponse(node_id=self.settings.server.node_id, role=self.ROLE, group=self.settings.server.group,
                                 master=self.mode == "master", epoch=self.member.epoch,
                                 json=json.dumps(self.stats(*asked)))

    # ------------------------------------------------------------------ sync acknowledgements

    async def _wait(self, tracker: SyncTracker, kind: str, offset: int, context) -> None:
        """Answer only once every slave holds ``offset`` (sync ack mode); abort otherwise."""
        if tracker.slaves is not None and (not tracker.slaves or (self._peers_read
                                                                  and not tracker.slaves & set(self._peers))):
            err = E.ReplicationTimeout("no live slave in the group (ack_mode=sync): stored on the master only "
                                       "and may still take effect; retry (ids and acks are idempotent)")
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await status.abort(context, err)
        t = tracker.wait(offset, mono_ms())
        if t is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._tickets[(kind, t)] = fut
        self._ticket_added.set()
        try:
            err = await fut
        finally:
            self._tickets.pop((kind, t), None)
        if err is not None:
            self.metrics.errors.labels(kind=type(err).__name__).inc()
            await status.abort(context, err)

    def _term(self) -> Role:
        """A token of the current term of this process (see ``_confirm_ack``): its role."""
        return self.role

    def _term_over(self, term: Role) -> bool:
        return self.role is not term or term.ended

    async def _confirm_ack(self, term: Role, tracker: SyncTracker | None, kind: str, offset: int, context) -> None:
        """The last step before a write (or an ack of consumers) is answered OK.

        ``sync``: every required slave holds ``offset`` (``_wait`` on the tracker of the term
        the write was made in). Both modes: the term the write began in is still this
        node's and its lease is still surely alive. A handler that awaited an fsync or a
        slave across a demotion (and maybe a promotion after it, with the log cut and
        refilled meanwhile) must not answer OK for bytes the group may not hold: it answers
        NotLeader, whose outcome is "unknown, retry with the same ids" (ids are idempotent).
        """
        if tracker is not None and self.settings.replication.ack_mode == "sync":
            if self._term_over(term):
                await self._term_ended(context)
            await self._wait(tracker, kind, offset, context)
        if self._term_over(term) or not self.is_master():
            await self._term_ended(context)

    async def _term_ended(self, context) -> None:
        self.metrics.errors.labels(kind="TermEndedBeforeAck").inc()
        await status.abort(context, E.NotLeader(self.member.leader_address or None))

    def _release(self, kind: str, tickets: list[int], err: Exception | None = None) -> None:
        for t in tickets:
            fut = self._tickets.get((kind, t))
            if fut is not None and not fut.done():
                fut.set_result(err)

    def _trackers(self) -> dict[str, SyncTracker]:
        """kind -> tracker of this node's sync acknowledgements."""
        raise NotImplementedError

    async def _sync_expiry_loop(self) -> None:
        """Every 50 ms while sync writes wait for their slaves; with none waiting, it sleeps
        until one does (at most a second): a master at rest does not wake 20 times a second."""
        while True:
            if self._tickets:
                await asyncio.sleep(0.05)
            else:
                self._ticket_added.clear()
                await wait_event(self._ticket_added, 1.0)
                continue  # a waiter was added (or a second passed): its deadline is 5 s away
            now = mono_ms()
            err = E.ReplicationTimeout(f"no slave confirmed within {self.settings.replication.sync_timeout_ms} ms "
                                       "(ack_mode=sync); stored on the master and may still take effect: retry")
            for kind, tr in self._trackers().items():
                self._release(kind, tr.expire(now), err)
            if not self.is_master():
                self._release_all(E.NotLeader(self.member.leader_address or None))

    def _release_all(self, err: Exception) -> None:
        for kind, tr in self._trackers().items():
            self._release(kind, tr.drop_all(), err)

    # ------------------------------------------------------------------ roles

    async def _switch(self, mode: str) -> None:
        """Become master or slave (node/role.py, "Lifecycle of a switch"): end the current
        role (its loops cancelled and awaited, its committer's waiters and the sync-ack
        waiters failed with NotLeader), make the store the new mode's on a worker thread
        (``_role_store``: promote, or close and open), then install the new role and start
        its loops in the root TaskGroup. No client is served meanwhile (``mode`` is
        "switching"), and nothing on the loop writes the store while the thread works on it
        (role loops stopped; ``ReadLog`` and the scrub wait for the switch)."""
        async with self._switch_lock:
            if self.role.mode == mode and self.role.started and not self.role.ended:
                return
            old, was = self.role, self.mode
            self.mode = "switching"  # _may_serve: False until the new role is installed
            err = E.NotLeader(self.member.leader_address or None)
            await old.end(err)
            self._release_all(err)
            now, store_epoch = self.clock.now_ms(), self._store_epoch
            try:
                store = await off_loop(lambda: self._role_store(mode, old.store, now, store_epoch), self._abandon)
            except Exception as e:
                if mode != "master":
                    raise
                # a promotion that failed half-way (a corrupt record read while restoring the
                # wheel) must not leave a half-made master behind: back to a follower store
                # read from disk, following, and the seat given up so another member can serve
                log.error("promotion failed group=%s epoch=%d: %r; staying a slave", self.settings.server.group,
                          self.member.epoch, e)
                self.metrics.errors.labels(kind="PromotionFailed").inc()
                store = await off_loop(lambda: self._recover_store(old.store, now), self._abandon)
                with self._member_lock:
                    self.member.give_up_seat()
                self._install("slave", store)
                self._no_campaign_until = mono_ms() + 3 * self.settings.meta.lease_ttl_ms
                await self._resign_quietly()
                raise E.StorageError(f"promotion failed: {e}") from e
            self.metrics.master_changes.labels(to=mode).inc()
            if "master" in (mode, was):  # became master or stopped being one (not: started as a slave)
                self.role_changes.note(mono_ms())
            if mode == "slave" and was == "master":
                # stood down (lease not confirmed in time, or deposed): the member elected next keeps
                # its seat for a minimum term; this one contests it again only if nobody else is there
                self._no_campaign_until = max(self._no_campaign_until,
                                              mono_ms() + self.settings.replication.min_term_ms)
            if mode == "master":
                self.failovers += 1
            else:
                log.warning("became SLAVE group=%s epoch=%d leader=%s", self.settings.server.group, self.member.epoch,
                            self.member.leader_address)
            self._install(mode, store)

    def _install(self, mode: str, store) -> None:
        """The new role, on the loop: its committer, the node's per-term state
        (``_role_began``), then its loops in the root TaskGroup; clients are served from here."""
        self.role = Role(mode, store, GroupCommitter(store.messages))
        self._role_began(mode)
        self.mode = mode
        self.role.start(self._tg, self._master_tasks if mode == "master" else self._slave_tasks)

    def _abandon(self, store) -> None:
        """A switch was cancelled (the node stops) after its thread made ``store``: it becomes
        an ended role's, so the node's shutdown closes it."""
        self.role = Role("stopped", store, GroupCommitter(store.messages))
        self.role.ended = True

    def _role_store(self, mode: str, store, now_ms: int, store_epoch: int):
        """On a worker thread: ``store`` (the ended role's) made ``mode``'s; returns the store
        the new role owns (the same object when promoted in place). Touches nothing of the
        event loop."""
        raise NotImplementedError

    def _recover_store(self, store, now_ms: int):
        """On a worker thread: after a failed promotion, the store opened from disk as a follower."""
        raise NotImplementedError

    def _role_began(self, mode: str) -> None:
        """On the loop, the new role installed: the node's per-term state (trackers, history)."""

    def _master_tasks(self, tg: asyncio.TaskGroup) -> None:
        """The master's loops, created in the role's child TaskGroup ``tg``."""
        raise NotImplementedError

    def _slave_tasks(self, tg: asyncio.TaskGroup) -> None:
        raise NotImplementedError

    async def _resign_quietly(self) -> None:
        try:
            await self.registrar.meta.call("Resign", mpb.ResignRequest(role=self.ROLE, group=self.settings.server.group,
                                                                       node_id=self.settings.server.node_id,
                                                                       epoch=self.member.epoch))
        except E.HourglassError as e:
            log.warning("resign after a failed promotion failed: %s (the seat ends with the lease)", e)

    async def _role_loop(self) -> None:
        meta = self.registrar.meta
        group, me = self.settings.server.group, self.settings.server.node_id
        await self._switch("slave")
        next_peers = 0.0
        while True:
            await self.registrar.registered.wait()
            lease = self.registrar.lease_id
            if lease != self._lease_seen:
                if self._lease_seen is not None:
                    with self._member_lock:
                        self.member.lease_lost()  # leadership died with the old lease
                self._lease_seen = lease
            loop_now = time.monotonic()
            try:
                if loop_now >= next_peers:
                    resp = await meta.call("GetServers", mpb.GetServersRequest(kind=self.DISCOVERY_KIND,
                                                                               include_draining=True))
                    peers = {}
                    for g in resp.groups:
                        if g.name == group:
                            peers = {m.node_id: int(m.offsets.get("message_log_end", 0)) for m in g.members
                                     if m.node_id != me}
                    self._peers = peers
                    self._peers_read = True  # retention may now trust the slave set (node/store/retention.py)
                    if self.mode == "master":
                        await self._maintain_in_sync()
                    next_peers = loop_now + 1.0
                wait_ms = self._leader_wait_ms(next_peers)
                self._leader_steady = False
                lr = await meta.call("Leader", mpb.LeaderRequest(role=self.ROLE, group=group, wait_ms=wait_ms,
                                                                 known=self._leader_token),
                                     timeout_s=meta.timeout_s + wait_ms / 1000)
                self._leader_token = lr.token
                if self.mode != "master":
                    self._in_sync = list(lr.in_sync)
                key = LeaderKey(lr.leader.node_id, lr.leader.address, lr.leader.epoch) if lr.present \
                    else LeaderKey(None)
                if key.node_id is not None:
                    self._refused_logged = False  # "not campaigning" is said once per empty seat
                allowed = (mono_ms() >= self._no_campaign_until
                           or (mono_ms() >= self._handover_until and not self._peers)) \
                    and may_campaign(me, self._in_sync)
                if key.node_id is None and not may_campaign(me, self._in_sync) and not self._refused_logged:
                    log.warning("not campaigning: %s is not in the in-sync set %s of group %s (it may lack "
                                "acknowledged records; `hourglass admin force-in-sync` elects it anyway)", me,
                                self._in_sync, group)
                    self._refused_logged = True
                action = role_step(self.member, key, me=me, address=self.address, mode=self.mode, lease=lease,
                                   campaigned_lease=self._campaigned_lease, now_ms=mono_ms(),
                                   campaign_allowed=allowed)
                if action == "campaign":
                    wait = campaign_delay_ms(self._role_log_end(), self._peers,
                                             step_ms=self.settings.replication.campaign_step_ms)
                    if wait:
                        await asyncio.sleep(wait / 1000)
                    self._campaigned_lease = lease
                    cr = await meta.call("Campaign", mpb.CampaignRequest(
                        role=self.ROLE, group=group, node_id=me, lease_id=lease, wait_ms=0,
                        store_epoch_min=self._store_epoch_floor()))
                    if cr.elected:
                        with self._member_lock:
                            self.member.won(cr.leader.epoch, self.address, lease)
                        self._store_epoch = cr.store_epoch
                        self._refused_logged = False
                        if not self._in_sync:
                            self._in_sync = [me]  # a group's first set: the winner alone (campaign_in_sync)
                        action = "master"
                    else:
                        if cr.refused:
                            log.warning("campaign refused: %s", cr.refused)
                        self.member.observed(cr.leader.node_id, cr.leader.address, cr.leader.epoch)
                        action = ""
                elif action == "master" and self.mode != "master":
                    # seat reclaim (role_step): the key is still this node's, but its store was
                    # reopened and would need a store epoch the election never handed out; a
                    # fresh term gets one: give the seat up and campaign again (or let the other
                    # in-sync member win)
                    log.warning("seat of epoch %d held but not acting: resigning to campaign for a new term",
                                self.member.epoch)
                    await self._resign_quietly()
                    with self._member_lock:
                        self.member.give_up_seat()
                    self._campaigned_lease = None
                    action = ""
                if action in ("master", "slave"):
                    await self._switch(action)
                self._leader_steady = steady_turn(action, key.node_id, me=me, mode=self.mode)
            except E.HourglassError as e:
                log.info("role loop: %s", e)
                if self.mode == "master" and not self.member.is_master(mono_ms()):
                    await self._switch("slave")
            await asyncio.sleep(self.settings.replication.leader_poll_ms / 1000)

    def _leader_wait_ms(self, next_peers: float) -> int:
        """How long the next Leader call may wait for a change (docs/replication.md, "Leader
        long poll"): 0 unless the last turn changed nothing; never past the next peers read,
        nor, for a master, past a poll before its lease would lapse unconfirmed."""
        if not self._leader_steady:
            return 0
        until_peers_ms = (next_peers - time.monotonic()) * 1000
        lease_left_ms = self.member.lease_left_ms(mono_ms()) if self.mode == "master" else None
        return leader_wait_ms(self.settings.replication.leader_wait_ms, until_peers_ms, lease_left_ms,
                              poll_ms=self.settings.replication.leader_poll_ms)

    def _store_epoch_floor(self) -> int:
        """The highest seq epoch this node's store uses or holds (the election hands the new
        term an epoch above it and above every earlier term's)."""
        return 0

    def _required_slaves(self) -> set[str]:
        """Whom a sync write waits for: the in-sync set without this node."""
        return set(self._in_sync) - {self.settings.server.node_id}

    async def _maintain_in_sync(self) -> None:
        """The master grows and shrinks its group's in-sync set (``core.in_sync_change``):
        grow = trackers first, then etcd; shrink = etcd first, then trackers."""
        me = self.settings.server.node_id
        tr = next(iter(self._trackers().values()))
        change = in_sync_change(me=me, in_sync=set(self._in_sync) | {me}, registered=set(self._peers),
                                offsets=tr.slave_offsets, log_end=self._role_log_end(), now_ms=mono_ms(),
                                lag_max_ms=self.settings.replication.in_sync_lag_max_ms,
                                term_start_ms=self._term_start_ms)
        if not change.add and not change.drop:
            return
        after = (set(self._in_sync) | {me} | change.add) - change.drop
        if change.add:
            for kind, t in self._trackers().items():
                self._release(kind, t.set_slaves(self._required_slaves() | set(change.add)))
        r = await self.registrar.meta.call("UpdateInSync", mpb.UpdateInSyncRequest(
            role=self.ROLE, group=self.settings.server.group, node_id=me, epoch=self.member.epoch,
            members=sorted(after)))
        if not r.updated:
            log.warning("in-sync set not updated (term over?): now %s", list(r.members))
            return
        self._in_sync = list(r.members)
        for kind, t in self._trackers().items():
            self._release(kind, t.set_slaves(self._required_slaves()))
        log.warning("in-sync set of group %s: %s (added %s, dropped %s)", self.settings.server.group, self._in_sync,
                    sorted(change.add), sorted(change.drop))

    def _on_lease_lost(self, lease_id: int) -> None:
        """The registration lease is gone (found expired): a master stops acting at once,
        before the node registers again (which revokes the old lease and frees the seat).
        Called on the registrar's heartbeat thread."""
        with self._member_lock:
            self.member.lease_lost()

    def _on_beat(self, lease_id: int, sent_at_ms: int) -> None:
        """A renewal of ``lease_id`` sent at ``sent_at_ms`` was confirmed. Called on the
        registrar's heartbeat thread, at once (a busy event loop does not delay it): the
        lock orders it with the loop's own changes of the member."""
        with self._member_lock:
            self.member.keepalive_sent(sent_at_ms, lease_id)

    async def _resign_and_follow(self) -> pb.HandoverResponse:
        """Last step of a graceful handover: give up the seat, become a slave, and stay out of
        the next elections for three lease periods so a caught-up slave wins."""
        self._no_campaign_until = self._handover_until = mono_ms() + 3 * self.settings.meta.lease_ttl_ms
        try:
            await self.registrar.meta.call("Resign", mpb.ResignRequest(role=self.ROLE, group=self.settings.server.group,
                                                                       node_id=self.settings.server.node_id,
                                                                       epoch=self.member.epoch))
        except E.HourglassError as e:
            return pb.HandoverResponse(done=False, error=f"resign failed: {e}")
        with self._member_lock:
            self.member.give_up_seat()
        self.mode = "handing-over"
        await self._switch("slave")
        return pb.HandoverResponse(done=True)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event, *, on_ready=None) -> None:
        if not self.settings.meta.servers:
            raise E.InvalidArgument("meta_servers", "a replicated node needs meta servers (election)")
        self.server, self.address = await start_grpc(
            self.settings, **self._grpc_services(), extra=[lambda srv: rpc.add_ReplicationServicer_to_server(self, srv)])
        self.registrar = Registrar(self.settings, self.address, describe=self.registration_info,
                                   health=self.server.health)
        self.registrar.on_beat = self._on_beat
        self.registrar.on_lost = self._on_lease_lost
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg  # role tasks are its children (Role.start)
                self._bind_metrics()
                tasks = [tg.create_task(self.registrar.run(), name="registration"),
                         tg.create_task(self._role_loop(), name="roles")]
                # both roles scrub their segments; the registration above has the heartbeat hook
                tasks += side_tasks(tg, self, log, register=False, gc_tuned=False)
                log.info("replicated %s node serving node_id=%s group=%s address=%s ack_mode=%s", self.ROLE,
                         self.settings.server.node_id, self.settings.server.group, self.address,
                         self.settings.replication.ack_mode)
                if on_ready:
                    on_ready(self.address)
                await stop.wait()
                if self.is_master() and self._peers:
                    # a clean stop (SIGTERM, rolling upgrade) of a master hands over first: a slave
                    # takes the last bytes and tick state and wins at once; nothing is lost or repeated
                    try:
                        r = await within(self.Handover(pb.HandoverRequest(wait_ms=10_000), None), 20)
                        log.warning("stop: handover %s%s", "done" if r.done else "refused: ", r.error)
                    except (TimeoutError, E.HourglassError) as e:
                        log.warning("stop: handover failed: %s", e)
                await self.registrar.close()
                await self.server.stop(grace=1.0)
                for t in tasks:
                    t.cancel()
                self.role.cancel_tasks()
        finally:
            self._tg = None
            await self.role.stop_tasks()
            await self.channels.close()
            await self._close_clients()
            if self.server is not None:
                await self.server.stop(grace=None)
            self.store.close()
            self.metrics.stop()
            log.info("%s node stopped node_id=%s", self.ROLE, self.settings.server.node_id)
