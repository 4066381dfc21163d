"""A subject's route over several real-time groups (cluster/routes.py, node/delay/targets.py):
the stored format (an old bare group name still reads), widening (``widen`` refusing a drop),
and the pure choice of a message's group by the hash of its id."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cluster.codec import Batch
from cluster.errors import InvalidArgument
from cluster.routes import ROUTE_GROUPS_MAX, Route, RouteView, group_index, group_of, parse_groups, widen
from metaserver import keyspace as ks
from node.delay import targets

pytestmark = pytest.mark.unit

ids_st = st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=60)


# ---------------------------------------------------------------------- the stored route


def test_an_old_single_group_route_reads_as_a_list_of_one():
    """Before routes were lists the key held the bare group name: it still reads, at epoch 1."""
    r = Route.decode(b"realtime-1")
    assert r == Route(("realtime-1",), 1)
    assert ks.route_views(r, [ks.GroupView("realtime", "realtime-1", master="h:1")])[0].master == "h:1"


def test_a_route_round_trips_and_is_sorted_whatever_the_order_written():
    r = Route.decode(b'{"groups": ["rt-3", "rt-1", "rt-2", "rt-1"], "epoch": 4}')
    assert r == Route(("rt-1", "rt-2", "rt-3"), 4)
    assert Route.decode(r.encode()) == r


@pytest.mark.parametrize("raw", [b"", b"two words", b'{"groups": []}', b'{"epoch": 2}',
                                 b'{"groups": ["a"], "epoch": 0}', b'{"groups": [""], "epoch": 1}'])
def test_an_unreadable_route_is_an_error_not_a_guess(raw):
    with pytest.raises(ValueError):
        Route.decode(raw)


def test_route_views_keep_the_route_order_and_show_groups_without_a_node():
    views = ks.route_views(Route(("a", "b")), [ks.GroupView("realtime", "b", master="h:2")])
    assert [(v.name, v.master) for v in views] == [("a", ""), ("b", "h:2")]


# ---------------------------------------------------------------------- changes: widen only


def test_widening_adds_groups_and_raises_the_epoch():
    r = widen("s", Route(("rt-1",), 1), ("rt-1", "rt-2", "rt-3"))
    assert r == Route(("rt-1", "rt-2", "rt-3"), 2)
    assert widen("s", None, ("rt-2",)) == Route(("rt-2",), 1)  # a subject with no route yet


def test_the_same_list_is_a_no_op_and_keeps_the_epoch():
    cur = Route(("rt-1", "rt-2"), 5)
    assert widen("s", cur, ("rt-1", "rt-2")) is cur


def test_widen_refuses_a_drop_with_one_line_naming_what_would_be_dropped():
    """``widen`` is for callers that may only widen; a narrowing drains (test_route_narrow_rules.py)."""
    with pytest.raises(InvalidArgument) as e:
        widen("orders", Route(("rt-1", "rt-2", "rt-3"), 2), ("rt-1", "rt-3"))
    msg = str(e.value)
    assert "rt-2" in msg and "widens" in msg and "\n" not in msg


def test_an_operators_list_is_checked():
    assert parse_groups(" rt-2, rt-1,,rt-2 ", ks.check_name) == ("rt-1", "rt-2")
    with pytest.raises(InvalidArgument):
        parse_groups(" , ", ks.check_name)
    with pytest.raises(InvalidArgument):
        parse_groups("rt/1", ks.check_name)
    with pytest.raises(InvalidArgument):
        parse_groups([f"g{i}" for i in range(ROUTE_GROUPS_MAX + 1)], ks.check_name)


# ---------------------------------------------------------------------- the hash choice


def test_a_message_goes_to_the_group_of_its_id_hash():
    groups = ("rt-1", "rt-2", "rt-3")
    for msg_id in ("order-1", "order-2", "x" * 200, "é"):
        assert group_of(msg_id, groups) == groups[xxhash.xxh3_64_intdigest(msg_id.encode()) % 3]
    assert group_of("anything", ("only",)) == "only"


@given(ids_st, st.integers(1, 8))
def test_the_batch_choice_is_the_one_message_choice_and_a_retry_lands_alike(ids, n):
    groups = tuple(f"g{i}" for i in range(n))
    gi = group_index(ids, n)
    assert [groups[k] for k in gi.tolist()] == [group_of(i, groups) for i in ids]
    assert (group_index(ids, n) == gi).all()  # the same ids, the same groups: a retry is de-duplicated


def test_ids_spread_over_every_group():
    counts = np.bincount(group_index([f"id-{i}" for i in range(3000)], 3), minlength=3)
    assert (counts > 800).all(), counts


def test_the_hash_is_not_the_delay_groups_crc32():
    """Two delay groups and two real-time groups: with the same hash every delay group would
    send a subject to one real-time group only."""
    import zlib
    ids = [f"id-{i}" for i in range(400)]
    delay_group = np.array([zlib.crc32(i.encode()) % 2 for i in ids])
    rt = group_index(ids, 2)
    assert set(rt[delay_group == 0].tolist()) == {0, 1}


# ---------------------------------------------------------------------- a dispatch round's targets


def _batch(subjects: list[str], ids: list[str]) -> Batch:
    n = len(ids)
    return Batch.build(subjects, [b"p"] * n, ids=ids, deliver_at_ms=np.zeros(n, np.int64))


def test_dispatch_targets_split_by_subject_route_and_id_hash():
    ids = [f"m{i}" for i in range(60)]
    subs = ["a" if i % 2 else "b" for i in range(60)]
    b = _batch(subs, ids)
    a = RouteView.single("h:1")
    wide = RouteView(("rt-1", "rt-2", "rt-3"), ("h:1", "h:2", ""), 2)
    views = [a if s == "a" else wide for s in b.subjects]
    idx = np.arange(60, dtype=np.int64)
    out, stuck = targets.split(b, idx, views)
    want: dict[str, list[int]] = {}
    want_stuck = []
    for i in range(60):
        if subs[i] == "a":
            want.setdefault("h:1", []).append(i)
        else:
            m = wide.masters[wide.groups.index(group_of(ids[i], wide.groups))]
            (want.setdefault(m, []) if m else want_stuck).append(i)
    assert {k: v.tolist() for k, v in out.items()} == want
    assert stuck.tolist() == want_stuck and want_stuck  # rt-2-less ids wait for a master


def test_dispatch_targets_one_group_per_subject_is_by_subject_only():
    b = _batch(["a", "b", "a"], ["x", "y", "z"])
    views = [RouteView.single("h:1") if s == "a" else RouteView.single("h:2") for s in b.subjects]
    out, stuck = targets.split(b, np.array([0, 1, 2], np.int64), views)
    assert {k: v.tolist() for k, v in out.items()} == {"h:1": [0, 2], "h:2": [1]} and not len(stuck)
