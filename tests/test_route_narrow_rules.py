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
from metaserver.fences import FenceValue, fence_ops, finish_refusal
from node.realtime.fence import NodeFences, subject_drained

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


@pytest.mark.parametrize("count, groups, drained", [
    (None, [], True),                      # the node never had the subject
    (0, [], True),
    (5, [], False),                        # messages nobody ever pulled here are not given up
    (5, [(0, False), (0, False)], True),   # every consumer group acked the end
    (5, [(0, False), (2, False)], False),  # one still has two to ack
    (5, [(0, False), (3, True)], True),    # an idle group holds nothing back (as for retention)
])
def test_a_subject_is_drained_when_every_consumer_group_acked_its_end(count, groups, drained):
    assert subject_drained(count, groups) is drained


class _Store:
    def __init__(self, rows):
        self.rows = rows

    def unacked(self, subject):
        return self.rows.get(subject, (None, []))


def test_a_master_reports_the_draining_subjects_it_holds_nothing_of():
    f = NodeFences("rt-3", required=True)
    assert f.drained(_Store({})) == []  # nothing loaded: nothing claimed
    f.load(10, [("a", True), ("b", True), ("c", False)])
    assert f.drained(_Store({"a": (3, [(0, False)]), "b": (3, [(1, False)]), "c": (0, [])})) == ["a"]


# ---------------------------------------------------------------------- when a drain finishes


def _why(**kw):
    base = dict(members=[("n1", 120), ("n2", 110)], needed_revision=100, reporter="h:1", master="h:1",
                reporter_revision=120)
    return finish_refusal(**{**base, **kw})


def test_a_drain_finishes_when_every_member_enforces_the_fence_and_the_master_says_drained():
    assert _why() == ""


@pytest.mark.parametrize("change_, words", [
    (dict(drained=False), "not acked"),
    (dict(master=""), "no master"),
    (dict(reporter="h:2"), "master is h:1"),
    (dict(reporter_revision=99), "predates"),
    (dict(members=[("n1", 120), ("n2", 99)]), "n2"),
    (dict(members=[("n1", 120), ("n2", 0)]), "n2"),   # a member that reports no fence revision
    (dict(members=[]), "no registered member"),
])
def test_a_drain_does_not_finish_otherwise(change_, words):
    why = _why(**change_)
    assert why and words in why, why
