"""The in-sync set and the rules around acknowledgements (issue 26), pure: who may be
elected, how a master grows and shrinks the set, what a campaign writes, and the
timelines of the loss seen under starvation driven through the core."""

from __future__ import annotations

from hypothesis import given, strategies as st

from metaserver.keyspace import InSync, campaign_in_sync
from node.replication.core import EpochHistory, Member, SyncTracker, divergence, in_sync_change, may_campaign


def test_only_members_of_the_set_may_be_elected():
    assert may_campaign("a", [])  # a new group: anyone
    assert may_campaign("a", ["a", "b"])
    assert not may_campaign("c", ["a", "b"])


def test_campaign_hands_out_a_new_store_epoch_above_everything():
    why, after = campaign_in_sync(None, "a", store_epoch_min=7)
    assert why == "" and after == InSync(("a",), 8)
    why, again = campaign_in_sync(after, "a", store_epoch_min=0)
    assert why == "" and again.store_epoch == 9 and again.members == ("a",)
    why, same = campaign_in_sync(InSync(("a", "b"), 9), "c", store_epoch_min=100)
    assert "not in the in-sync set" in why and same == InSync(("a", "b"), 9)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 50)), min_size=1, max_size=30))
def test_store_epochs_of_terms_never_repeat(campaigns):
    """Whatever each candidate's own floor, every term gets an epoch above every earlier one."""
    isr, seen = None, []
    for who, floor in campaigns:
        why, after = campaign_in_sync(isr, who, floor)
        if why:
            continue
        assert after.store_epoch > max(seen, default=0) and after.store_epoch > floor
        seen.append(after.store_epoch)
        isr = InSync(("a", "b", "c"), after.store_epoch)


def test_a_caught_up_member_joins_and_a_dead_one_leaves_only_if_two_stay():
    offs = {"b": (100, 1000), "c": (40, 1000)}
    ch = in_sync_change(me="a", in_sync={"a"}, registered={"b", "c"}, offsets=offs, log_end=100, now_ms=1000,
                        lag_max_ms=5000, term_start_ms=0)
    assert ch.add == {"b"} and not ch.drop  # c is behind: not yet
    # two members: a dead slave stays in (sync writes fail instead; it holds all that was acked)
    ch = in_sync_change(me="a", in_sync={"a", "b"}, registered=set(), offsets=offs, log_end=100, now_ms=1000,
                        lag_max_ms=5000, term_start_ms=0)
    assert not ch.drop
    # three: the dead one leaves, the master and the live one stay
    ch = in_sync_change(me="a", in_sync={"a", "b", "c"}, registered={"b"}, offsets=offs, log_end=100,
                        now_ms=1000, lag_max_ms=5000, term_start_ms=0)
    assert ch.drop == {"c"}
    # a slave not seen since the term began counts from the term's start, not as stale at once
    ch = in_sync_change(me="a", in_sync={"a", "b", "c"}, registered={"b", "c"}, offsets={}, log_end=100,
                        now_ms=1000, lag_max_ms=5000, term_start_ms=900)
    assert not ch.drop


def test_sync_ack_needs_every_in_sync_slave():
    tr = SyncTracker(timeout_ms=1000)
    tr.set_slaves({"b", "c"})
    t = tr.wait(100, now_ms=0)
    assert t is not None
    assert tr.on_fetch("b", 100, 1) == []
    assert tr.on_fetch("c", 100, 2) == [t]


def test_the_old_timeline_a_lease_confirmed_late_is_not_a_seat():
    """The evidence run: delay-1's keepalive was confirmed late while its lease had already
    expired at etcd and delay-2 was elected. ``Member`` keeps a master acting only until
    ``sent + ttl - margin`` of the last keepalive *sent*; a lost registration stops it at once."""
    m = Member("a", lease_ttl_ms=5000, margin_ms=1000)
    m.won(7, "a:1")
    m.keepalive_sent(0)
    assert m.is_master(3999) and not m.is_master(4000)
    m.keepalive_sent(3000)
    assert m.is_master(6999)
    m.lease_lost()  # registration found lost: before registering again (which frees the seat)
    assert not m.is_master(3001)


def test_history_adopted_before_the_bytes_keeps_the_cut_after_them():
    """A slave that appended a term's bytes but had not adopted its history entry yet when it
    was promoted attributed them to the older term: a later divergence check cut records both
    members held. Adopting first, the common term ends where the bytes end."""
    master = EpochHistory([(1, 0), (2, 100)])  # epoch 2 wrote 100..200
    lagging = EpochHistory([(1, 0), (3, 200)])  # promoted in epoch 3 with 2's bytes under epoch 1
    assert divergence(master, 250, lagging, 260) == 100  # the old way: cut at 100, acked bytes go
    adopted = EpochHistory([(1, 0), (2, 100), (3, 200)])
    assert divergence(master, 200, adopted, 260) is None  # the returning member keeps them


def test_divergence_steps_down_to_an_epoch_both_hold():
    """Found by the seeded simulation with the in-sync set: n0 wrote epoch 1 to 78; n1 (its
    epoch 1 ends at 74) wrote epoch 2 from 74; n0 was elected in epoch 3 without seeing epoch 2,
    then n1 in epoch 4. The old rule compared the end of epoch 2 in n1 (95) with the end of
    epoch 1 in n0 (78), answered "records from 78", and n0 kept 74..78 of the wrong term: the
    logs differed at the same offsets, and acknowledged records of epoch 2 were not on n0."""
    n0 = EpochHistory([(1, 0), (3, 78)])
    n1 = EpochHistory([(1, 0), (2, 74), (4, 95)])
    assert divergence(n0, 78, n1, 98) == 74
    assert divergence(n0, 94, n1, 98) == 74
    # a prefix stays a prefix
    assert divergence(EpochHistory([(1, 0), (2, 74)]), 90, n1, 98) is None
    assert divergence(EpochHistory([(1, 0)]), 70, n1, 98) is None


def test_a_seat_given_up_is_not_a_lease_lost():
    """Chaos meta-pause seed 20: after a failed promotion the node resigned and forgot its
    lease's renewals; the seat it won next was not "surely alive" until the next renewal, so it
    stood down at once and flapped. Giving up a seat keeps the lease's renewals."""
    m = Member("a", lease_ttl_ms=6000, margin_ms=1200)
    m.keepalive_sent(1000, lease=5)
    m.won(7, "a:1", lease=5)
    assert m.is_master(2000)
    m.give_up_seat()
    assert not m.is_master(2000)
    m.won(9, "a:1", lease=5)
    assert m.is_master(2000)  # acts at once: the lease was renewed at 1000
    m.lease_lost()
    assert not m.is_master(2000)
    m.keepalive_sent(2500, lease=6)  # a new registration's renewal does not revive the old seat
    assert not m.is_master(2600)
