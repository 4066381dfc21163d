"""Pending counts per (bucket, subject) on a delay node (issue 31, the Schedule page per
subject): kept at filing, dispatch and cancel, made again from the per-bucket subject tables
and the frames' subject columns at a restart or after a crash, never from a payload."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given, settings as hsettings, strategies as st

from node.delay.subject_tables import TABLE_NAME, TABLE_VERSION
from node.delay.subjects import OTHER, SubjectPending
from node.delay.schedule_status import ScheduleStatus
from node.config import NodeSettings
from node.store import checkpoint
from node.store.records import Limits
from node.delay.store import StoreSettings
from tests.test_delay_store import T0, Harness, msg

BUCKET_MS = 600_000
SETTINGS = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14,
                         schedule_segment_bytes=1 << 16, id_slots=256, id_entries_max=4096, bucket_ms=BUCKET_MS,
                         limits=Limits(payload_bytes_max=1024), subject_table_stale_entries_max=2,
                         subject_tables_per_checkpoint_max=2)
START = T0 - T0 % BUCKET_MS
SUBJECTS = ["orders", "mail", "billing.eu"]


def totals(h: Harness) -> dict[str, int]:
    sp = h.store.core.subjects
    return sp.totals(list(sp.by_bucket))


def model_totals(subjects) -> dict[str, int]:
    """Subject -> how many of ``subjects`` (one per pending message) name it."""
    out: dict[str, int] = {}
    for subject in subjects:
        out[subject] = out.get(subject, 0) + 1
    return out


MINUTE_VIEW = NodeSettings(pending_by_minute_horizon_ms=3_600_000, pending_by_minute_buckets_max=3)


def model_minutes(h: Harness, due: dict[str, tuple[str, int]], subject: str) -> dict[str, int]:
    """The minute view of ``subject`` a model expects: its pending messages by minute of their
    bucket (a bucket's minutes count from its start), in the buckets the view covers."""
    pending = h.store.pending_by_bucket()
    near = sorted(b for b in pending if b < h.now + MINUTE_VIEW.status.pending_by_minute_horizon_ms)
    near = near[: MINUTE_VIEW.status.pending_by_minute_buckets_max]
    out: dict[int, int] = {}
    for s, t in due.values():
        b = t - t % BUCKET_MS
        if s == subject and b in near:
            m = b + (t - b) // 60_000 * 60_000
            out[m] = out.get(m, 0) + 1
    return {str(m): n for m, n in sorted(out.items())}


@hsettings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "cancel", "run", "checkpoint", "restart", "crash"]),
                          st.integers(0, 10 ** 6)), min_size=1, max_size=14))
def test_subject_counts_match_a_model_through_accept_cancel_fire_restart_and_crash(tmp_path_factory, steps):
    """Per (bucket, subject), and per minute in the Status's minute view of one subject
    (``pending_by_subject_minute``, the buckets near the head), against a model, after every step."""
    h = Harness(tmp_path_factory.mktemp("s"), settings=SETTINGS, now=START + 1_000)
    ss = ScheduleStatus(MINUTE_VIEW)
    pending: dict[str, tuple[str, int]] = {}  # id -> (subject, due) of every message neither delivered nor cancelled

    def batch_of(x, n):
        return [msg(n + i, h.now + (x * (i + 1)) % (5 * BUCKET_MS), subject=SUBJECTS[(x + i * i) % 3])
                for i in range(1 + x % 7)]

    for op, x in steps:  # a crash reopens with no close: tables as the last checkpoint left them
        h.model_step(op, x, pending, batch_of, lambda m: (m.subject, m.deliver_at_ms))
        assert totals(h) == model_totals(s for s, _due in pending.values())
        for subject in SUBJECTS:
            got = ss.stats(h.store, now_ms=h.now, subject=subject)["pending_by_subject_minute"][subject]
            assert got == model_minutes(h, pending, subject), (op, subject)
        h.store.check_invariants()  # per bucket (and minute): positive, summing up, equal to a recount from disk


