"""The trace's pure parts (issue 31): the hops from the answers (``cluster/trace.py``), the
dispatch-record search of a delay node (``node/delay/dispatch_find.py``) and the real-time
lookup on a real ``RealtimeStore`` with time passed in (``node/realtime/lookup.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cluster import trace
from cluster.codec import OUTCOME_DEAD_LETTER, OUTCOME_OK, DispatchBatch
from cluster.errors import NotFound, Unavailable, UnknownSubject
from node.delay import terms as term_table
from node.delay.dispatch_find import dispatched_at, find_in, start_segment
from node.realtime.nack import nack_copies
from node.realtime.store import DLQ_SUBJECT, RealtimeStore
from node.store.log import SegmentedLog
from tests.test_realtime_store import SMALL, T0, M, append, handles

NOW = 1_800_000_000_000


# ---------------------------------------------------------------------- hops


def _dispatched(**rt) -> dict:
    return {"id": "m", "status": "dispatched", "seq": 5, "deliver_at_ms": NOW - 9_000, "effective_ms": NOW - 9_000,
            "accepted_ms": NOW - 20_000, "dispatched_ms": NOW - 8_990, "subject": "s", "realtime_group": "rt-1",
            "realtime": {"node_id": "realtime-1", "group": "rt-1", "position": 3, "stored_ms": NOW - 8_980,
                         **rt}}


def test_hops_name_each_group_in_order_and_the_dead_letter_copy():
    hops = trace.hops(_dispatched(groups=[
        {"group": "b", "state": "dead_lettered", "copy_id": "m~r1", "copy_subject": DLQ_SUBJECT, "copy_ms": NOW},
        {"group": "a", "state": "acked"}]), NOW)
    assert [(h.name, h.state) for h in hops] == [
        ("accepted", "done"), ("filed", "done"), ("fired", "done"), ("stored at the real-time node", "done"),
        ("delivered to a", "done"), ("acked by a", "done"), ("delivered to b", "done"), ("nacked by b", "done"),
        ("dead-lettered", "done"), ("cancelled", "skipped")]
    assert hops[2].detail == f"at {trace.iso(NOW - 9_000)}, its dispatch recorded at {trace.iso(NOW - 8_990)} to rt-1"
    assert "realtime-1" in hops[3].detail and "position 3" in hops[3].detail
    assert "m~r1" in hops[8].detail and "nacked by b" in hops[8].detail


def test_a_group_still_holding_it_or_not_handed_it_waits_and_so_does_the_dead_letter_hop():
    hops = {h.name: h for h in trace.hops(_dispatched(groups=[{"group": "a", "state": "in_flight"},
                                                              {"group": "c", "state": "waiting"},
                                                              {"group": "r", "state": "nacked", "copy_id": "m~r1"}]),
                                          NOW)}
    assert hops["delivered to a"].state == "done" and hops["acked or nacked by a"].state == "waiting"
    assert hops["delivered to c"].state == "waiting"
    assert hops["nacked by r"].detail == "retried as m~r1"
    assert hops["dead-lettered"].state == "waiting"
    acked = {h.name: h.state for h in trace.hops(_dispatched(groups=[{"group": "a", "state": "acked"}]), NOW)}
    assert acked["dead-lettered"] == "skipped"


def test_without_the_real_time_answer_the_delivery_hops_say_why():
    d = _dispatched()
    del d["realtime"]
    d["realtime_error"] = "Unavailable: no master"
    hops = {h.name: h for h in trace.hops(d, NOW)}
    assert [h.name for h in trace.hops(d, NOW)] == list(trace.HOPS)
    assert hops["delivered"].state == "unknown" and hops["delivered"].detail == "Unavailable: no master"
    pending = {h.name: h.state for h in trace.hops({"status": "pending", "deliver_at_ms": NOW + 5_000}, NOW)}
    assert pending["delivered"] == pending["dead-lettered"] == "waiting"
    dl = {h.name: h.state for h in trace.hops({"status": "dispatched", "dead_lettered": True}, NOW)}
    assert dl["dead-lettered"] == "done" and dl["delivered"] == "skipped"


def test_trace_lines_mark_each_hop():
    lines = trace.lines(_dispatched(groups=[{"group": "a", "state": "acked"}]), NOW)
    assert lines[0].startswith("message m  status=dispatched")
    assert [ln.split("]", 1)[0].strip() for ln in lines[1:]] == ["[x"] * 6 + ["[-"] * 2


# ---------------------------------------------------------------------- dispatch records


def _rec(seqs, effs, at, outcome=OUTCOME_OK) -> bytes:
    n = len(seqs)
    return DispatchBatch(np.array(seqs, np.uint64), np.array(effs, np.int64), np.array(effs, np.int64), at,
                         outcome).encode()


def test_the_accepted_hop_names_the_node_and_the_term_or_the_term_only():
    lk = {"status": "pending", "seq": 7, "deliver_at_ms": NOW + 60_000, "accepted_ms": NOW, "group": "delay-1",
          "store_epoch": 3, "node_id": "d2"}
    assert trace.hops({**lk, "accepted_node_id": "d1"}, NOW)[0].detail.startswith("by delay-1 (node d1, store epoch 3), seq 7")
    assert trace.hops(lk, NOW)[0].detail.startswith("by delay-1 (store epoch 3), seq 7")  # data older than the table
    assert trace.hops({**lk, "store_epoch": 0}, NOW)[0].detail.startswith("by delay-1, seq 7")


# ---------------------------------------------------------------------- the term table (node/delay/terms.py)


def test_a_term_table_survives_a_reopen_and_a_slave_adopts_the_masters_table(tmp_path):
    m, s = tmp_path / "m", tmp_path / "s"
    m.mkdir(), s.mkdir()
    t = term_table.TermTable(m)
    assert t.node_of(3) == "" and t.encoded() == "[]"
    assert t.take(3, "d1") and not t.take(3, "d1")  # written once
    t.take(5, "d2")
    assert term_table.TermTable(m).terms == {3: "d1", 5: "d2"}  # durable
    slave = term_table.TermTable(s)
    slave.take(4, "d3")  # its own term as master, before
    assert slave.adopt(__import__("json").loads(t.encoded()))
    assert term_table.TermTable(s).terms == {3: "d1", 4: "d3", 5: "d2"}
    assert not slave.adopt([[3, "d1"], "junk", [None, "x"], [6, ""]])  # nothing new, junk left out
    (m / term_table.FILE_NAME).write_text("not a checkpoint\n")
    assert term_table.TermTable(m).terms == {}  # unusable: lookups name the term only


@given(st.lists(st.dictionaries(st.integers(0, 400), st.sampled_from(["a", "b", "c"]), max_size=20), max_size=8))
def test_merging_term_tables_keeps_the_newest_epochs_and_the_masters_word(tables):
    out: dict[int, str] = {}
    for theirs in tables:
        out = term_table.merged(out, theirs, keep=50)
        assert len(out) <= 50 and all(out[e] == n for e, n in theirs.items() if e in out)
        assert list(out) == sorted(out)
    union: dict[int, str] = {}
    for theirs in tables:
        union.update(theirs)
    assert out == dict(sorted(union.items())[-50:])


def test_find_in_answers_the_record_holding_the_seq_and_stops_at_its_bounds():
    recs = [(0, _rec([1, 2], [100, 100], 105)), (1, _rec([3], [200], 210, OUTCOME_DEAD_LETTER))]
    got = find_in(iter(recs), 3, 200)
    assert (got.dispatched_ms, got.dead_lettered) == (210, True)
    assert find_in(iter(recs), 2, 100).dispatched_ms == 105
    assert find_in(iter(recs), 3, 200, records_max=1) is None  # the bound: one record read
    far = [(0, _rec([9], [10_000_000], 10_000_001)), (1, _rec([3], [200], 210))]
    assert find_in(iter(far), 3, 200) is None  # a record far past its time ends the scan


def test_start_segment_is_the_last_starting_before_the_time():
    firsts = {0: 100, 10: 500, 20: 900, 30: None}  # 30: empty (the active segment)
    assert start_segment([0, 10, 20, 30], firsts.get, 600) == 1
    assert start_segment([0, 10, 20, 30], firsts.get, 950) == 2
    assert start_segment([0, 10, 20, 30], firsts.get, 900) == 1  # 900 may begin in segment 10
    assert start_segment([0, 10, 20, 30], firsts.get, 50) == 0


def test_dispatched_at_reads_a_real_dispatch_log_across_segments(tmp_path):
    log = SegmentedLog.open(tmp_path / "dispatch", segment_bytes_max=4096)
    try:
        for k in range(200):  # ~ 50 bytes a record: several segments
            log.append([_rec([k], [1000 + 10 * k], 1005 + 10 * k)])
        assert len(log.segment_bases()) > 2
        assert dispatched_at(log, 150, 2500).dispatched_ms == 2505
        assert dispatched_at(log, 0, 1000).dispatched_ms == 1005
        assert dispatched_at(log, 999, 2500) is None
    finally:
        log.close()


# ---------------------------------------------------------------------- the real-time lookup


@pytest.fixture
def store(tmp_path):
    s = RealtimeStore.open(tmp_path, SMALL, now_ms=T0)
    yield s
    s.close()


def test_each_groups_state_of_one_message(store):
    append(store, *(M(i) for i in range(5)), now=T0)
    store.flush()
    assert handles(store, "orders", "billing", 10, T0 + 1) == [0, 1, 2, 3, 4]
    assert store.ack("orders", "billing", [(0, 5)], now_ms=T0 + 2) == 5
    assert handles(store, "orders", "audit", 3, T0 + 1) == [0, 1, 2]
    got, _ = store.nack("orders", "audit", [(2, 3)], now_ms=T0 + 3)
    _, dead = nack_copies(got, now_ms=T0 + 3, retry_after_ms=0, max_attempts=1, group="audit")
    store.append(dead, now_ms=T0 + 3)
    assert store.ack("orders", "audit", [(2, 3)], now_ms=T0 + 3) == 1
    store.flush()
    f = store.lookup("orders", "m2")
    assert (f.position, f.found_by, f.stored_ms) == (2, "window", T0)
    assert {g.group: (g.state, g.copy_id) for g in f.groups} == {"audit": ("dead_lettered", "m2~r1"),
                                                                 "billing": ("acked", "")}
    assert {g.group: g.state for g in store.lookup("orders", "m1").groups} == {"audit": "in_flight",
                                                                               "billing": "acked"}
    assert {g.group: g.state for g in store.lookup("orders", "m4").groups} == {"audit": "waiting",
                                                                               "billing": "acked"}
    with pytest.raises(NotFound):
        store.lookup("orders", "m9")
    with pytest.raises(UnknownSubject):
        store.lookup("nope", "m1")


def test_an_id_past_the_dedup_window_is_found_by_time_and_at_the_end(tmp_path):
    later = T0 + SMALL.dedup_window_ms + 100
    s = RealtimeStore.open(tmp_path, SMALL, now_ms=T0)
    try:
        for k in range(20):
            append(s, M(k), now=T0 + k)
        append(s, M("late"), now=later)  # expires the window of the others
        s.flush()
        assert s.lookup("orders", "m3", around_ms=T0 + 3).found_by == "scan"
        assert s.lookup("orders", "m3", around_ms=T0 + 3).position == 3
        assert s.lookup("orders", "m17").position == 17  # no time: the newest entries
    finally:
        s.close()


# ---------------------------------------------------------------------- the real-time group of an id


async def test_the_lookup_names_the_real_time_group_the_dispatch_rule_picks():
    from cluster.codec import Batch
    from cluster.routes import RouteView
    from node.delay.targets import realtime_target, split

    view = RouteView(("rt-1", "rt-2", "rt-3"), ("10.0.0.1:7002", "", "10.0.0.3:7002"))

    class Router:
        async def realtime_route(self, subject):
            if subject == "gone":
                raise Unavailable("no route")
            return view

    ids = [f"id-{k}" for k in range(30)]
    b = Batch.build("s", [b"x"] * len(ids), ids, np.zeros(len(ids), np.int64))
    sent, stuck = split(b, np.arange(len(ids)), [view])
    where = {ids[i]: addr for addr, part in sent.items() for i in part.tolist()}
    where.update({ids[i]: "" for i in stuck.tolist()})
    for msg_id in ids:  # the group named is the one the message was (or will be) dispatched to
        group, address = await realtime_target(Router(), "s", msg_id)
        assert address == where[msg_id] and view.masters[view.groups.index(group)] == address
    # 30 ids reach every group, the one without a master too (named, with no address)
    assert {await realtime_target(Router(), "s", i) for i in ids} == {("rt-1", "10.0.0.1:7002"), ("rt-2", ""),
                                                                      ("rt-3", "10.0.0.3:7002")}
    assert await realtime_target(Router(), "gone", "id-1") == ("", "")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(1, 8), st.sampled_from([0, 0, 0, 1, 40])), min_size=1, max_size=200))
def test_dispatched_at_agrees_with_a_list_of_the_records(tmp_path_factory, steps):
    """Records in firing order (effective times never going back, often the same across
    segments: a backlog filed under one floor), over small segments: every seq's dispatch is
    found, as a list of the records says; a seq never dispatched is not."""
    log = SegmentedLog.open(tmp_path_factory.mktemp("d") / "dispatch", segment_bytes_max=512)
    model: dict[int, tuple[int, int]] = {}
    seq, eff = 0, 1000
    try:
        for k, (n, gap) in enumerate(steps):
            eff += gap
            seqs = list(range(seq, seq + n))
            seq += n
            log.append([_rec(seqs, [eff] * n, eff + 7, OUTCOME_DEAD_LETTER if k % 5 == 4 else OUTCOME_OK)])
            model.update({s: (eff, eff + 7) for s in seqs})
        for s, (e, at) in model.items():
            got = dispatched_at(log, s, e)
            assert got is not None and got.dispatched_ms == at, (s, e, log.segment_bases())
        assert dispatched_at(log, seq + 1, eff) is None
    finally:
        log.close()
