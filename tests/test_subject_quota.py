"""Per-principal subject quotas (cluster/quota.py, a pure core) and the real-time node's
subjects journal (node/realtime/subjects.py): rounds, owners, torn tails, corruption,
the old ``subjects.json`` layout, and a store reopened after a crash mid-creation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from cluster import status
from cluster.codec import OK, Batch
from cluster.errors import CorruptRecord, InvalidArgument, Overloaded, QuotaExceeded
from cluster.proto import hourglass_pb2 as pb
from cluster.quota import MINUTE_MS, OWNED_SETTING, RATE_SETTING, SubjectQuota, SubjectQuotas
from node.realtime import subjects as J
from node.realtime.store import DLQ_SUBJECT, RealtimeSettings, RealtimeStore
from node.store import checkpoint

T0 = 1_700_000_000_000


# ---------------------------------------------------------------------------------- the limiter


def test_a_burst_of_a_minutes_worth_then_the_steady_rate():
    q = SubjectQuotas(SubjectQuota(new_per_minute_max=60, owned_max=1000))
    a = q.admit("t", 80, now_ms=0)
    assert a.granted == 60 and a.refusal.limit == RATE_SETTING and a.refusal.principal == "t"
    assert "quota exceeded" in str(a.refusal) and "subjects_new_per_minute_max=60" in str(a.refusal)
    assert "20 of 80 refused" in str(a.refusal)
    assert q.admit("t", 1, now_ms=500).granted == 0     # half a token
    assert q.admit("t", 5, now_ms=5_000).granted == 5   # one a second
    assert q.admit("t", 1, now_ms=5_000).granted == 0
    assert q.admit("t", 100, now_ms=5_000 + 10 * MINUTE_MS).granted == 60  # never more than a minute's worth
    assert q.owned("t") == 125


def test_other_principals_are_not_touched():
    q = SubjectQuotas(SubjectQuota(10, 1000))
    assert q.admit("attacker", 10, now_ms=0).granted == 10
    assert q.admit("attacker", 1, now_ms=0).granted == 0
    assert q.admit("victim", 10, now_ms=0).granted == 10


def test_owned_limit_counts_what_was_persisted_and_refunds():
    q = SubjectQuotas(SubjectQuota(1000, 100), {"t": 95}, owned_setting="subjects_owned_max")
    a = q.admit("t", 10, now_ms=0)
    assert a.granted == 5 and a.refusal.limit == OWNED_SETTING
    assert "'t' owns 100 subjects" in str(a.refusal) and "subjects_owned_max=100" in str(a.refusal)
    q.refund("t", 3)  # three of them existed already
    assert q.owned("t") == 97
    assert q.admit("t", 10, now_ms=0).granted == 3


def test_a_refusal_travels_as_a_final_overloaded():
    e = SubjectQuotas(SubjectQuota(1, 10)).admit("t", 2, now_ms=0).refusal
    assert status.to_code(e) == pb.OVERLOADED and status.to_grpc(e).name == "RESOURCE_EXHAUSTED"
    back = status.from_code(pb.OVERLOADED, str(e))
    assert isinstance(back, QuotaExceeded) and not status.retryable(back) and status.final_refusal(str(e))
    assert status.retryable(Overloaded("busy"))


def test_bad_quotas_and_counts_are_refused():
    with pytest.raises(ValueError):
        SubjectQuota(0, 10)
    with pytest.raises(ValueError):
        SubjectQuotas(SubjectQuota(1, 1)).admit("t", -1, now_ms=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 50), st.integers(0, 20_000), st.integers(0, 5)),
                max_size=40))
def test_never_more_than_the_bucket_and_the_owned_limit(calls):
    """Against a naive model: over any window of w ms a principal is granted at most
    per_minute + w * per_minute / 60,000 subjects, and never owns more than owned_max."""
    per, owned_max = 30, 70
    q = SubjectQuotas(SubjectQuota(per, owned_max))
    now = 0
    grants: dict[str, list[tuple[int, int]]] = {}
    owned: dict[str, int] = {}
    for who, n, step, refund in calls:
        now += step
        a = q.admit(who, n, now_ms=now)
        assert 0 <= a.granted <= n and (a.refusal is None) == (a.granted == n)
        grants.setdefault(who, []).append((now, a.granted))
        owned[who] = owned.get(who, 0) + a.granted
        back = min(refund, a.granted)
        q.refund(who, back)
        owned[who] -= back
        assert q.owned(who) == owned[who] <= owned_max
    for who, gs in grants.items():
        for i, (t0, _) in enumerate(gs):
            total = 0
            for t, g in gs[i:]:
                total += g
                assert total <= per + (t - t0) * per / MINUTE_MS + 5 * len(gs)  # refunds give tokens back


# ---------------------------------------------------------------------------------- the journal


def test_journal_parse_round_trip_torn_tail_and_corruption():
    a = J.encode_record([("a", "t1"), ("b", "")], created_ms=1)
    b = J.encode_record([("b", "t2"), ("c", "t2")], created_ms=2)
    owners, good = J.parse(a + b)
    assert owners == {"a": "t1", "b": "t2", "c": "t2"} and good == len(a + b)  # a known owner replaces ""
    for cut in range(len(a) + 1, len(a + b)):  # any torn last record: the first one stands
        assert J.parse((a + b)[:cut]) == ({"a": "t1", "b": ""}, len(a))
    for i in range(len(a) - 1):  # a flipped byte in a record before the last: corrupt, with its offset
        bad = bytearray(a + b)
        bad[i] ^= 0x01
        with pytest.raises(CorruptRecord) as ei:
            J.parse(bytes(bad), "subjects.log")
        assert ei.value.offset == 0
    for i in range(len(a), len(a + b) - 1):  # ... in the last record: a torn tail
        bad = bytearray(a + b)
        bad[i] ^= 0x01
        assert J.parse(bytes(bad))[1] == len(a)


def open_store(path, s=RealtimeSettings(), now=T0):
    return RealtimeStore.open(path, s, now_ms=now)


def records(path) -> list[list]:
    return [json.loads(line[9:])["subjects"] for line in (path / J.JOURNAL_NAME).read_bytes().splitlines()]


def test_a_round_is_one_record_and_owners_survive_a_restart(tmp_path):
    st_ = open_store(tmp_path)
    before = len(records(tmp_path))
    work = st_.subjects_plan([(f"s{i}", "tenant-a") for i in range(300)] + [("s0", "tenant-b"), ("x", "tenant-b")],
                             now_ms=T0)
    assert len(work.items) == 301 and not work.refused  # s0 named twice: the first asks
    assert "s5" not in st_.subjects()  # planned, not there yet
    work.run()
    st_.subjects_finish(work)
    assert len(records(tmp_path)) == before + 1
    assert st_.subject_owner("s5") == "tenant-a" and st_.subject_owner("x") == "tenant-b"
    assert st_.owned_counts() == {"tenant-a": 300, "tenant-b": 1}
    st_.append(Batch.build(["s7"], [b"p"], ["i"], [T0]), now_ms=T0)
    st_.close()
    st_ = open_store(tmp_path)
    assert st_.owned_counts() == {"tenant-a": 300, "tenant-b": 1} and st_.subject_owner(DLQ_SUBJECT) == ""
    b, _ = st_.pull(["s7"], "g", "c", max_messages=5, now_ms=T0 + 1)
    assert b.payload_list() == [b"p"]
    st_.close()


def test_plan_refuses_past_subjects_max_and_bad_names_and_reserves(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(subjects_max=5))  # the DLQ is one
    w1 = st_.subjects_plan([("a", "t"), ("b", "t")], now_ms=T0)
    w2 = st_.subjects_plan([("b", "t"), ("c", "t"), ("d", "t"), ("e", "t"), ("bad name", "t")], now_ms=T0)
    assert w2.names == ["c", "d"]  # b is being created by w1; room for 2 more
    assert isinstance(w2.refused["e"], Overloaded) and "subjects_max=5" in str(w2.refused["e"])
    assert isinstance(w2.refused["bad name"], InvalidArgument)
    st_.subjects_abandon(w1)  # w1 never runs: its names are free again
    w2.run()
    st_.subjects_finish(w2)
    assert st_.subjects_plan([("a", "t"), ("b", "t"), ("f", "t")], now_ms=T0).names == ["a", "b"]


def test_append_creates_a_batchs_new_subjects_as_one_round(tmp_path):
    st_ = open_store(tmp_path)
    before = len(records(tmp_path))
    subjects = [f"n{i}" for i in range(50)]
    r = st_.append(Batch.build(subjects, [b"x"] * 50, [f"i{i}" for i in range(50)], [T0] * 50), now_ms=T0)
    assert (r.codes == OK).all() and len(records(tmp_path)) == before + 1
    refused = {"q1": QuotaExceeded("'t' owns 2 subjects", OWNED_SETTING, "t")}
    r = st_.append(Batch.build(["n1", "q1"], [b"y", b"z"], ["j1", "j2"], [T0, T0]), now_ms=T0,
                   refused_subjects=refused)
    assert r.codes.tolist() == [OK, pb.OVERLOADED] and r.errors[1].startswith("quota exceeded")
    assert "q1" not in st_.subjects()
    st_.close()


def test_old_subjects_json_is_migrated_once(tmp_path):
    st_ = open_store(tmp_path)
    st_.create_subjects(["a", "b"], owner="t")
    st_.close()
    (tmp_path / J.JOURNAL_NAME).unlink()
    checkpoint.write_atomic(tmp_path / J.LEGACY_NAME, {"subjects": ["a", "b", "old", DLQ_SUBJECT]})
    st_ = open_store(tmp_path)
    assert {"a", "b", "old"} <= set(st_.subjects()) and not (tmp_path / J.LEGACY_NAME).exists()
    assert st_.owned_counts() == {}  # owners of the old layout are not known
    st_.close()
    assert set(open_store(tmp_path).subjects()) == {"a", "b", "old", DLQ_SUBJECT}


def test_crash_mid_creation_leaves_a_readable_store(tmp_path):
    """A round that crashed before its journal record (folders made, record torn) is not there
    after a restart, the store opens, and the names can be created again; an acknowledged
    subject (its record complete) and its messages are there."""
    st_ = open_store(tmp_path)
    st_.create_subjects(["kept"], owner="t")
    st_.append(Batch.build(["kept"], [b"m"], ["i"], [T0]), now_ms=T0)
    st_.flush()
    work = st_.subjects_plan([("lost1", "t"), ("lost2", "t")], now_ms=T0)
    for s in work.names:
        (tmp_path / "index" / s).mkdir()
        (tmp_path / "index" / s / "entries").touch()
    line = J.encode_record(work.items, created_ms=T0)
    with open(tmp_path / J.JOURNAL_NAME, "ab") as f:
        f.write(line[: len(line) // 2])  # the append was cut by the crash
    del st_  # no close: a crash
    st_ = open_store(tmp_path)
    assert "kept" in st_.subjects() and "lost1" not in st_.subjects()
    assert st_.pull(["kept"], "g", "c", max_messages=5, now_ms=T0 + 1)[0].payload_list() == [b"m"]
    assert st_.create_subjects(["lost1", "lost2"], owner="u") == ["lost1", "lost2"]  # leftover folders adopted
    st_.close()
    assert J.parse((tmp_path / J.JOURNAL_NAME).read_bytes())[0]["lost1"] == "u"


def test_a_corrupt_record_in_the_middle_stops_the_open(tmp_path):
    st_ = open_store(tmp_path)
    st_.create_subjects(["a"], owner="t")
    st_.create_subjects(["b"], owner="t")
    st_.close()
    p = tmp_path / J.JOURNAL_NAME
    data = bytearray(p.read_bytes())
    data[12] ^= 0x04  # inside the first record's JSON
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord) as ei:
        open_store(tmp_path)
    assert ei.value.path == str(p)


def test_a_replica_adopts_owners_as_one_record(tmp_path):
    st_ = open_store(tmp_path)
    st_.create_subjects(["seen"], owner="")  # learned from the master's log, owner not known yet
    before = len(records(tmp_path))
    st_.adopt_owners([("seen", "t1"), ("new", "t2"), (DLQ_SUBJECT, "")], now_ms=T0)
    assert st_.owned_counts() == {"t1": 1, "t2": 1}
    assert len(records(tmp_path)) == before + 2  # one round for "new", one record naming "seen"'s owner
    st_.close()
    assert open_store(tmp_path).owned_counts() == {"t1": 1, "t2": 1}
    assert st_.subject_owners(0, 10)[-1] == ("new", "t2")
