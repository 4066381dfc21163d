"""The counts a node's Status carries for the console (issue 31): pending messages by minute
from the per-second schedule index, the lateness window, role changes. Pure parts against
naive models (Hypothesis), the minute counts against a real store's messages."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings as hsettings, strategies as st

from node.delay.lateness import LatenessWindow
from node.delay.minutes import MINUTE_MS, PendingMinutes, minute_counts
from node.delay.schedule_status import ScheduleStatus
from node.delay.store import StoreSettings
from node.config import NodeSettings
from node.nodestatus import RoleChanges
from tests.test_delay_store import T0, Harness, msg

BUCKET_MS = 600_000  # 10 minutes: three buckets hold half an hour
SETTINGS = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14,
                         schedule_segment_bytes=1 << 16, id_slots=256, id_entries_max=4096, bucket_ms=BUCKET_MS)
START = T0 - T0 % BUCKET_MS


def naive_minutes(dues: dict[str, int], completed_ms: int) -> dict[int, int]:
    """Each pending message in the minute it is due, or in completed_ms's minute when that is
    later (due now), never past its own bucket's last minute."""
    out: dict[int, int] = {}
    for due in dues.values():
        b = due - due % BUCKET_MS
        t = min(max(due, completed_ms), b + BUCKET_MS - 1)
        m = t - t % MINUTE_MS
        out[m] = out.get(m, 0) + 1
    return out


def minutes_of(h: Harness, pm: PendingMinutes) -> dict[int, int]:
    return pm.counts(h.store, h.store.pending_by_bucket(), now_ms=h.now, horizon_ms=3 * BUCKET_MS)


def test_minutes_of_a_burst_are_in_its_minute_and_sum_to_the_bucket(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 5_000)
    burst = START + 5_000 + 10 * MINUTE_MS
    h.send([msg(i, burst + i) for i in range(20)] + [msg(100 + i, START + 5_000 + 30_000 * i) for i in range(8)])
    pm = PendingMinutes(buckets_max=4)
    got = minutes_of(h, pm)
    assert got.get(burst - burst % MINUTE_MS, 0) == 20
    for b, n in h.store.pending_by_bucket().items():
        assert sum(v for m, v in got.items() if b <= m < b + BUCKET_MS) == n


@hsettings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "cancel", "run", "restart"]), st.integers(0, 10 ** 6)),
                min_size=1, max_size=12))
def test_minute_counts_match_the_messages_pending(tmp_path_factory, steps):
    h = Harness(tmp_path_factory.mktemp("m"), settings=SETTINGS, now=START + 1_000)
    pm = PendingMinutes(buckets_max=8)
    dues: dict[str, int] = {}
    for op, x in steps:
        h.model_step(op, x, dues, lambda x, n: [msg(n + i, h.now + (x * (i + 1)) % (2 * BUCKET_MS))
                                                for i in range(1 + x % 7)], lambda m: m.deliver_at_ms)
        assert minutes_of(h, pm) == naive_minutes(dues, h.store.completed_ms)


@given(st.lists(st.integers(0, 10), min_size=60, max_size=60), st.integers(0, 59), st.integers(0, 50),
       st.lists(st.integers(0, 59), max_size=5))
def test_minute_counts_always_sum_to_the_pending_count(net, c_second, pending, delivered):
    got = minute_counts(np.array(net), start_ms=0, completed_ms=c_second * 1000 + 500, pending=pending,
                        delivered_ms=np.array([d * 1000 for d in delivered], np.int64))
    assert sum(got.values()) == pending and all(v > 0 for v in got.values())


def test_the_worked_example_of_the_module_docs():
    net = np.zeros(3600, np.int64)
    net[30], net[90], net[130], net[200] = 3, 4, 2, 1
    assert minute_counts(net, start_ms=0, completed_ms=90_500, pending=7,
                         delivered_ms=np.array([200_000])) == {60_000: 5, 120_000: 2}


@given(st.lists(st.integers(0, 5_000_000), min_size=1, max_size=300))
def test_lateness_quantiles_bound_the_true_ones_within_ten_percent(values):
    w = LatenessWindow(window_ms=3_600_000, slot_ms=60_000)
    w.observe(np.array(values), now_ms=T0)
    s = w.summary(T0)
    ordered = sorted(values)
    assert s["count"] == len(values)
    for key, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
        true = ordered[max(1, int(np.ceil(q * len(values)))) - 1]
        assert true <= s[key] <= true * 1.1 + 1


def test_lateness_forgets_what_left_the_window():
    w = LatenessWindow(window_ms=3_600_000, slot_ms=60_000)
    w.observe(np.array([5_000] * 10), now_ms=T0)
    w.observe(np.array([3] * 10), now_ms=T0 + 1_800_000)
    assert w.summary(T0 + 1_800_000)["p99_ms"] >= 5_000
    later = w.summary(T0 + 3_600_000 + 60_000)
    assert later["count"] == 10 and later["p99_ms"] == 3
    assert w.summary(T0 + 2 * 3_600_000 + 60_000)["count"] == 0


def test_role_changes_count_the_last_hour_and_stay_bounded():
    r = RoleChanges(window_ms=3_600_000, kept_max=3)
    for t in (0, 2_400_000, 3_900_000):
        r.note(t)
    assert r.count(4_200_000) == 2
    for t in range(10):
        r.note(4_200_000 + t)
    assert r.count(4_200_010) == 3  # a storm reads as kept_max


