"""Narrowing drains first (docs/design.md, "Narrowing drains first"): the pure rules. The route's
draining list (cluster/routes.py: ``change``, ``finish``), the fence a real-time node enforces
(node/realtime/fence.py), what a route change writes beside the route and when a drain may
finish (metaserver/fences.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster import status
from cluster.codec import Batch
from cluster.errors import InvalidArgument, RouteMoved, Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.routes import Route, RouteView, change, dropped, finish, taken_back
from cluster.wire import BatchResult
from metaserver.fences import (FenceValue, Fences, StoredFence, consumers_after, fence_ops, finish_refusal,
                               released_after, report_refusal)
from node.realtime.fence import NodeFences, drain_left, subject_drained, waiting_for

pytestmark = pytest.mark.unit

NAMES = [f"rt-{i}" for i in range(1, 7)]
group_sets = st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True)
ops = st.lists(st.one_of(st.tuples(st.just("set"), group_sets), st.tuples(st.just("finish"), st.integers(0, 5))),
               max_size=25)


# ---------------------------------------------------------------------- the route


def test_narrowing_moves_the_dropped_group_to_draining_and_raises_the_epoch():
    r = change("orders", Route(("rt-1", "rt-2", "rt-3"), 2), ("rt-2", "rt-1"))
    assert r == Route(("rt-1", "rt-2"), 3, ("rt-3",))
    assert r.readable == ("rt-1", "rt-2", "rt-3")
    assert r.encode() == b'{"draining": ["rt-3"], "epoch": 3, "groups": ["rt-1", "rt-2"]}'
    assert Route.decode(r.encode()) == r
    assert finish(r, "rt-3") == Route(("rt-1", "rt-2"), 4)


def test_a_route_that_never_narrowed_keeps_its_bytes():
    assert Route(("rt-1", "rt-2"), 2).encode() == b'{"epoch": 2, "groups": ["rt-1", "rt-2"]}'
    assert Route.decode(b'{"epoch": 2, "groups": ["rt-1", "rt-2"]}').draining == ()


def test_listing_a_draining_group_again_takes_it_back():
    narrowed = Route(("rt-1",), 3, ("rt-2", "rt-3"))
    r = change("s", narrowed, ("rt-1", "rt-3"))
    assert r == Route(("rt-1", "rt-3"), 4, ("rt-2",))
    assert taken_back(narrowed, r) == ("rt-3",) and dropped(narrowed, r) == ()


def test_finishing_a_group_that_is_not_draining_is_refused():
    with pytest.raises(InvalidArgument):
        finish(Route(("rt-1", "rt-2"), 2), "rt-2")


def test_a_route_with_a_group_both_written_and_draining_reads_as_written():
    r = Route.decode(b'{"draining": ["rt-2", "rt-3"], "epoch": 5, "groups": ["rt-1", "rt-2"]}')
    assert r == Route(("rt-1", "rt-2"), 5, ("rt-3",))


@given(group_sets, ops)
def test_route_changes_keep_their_invariants(first, steps):
    """Against the rules: groups and draining disjoint, groups never empty, the epoch grows
    on every change, the readable set loses a group only by ``finish``, the stored form
    round-trips."""
    r = change("s", None, tuple(first))
    for op, arg in steps:
        if op == "set":
            after = change("s", r, tuple(arg))
            if set(arg) == set(r.groups):
                assert after is r
                continue
            assert after.groups == tuple(sorted(arg))
            assert set(after.readable) == set(r.readable) | set(arg)  # nothing readable is lost
            assert set(dropped(r, after)) == set(r.groups) - set(arg)
        else:
            if not r.draining:
                continue
            g = r.draining[arg % len(r.draining)]
            after = finish(r, g)
            assert set(after.readable) == set(r.readable) - {g} and after.groups == r.groups
        assert after.epoch == r.epoch + 1
        assert after.groups and not set(after.groups) & set(after.draining)
        assert Route.decode(after.encode()) == after
        assert (b"draining" in after.encode()) == bool(after.draining)
        r = after


def test_writers_hash_over_the_written_groups_and_consumers_read_every_group():
    v = RouteView(("rt-1", "rt-2"), ("h:1", ""), 3, ("rt-3",), ("h:3",))
    assert v.live() == ["h:1", "h:3"] and v.writable_live() == ["h:1"]
    assert v.first_master() == "h:1"
    assert set(v.targets([f"id-{i}" for i in range(100)]).tolist()) == {0, 1}


# ---------------------------------------------------------------------- what a change writes beside the route


def test_a_narrowing_writes_a_draining_fence_and_every_written_group_loses_its_fence():
    before = Route(("rt-1", "rt-2", "rt-3"), 2)
    after = change("s", before, ("rt-1", "rt-2"))
    puts, deletes = fence_ops("s", before, after)
    assert puts == {"rt-3": FenceValue(3, True)} and deletes == ["rt-1", "rt-2"]
    back = change("s", after, ("rt-1", "rt-2", "rt-3"))
    assert fence_ops("s", after, back) == ({}, ["rt-1", "rt-2", "rt-3"])
    assert FenceValue.decode(FenceValue(3, False).encode()) == FenceValue(3, False)


# ---------------------------------------------------------------------- the fence on a node


def _batch(subjects: list[str]) -> Batch:
    n = len(subjects)
    return Batch.build(subjects, [b"p"] * n, ids=[f"m{i}" for i in range(n)], deliver_at_ms=np.zeros(n, np.int64))


def test_a_node_refuses_the_fenced_subjects_messages_only_with_a_retryable_route_moved():
    f = NodeFences("rt-3", required=True)
    with pytest.raises(Unavailable):
        f.check_loaded()  # a node with meta servers takes nothing before their first answer
    assert f.load(100, [("orders", True)])
    f.check_loaded()
    b = _batch(["orders", "audit", "orders", "audit"])
    idx = f.fenced(b)
    assert idx.tolist() == [0, 2]
    res = BatchResult.sized(b.n)
    assert f.refuse(res, b, idx) == 2
    assert res.codes.tolist() == [pb.OVERLOADED, 0, pb.OVERLOADED, 0]
    err = status.from_code(int(res.codes[0]), res.errors[0])
    assert isinstance(err, RouteMoved) and status.retryable(err) and "rt-3" in str(err)
    assert not status.final_refusal(res.errors[0])
    assert status.to_code(err) == pb.OVERLOADED


def test_a_node_keeps_the_newest_fences_and_a_finished_fence_still_refuses():
    f = NodeFences("rt-3", required=True)
    f.load(100, [("orders", True)])
    assert not f.load(90, [])  # an older answer (another meta server behind) changes nothing
    assert f.revision == 100 and f.draining() == ["orders"]
    f.load(120, [("orders", False)])  # finished: no longer draining, still fenced
    assert f.draining() == [] and f.fenced(_batch(["orders"])).tolist() == [0]
    f.load(130, [])  # the group was listed again: the fence is gone
    assert f.fenced(_batch(["orders"])).tolist() == [] and f.revision == 130
    assert not f.load(0, [])  # a meta server that knows no fences: nothing changes


def test_a_node_without_meta_servers_has_nothing_to_wait_for():
    NodeFences("rt-1", required=False).check_loaded()


@pytest.mark.parametrize("count, groups, required, drained", [
    (None, {}, (), True),                              # the node never had the subject
    (0, {}, (), True),
    (5, {}, (), False),                                # messages nobody ever pulled here are not given up
    (5, {"a": (0, False), "b": (0, False)}, (), True),  # every consumer group acked the end
    (5, {"a": (0, False), "b": (2, False)}, (), False),  # one still has two to ack
    (5, {"a": (0, False), "b": (3, True)}, (), True),   # an idle group holds nothing back (as for retention)
    (5, {"a": (0, False)}, ("a", "b"), False),         # b consumes elsewhere and never pulled here
    (5, {"a": (0, False), "b": (0, False)}, ("b",), True),
    (0, {}, ("a",), True),                             # nothing here: nothing to wait for
    (None, {}, ("a",), True),
])
def test_a_subject_is_drained_when_every_consumer_group_acked_its_end(count, groups, required, drained):
    assert subject_drained(count, groups, required) is drained
    assert (drain_left(count, groups, required) == 0) is drained


def test_what_is_left_counts_a_required_group_without_state_as_all_unacked():
    assert drain_left(40, {"billing": (0, False)}, ("audit", "billing")) == 40
    assert drain_left(40, {"billing": (3, False), "x": (9, True)}, ("audit",)) == 43
    assert waiting_for(40, {"billing": (3, False), "x": (9, True)}, ("audit",)) == ["audit", "billing"]
    assert waiting_for(40, {}, ()) == []


class _Store:
    def __init__(self, rows):
        self.rows = rows

    def unacked(self, subject):
        return self.rows.get(subject, (None, {}))


def test_a_master_reports_the_draining_subjects_it_holds_nothing_of():
    f = NodeFences("rt-3", required=True)
    assert f.drained(_Store({})) == []  # nothing loaded: nothing claimed
    f.load(10, [("a", True), ("b", True), ("c", False)])
    assert f.drained(_Store({"a": (3, {"g": (0, False)}), "b": (3, {"g": (1, False)}), "c": (0, {})})) == ["a"]


def test_a_draining_fence_names_the_consumer_groups_it_waits_for():
    f = NodeFences("rt-3", required=True)
    f.load(10, [("a", True, ("audit", "billing")), ("c", False, ("x",))], ("a", "other"))
    store = _Store({"a": (3, {"billing": (0, False)})})
    assert f.drained(store) == []  # audit never pulled here: its three entries are left
    assert f.progress(store) == [{"subject": "a", "left": 3, "waiting_for": ["audit"]}]
    assert f.consumers == {"a": ("audit", "billing")}  # a finished fence waits for nobody
    store.rows["a"] = (3, {"billing": (0, False), "audit": (0, False)})
    assert f.drained(store) == ["a"] and f.progress(store)[0]["left"] == 0


def test_every_master_reports_its_consumer_groups_of_the_watched_subjects():
    f = NodeFences("rt-1", required=True)
    store = _Store({"a": (3, {"billing": (0, False), "old": (2, True)}), "b": (1, {"x": (1, False)})})
    assert f.report(store) == (0, [])  # nothing loaded: no report (it never counts as complete)
    f.load(10, [], ("a", "z"))
    assert f.report(store) == (10, [("a", ["billing"])])  # idle groups are not reported; z: no groups here
    f.merged(10)
    f.merged(7)  # an older answer does not go back
    assert f.consumers_revision == 10


def test_a_report_outside_the_name_rule_or_too_long_is_not_recorded_and_says_why():
    assert report_refusal({"orders": ["audit", "billing"]}) == ""
    assert "consumer group" in report_refusal({"orders": ["bad name"]})
    assert "subject" in report_refusal({"": ["audit"]})
    assert "more than" in report_refusal({"orders": [f"g{i}" for i in range(10_001)]})


def test_a_reported_consumer_group_is_added_to_a_draining_fence_only():
    v = FenceValue(3, True, ("billing",))
    assert consumers_after(v, ["billing"]) is None
    assert consumers_after(v, ["audit", "billing"]) == FenceValue(3, True, ("audit", "billing"))
    assert consumers_after(FenceValue(3, False), ["audit"]) is None
    assert FenceValue.decode(FenceValue(3, True, ("b", "a")).encode()).consumers == ("a", "b")
    assert FenceValue(3, True).encode() == b'{"draining": true, "epoch": 3}'  # a fence from before keeps its bytes
    with pytest.raises(ValueError):
        FenceValue.decode(b'{"consumers": "audit", "draining": true, "epoch": 3}')


@pytest.mark.parametrize("count,groups,required,released,left", [
    (5, {"a": (0, False), "b": (2, False)}, (), ("b",), 0),     # b stopped for good: released, a acked all
    (5, {"a": (1, False), "b": (2, False)}, (), ("b",), 1),     # a still has one to ack
    (5, {"a": (0, False)}, ("a", "b"), ("b",), 0),              # b required (consumes elsewhere), released
    (5, {}, ("b",), ("b",), 0),                                 # the only consumer group, released: given up
    (5, {}, (), (), 5),                                         # nobody ever pulled: not given up
    (None, {}, ("b",), ("b",), 0),
])
def test_a_released_consumer_group_holds_no_drain_back(count, groups, required, released, left):
    assert drain_left(count, groups, required, released) == left
    assert subject_drained(count, groups, required, released) is (left == 0)
    assert not set(waiting_for(count, groups, required, released)) & set(released)


def test_a_release_is_kept_by_later_reports_and_sent_to_the_members():
    v = FenceValue(3, True, ("audit", "billing"))
    r = released_after(v, "audit")
    assert r == FenceValue(3, True, ("audit", "billing"), ("audit",))
    assert released_after(r, "audit") is None  # released already: nothing to write
    assert released_after(FenceValue(3, False), "audit") is None  # a finished drain waits for nobody
    assert consumers_after(r, ["audit"]) is None  # a master still reporting it does not bring it back
    assert consumers_after(r, ["audit", "x"]) == FenceValue(3, True, ("audit", "billing", "x"), ("audit",))
    assert FenceValue.decode(r.encode()) == r
    assert b'"released": ["audit"]' in r.encode()
    assert FenceValue.decode(v.encode()).released == ()  # a fence from before reads as none released
    with pytest.raises(ValueError):
        FenceValue.decode(b'{"draining": true, "epoch": 3, "released": [""]}')
    f = NodeFences("rt-3", required=True)
    f.load(10, [("a", True, ("audit", "billing"), ("audit",))])
    store = _Store({"a": (3, {"billing": (0, False), "audit": (2, False)})})
    assert f.drained(store) == ["a"]
    assert f.progress(store) == [{"subject": "a", "left": 0, "waiting_for": [], "released": ["audit"]}]
    f.load(11, [("a", True, ("audit", "billing"))])  # an answer without it (taken back by a widening and a
    assert f.drained(store) == [] and f.released == {}  # new narrowing): audit's two are left again


# ---------------------------------------------------------------------- when a drain finishes


def _why(**kw):
    base = dict(members=[("n1", 120), ("n2", 110)], needed_revision=100, reporter="h:1", master="h:1",
                reporter_revision=120)
    return finish_refusal(**{**base, **kw})


def test_a_drain_finishes_when_every_member_enforces_the_fence_and_the_master_says_drained():
    assert _why() == ""
    assert _why(others=[("rt-1", "h:9", 100), ("rt-2", "h:8", 130)]) == ""


@pytest.mark.parametrize("change_, words", [
    (dict(drained=False), "not acked"),
    (dict(master=""), "no master"),
    (dict(reporter="h:2"), "master is h:1"),
    (dict(reporter_revision=99), "predates"),
    (dict(members=[("n1", 120), ("n2", 99)]), "n2"),
    (dict(members=[("n1", 120), ("n2", 0)]), "n2"),   # a member that reports no fence revision
    (dict(members=[]), "no registered member"),
    (dict(others=[("rt-1", "", 0)]), "rt-1 of the route has no master"),
    (dict(others=[("rt-1", "h:9", 120), ("rt-2", "h:8", 99)]), "rt-2 (99)"),  # its report predates the fence
])
def test_a_drain_does_not_finish_otherwise(change_, words):
    why = _why(**change_)
    assert why and words in why, why


# ---------------------------------------------------------------------- a seeded simulation of the finish rule


class _Node:
    """One real-time group's master as the drain sees it: its store (one subject's index and
    each consumer group's position and in-flight entries), its fences (``NodeFences``, lost by
    a restart) and the registration snapshot its next heartbeat sends."""

    def __init__(self, group: str):
        self.group = group
        self.entries: list[str] = []
        self.pos: dict[str, int] = {}
        self.inflight: dict[str, set[int]] = {}
        self.fences = NodeFences(group, required=True)
        self.snap = None

    def unacked(self, subject):
        if not self.entries and not self.pos:
            return None, {}
        n = len(self.entries)
        return n, {g: (n - p + len(self.inflight[g]), False) for g, p in self.pos.items()}

    def snapshot(self):
        self.snap = (self.fences.revision, self.fences.consumers_revision, self.fences.report(self),
                     self.fences.drained(self))


class _Sim:
    """The etcd keys a drain touches (the route, the fences, the masters' records) with one
    revision counter, and the meta server's steps on them, written with the pure rules."""

    S = "orders"

    def __init__(self, rnd, groups):
        self.rnd = rnd
        self.rev = 1
        self.route = Route(tuple(groups), 1)
        self.fences: dict[str, tuple[FenceValue, int]] = {}  # group -> (value, mod revision)
        self.records: dict[str, tuple[int, int]] = {}        # group -> (fence revision, consumers revision)
        self.nodes = {g: _Node(g) for g in groups}
        self.got: dict[str, dict[str, int]] = {}             # consumer group -> id -> times received
        self.before_narrow: list[str] = []                   # ids accepted before the narrowing
        self.protected: set[str] = set()                     # consumer groups the drain must wait for
        self.released: set[str] = set()                      # consumer groups an operator released from it
        self.given_up: dict[str, int] = {}                   # released group -> messages of the dropped group
        self.finished = False                                #   it had not got when the drain finished
        self.n = 0

    def _write(self) -> int:
        self.rev += 1
        return self.rev

    def send(self):
        i = f"m{self.n}"
        self.n += 1
        node = self.nodes[self.route.groups[self.n % len(self.route.groups)]]
        if self.rnd.random() < 0.2:  # a writer with a route from before the narrowing
            node = self.nodes[self.rnd.choice(sorted(self.nodes))]
        if self.S in node.fences.subjects or node.group not in self.route.readable:
            return  # refused: route moved (stored nowhere)
        node.entries.append(i)
        if not self.route.draining:
            self.before_narrow.append(i)

    def pull(self, g, node):
        if node.group not in self.route.readable:
            return
        node.pos.setdefault(g, 0)
        node.inflight.setdefault(g, set())
        if node.pos[g] < len(node.entries):
            node.inflight[g].add(node.pos[g])
            node.pos[g] += 1

    def ack(self, g, node):
        if node.inflight.get(g):
            k = self.rnd.choice(sorted(node.inflight[g]))
            node.inflight[g].discard(k)
            self.got.setdefault(g, {})
            self.got[g][node.entries[k]] = self.got[g].get(node.entries[k], 0) + 1

    def narrow(self):
        keep = self.route.groups[:1]
        before, after = self.route, change(self.S, self.route, keep)
        puts, deletes = fence_ops(self.S, before, after)
        rev = self._write()  # one transaction: the route and its fences
        self.route = after
        for g, v in puts.items():
            self.fences[g] = (v, rev)
        for g in deletes:
            self.fences.pop(g, None)
        self.protected |= {g for n in self.nodes.values() for g in n.pos}  # every group at the narrowing

    def heartbeat(self, node):
        """The meta server's Heartbeat: the record, the report merged, the drain claimed, the answer."""
        if node.snap is None:
            return
        fence_rev, consumers_rev, (watch_rev, report), drained = node.snap
        self.records[node.group] = (fence_rev, consumers_rev)
        self._write()
        if watch_rev:  # merged (one meta server here: no write is lost to a concurrent one)
            for fg, (v, mod) in list(self.fences.items()):
                after = consumers_after(v, dict(report).get(self.S, ()))
                if after is not None:
                    self.fences[fg] = (after, self._write())
            node.fences.merged(watch_rev)
            if self.route.draining and self.S in dict(report):
                # the groups this merged report carried are in every draining fence now
                self.protected |= set(dict(report)[self.S])
        if self.S in drained:
            self.try_finish(node, fence_rev)
        # the answer: the meta server's own (Fences.answer), as node/registration.py hands it to the node
        stored = [StoredFence(g, self.S, v, mod) for g, (v, mod) in self.fences.items()]
        own, watch = Fences.answer(stored, node.group)
        node.fences.load(self.rev, [(s, d, tuple(c), tuple(r)) for s, d, c, r in own], tuple(watch))

    def release(self, name):
        """An operator releases consumer group ``name`` from the subject's drains (``Fences.release``:
        ``released_after`` on every draining fence, each a CAS write, so a new mod revision). Returns
        whether anything was written."""
        mine = [(g, v) for g, (v, _) in self.fences.items() if v.draining]
        assert mine and self.route.draining  # the RPC answers NotFound otherwise: the sim only calls it meanwhile
        changed = False
        for g, v in mine:
            after = released_after(v, name)
            if after is not None:
                self.fences[g] = (after, self._write())
                changed = True
        self.released.add(name)
        return changed

    def try_finish(self, node, reporter_revision):
        if node.group not in self.route.draining or node.group not in self.fences:
            return
        v, mod = self.fences[node.group]
        if not v.draining:
            return
        others = [(g, f"h:{g}" if g in self.records else "", self.records.get(g, (0, 0))[1])
                  for g in self.route.readable if g != node.group]
        why = finish_refusal(members=[(node.group, self.records[node.group][0])], needed_revision=mod,
                             reporter=node.group, master=node.group, reporter_revision=reporter_revision,
                             others=others)
        if why:
            return
        # the drain finishes: every protected consumer group that was not released has every message
        # the group held (a released one gave up its unacked messages here)
        for g in sorted(self.protected - self.released):
            missing = [i for i in node.entries if i not in self.got.get(g, {})]
            assert not missing, f"consumer group {g} loses {missing[:5]} of {node.group}"
        for g in sorted(self.released):
            self.given_up[g] = sum(i not in self.got.get(g, {}) for i in node.entries)
        self.route = finish(self.route, node.group)
        self.fences[node.group] = (FenceValue(self.route.epoch, False), self._write())
        self.finished = True

    def restart(self, node):
        node.fences = NodeFences(node.group, required=True)  # fences and reports come again from the meta server
        node.snap = None
        self.records.pop(node.group, None)  # its registration is gone until it registers again


STOP_P, RELEASE_P = 0.0015, 0.0015  # per step: a consumer group stops for good; the operator releases one


def _run(seed):
    """One seeded run: random interleavings of sends (some by writers with an old route), pulls
    and acks by consumer groups that pull from only some of the groups for a while, the
    narrowing, consumer groups appearing later, consumer groups stopping for good (they pull and
    ack nothing more, their in-flight entries stay unacked), an operator releasing a consumer group
    from the drain (a stopped one or one still consuming; only while the drain is in progress),
    snapshots, heartbeats (reports merged, drains claimed and finished) and restarts of a master;
    then everybody still consuming catches up, and the operator releases each stopped group the
    drain still waits for (what ``hourglass status``'s "waiting for" would tell them to do).
    Returns the sim, the stopped groups and the groups released while they were still consuming."""
    import random

    rnd = random.Random(seed)
    sim = _Sim(rnd, ["rt-1", "rt-2"])
    consumer_groups = ["g0", "g1"]
    stopped: set[str] = set()
    released_live: set[str] = set()
    narrowed_at = rnd.randint(30, 150)
    # g1 pulls only from rt-1 until a random step after the narrowing (a consumer that is slow to
    # reach rt-2, or down there); g0 pulls from both all along
    wakes = {"g0": 0, "g1": narrowed_at + rnd.randint(0, 400)}

    def release(g):
        if g not in stopped:
            released_live.add(g)
        sim.release(g)

    for step in range(800):
        if step == narrowed_at:
            sim.narrow()
        if sim.finished and step > max(wakes.values()):
            break
        if not stopped and step > narrowed_at // 2 and rnd.random() < STOP_P:  # one consumer group stops for good
            stopped.add(rnd.choice(consumer_groups))
        if sim.route.draining and rnd.random() < RELEASE_P:  # the operator releases a consumer group
            waiting = sorted(stopped - sim.released)
            release(rnd.choice(waiting) if waiting and rnd.random() < 0.7 else rnd.choice(consumer_groups))
        r = rnd.random()
        node = sim.nodes[rnd.choice(sorted(sim.nodes))]
        if r < 0.12 and step < narrowed_at + 100:
            sim.send()
        elif r < 0.45:
            g = rnd.choice(consumer_groups)
            if g not in stopped:
                sim.pull(g, sim.nodes[rnd.choice(["rt-1", "rt-2"] if step >= wakes[g] else ["rt-1"])])
        elif r < 0.7:
            g = rnd.choice(consumer_groups)
            if g not in stopped:
                sim.ack(g, node)
        elif r < 0.8:
            node.snapshot()
        elif r < 0.96:
            sim.heartbeat(node)
        elif r < 0.98:
            sim.restart(node)
        elif len(consumer_groups) < 4 and step > narrowed_at:  # a consumer group appears after the narrowing,
            g = f"g{len(consumer_groups)}"                       # on the written group first
            consumer_groups.append(g)
            wakes[g] = step + rnd.randint(0, 300)
            sim.pull(g, sim.nodes["rt-1"])
    # everybody still consuming catches up: pulls and acks everything readable; heartbeats until it
    # finishes; the operator releases the stopped groups the drain still waits for, one at a time
    for round_ in range(200):
        for g in consumer_groups:
            if g in stopped:
                continue
            for name in sim.route.readable:
                n = sim.nodes[name]
                for _ in range(len(n.entries) + 1):
                    sim.pull(g, n)
                while n.inflight.get(g):
                    sim.ack(g, n)
        waiting = sorted(stopped - sim.released)
        if round_ >= 2 and waiting and sim.route.draining and rnd.random() < 0.5:
            release(rnd.choice(waiting))
        for n in sim.nodes.values():
            n.snapshot()
            sim.heartbeat(n)
        if sim.finished:
            break
    return sim, stopped, released_live


@pytest.mark.parametrize("seed", range(100))
def test_a_seeded_drain_loses_no_message_accepted_before_the_narrowing(seed):
    """``_run``. Whenever a drain finishes, every consumer group that consumed the subject at the
    narrowing or in a report merged since (``protected``) and was not released has every message
    the dropped group held; the drain always finishes, a released group that stopped for good
    does not keep it open; after it, each protected group that was neither released nor stopped
    got every message accepted before the narrowing exactly once, one released while still
    consuming got every such message the kept group holds (it reads the live groups as before),
    and no consumer group got a message twice."""
    sim, stopped, released_live = _run(seed)
    assert sim.finished, (f"the drain never finished: route {sim.route}, fences {sim.fences}, stopped "
                          f"{sorted(stopped)}, released {sorted(sim.released)}")
    for g in sorted(sim.protected - sim.released - stopped):
        got = sim.got.get(g, {})
        assert not [i for i in sim.before_narrow if i not in got], g
    kept = {i for name in sim.route.readable for i in sim.nodes[name].entries}
    for g in sorted(released_live - stopped):
        got = sim.got.get(g, {})
        assert not [i for i in sim.before_narrow if i in kept and i not in got], g
    for g, got in sorted(sim.got.items()):
        assert all(k == 1 for k in got.values()), g


def test_the_seeded_drains_release_stopped_and_live_consumer_groups():
    """The runs above are not vacuous: in some, a consumer group that stopped for good is released
    while the dropped group holds messages it never got (it gave them up: without the release the
    drain could not have finished), in some a group still consuming is released, in some nothing
    is; and in every run some protected group is not released (the finish check has a group to check)."""
    stopped_gave_up = live = none = checked = 0
    for seed in range(100):
        sim, stopped, released_live = _run(seed)
        stopped_gave_up += any(sim.given_up.get(g, 0) for g in stopped & sim.released)
        live += bool(released_live)
        none += not sim.released
        checked += bool(sim.protected - sim.released)
    counts = (stopped_gave_up, live, none, checked)
    assert stopped_gave_up >= 20 and live >= 20 and none >= 10 and checked == 100, counts


# ---------------------------------------------------------------------- what hourglass status says of a drain


def test_status_shows_each_drain_in_progress_from_the_draining_masters_rows():
    from cluster.cli.status import drain_lines, drain_of, draining_text

    drains = [{"subject": "orders", "left": 12, "waiting_for": ["audit"]},
              {"subject": "billing.v2", "left": 0, "waiting_for": [], "released": ["old"]}]
    rows = [{"role": "realtime", "group": "rt-3", "mode": "master", "route_drains": drains},
            {"role": "realtime", "group": "rt-3", "mode": "slave", "route_drains": drains},  # the master's word only
            {"role": "realtime", "group": "rt-1", "route_drains": []},                        # unreplicated: a master
            {"role": "realtime", "group": "rt-2", "error": "UNAVAILABLE: gone"},
            {"role": "delay", "group": "delay-1", "drain": {"state": "draining", "pending": 3}}]
    assert drain_lines(rows) == ["route: billing.v2 draining: rt-3 (0 left), released old",
                                 "route: orders draining: rt-3 (12 left), waiting for audit"]
    assert drain_lines([{"role": "realtime", "group": "rt-1"}]) == []  # a node from before: nothing
    assert drain_of({"route_drains": drains}, "orders")["left"] == 12 and drain_of({}, "orders") is None
    assert draining_text("rt-3", "?") == "draining: rt-3 (? left)"  # what `admin route` prints too
