"""The role loop's Leader long poll (node/replication/core.py ``steady_turn``,
``leader_wait_ms``): when a member may wait for a change, and for how long."""

from __future__ import annotations

from hypothesis import given, strategies as st

from node.replication.core import leader_wait_ms, steady_turn


def test_only_a_settled_turn_may_wait():
    assert steady_turn("", "n2", me="n1", mode="slave")          # following n2
    assert steady_turn("", "n1", me="n1", mode="master")         # holding the seat
    assert not steady_turn("", None, me="n1", mode="slave")      # empty seat: poll, campaign soon
    assert not steady_turn("campaign", None, me="n1", mode="slave")
    assert not steady_turn("master", "n1", me="n1", mode="master")  # just switched
    assert not steady_turn("slave", "n2", me="n1", mode="slave")
    assert not steady_turn("", "n1", me="n1", mode="slave")      # seat reclaim pending
    assert not steady_turn("", "n2", me="n1", mode="master")     # someone else holds it


@given(wait=st.integers(0, 30_000), until_peers=st.floats(-5_000, 5_000, allow_nan=False),
       lease_left=st.one_of(st.none(), st.integers(-10_000, 10_000)), poll=st.integers(10, 1_000))
def test_the_wait_never_passes_the_peers_read_or_a_masters_lease(wait, until_peers, lease_left, poll):
    w = leader_wait_ms(wait, until_peers, lease_left, poll_ms=poll)
    assert 0 <= w <= wait
    assert w <= max(0, until_peers)
    if lease_left is not None:
        assert w <= max(0, lease_left - 2 * poll)


def test_a_slave_waits_up_to_the_setting():
    assert leader_wait_ms(1000, 5000.0, None, poll_ms=100) == 1000
    assert leader_wait_ms(0, 5000.0, None, poll_ms=100) == 0  # the setting turns it off
    assert leader_wait_ms(1000, 400.0, 5000, poll_ms=100) == 400
    assert leader_wait_ms(1000, 5000.0, 700, poll_ms=100) == 500