def test_schedule_status_is_json_keyed_by_bucket_start(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    h.send([msg(i, START + 1_000 + BUCKET_MS * i) for i in range(3)])
    s = ScheduleStatus(NodeSettings(status_buckets_max=2)).stats(h.store, now_ms=h.now)
    assert s["bucket_ms"] == BUCKET_MS
    assert s["pending_by_bucket"] == {str(START): 1, str(START + BUCKET_MS): 1}
    assert s["pending_buckets_left_out"] == 1
    assert s["lateness"]["count"] == 0


# ---------------------------------------------------------------------- real-time consumer groups


def test_group_rows_count_backlog_in_flight_and_redeliveries_and_survive_restart(tmp_path):
    from tests.test_realtime_store import M, SMALL, append, open_store, pull

    s = open_store(tmp_path)
    append(s, *[M(i) for i in range(100)])
    _, h = pull(s, "orders", "billing", 90, T0)
    s.ack("orders", "billing", [(int(h[0]), int(h[80]))], now_ms=T0)  # 80..89 stay in flight
    pull(s, "orders", "audit", 5, T0)
    assert s.group_rows(10) == ([
        {"subject": "orders", "group": "audit", "backlog": 95, "lag_messages": 100, "in_flight": 5, "redelivered": 0,
         "idle": False},
        {"subject": "orders", "group": "billing", "backlog": 10, "lag_messages": 20, "in_flight": 10, "redelivered": 0,
         "idle": False}], 0)
    again, _ = pull(s, "orders", "billing", 3, T0 + SMALL.ack_timeout_ms + 1)  # three of them time out: redelivered
    assert again.n == 3
    billing = {r["group"]: r for r in s.group_rows(10)[0]}["billing"]
    assert (billing["in_flight"], billing["redelivered"], billing["lag_messages"]) == (10, 3, 20)
    assert s.group_rows(1) == ([{"subject": "orders", "group": "audit", "backlog": 95, "lag_messages": 100,
                                 "in_flight": 5, "redelivered": 0, "idle": False}], 1)
    s.close()
    s = open_store(tmp_path, now=T0 + 5_000)
    rows = {r["group"]: r for r in s.group_rows(10)[0]}
    # positions and in-flight handles come back from the offsets log; redeliveries count anew
    assert (rows["billing"]["backlog"], rows["billing"]["in_flight"], rows["billing"]["redelivered"]) == (10, 10, 0)
    assert (rows["audit"]["backlog"], rows["audit"]["in_flight"]) == (95, 5)
    s.close()


def test_a_follower_counts_as_of_its_masters_checkpoint(tmp_path):
    """A follower fires nothing: what its master's checkpoint says is done leaves its counts."""
    from node.delay.store import DelayStore

    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    dues = [START + 2_000] * 5 + [START + 300_000] * 3 + [START + BUCKET_MS + 5_000] * 4
    h.send([msg(i, d) for i, d in enumerate(dues)])
    h.store.checkpoint()
    doc = h.store.replication_doc()
    h.store.close()
    f = DelayStore.open(tmp_path, SETTINGS, now_ms=START + 1_000, follower=True)
    s = ScheduleStatus(NodeSettings())
    assert s.stats(f, now_ms=START + 1_000)["pending_by_bucket"] == {str(START): 8, str(START + BUCKET_MS): 4}
    f.follow(dict(doc, completed_ms=START + 60_000))  # the master fired the first 5
    got = s.stats(f, now_ms=START + 60_000)
    assert got["pending_by_bucket"] == {str(START): 3, str(START + BUCKET_MS): 4}
    assert got["pending_by_minute"] == {str(START + 300_000): 3, str(START + BUCKET_MS): 4}
    f.follow(dict(doc, completed_ms=START + BUCKET_MS + 1_000))
    assert s.stats(f, now_ms=START + BUCKET_MS + 1_000)["pending_by_bucket"] == {str(START + BUCKET_MS): 4}
    f.close()


# ---------------------------------------------------------------------- browsing without consuming


def test_browse_reads_what_the_group_has_not_acked_and_moves_nothing(tmp_path):
    from node.realtime.browse import unacked
    from node.realtime.inflight import InflightRanges
    from tests.test_realtime_store import M, append, open_store, pull

    # the worked example of node/realtime/browse.py
    f = InflightRanges()
    f.add(4, 6, 0)
    assert np.flatnonzero(unacked(np.arange(10), 7, f)).tolist() == [4, 5, 7, 8, 9]

    s = open_store(tmp_path)
    append(s, *[M(i) for i in range(10)])
    _, h = pull(s, "orders", "billing", 7, T0)
    s.ack("orders", "billing", [(0, 4), (6, 7)], now_ms=T0)
    before = s.group_rows(10)
    batch, positions, nxt, end = s.browse("orders", "billing", from_position=0, max_messages=10)
    assert positions.tolist() == [4, 5, 7, 8, 9] and batch.id_list() == ["m4", "m5", "m7", "m8", "m9"]
    assert (nxt, end) == (10, 10)
    assert s.group_rows(10) == before  # nothing handed out, nothing moved
    _, positions, nxt, _ = s.browse("orders", "billing", from_position=0, max_messages=2)
    assert positions.tolist() == [4, 5] and nxt == 6
    _, positions, nxt, _ = s.browse("orders", "billing", from_position=nxt, max_messages=2)
    assert positions.tolist() == [7, 8] and nxt == 9
    batch, positions, _, _ = s.browse("orders", "fresh", from_position=3, max_messages=100)
    assert positions.tolist() == list(range(3, 10))  # a group not opened yet acked nothing
    assert s.group_rows(10) == before  # and browsing did not open it
    s.close()
