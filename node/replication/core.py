"""Pure replication core: epoch history, divergence, sync-ack tracking, candidate ranking.

Nothing here does I/O or reads a clock; the asyncio shell (``node/replication/roles.py``)
and the deterministic simulation (``tests/test_replication_sim.py``) drive the same code:
the fetch answer (``answer_fetch``: fencing, divergence, retention), what a slave takes
(``take_answer``) and each turn of the role loop (``role_step``: observe, campaign, seat
reclaim, step down) are decided here, never in the shell or the simulation.

Vocabulary
----------
* A group has one master per *term*; every term has an *epoch* (strictly increasing,
  from the election). Requests and replication calls carry the caller's epoch;
  anything older than what a node has seen is refused (``StaleEpoch``).
* Each replicated log (message log, dispatch log) keeps an **epoch history**: the list of
  ``(epoch, start_offset)`` pairs, one per term that wrote to it, like Kafka's leader
  epoch file. A slave copies its master's history as it copies bytes.
* A returning old master (or any slave) asks, before fetching: "where does *my last
  epoch* end in your log?" If its own log is longer than that, the suffix was never
  part of the new master's log: it is truncated (``divergence``).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

from cluster.errors import Overloaded


@dataclass
class EpochHistory:
    """``(epoch, start_offset)`` pairs, epochs strictly increasing, offsets non-decreasing."""

    entries: list[tuple[int, int]] = field(default_factory=list)

    @property
    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else -1

    def begin(self, epoch: int, offset: int) -> None:
        """A term ``epoch`` starts writing at ``offset`` (called by a new master, and by a slave
        when its master's history says so). Idempotent for the same pair."""
        if self.entries and epoch < self.entries[-1][0]:
            raise ValueError(f"epoch {epoch} is older than the last one {self.entries[-1][0]}")
        if self.entries and epoch == self.entries[-1][0]:
            return
        if self.entries and offset < self.entries[-1][1]:
            raise ValueError(f"epoch {epoch} starts at {offset}, before the previous term's start")
        self.entries.append((epoch, offset))

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """For a follower whose last epoch is ``epoch``: ``(the largest epoch <= epoch this
        history knows, the offset where that epoch's writes end)``. With no such epoch:
        ``(-1, 0)``, meaning "nothing you hold is known to be mine"."""
        epochs = [e for e, _ in self.entries]
        i = bisect.bisect_right(epochs, epoch) - 1
        if i < 0:
            return -1, self.entries[0][1] if self.entries else 0
        if i + 1 < len(self.entries):
            return self.entries[i][0], self.entries[i + 1][1]
        return self.entries[i][0], log_end

    def truncate(self, offset: int) -> None:
        """The log was cut at ``offset``: terms starting at or after it hold nothing any more."""
        self.entries = [(e, o) for e, o in self.entries if o < offset]

    def adopt(self, master: list[tuple[int, int]], upto: int) -> None:
        """Copy the master's terms that start at or before ``upto`` (what this log now holds)."""
        for e, o in master:
            if o <= upto and e > self.last_epoch:
                self.begin(e, max(o, self.entries[-1][1] if self.entries else o))

    def encode(self) -> str:
        return json.dumps([[e, o] for e, o in self.entries])

    @classmethod
    def decode(cls, text: str) -> "EpochHistory":
        raw = json.loads(text)
        h = cls()
        for e, o in raw:
            h.begin(int(e), int(o))
        return h


def divergence(slave: EpochHistory, slave_end: int, master: EpochHistory, master_end: int) -> int | None:
    """Offset the slave must truncate its log to before fetching, or None if it is a prefix.

    Terms are written by one master each, so the slave's bytes equal the master's up to
    where their common epoch ends in *both* histories (Kafka's OffsetsForLeaderEpoch):
    take the newest epoch the master knows that is not newer than the slave's last one,
    and cut at the smaller of the two ends of that epoch. Anything beyond was never in
    the master's log.
    """
    # The newest epoch both histories hold: the master names the newest epoch <= the slave's
    # last; if the slave never wrote or copied that one (it was elected in a term that never
    # saw it), step down to the slave's newest epoch below it and ask again, as Kafka's
    # follower does (KIP-279). Comparing ends of two *different* epochs kept a divergent
    # suffix: a slave whose epoch 1 ran to 78 while the master's epoch 1 ended at 74 (its
    # epoch 2 from there) was told "records from 78" and kept 74..78 of the wrong term.
    e = slave.last_epoch
    end = 0
    for _ in range(len(slave.entries) + len(master.entries) + 1):  # each turn goes to an older epoch
        m_epoch, m_end = master.end_offset_for(e, master_end)
        if m_epoch < 0:
            end = m_end  # nothing the slave holds is of a term the master knows: up to its first term
            break
        s_epoch, s_end = slave.end_offset_for(m_epoch, slave_end)
        if s_epoch == m_epoch:
            end = min(m_end, s_end)
            break
        if s_epoch < 0:
            end = 0
            break
        e = s_epoch
    if slave_end > end:
        return end
    return None


class SyncTracker:
    """Sync-mode acknowledgement: a write ending at offset ``x`` is acknowledged once every
    slave of the group holds it (a slave's next fetch offset is its acknowledgement).

    "Every slave" is the set the shell keeps from the group's registrations
    (``set_slaves``): with master + one slave that is "at least one slave"; with more,
    whichever slave wins the next election holds every acknowledged write. With no
    slave at all nothing is acknowledged: the writes time out (``ReplicationTimeout``),
    never a silent downgrade to async. A slave whose registration expired (dead) leaves
    the set; one that returns is required again once it registers.

    Pure: callers pass ``now_ms``; waiters are ids the shell maps to futures.
    ``waiters_max`` bounds what may wait at once.
    """

    def __init__(self, *, timeout_ms: int, waiters_max: int = 100_000) -> None:
        self.timeout_ms = timeout_ms
        self.waiters_max = waiters_max
        self.slave_offsets: dict[str, tuple[int, int]] = {}  # slave_id -> (offset, at_ms)
        self.slaves: set[str] | None = None  # None: whoever fetches (until the shell knows the group)
        self._waiters: list[tuple[int, int, int]] = []  # (offset, deadline_ms, ticket) sorted by offset
        self._next_ticket = 0

    def set_slaves(self, slave_ids: set[str] | frozenset[str]) -> list[int]:
        """The group's slaves changed; returns tickets released by the change."""
        self.slaves = set(slave_ids)
        return self._release()

    @property
    def acked_offset(self) -> int:
        """The offset every required slave holds (-1 when none is known)."""
        if self.slaves is None:
            return max((o for o, _ in self.slave_offsets.values()), default=-1)
        if not self.slaves:
            return -1
        return min(self.slave_offsets.get(s, (-1, 0))[0] for s in self.slaves)

    def wait(self, offset: int, now_ms: int) -> int | None:
        """Register a waiter for ``offset``; returns a ticket, or None when already acknowledged."""
        if self.acked_offset >= offset:
            return None
        if len(self._waiters) >= self.waiters_max:
            raise Overloaded(f"{len(self._waiters)} writes wait for a slave (waiters_max={self.waiters_max})")
        t = self._next_ticket
        self._next_ticket += 1
        bisect.insort(self._waiters, (offset, now_ms + self.timeout_ms, t))
        return t

    def on_fetch(self, slave_id: str, offset: int, now_ms: int) -> list[int]:
        """A slave asked for ``offset`` (so it holds everything before). Returns released tickets."""
        prev = self.slave_offsets.get(slave_id, (-1, 0))[0]
        self.slave_offsets[slave_id] = (max(prev, offset), now_ms)
        return self._release()

    def _release(self) -> list[int]:
        acked = self.acked_offset
        i = bisect.bisect_right(self._waiters, (acked, 1 << 62, 1 << 62))
        done = [t for _, _, t in self._waiters[:i]]
        del self._waiters[:i]
        return done

    def expire(self, now_ms: int) -> list[int]:
        """Tickets whose deadline passed: the shell answers them with ``ReplicationTimeout``."""
        gone = [w for w in self._waiters if w[1] <= now_ms]
        if gone:
            self._waiters = [w for w in self._waiters if w[1] > now_ms]
        return [t for _, _, t in gone]

    def drop_all(self) -> list[int]:
        """The node stopped being master: every waiter fails (the shell answers NotLeader)."""
        out = [t for _, _, t in self._waiters]
        self._waiters.clear()
        return out


def campaign_delay_ms(my_end: int, peer_ends: dict[str, int], *, step_ms: int) -> int:
    """How long a slave waits before campaigning after the master's key vanished: zero for
    the most caught-up slave, one ``step_ms`` per peer that holds more (ties: by id, so
    equal candidates do not all wait). The election still decides; this only makes the
    most caught-up slave the likely winner."""
    ahead = sum(1 for end in peer_ends.values() if end > my_end)
    return ahead * step_ms


class Member:
    """One node's view of its group: who is master, in which epoch, and whether this node
    may act as master *now*.

    A master acts only while its lease is surely alive by its own clock: a keepalive
    sent at ``t`` keeps it master until ``t + ttl - margin``; etcd deletes the leader key
    no earlier than ``t + ttl``, so an old master has stopped before a new one can be
    elected (with clock rates within the margin). A frozen master that wakes after its
    lease ran out stops acting at once, before it has heard of the new term.
    """

    def __init__(self, node_id: str, *, lease_ttl_ms: int, margin_ms: int) -> None:
        if margin_ms >= lease_ttl_ms:
            raise ValueError("margin_ms must be smaller than lease_ttl_ms")
        self.node_id = node_id
        self.lease_ttl_ms = lease_ttl_ms
        self.margin_ms = margin_ms
        self.epoch = 0                  # newest epoch seen
        self.leader: str | None = None  # node id of the master of ``epoch``
        self.leader_address: str = ""
        self._lease_ok_until = -1
        self._won_epoch = -1            # the epoch this incarnation won (a restart forgets it)
        self._won_lease: int | None = None  # the lease the seat of ``_won_epoch`` is attached to

    def keepalive_sent(self, sent_at_ms: int, lease: int | None = None) -> None:
        """A keepalive of ``lease`` sent at ``sent_at_ms`` was confirmed. A keepalive of another
        lease (the node registered again after its old lease was lost) does not keep a seat
        that was attached to the old one: that seat is gone with it."""
        if lease is not None and self._won_lease is not None and lease != self._won_lease:
            return
        self._lease_ok_until = max(self._lease_ok_until, sent_at_ms + self.lease_ttl_ms - self.margin_ms)

    def lease_lost(self) -> None:
        """The registration lease is gone (expired, or replaced by a new one): no seat attached
        to it is held any more, and nothing it renewed counts."""
        self._lease_ok_until = -1
        self._won_epoch = -1
        self._won_lease = None

    def give_up_seat(self) -> None:
        """This node leaves the seat it won (resigned, or a promotion failed) while its lease
        lives on: renewals of that lease still count, so a seat won next acts at once (a lease
        renewed before the win is what makes ``is_master`` true right after it)."""
        self._won_epoch = -1

    def won(self, epoch: int, address: str, lease: int | None = None) -> None:
        """This node holds the leader key of ``epoch`` (its campaign answered, or the key it
        finds names it under its current lease after a lost answer). It acts as master
        only while its registration lease is surely alive (``keepalive_sent``): attaching
        the key to the lease does not extend the lease."""
        if epoch < self.epoch or (epoch == self.epoch and self.leader not in (None, self.node_id)):
            raise ValueError(f"won epoch {epoch} is not newer than {self.epoch}")
        self.epoch, self.leader, self.leader_address = epoch, self.node_id, address
        self._won_epoch = epoch
        self._won_lease = lease

    def observed(self, leader: str | None, address: str, epoch: int) -> bool:
        """The election says ``leader`` is master of ``epoch`` (None: nobody). True if news."""
        if epoch < self.epoch or (epoch == self.epoch and leader == self.leader):
            return False
        if epoch == self.epoch and self.leader is not None and leader is not None:
            return False  # one master per epoch: a different name for it cannot be news
        if leader == self.node_id and epoch != self._won_epoch:
            leader, address = None, ""  # a key left by this node's previous life: wait for it to expire
        self.epoch = epoch
        self.leader, self.leader_address = leader, address
        return True

    def deposed(self, epoch: int) -> None:
        """A peer showed a newer epoch: stop acting as master at once."""
        if epoch > self.epoch:
            self.epoch = epoch
            self.leader = None
            self.leader_address = ""
        self._lease_ok_until = -1

    def is_master(self, now_ms: int) -> bool:
        return self.leader == self.node_id and self._won_epoch == self.epoch and now_ms < self._lease_ok_until

    def lease_left_ms(self, now_ms: int) -> int:
        """How long the confirmed lease still holds the seat (<= 0: not confirmed now)."""
        return self._lease_ok_until - now_ms


# ---------------------------------------------------------------------- the rules the shell applies
# node/replication/roles.py asks these; tests/test_replication_sim.py drives the same functions.


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    """What a master answers a slave's fetch: ``not_master`` (refused: not master now, or
    the request's term is not this master's), ``truncate`` (the slave's log diverges: cut it
    at ``to`` first), ``reset`` (retention deleted what it asks for: its log must start at
    ``to``, a rebuild) or ``records`` (send bytes from the asked offset)."""

    kind: str
    to: int = -1


def answer_fetch(*, serving: bool, my_epoch: int, req_epoch: int, theirs: EpochHistory, offset: int,
                 mine: EpochHistory, start: int, end: int) -> FetchAnswer:
    """Fencing, divergence and retention, in that order, for one fetch. A request of a newer
    term is refused like an older one: a claim deposes nobody (any client could send
    ``epoch=2**63``); the shell asks the election about it first (``_check_term``)."""
    if not serving or req_epoch != my_epoch:
        return FetchAnswer("not_master")
    cut = divergence(theirs, offset, mine, end)
    if cut is None and offset > end:
        cut = end  # longer than the master's log in the same history: the tail was never the master's
    if cut is not None:
        return FetchAnswer("truncate", cut)
    if offset < start:
        return FetchAnswer("reset", start)
    return FetchAnswer("records")


def take_answer(*, my_epoch: int, answer_epoch: int, from_leader: bool, acting_master: bool) -> bool:
    """A slave applies a fetch answer (bytes, a truncation) only from the node it follows,
    of a term not older than the one it knows, and never while it acts as master itself."""
    return from_leader and not acting_master and answer_epoch >= my_epoch


@dataclass(frozen=True, slots=True)
class LeaderKey:
    """What the election says now: the leader key's holder, or nobody (``node_id`` None)."""

    node_id: str | None
    address: str = ""
    epoch: int = 0


def steady_turn(action: str, leader: str | None, *, me: str, mode: str) -> bool:
    """After a role-loop turn: nothing is left to do until the election changes. The seat is
    held, this turn neither campaigned nor switched, and the node acts as what the key says
    (master when the key is its own, slave otherwise). Only then may the next ``Leader``
    call wait for a change (an empty seat, a campaign or a switch polls every
    ``leader_poll_ms``)."""
    return action == "" and leader is not None and (mode == "master") == (leader == me)


def leader_wait_ms(wait_ms: int, until_peers_ms: float, lease_left_ms: int | None, *, poll_ms: int) -> int:
    """How long a steady turn's next ``Leader`` call may wait for a change: at most
    ``wait_ms``, never past the next peers read, and for a master (``lease_left_ms`` given)
    at least a poll before its confirmed lease would lapse, so a master whose keepalives stop
    still steps down on time."""
    w = min(float(wait_ms), until_peers_ms)
    if lease_left_ms is not None:
        w = min(w, lease_left_ms - 2 * poll_ms)
    return max(0, int(w))


def role_step(member: Member, key: LeaderKey, *, me: str, address: str, mode: str, lease: int | None,
              campaigned_lease: int | None, now_ms: int, campaign_allowed: bool) -> str:
    """One turn of a node's role loop, after reading the leader key: updates ``member`` and
    says what the shell does next: ``"master"`` (take or keep the seat), ``"campaign"``
    (nobody holds it: try, after ``campaign_delay_ms``), ``"slave"`` (follow someone, or
    stop acting as master) or ``""`` (nothing changes).

    Seat reclaim: the key names this node under the lease it campaigned with, yet it is
    not acting as master (its campaign's answer was lost, or it stepped down because a
    keepalive was confirmed late while the lease lived on). It takes the seat back as soon
    as the lease is confirmed again, so that the seat is never held by nobody."""
    if key.node_id == me and mode != "master" and lease is not None and campaigned_lease == lease:
        member.won(key.epoch, address, lease)
        if member.is_master(now_ms):
            return "master"
    elif key.node_id is not None:
        member.observed(key.node_id, key.address, key.epoch)
    elif member.leader is not None and member.leader != me:
        member.observed(None, "", member.epoch)
    if key.node_id is None and mode != "master" and campaign_allowed and lease is not None:
        return "campaign"
    if mode == "master" and not member.is_master(now_ms):
        return "slave"
    if mode != "slave" and member.leader not in (None, me):
        return "slave"
    return ""


# ---------------------------------------------------------------------- the in-sync set
# Kafka's ISR for a group: the members whose logs hold every acknowledged record. Kept in
# etcd beside the leader key (metaserver/keyspace.py ``InSync``); only a member may be
# elected (the meta server checks it in the campaign's transaction; ``may_campaign`` keeps a
# node that is not in it from trying). The master changes it (``in_sync_change``):
#   * grow: a registered member whose fetch offset reached the master's log end is made a
#     required slave of the sync trackers first (every later write waits for it), then
#     written to etcd: it holds everything acknowledged before, and nothing is acknowledged
#     after without it;
#   * shrink: written to etcd first, then dropped from the trackers; only when at least the
#     master and one other member stay in it (a sync ack needs one slave anyway, and a lone
#     master in the set would make its death need an operator): with two members the set
#     stays both, and a dead slave makes sync writes fail rather than leave it behind.


def truncate_allowed(cut: int, acked_known: int) -> bool:
    """A slave cuts its log at ``cut`` only at or above the acknowledged point a master told it
    (``acked_offset`` of the tick state): below it lie records the group acknowledged, which a
    correctly elected master holds, so a request to cut there is refused, never obeyed."""
    return cut >= acked_known


def may_campaign(me: str, in_sync: list[str] | tuple[str, ...] | set[str]) -> bool:
    """Only a member of the in-sync set may be elected (none recorded yet: anyone)."""
    return not in_sync or me in in_sync


@dataclass(frozen=True, slots=True)
class InSyncChange:
    add: frozenset[str]
    drop: frozenset[str]


def in_sync_change(*, me: str, in_sync: set[str], registered: set[str], offsets: dict[str, tuple[int, int]],
                   log_end: int, now_ms: int, lag_max_ms: int, term_start_ms: int) -> InSyncChange:
    """What the master changes in its group's in-sync set now. ``offsets``: each slave's
    (fetch offset, when it was seen) as ``SyncTracker.slave_offsets`` keeps them; a slave not
    seen yet in this term counts as seen at ``term_start_ms``."""
    add = {p for p in registered - in_sync - {me} if offsets.get(p, (-1, 0))[0] >= log_end}
    stale = {p for p in in_sync - {me}
             if p not in registered or now_ms - offsets.get(p, (-1, term_start_ms))[1] > lag_max_ms}
    if len((in_sync | add) - stale) < 2:
        stale = set()  # never down to the master alone
    return InSyncChange(frozenset(add), frozenset(stale))