def test_a_subjects_burst_shows_in_its_minute_and_leaves_it_when_cancelled_or_fired(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    ss = ScheduleStatus(MINUTE_VIEW)
    burst = START + BUCKET_MS + 4 * 60_000 + 30_000  # the next bucket's fifth minute
    h.send([msg(i, burst + i, subject="mail") for i in range(6)]
           + [msg(10 + i, burst, subject="orders") for i in range(2)]
           + [msg(20, START + 90_000, subject="mail")])
    minute = str(START + BUCKET_MS + 4 * 60_000)

    def mail() -> dict[str, int]:
        return ss.stats(h.store, now_ms=h.now, subject="mail")["pending_by_subject_minute"]["mail"]
    assert mail() == {str(START + 60_000): 1, minute: 6}
    h.cancel("m0")
    h.cancel("m1")
    assert mail() == {str(START + 60_000): 1, minute: 4}
    h.run_forgetting(START + 100_000, {}, step=997)  # the one due at 90 s fires
    assert mail() == {minute: 4}
    h.restart()
    assert mail() == {minute: 4}
    h.run_until(burst + 10_000, step=997)
    assert mail() == {} and h.store.pending_by_bucket() == {}
    h.store.check_invariants()


def test_counts_after_a_crash_come_from_the_tables_and_the_frames_filed_since(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    for k in range(6):  # six filing calls into one bucket: a table is written behind them
        h.send([msg(10 * k + i, START + 300_000 + 1000 * k + i, subject=SUBJECTS[i % 2]) for i in range(5)])
    h.store.checkpoint()
    b = h.store.schedule.bucket_path(START) / TABLE_NAME
    doc = checkpoint.read(b)
    assert doc["version"] == TABLE_VERSION and doc["entries"] == 6 and doc["bucket_start_ms"] == START
    h.send([msg(100, START + 400_000, subject="mail")])  # filed after the table: counted from its frame
    h.store.cancel("m0", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    want = {START: {"orders": 17, "mail": 13}}  # 18 + 12 sent, one "mail" more, "m0" (orders) cancelled
    assert h.store.core.subjects.by_bucket == want
    h.crash()
    assert h.store.core.subjects.by_bucket == want
    assert h.store.subject_tables.counters["frames_counted"] == 2  # the message and the tombstone, not all 8
    h.store.check_invariants()


def test_a_damaged_or_ill_fitting_table_is_not_used_and_the_frames_give_the_same_counts(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    for k in range(4):
        h.send([msg(10 * k + i, START + 300_000 + 60_000 * k, subject=SUBJECTS[k % 3]) for i in range(3)])
    h.store.close()
    path = h.store.schedule.bucket_path(START) / TABLE_NAME
    want = {START: {"orders": 6, "mail": 3, "billing.eu": 3}}
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01  # a flipped bit: the CRC fails
    path.write_bytes(bytes(raw))
    h.crash()
    assert h.store.core.subjects.by_bucket == want
    assert h.store.subject_tables.counters["frames_counted"] == 4
    doc = {"version": TABLE_VERSION, "bucket_start_ms": START, "entries": 99, "subjects": ["orders"],
           "counts": [[0, 5, 1000]]}  # more entries than the index holds (an index repaired shorter)
    checkpoint.write_atomic(path, doc)
    h.crash()
    assert h.store.core.subjects.by_bucket == want
    assert h.store.subject_tables.counters["tables_unusable"] == 1
    assert json.loads(path.read_text().splitlines()[0])["entries"] == 99  # nothing written without a checkpoint
    h.restart()
    assert checkpoint.read(path)["entries"] == 4  # a close writes every table behind
    assert h.store.core.subjects.by_bucket == want


def test_the_bucket_holding_completed_ms_counts_only_what_is_still_due(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    h.send([msg(i, START + 30_000 + 20_000 * i, subject=SUBJECTS[i % 3]) for i in range(12)])
    h.run_until(START + 100_000, step=500)  # four delivered (due 30, 50, 70, 90 s)
    assert len(h.delivered) == 4
    h.store.checkpoint()
    h.crash()
    assert totals(h) == {"orders": 2, "mail": 3, "billing.eu": 3}  # i = 4..11 left
    h.store.check_invariants()


def test_status_names_the_largest_subjects_and_one_subject_by_bucket(tmp_path):
    h = Harness(tmp_path, settings=SETTINGS, now=START + 1_000)
    h.send([msg(i, START + 300_000, subject="orders") for i in range(5)]
           + [msg(10 + i, START + BUCKET_MS + 5_000, subject="mail") for i in range(3)]
           + [msg(20, START + 2 * BUCKET_MS, subject="billing.eu")])
    ss = ScheduleStatus(NodeSettings(status_subjects_max=2))
    got = ss.stats(h.store, now_ms=h.now)
    assert got["pending_subjects"] == {"orders": 5, "mail": 3, OTHER: 1}
    assert "pending_by_subject" not in got  # only when a Status asks for a subject
    one = ss.stats(h.store, now_ms=h.now, subject="mail")
    assert one["pending_by_subject"] == {"mail": {str(START + BUCKET_MS): 3}}


def test_summary_worked_example_of_the_module_docs():
    sp = SubjectPending(bucket_ms=3_600_000)
    sp.reset({0: {"a": 3, "b": 1}, 3_600_000: {"c": 2}})
    assert sp.summary(subjects_max=2) == {"a": 3, "c": 2, OTHER: 1}
    assert sp.summary(subjects_max=2, left_out=[3_600_000]) == {"a": 3, "b": 1}
    assert sp.of_subject("a", [0, 3_600_000]) == {0: 3}


def test_settings_reach_the_store():
    s = NodeSettings(subject_table_stale_entries_max=7, subject_tables_per_checkpoint_max=3).store_settings()
    assert replace(s).subject_table_stale_entries_max == 7 and s.subject_tables_per_checkpoint_max == 3


def test_a_promoted_slave_counts_per_subject_what_its_master_left_pending(tmp_path):
    from node.delay.store import DelayStore
    from tests.test_failover_store import replicate

    now = START + 1_000
    m = DelayStore.open(tmp_path / "m", SETTINGS, now_ms=now)
    f = DelayStore.open(tmp_path / "f", SETTINGS, now_ms=now, follower=True)
    f.follow()
    h = Harness.__new__(Harness)
    h.path, h.settings, h.now, h.store, h.delivered = tmp_path / "m", SETTINGS, now, m, []
    h.send([msg(i, START + 20_000 + 10_000 * i, subject=SUBJECTS[i % 3]) for i in range(9)]
           + [msg(50 + i, START + BUCKET_MS + 1_000, subject="mail") for i in range(4)])
    h.store.cancel("m50", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    m.checkpoint()
    replicate(m, f)  # the slave files them where the master did
    h.run_until(START + 55_000, step=500)  # m0..m3 delivered
    m.checkpoint()
    replicate(m, f)
    f.checkpoint()
    # the slave's Status: what is left, the bucket holding completed_ms from the table's later minutes
    st = ScheduleStatus(NodeSettings()).stats(f, now_ms=h.now, subject="mail")
    assert sum(st["pending_subjects"].values()) == 8
    # its minutes of one subject: those after its master's completed_ms's minute (the first):
    # m4 and m7 (60 s, 90 s) in the second, m51..m53 in the next bucket's first
    assert st["pending_by_subject_minute"]["mail"] == {str(START + 60_000): 2, str(START + BUCKET_MS): 3}
    f.promote(h.now)
    want = {START: {"mail": 2, "billing.eu": 2, "orders": 1}, START + BUCKET_MS: {"mail": 3}}  # m4..m8, m51..m53
    assert f.core.subjects.by_bucket == m.core.subjects.by_bucket == want
    # promoted: the minutes per subject made again, exact, as the master's
    for store in (f, m):
        st = ScheduleStatus(NodeSettings()).stats(store, now_ms=h.now, subject="mail")
        assert st["pending_by_subject_minute"]["mail"] == {str(START + 60_000): 2, str(START + BUCKET_MS): 3}
    f.check_invariants()


def test_counts_per_subject_survive_retention_and_a_restart_after_it(tmp_path):
    from tests.test_retention import BMS, T0 as RT0, Node

    n = Node(tmp_path)
    for k in range(20):  # 200 messages due over 26 s: several 10 s buckets
        n.send([msg(k * 10 + j, RT0 + 1_000 + (k * 10 + j) * 130, subject=SUBJECTS[j % 3]) for j in range(10)])
    n.run_until(RT0 + 15_000)
    n.retention()  # the buckets that ended before completed_ms go, with their tables
    left = {f"m{k * 10 + j}": SUBJECTS[j % 3] for k in range(20) for j in range(10)}
    for mid in n.delivered:
        left.pop(mid)
    assert totals_of(n.store) == model_totals(left.values())
    assert all(s + BMS > n.store.persisted_completed_ms for s in n.store.schedule.bucket_starts())
    n.store.check_invariants()
    n.store.close()
    n2 = Node(tmp_path, now=n.now)
    assert totals_of(n2.store) == model_totals(left.values())
    n2.store.check_invariants()
    n2.run_until(RT0 + 40_000)
    n2.store.checkpoint()  # the next checkpoint forgets the tables of buckets done by the last one
    assert n2.store.core.subjects.by_bucket == {} and n2.store.subject_tables.tables == {}
    n2.store.close()


def totals_of(store) -> dict[str, int]:
    sp = store.core.subjects
    return sp.totals(list(sp.by_bucket))


@hsettings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(-2, 2)), min_size=1, max_size=150),
       st.booleans())
def test_grouped_sums_alike_in_a_dict_and_in_numpy(rows, scalar):
    """``grouped`` sums a few records in a dict and more with numpy: the same rows either way."""
    import numpy as np

    from node.delay import subjects as S

    names = [f"s{i}" for i in range(5)]
    starts = np.array([r[0] * 60_000 for r in rows], np.int64)
    sidx = np.array([r[1] for r in rows], np.uint16)
    sign = -1 if scalar else np.array([r[2] for r in rows], np.int64)
    one = np.full(len(rows), starts[0])  # one start (a round within one minute): by subject alone
    small, small_one = S.grouped(starts, names, sidx, sign), S.grouped(one, names, sidx, sign)
    old, S.GROUPED_PY_MAX = S.GROUPED_PY_MAX, 0
    try:
        assert S.grouped(starts, names, sidx, sign) == small  # counted in bins
        assert S.grouped(one, names, sidx, sign) == small_one
        old_bins, S.GROUPED_BINS_MAX = S.GROUPED_BINS_MAX, 0
        try:
            assert S.grouped(starts, names, sidx, sign) == small  # too many keys for bins: sorted
        finally:
            S.GROUPED_BINS_MAX = old_bins
    finally:
        S.GROUPED_PY_MAX = old
