"""Deterministic simulation of replication + election (the pure core in node/replication/core.py).

The simulation decides nothing itself that the shipped shell decides: a master answers a
fetch with ``answer_fetch`` (fencing, divergence), a slave takes an answer by
``take_answer``, and every node's role loop turn (observe, campaign, seat reclaim, step
down) is ``role_step``, and when a settled node's next turn comes is ``steady_turn`` and
``leader_wait_ms`` (the Leader long poll: a turn on a change of the leader key or the in-sync
set, or when the wait ends) - the same functions ``node/replication/roles.py`` calls. What is
modelled here is only the world around them: etcd, the network, faults.

One group of a master and slaves, an etcd model (a leader key under a lease, a revision
counter), a network that loses, delays and partitions messages, and faults from a seed:
crashes with restarts, freezes (SIGSTOP-like pauses), partitions from peers and from etcd.
Writes are acknowledged in ``sync`` mode. Invariants checked:

* every acknowledged write is in every later master's log at its offset;
* never two nodes acting as master at the same moment; epochs strictly increase;
* after the faults heal, every log is byte-identical to the master's.

A failure prints its seed; ``HOURGLASS_SIM_SEED=n`` reruns one seed,
``HOURGLASS_SIM_RUNS`` sets how many seeds run (default 2000 with two nodes, a quarter
of that with three, where faults come one at a time: sync mode promises to survive
one failure at a time, see docs/replication.md).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from node.replication.core import (EpochHistory, LeaderKey, Member, SyncTracker, answer_fetch, campaign_delay_ms,
                                   divergence, in_sync_change, leader_wait_ms, may_campaign, role_step,
                                   steady_turn, take_answer, truncate_allowed)

STEP_MS = 10
TTL_MS = 2000
MARGIN_MS = 300
KEEPALIVE_MS = 500
LEADER_WAIT_MS = 1000  # the role loop's long poll once settled (node setting leader_wait_ms)
LEADER_POLL_MS = 100
PEERS_MS = 1000        # the role loop's peers read: a long poll never waits past it
CHUNK = 16
FETCH_TIMEOUT_MS = 200


@dataclass
class Node:
    id: str
    member: Member
    log: list = field(default_factory=list)       # records: (epoch, value)
    history: EpochHistory = field(default_factory=EpochHistory)
    alive: bool = True
    frozen_until: int = 0
    down_until: int = 0
    cut_etcd_until: int = 0
    cut_peers_until: int = 0
    next_keepalive: int = 0
    next_fetch: int = 0
    campaign_at: int | None = None
    tracker: SyncTracker | None = None
    tickets: dict = field(default_factory=dict)   # ticket -> (offset, record)
    lease: int = 0                                # etcd lease id of this incarnation
    mode: str = "slave"                           # what the shell runs: master or slave tasks
    campaigned_lease: int | None = None           # the lease of this node's last campaign
    term_start: int = 0
    fetch_no: int = 0                             # the last fetch sent (answers to older ones are dropped)
    acked_known: int = -1                         # the acknowledged point masters told this slave
    wait_until: int | None = None                 # a settled turn's Leader long poll ends here (None: polling)
    key_seen: tuple | None = None                 # the leader key and in-sync set that long poll waits on

    def active(self, now: int) -> bool:
        return self.alive and now >= self.frozen_until

    def acting_master(self, now: int) -> bool:
        return self.mode == "master" and self.member.is_master(now)


class Sim:
    def __init__(self, seed: int, nodes: int = 2, steps: int = 700, heal_steps: int = 500) -> None:
        self.rnd = random.Random(seed)
        self.seed = seed
        self.now = 0
        self.steps, self.heal_steps = steps, heal_steps
        self.nodes = {f"n{i}": Node(f"n{i}", Member(f"n{i}", lease_ttl_ms=TTL_MS, margin_ms=MARGIN_MS))
                      for i in range(nodes)}
        self.key: tuple[str, int, int] | None = None  # leader key: (node id, epoch, lease)
        self.key_expiry = 0
        self.revision = 0
        self.registry: dict[str, tuple[int, int]] = {}  # node -> (end offset, registration expiry)
        self.single_fault = nodes > 2  # sync mode promises to survive one failure at a time
        self.net: list[tuple[int, str, str, tuple]] = []  # (deliver_at, src, dst, msg)
        self.loss = self.rnd.choice([0.0, 0.05, 0.2])
        self.acked: dict[int, tuple] = {}           # offset -> record, acknowledged to a client
        self.in_sync: set[str] = set()              # the group's in-sync set in etcd (empty: none yet)
        self.refused_campaigns = 0
        self.epochs_won: list[int] = []
        self.won_by: list[str] = []
        self.value = 0
        self.faults = 0
        self.waited_turns = 0  # turns a settled node's long poll left out (it waited for a change)
        self.leases = 0
        for i, n in enumerate(self.nodes.values()):
            n.lease = self.leases = i + 1

    # ------------------------------------------------------------------ etcd model

    def etcd_reachable(self, n: Node) -> bool:
        return n.active(self.now) and self.now >= n.cut_etcd_until

    def etcd_step(self) -> None:
        if self.key is not None and self.now >= self.key_expiry:
            self.key = None
        for n in self.nodes.values():
            if not self.etcd_reachable(n):
                continue
            if self.now >= n.next_keepalive:
                n.next_keepalive = self.now + KEEPALIVE_MS
                if self.rnd.random() >= self.loss:
                    self.registry[n.id] = (len(n.log), self.now + TTL_MS)
                    if self.key is not None and self.key[2] == n.lease:
                        self.key_expiry = self.now + TTL_MS
                        n.member.keepalive_sent(self.now)
            if self.rnd.random() < 0.5 and self.turn_due(n):  # the role loop's turn (its poll late or early)
                self.role_turn(n)

    def election_state(self) -> tuple:
        return (self.key[:2] if self.key is not None else None, frozenset(self.in_sync))

    def turn_due(self, n: Node) -> bool:
        """The Leader long poll (docs/replication.md): a settled node's next turn comes when the
        leader key or the in-sync set changes (the meta server's watch) or when its wait ends."""
        if n.wait_until is None or self.election_state() != n.key_seen or self.now >= n.wait_until:
            return True
        self.waited_turns += 1
        return False

    def role_turn(self, n: Node) -> None:
        """One turn of the shipped role loop (``role_step``), the leader key read from the model."""
        key = LeaderKey(self.key[0], self.key[0], self.key[1]) if self.key is not None else LeaderKey(None)
        n.wait_until = None  # a turn that returns early (a campaign waiting) polls again
        action = role_step(n.member, key, me=n.id, address=n.id, mode=n.mode, lease=n.lease,
                           campaigned_lease=n.campaigned_lease, now_ms=self.now, campaign_allowed=True)
        if action == "campaign":
            if n.campaign_at is None:  # the shell sleeps campaign_delay_ms, then asks
                peers = {k: v[0] for k, v in self.registry.items() if k != n.id and v[1] > self.now}
                n.campaign_at = self.now + campaign_delay_ms(len(n.log), peers, step_ms=200)
                return
            if self.now < n.campaign_at:
                return
            n.campaign_at = None
            n.campaigned_lease = n.lease
            if self.key is not None:  # someone was faster: the answer names the winner
                n.member.observed(self.key[0], self.key[0], self.key[1])
                return
            if not may_campaign(n.id, self.in_sync):  # the meta server's transaction refuses it
                self.refused_campaigns += 1
                return
            self.in_sync = self.in_sync or {n.id}
            self.revision += 1
            self.key, self.key_expiry = (n.id, self.revision, n.lease), self.now + TTL_MS
            n.member.won(self.revision, n.id)
            n.member.keepalive_sent(self.now)  # the model's campaign also renews the lease
            action = "master"
        else:
            n.campaign_at = None
        if action == "master" and n.mode != "master":
            self.win(n, n.member.epoch)
        elif action == "slave" and n.mode != "slave":
            n.mode = "slave"
            self.fail_waiters(n)
        if steady_turn(action, key.node_id, me=n.id, mode=n.mode):  # the shell's rule, as roles.py asks it
            lease_left = n.member.lease_left_ms(self.now) if n.mode == "master" else None
            n.key_seen = self.election_state()
            n.wait_until = self.now + leader_wait_ms(LEADER_WAIT_MS, PEERS_MS, lease_left, poll_ms=LEADER_POLL_MS)

    def win(self, n: Node, epoch: int) -> None:
        """``n`` takes the seat of ``epoch`` (won, or reclaimed: the key is still its own)."""
        reclaim = bool(self.epochs_won) and epoch == self.epochs_won[-1] and self.won_by[-1] == n.id
        assert reclaim or not self.epochs_won or epoch > self.epochs_won[-1], "epochs must strictly increase"
        if not reclaim:
            self.epochs_won.append(epoch)
            self.won_by.append(n.id)
        n.mode = "master"
        n.history.begin(epoch, len(n.log))
        n.tracker = SyncTracker(timeout_ms=1000)
        n.tracker.set_slaves(self.in_sync - {n.id})
        n.term_start = self.now
        n.tickets = {}
        for off, rec in self.acked.items():
            assert off < len(n.log) and n.log[off] == rec, \
                f"acknowledged write at {off} {rec} missing from new master {n.id} (epoch {epoch})"

    # ------------------------------------------------------------------ network

    def send(self, src: str, dst: str, msg: tuple) -> None:
        a, b = self.nodes[src], self.nodes[dst]
        if self.now < a.cut_peers_until or self.now < b.cut_peers_until or self.rnd.random() < self.loss:
            return
        self.net.append((self.now + self.rnd.randint(0, 60), src, dst, msg))

    def deliver(self) -> None:
        keep, ready = [], []
        for item in self.net:
            dst = self.nodes[item[2]]
            if item[0] <= self.now and dst.active(self.now):
                ready.append(item)
            elif not dst.alive:
                continue  # a dead process loses what was sent to it
            else:
                keep.append(item)
        self.net = keep
        for _, src, dst, msg in sorted(ready, key=lambda x: x[0]):
            getattr(self, "on_" + msg[0])(self.nodes[dst], src, *msg[1:])

    # ------------------------------------------------------------------ replication

    def on_fetch(self, m: Node, src: str, epoch: int, offset: int, hist: tuple, no: int) -> None:
        ans = answer_fetch(serving=m.acting_master(self.now), my_epoch=m.member.epoch, req_epoch=epoch,
                           theirs=EpochHistory(list(hist)), offset=offset, mine=m.history, start=0, end=len(m.log))
        if ans.kind == "not_master":
            self.send(m.id, src, ("refused", m.member.epoch))
            return
        if ans.kind == "truncate":
            self.send(m.id, src, ("truncate", m.member.epoch, (offset, no), ans.to))
            return
        assert ans.kind == "records", ans  # the model's logs start at 0: no reset
        for t in m.tracker.on_fetch(src, offset, self.now):
            off, rec = m.tickets.pop(t)
            self.acked[off] = rec
        self.send(m.id, src, ("records", m.member.epoch, (offset, no), tuple(m.log[offset:offset + CHUNK]),
                              tuple(m.history.entries), m.tracker.acked_offset))

    def on_refused(self, s: Node, src: str, epoch: int) -> None:
        pass  # the shell's follow loop backs off and asks again; a peer's epoch deposes nobody

    def _takes(self, s: Node, src: str, epoch: int, asked: tuple[int, int]) -> bool:
        """``take_answer``, and the answer is to the question asked last: the shipped stream
        has one fetch in flight and its answers come in order, while this network may
        deliver an old answer late (after a later one left the log at the same length)."""
        asked_at, no = asked
        if no != s.fetch_no:
            return False
        s.next_fetch = min(s.next_fetch, self.now + 20)
        if not take_answer(my_epoch=s.member.epoch, answer_epoch=epoch, from_leader=s.member.leader == src,
                           acting_master=s.acting_master(self.now)):
            return False
        s.member.epoch = max(s.member.epoch, epoch)
        return asked_at == len(s.log)

    def on_truncate(self, s: Node, src: str, epoch: int, asked: tuple[int, int], cut: int) -> None:
        if not self._takes(s, src, epoch, asked):
            return
        # the shipped guard (roles.py _may_truncate): never below the acknowledged point a
        # master told this slave; with the in-sync set a correct master never asks that
        assert truncate_allowed(cut, s.acked_known), f"{s.id} asked to cut at {cut} below acked {s.acked_known}"
        if cut < len(s.log):
            for off in range(cut, len(s.log)):
                assert off not in self.acked or self.acked[off] != s.log[off], \
                    f"{s.id} truncates acknowledged write at {off}"
            del s.log[cut:]
            s.history.truncate(cut)

    def on_records(self, s: Node, src: str, epoch: int, asked: tuple[int, int], recs: tuple, hist: tuple,
                   acked: int) -> None:
        if not self._takes(s, src, epoch, asked):
            return
        s.log.extend(recs)
        s.history.adopt(list(hist), len(s.log))
        s.acked_known = max(s.acked_known, acked)

    def fail_waiters(self, m: Node) -> None:
        if m.tracker is not None:
            m.tracker.drop_all()
            m.tickets.clear()

    def node_step(self, n: Node) -> None:
        if not n.active(self.now):
            return
        if n.acting_master(self.now):
            for t in n.tracker.expire(self.now):
                n.tickets.pop(t, None)
            # the in-sync set (node/replication/roles.py _maintain_in_sync): grow = trackers
            # first, then etcd; shrink = etcd first (only while the master holds the seat)
            registered = {k for k, (_, exp) in self.registry.items() if k != n.id and exp > self.now}
            ch = in_sync_change(me=n.id, in_sync=self.in_sync | {n.id}, registered=registered,
                                offsets=n.tracker.slave_offsets, log_end=len(n.log), now_ms=self.now,
                                lag_max_ms=3000, term_start_ms=n.term_start)
            if (ch.add or ch.drop) and self.etcd_reachable(n) and self.key is not None and self.key[0] == n.id:
                for t in n.tracker.set_slaves((self.in_sync - {n.id}) | set(ch.add)):
                    off, rec = n.tickets.pop(t)
                    self.acked[off] = rec
                self.in_sync = (self.in_sync | {n.id} | set(ch.add)) - set(ch.drop)
                for t in n.tracker.set_slaves(self.in_sync - {n.id}):
                    off, rec = n.tickets.pop(t)
                    self.acked[off] = rec
            if self.rnd.random() < 0.3:
                self.value += 1
                rec = (n.member.epoch, self.value)
                n.log.append(rec)
                t = n.tracker.wait(len(n.log), self.now)
                if t is None:
                    self.acked[len(n.log) - 1] = rec
                else:
                    n.tickets[t] = (len(n.log) - 1, rec)
        else:
            self.fail_waiters(n)
            leader = n.member.leader
            # one fetch in flight (the next once answered, or after a timeout: a new stream)
            if leader and leader != n.id and self.now >= n.next_fetch:
                n.next_fetch = self.now + FETCH_TIMEOUT_MS  # sooner once answered (_takes)
                n.fetch_no += 1
                self.send(n.id, leader, ("fetch", n.member.epoch, len(n.log), tuple(n.history.entries), n.fetch_no))

    # ------------------------------------------------------------------ faults

    def inject(self) -> None:
        if self.rnd.random() > 0.01:
            return
        n = self.rnd.choice(list(self.nodes.values()))
        if self.single_fault and any(self.faulty(x) for x in self.nodes.values()):
            return
        kind = self.rnd.choice(["crash", "freeze", "cut_etcd", "cut_peers"])
        dur = min(self.rnd.randint(100, 4000), self.steps * STEP_MS - self.now)  # all healed by the end
        self.faults += 1
        if kind == "crash" and n.alive:
            n.alive = False
            n.down_until = self.now + dur
        elif kind == "freeze":
            n.frozen_until = max(n.frozen_until, self.now + dur)
        elif kind == "cut_etcd":
            n.cut_etcd_until = self.now + dur
        else:
            n.cut_peers_until = self.now + dur

    def faulty(self, n: Node) -> bool:
        # a node counts as failed until it is back and has caught up with the master again
        masters = [m for m in self.nodes.values() if m.acting_master(self.now)]
        behind = bool(masters) and masters[0] is not n and len(n.log) < len(masters[0].log) - CHUNK * 10
        return (not n.alive or self.now < n.frozen_until or self.now < n.cut_etcd_until
                or self.now < n.cut_peers_until or behind or not masters)

    def restarts(self) -> None:
        for n in self.nodes.values():
            if not n.alive and self.now >= n.down_until:
                # the log and its epoch history are on disk; memory starts empty
                n.alive = True
                self.leases += 1
                n.lease = self.leases  # a new process gets a new lease
                n.member = Member(n.id, lease_ttl_ms=TTL_MS, margin_ms=MARGIN_MS)
                n.member.epoch = n.history.last_epoch if n.history.entries else 0
                n.tracker, n.tickets, n.campaign_at = None, {}, None
                n.mode, n.campaigned_lease = "slave", None

    # ------------------------------------------------------------------ run

    def check_single_master(self) -> None:
        masters = [n.id for n in self.nodes.values() if n.active(self.now) and n.acting_master(self.now)]
        assert len(masters) <= 1, f"two masters at {self.now}: {masters}"

    def run(self) -> None:
        for i in range(self.steps + self.heal_steps):
            self.now += STEP_MS
            if i < self.steps:
                self.inject()
            elif i == self.steps:
                self.loss = 0.0  # healed: the network delivers again
            self.restarts()
            self.etcd_step()
            self.deliver()
            for n in self.nodes.values():
                self.node_step(n)
            self.check_single_master()
        # healed: everything converges on the master's log
        for n in self.nodes.values():
            assert n.alive and n.active(self.now)
        masters = [n for n in self.nodes.values() if n.acting_master(self.now)]
        assert len(masters) == 1, "no master after healing"
        m = masters[0]
        for off, rec in self.acked.items():
            assert m.log[off] == rec, f"acknowledged write at {off} lost"
        for n in self.nodes.values():
            assert n.log == m.log[:len(n.log)], f"{n.id} diverges from master {m.id}"
            assert len(m.log) - len(n.log) <= CHUNK * 40, f"{n.id} did not catch up"


RUNS = int(os.environ.get("HOURGLASS_SIM_RUNS", "2000"))
ONE = os.environ.get("HOURGLASS_SIM_SEED")


@pytest.mark.slow  # tier: minutes of simulated traffic
@pytest.mark.parametrize("nodes", [2, 3])
def test_seeded_runs_keep_every_acknowledged_write(nodes):
    seeds = [int(ONE)] if ONE else range(RUNS if nodes == 2 else RUNS // 4)
    faults = acked = waited = 0
    for seed in seeds:
        sim = Sim(seed, nodes=nodes)
        try:
            sim.run()
        except AssertionError as e:
            raise AssertionError(f"seed {seed} (nodes={nodes}): {e}\n"
                                 f"rerun: HOURGLASS_SIM_SEED={seed} pytest tests/test_replication_sim.py") from None
        faults += sim.faults
        acked += len(sim.acked)
        waited += sim.waited_turns
    assert faults > 0 and acked > 0  # the runs did inject faults and acknowledge writes
    assert waited > 0  # and settled nodes did wait in the Leader long poll between changes


def test_same_seed_same_run():
    a, b = Sim(42), Sim(42)
    a.run()
    b.run()
    assert a.acked == b.acked and a.epochs_won == b.epochs_won


def test_divergent_tail_is_found():
    master = EpochHistory([(1, 0), (3, 10)])
    h = EpochHistory
    # the slave wrote 4 records in epoch 1 beyond what the new master (epoch 3) kept
    assert divergence(h([(1, 0)]), 14, master, 20) == 10
    assert divergence(h([(1, 0)]), 8, master, 20) is None
    assert divergence(h([(1, 0), (3, 10)]), 15, master, 20) is None
    assert divergence(h([(1, 0), (3, 10)]), 25, master, 20) == 20
    # a slave that was master of epoch 2 from offset 6: epoch 1 ends at 6 in its log
    assert divergence(h([(1, 0), (2, 6)]), 30, master, 20) == 6
    assert divergence(h(), 5, h([(2, 5)]), 9) is None
