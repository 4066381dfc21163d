"""RealtimeStore on real files with time passed in: append batch -> index -> pull/ack ranges -> restart."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.codec import INVALID_ARGUMENT, OK, PAYLOAD_TOO_LARGE, Batch, Limits, encode_extra
from cluster.errors import CorruptRecord, InvalidArgument, Overloaded, PayloadTooLarge, UnknownSubject
from cluster.proto import hourglass_pb2 as pb
from cluster.wire import pack_ranges, unpack_ranges
from node.realtime.store import DLQ_SUBJECT, ENTRY_SIZE, RealtimeSettings, RealtimeStore, tags_mask
from node.store.records import SEQ_EPOCH_SHIFT

T0 = 1_800_000_000_000
SMALL = RealtimeSettings(segment_bytes=1 << 14, ack_timeout_ms=1_000, dedup_window_ms=60_000,
                         limits=Limits(payload_bytes_max=1024))


@dataclass
class M:
    """One message to put in a test batch."""

    i: int | str
    subject: str = "orders"
    payload: bytes | None = None
    tags: tuple = ()
    properties: tuple = ()
    deliver_at_ms: int = T0
    attempts: int = 0

    @property
    def id(self) -> str:
        return self.i if isinstance(self.i, str) else f"m{self.i}"


def batch(*ms: M) -> Batch:
    extras = [encode_extra(m.tags, m.properties) for m in ms]
    return Batch.build([m.subject for m in ms], [m.payload if m.payload is not None else f"p{m.i}".encode()
                                                 for m in ms],
                       [m.id for m in ms], np.array([m.deliver_at_ms for m in ms], np.int64),
                       attempts=np.array([m.attempts for m in ms], np.uint16), extras=extras if any(extras) else None)


def append(st_, *ms: M, now=T0):
    return st_.append(batch(*ms), now_ms=now)


def open_store(path, s=SMALL, now=T0, **kw):
    return RealtimeStore.open(path, s, now_ms=now, **kw)


def pull(st_, subjects, group, k, now, **kw):
    b, h = st_.pull([subjects] if isinstance(subjects, str) else subjects, group, "c", max_messages=k, now_ms=now,
                    **kw)
    assert len(h) == b.n and h.dtype == np.uint64
    return b, h


def ids(st_, subjects, group, k, now, **kw) -> list[str]:
    return pull(st_, subjects, group, k, now, **kw)[0].id_list()


def handles(st_, subjects, group, k, now, **kw) -> list[int]:
    return pull(st_, subjects, group, k, now, **kw)[1].tolist()


def ack(st_, subject, group, hs, now=T0) -> int:
    return st_.ack(subject, group, unpack_ranges(pack_ranges(hs)), now_ms=now)


def index_path(root, subject="orders"):
    return Path(root) / "index" / subject / "entries"


def segment_files(root):
    return sorted((Path(root) / "messages").glob("*.log"))


# ---------------------------------------------------------------------- basics


def test_append_pull_ack_round_trip(tmp_path):
    st_ = open_store(tmp_path)
    res = append(st_, *[M(i, tags=("eu",), properties=(("k", "v"),), deliver_at_ms=T0 - 5, attempts=2)
                        for i in range(3)])
    assert res.codes.tolist() == [OK] * 3 and res.duplicates.tolist() == [0] * 3 and not res.errors
    seqs = res.seqs.tolist()
    assert seqs == list(range(seqs[0], seqs[0] + 3))  # contiguous inside a batch
    assert all(s >> SEQ_EPOCH_SHIFT == st_.epoch for s in seqs)
    assert res.deliver_at_ms.tolist() == [T0 - 5] * 3
    st_.flush()
    b, h = pull(st_, "orders", "billing", 10, T0 + 1)
    assert h.tolist() == [0, 1, 2]
    assert (b.id(1), b.payload(1), b.extra(1), int(b.seq[1]), b.subject(1)) == \
        ("m1", b"p1", (("eu",), (("k", "v"),)), seqs[1], "orders")
    assert (int(b.store_ms[1]), int(b.deliver_at_ms[1]), int(b.attempts[1])) == (T0, T0 - 5, 2)  # due time kept
    assert Batch.decode(b.encode()).id_list() == ["m0", "m1", "m2"]  # what Pull puts on the wire
    assert st_.lag("orders", "billing") == 3
    assert st_.ack("orders", "billing", [(0, 3), (99, 100)], now_ms=T0 + 2) == 3
    assert st_.ack("orders", "billing", [(0, 1)], now_ms=T0 + 2) == 0
    assert st_.lag("orders", "billing") == 0
    assert pull(st_, "orders", "billing", 10, T0 + 10_000)[0].n == 0
    assert "orders" in st_.subjects() and DLQ_SUBJECT in st_.subjects()
    st_.close()


def test_one_frame_per_append_and_one_index_run_per_subject(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings())
    append(st_, *[M(i, subject=("a", "b", "c")[i % 3]) for i in range(30)])
    append(st_, *[M(100 + i, subject="a") for i in range(5)])
    frames = list(st_.messages.iterate())
    assert len(frames) == 2
    first = Batch.decode(frames[0][1])
    assert first.n == 30 and sorted(set(first.subject_list())) == ["a", "b", "c"]
    assert (first.store_ms == T0).all() and (np.diff(first.seq.astype(np.int64)) == 1).all()
    assert os.path.getsize(index_path(tmp_path, "a")) == 15 * ENTRY_SIZE
    assert os.path.getsize(index_path(tmp_path, "b")) == 10 * ENTRY_SIZE


def test_one_pull_covers_several_subjects(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i, subject=("a", "b")[i % 2]) for i in range(10)])
    append(st_, M(50, subject="c"))
    b, h = pull(st_, ["a", "b", "c"], "g", 100, T0)
    got = sorted(zip(b.subject_list(), h.tolist(), b.id_list()))
    assert got == sorted([("a", k, f"m{2 * k}") for k in range(5)] + [("b", k, f"m{2 * k + 1}") for k in range(5)]
                         + [("c", 0, "m50")])
    assert b.id_list()[:10] == [f"m{i}" for i in range(10)]  # answered in log order
    for s in ("a", "b", "c"):
        sel = [hh for ss, hh in zip(b.subject_list(), h.tolist()) if ss == s]
        assert ack(st_, s, "g", sel) == len(sel)
    assert all(st_.lag(s, "g") == 0 for s in ("a", "b", "c"))
    # a small pull shares max_messages over the subjects, oldest in the log first
    append(st_, *[M(100 + i, subject=("a", "b")[i % 2]) for i in range(10)])
    b, _ = pull(st_, ["a", "b"], "g", 4, T0)
    assert b.id_list() == ["m100", "m101", "m102", "m103"]
    with pytest.raises(UnknownSubject):
        st_.pull(["a", "nope"], "g", "c", max_messages=1, now_ms=T0)
    with pytest.raises(InvalidArgument):
        st_.pull([], "g", "c", max_messages=1, now_ms=T0)


def test_acks_of_several_subjects_in_one_call(tmp_path):
    from cluster.wire import pack_ranges

    st_ = open_store(tmp_path)
    append(st_, *[M(i, subject=("a", "b", "c")[i % 3]) for i in range(12)])
    b, h = pull(st_, ["a", "b", "c"], "g", 100, T0)
    by = {s: [hh for ss, hh in zip(b.subject_list(), h.tolist()) if ss == s] for s in ("a", "b", "c")}
    # a malformed range in any subject: refused whole, nothing acked
    for bad in (b"\x00" * 15, pack_ranges([3]) [8:] + pack_ranges([3])[:8]):
        with pytest.raises(InvalidArgument):
            st_.ack_many("g", [("a", pack_ranges(by["a"])), ("b", bad)], now_ms=T0)
    assert all(st_.lag(s, "g") == 4 for s in ("a", "b", "c"))
    # a, and part of b, in one call; c not at all; an unknown group acks nothing
    assert st_.ack_many("g", [("a", pack_ranges(by["a"])), ("b", pack_ranges(by["b"][:2])), ("c", b"")],
                        now_ms=T0) == 6
    assert st_.ack_many("other", [("a", pack_ranges(by["a"]))], now_ms=T0) == 0
    assert [st_.lag(s, "g") for s in ("a", "b", "c")] == [0, 2, 4]
    with pytest.raises(UnknownSubject):
        st_.ack_many("g", [("nope", pack_ranges([0]))], now_ms=T0)


def test_two_consumers_in_one_group_share_work(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(10)])
    a = ids(st_, "orders", "g", 4, T0)
    b = ids(st_, "orders", "g", 4, T0)
    c = ids(st_, "orders", "g", 4, T0)
    assert (len(a), len(b), len(c)) == (4, 4, 2)
    assert sorted(a + b + c) == sorted(f"m{i}" for i in range(10))
    assert ids(st_, "orders", "g", 4, T0 + 1) == []


def test_two_groups_each_get_everything(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(5)])
    for g in ("g1", "g2"):
        b, h = pull(st_, "orders", g, 100, T0)
        assert b.id_list() == [f"m{i}" for i in range(5)]
        ack(st_, "orders", g, h)
    assert st_.lag("orders", "g1") == st_.lag("orders", "g2") == 0
    assert st_.lag("orders", "never-seen") == 5


def test_ack_timeout_redelivers(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(3)])
    first = handles(st_, "orders", "g", 2, T0)
    ack(st_, "orders", "g", first[:1])
    assert ids(st_, "orders", "g", 10, T0 + 999) == ["m2"]
    b, h = pull(st_, "orders", "g", 10, T0 + 1000)
    assert list(zip(h.tolist(), b.id_list())) == [(1, "m1")]
    assert st_.lag("orders", "g") == 2
    # both deadlines were (re)started by the last pulls
    assert ids(st_, "orders", "g", 10, T0 + 1500) == []
    ack(st_, "orders", "g", [1, 2])
    assert ids(st_, "orders", "g", 10, T0 + 100_000) == []
    assert st_.lag("orders", "g") == 0


def test_redelivery_deadline_is_restarted(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, M(0))
    assert ids(st_, "orders", "g", 1, T0) == ["m0"]
    assert ids(st_, "orders", "g", 1, T0 + 1000) == ["m0"]
    assert ids(st_, "orders", "g", 1, T0 + 1999) == []
    assert ids(st_, "orders", "g", 1, T0 + 2000) == ["m0"]


def test_redeliveries_come_oldest_pull_first_and_before_new_messages(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, M(0), M(1), M(2))
    assert ids(st_, "orders", "g", 1, T0) == ["m0"]
    assert ids(st_, "orders", "g", 1, T0 + 500) == ["m1"]
    assert ids(st_, "orders", "g", 1, T0 + 1000) == ["m0"]  # due, and taken before the new m2
    assert ids(st_, "orders", "g", 1, T0 + 1500) == ["m1"]
    assert ids(st_, "orders", "g", 5, T0 + 2500) == ["m0", "m1", "m2"]


def test_tag_filter_skips_non_matching(tmp_path):
    assert tags_mask(["red"]) & tags_mask(["blue"]) == 0  # the test relies on distinct bits
    st_ = open_store(tmp_path)
    append(st_, M(0, tags=("red",)), M(1, tags=("blue",)), M(2), M(3, tags=("blue", "red")))
    b, h = pull(st_, "orders", "reds", 10, T0, tags=["red"])
    assert b.id_list() == ["m0", "m3"] and h.tolist() == [0, 3]
    assert st_.lag("orders", "reds") == 2  # skipped entries count as done for this group
    ack(st_, "orders", "reds", h)
    assert st_.lag("orders", "reds") == 0
    assert ids(st_, "orders", "all", 10, T0) == ["m0", "m1", "m2", "m3"]
    assert ids(st_, "orders", "bg", 10, T0, tags=["blue", "green"]) == ["m1", "m3"]
    assert ids(st_, "orders", "one", 1, T0, tags=["blue"]) == ["m1"]
    assert ids(st_, "orders", "one", 1, T0, tags=["blue"]) == ["m3"]  # m2 skipped, m3 not consumed early
    with pytest.raises(InvalidArgument):
        st_.pull(["orders"], "x", "c", max_messages=1, tags=[""], now_ms=T0)


def test_dedup_within_window_and_not_after(tmp_path):
    st_ = open_store(tmp_path)
    a = append(st_, M(1)).seqs[0]
    r = append(st_, M(1, payload=b"other"), M(2), now=T0 + 59_999)
    assert r.codes.tolist() == [OK, OK] and r.duplicates.tolist() == [1, 0] and r.seqs[0] == a
    r = append(st_, M(3), M(3), now=T0 + 59_999)  # twice in one batch
    assert r.duplicates.tolist() == [0, 1] and r.seqs[0] == r.seqs[1]
    assert append(st_, M(1, subject="other"), now=T0 + 1).duplicates[0] == 0  # dedup key is (subject, id)
    assert ids(st_, "orders", "g", 10, T0 + 60_000) == ["m1", "m2", "m3"]
    # survives a restart: rebuilt from the log
    st_.close()
    st_ = open_store(tmp_path, now=T0 + 59_999)
    r = append(st_, M(1), now=T0 + 59_999)
    assert r.duplicates[0] == 1 and r.seqs[0] == a
    r = append(st_, M(1), now=T0 + 60_000)
    assert r.duplicates[0] == 0 and r.seqs[0] != a
    st_.flush()
    b, _ = pull(st_, "orders", "g2", 10, T0 + 60_000)
    assert b.payload_list() == [b"p1", b"p2", b"p3", b"p1"]


def test_dedup_map_is_bounded_and_a_full_map_never_refuses_a_send(tmp_path, caplog):
    """A rate x dedup_window_ms above dedup_entries_max (5,000 msgs/s with the defaults) used
    to make the node answer OVERLOADED to every new message until the window ran out (a
    real-clock soak stopped for minutes). Now the oldest ids are forgotten early, said once
    a minute and counted; memory stays bounded."""
    st_ = open_store(tmp_path, RealtimeSettings(dedup_entries_max=3, dedup_window_ms=60_000))
    r = append(st_, *[M(i) for i in range(3)])
    assert (r.codes == OK).all() and len(st_._dedup) == 3
    r = append(st_, M(3), M(4), M(4), now=T0 + 10)
    assert (r.codes == OK).all() and r.duplicates.tolist() == [0, 0, 1]  # a repeat in one batch: still one
    assert len(st_._dedup) <= 3 and st_.counters["dedup_evicted_early"] == 3
    assert "dedup map full" in caplog.text
    assert append(st_, M(4), now=T0 + 20).duplicates[0] == 1  # the newest ids are remembered ...
    assert append(st_, M(0), now=T0 + 30).duplicates[0] == 0  # ... the oldest went early
    b, _ = pull(st_, "orders", "g", 10, T0 + 40)
    assert b.payload_list() == [b"p0", b"p1", b"p2", b"p3", b"p4", b"p0"]


def test_unknown_subject_without_auto_create(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(auto_create_subjects=False))
    end = st_.messages.end_offset
    r = append(st_, M(0, subject="nope"))
    assert r.codes.tolist() == [pb.UNKNOWN_SUBJECT] and "nope" in r.errors[0]
    assert st_.messages.end_offset == end and "nope" not in st_.subjects()
    with pytest.raises(UnknownSubject):
        st_.pull(["nope"], "g", "c", max_messages=1, now_ms=T0)
    with pytest.raises(UnknownSubject):
        st_.lag("nope", "g")
    assert append(st_, M(1, subject=DLQ_SUBJECT)).codes.tolist() == [OK]  # the DLQ always exists
    assert st_.create_subject("orders") is True and st_.create_subject("orders") is False
    assert append(st_, M(2, subject="orders"), M(3, subject="nope")).codes.tolist() == [OK, pb.UNKNOWN_SUBJECT]
    with pytest.raises(InvalidArgument):
        st_.create_subject("../etc")
    st_.close()
    st_ = open_store(tmp_path, RealtimeSettings(auto_create_subjects=False))
    assert st_.subjects() == sorted([DLQ_SUBJECT, "orders"])


def test_validation_errors_change_nothing(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, M(0))
    end, subjects = st_.messages.end_offset, st_.subjects()
    bad = [M(1, subject="bad subject"), M(2, payload=b"x" * 2000), M(3, tags=tuple(f"t{i}" for i in range(17))),
           M("has space"), M(6, properties=(("", "v"),))]
    r = append(st_, *bad)
    assert r.codes.tolist() == [INVALID_ARGUMENT, PAYLOAD_TOO_LARGE, INVALID_ARGUMENT, INVALID_ARGUMENT,
                                INVALID_ARGUMENT]
    assert set(r.errors) == set(range(5)) and (r.seqs == 0).all()
    assert st_.messages.end_offset == end and st_.subjects() == subjects
    r = append(st_, M(7, subject="bad subject"), M(8))
    assert r.codes.tolist() == [INVALID_ARGUMENT, OK]
    # a far-future or past deliver_at is fine on the real-time side: a future one is held at
    # most visible_hold_ms_max (100 ms), and the subject's later messages wait behind it
    assert append(st_, M(9, deliver_at_ms=T0 + 10 * 366 * 86_400_000), M(10, deliver_at_ms=0)).codes.tolist() == \
        [OK, OK]
    tomb = batch(M(11)).replace(kind=2)  # producers store messages only
    assert st_.append(tomb, now_ms=T0).codes.tolist() == [INVALID_ARGUMENT]
    assert ids(st_, "orders", "g", 10, T0) == ["m0", "m8"]
    step = RealtimeSettings().visible_step_ms
    at = -(-(T0 + 100) // step) * step  # rounded up to visible_step_ms
    assert st_.held_next_ms == at
    assert ids(st_, "orders", "g", 10, at - 1) == []
    assert ids(st_, "orders", "g", 10, at) == ["m9", "m10"]
    with pytest.raises(InvalidArgument):
        st_.pull(["orders"], "bad/group", "c", max_messages=1, now_ms=T0)
    with pytest.raises(InvalidArgument):
        st_.pull(["orders"], "g", "c", max_messages=0, now_ms=T0)
    with pytest.raises(InvalidArgument):
        st_.pull(["orders"], "g3", "c", max_messages=1, start="middle", now_ms=T0)


def test_whole_batch_limits(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(limits=Limits(batch_messages_max=3)))
    end = st_.messages.end_offset
    with pytest.raises(InvalidArgument):
        append(st_, *[M(i) for i in range(4)])
    assert st_.messages.end_offset == end
    st2 = open_store(tmp_path / "b", RealtimeSettings(segment_bytes=1 << 20, limits=Limits(batch_bytes_max=1000)))
    with pytest.raises(PayloadTooLarge):  # more than one frame holds (frames hold at least 8 MiB)
        append(st2, *[M(i, payload=b"x" * (1 << 20)) for i in range(9)])
    assert st2.messages.end_offset == 0
    assert append(st2).n == 0  # an empty batch is fine and stores nothing


def test_messages_without_id_get_one(tmp_path):
    st_ = open_store(tmp_path)
    r = append(st_, M(""), M(1), M(""))
    assert (r.codes == OK).all()
    got = ids(st_, "orders", "g", 10, T0)
    assert got[1] == "m1" and len(got[0]) == len(got[2]) == 32 and got[0] != got[2]


def test_start_latest(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, M(0), M(1))
    assert ids(st_, "orders", "late", 10, T0, start="latest") == []
    append(st_, M(2))
    st_.close()
    st_ = open_store(tmp_path)  # the start position was persisted when the group was created
    assert ids(st_, "orders", "late", 10, T0) == ["m2"]


def test_inflight_bound(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(inflight_per_group_max=3, ack_timeout_ms=1000))
    append(st_, *[M(i) for i in range(5)])
    assert len(handles(st_, "orders", "g", 10, T0)) == 3
    with pytest.raises(Overloaded):
        st_.pull(["orders"], "g", "c", max_messages=10, now_ms=T0)
    assert len(handles(st_, "orders", "g", 10, T0 + 1000)) == 3  # redeliveries still flow
    ack(st_, "orders", "g", [0])
    assert handles(st_, "orders", "g", 10, T0 + 1000) == [3]


def test_nack_returns_inflight_records(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, M(0, attempts=3), M(1))
    h = handles(st_, "orders", "g", 10, T0)
    b, back = st_.nack("orders", "g", [(h[0], h[0] + 1), (77, 78)], now_ms=T0 + 900)
    assert back.tolist() == [0] and b.id_list() == ["m0"] and int(b.attempts[0]) == 3
    assert st_.nack("orders", "unknown-group", [(0, 1)], now_ms=T0)[0].n == 0
    # nack restarted the deadline of handle 0 only
    assert handles(st_, "orders", "g", 10, T0 + 1000) == [1]
    assert ack(st_, "orders", "g", [0], T0 + 1000) == 1
    assert st_.nack("orders", "g", [(0, 1)], now_ms=T0 + 1000)[0].n == 0


def test_a_retry_copy_of_another_groups_nack_is_settled_not_handed_out(tmp_path):
    st_ = open_store(tmp_path)
    by = "hourglass.nacked_by"
    append(st_, M(0), M("m1~r1", attempts=1, properties=(("hourglass.origin_id", "m1"), (by, "billing"))),
           M(2), M("m3~r1", attempts=1, properties=(("hourglass.origin_id", "m3"),)))  # m3: an old copy
    assert ids(st_, "orders", "mail", 10, T0) == ["m0", "m2", "m3~r1"]
    assert ids(st_, "orders", "billing", 10, T0) == ["m0", "m1~r1", "m2", "m3~r1"]
    assert st_.counters["skipped_other_group_retry"] == 1
    # settled for "mail": not in flight, so never redelivered, and its position moves past it
    g = st_._groups.get("orders", "mail")
    assert len(g.inflight) == 3
    assert ack(st_, "orders", "mail", [0, 2, 3], T0) == 3
    assert g.committed() == 4
    assert ids(st_, "orders", "mail", 10, T0 + 5_000) == []


def test_a_pull_of_only_other_groups_retries_goes_on_to_the_next_messages(tmp_path):
    st_ = open_store(tmp_path)
    by = "hourglass.nacked_by"
    append(st_, *[M(f"r{i}~r1", attempts=1, properties=((by, "billing"),)) for i in range(3)], M(9))
    assert ids(st_, "orders", "mail", 3, T0) == ["m9"]  # the first round was all copies: a second round
    assert ids(st_, "orders", "mail", 3, T0 + 5_000) == ["m9"]  # after ack_timeout_ms: m9 again, no copy


# ---------------------------------------------------------------------- restarts


def test_committed_positions_survive_reopen_and_unacked_are_redelivered(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(6)])
    got = handles(st_, "orders", "g", 5, T0)
    ack(st_, "orders", "g", [0, 1, 3])  # out of order: 2 and 4 stay in flight
    ack(st_, "orders", "h", handles(st_, "orders", "h", 10, T0))
    assert len(got) == 5 and st_.committed("orders", "g") == 2
    epoch = st_.epoch
    st_.close()
    st_ = open_store(tmp_path, now=T0 + 1)
    assert st_.epoch == epoch + 1
    assert st_.committed("orders", "g") == 2 and st_.lag("orders", "g") == 3
    # in-flight deadlines are lost: redelivered at once, then the never-pulled one; acked ones never again
    assert handles(st_, "orders", "g", 10, T0 + 1) == [2, 4, 5]
    assert handles(st_, "orders", "h", 10, T0 + 100_000) == []
    assert append(st_, M(99), now=T0 + 1).seqs[0] >> SEQ_EPOCH_SHIFT == epoch + 1


def test_kill_without_close_loses_nothing_flushed(tmp_path):
    st_ = open_store(tmp_path)
    for k in range(4):  # several segments
        append(st_, *[M(10 * k + i, payload=b"x" * 500) for i in range(10)])
    ack(st_, "orders", "g", handles(st_, "orders", "g", 10, T0))
    st_.flush()
    append(st_, M(100))  # written (page cache) but never flushed: a process kill keeps it
    assert len(segment_files(tmp_path)) > 1
    # no close(): the old object is simply abandoned, as after kill -9
    st2 = open_store(tmp_path, now=T0 + 5)
    assert st2.lag("orders", "g") == 31
    assert ids(st2, "orders", "g", 100, T0 + 5) == [f"m{i}" for i in range(10, 40)] + ["m100"]
    assert st2.counters["frame_cache_misses"] == 4  # frames read from disk once each
    assert append(st2, M(5), now=T0 + 5).duplicates[0] == 1  # dedup map rebuilt
    st2.close()


def test_a_store_dropped_without_close_says_so_and_gives_its_descriptors_back(tmp_path, caplog):
    """No silent safety net: a store that is dropped unclosed logs it, closes its index files
    without flushing anything, and the next open recovers what it had written."""
    import logging

    st_ = open_store(tmp_path)
    append(st_, M(0), M(1, subject="other"))
    pull(st_, "orders", "g", 10, T0)
    fds = len(os.listdir("/proc/self/fd"))
    with caplog.at_level(logging.WARNING, "hourglass.realtime.store"):
        del st_
    assert "real-time store dropped without close()" in caplog.text
    assert len(os.listdir("/proc/self/fd")) <= fds - 2  # both index files closed
    st2 = open_store(tmp_path, now=T0 + 1)
    r = st2.recovery
    assert (r.subjects, r.groups, r.dedup_entries, r.groups_ignored) == (3, 1, 2, 0)  # orders, other, DLQ
    assert handles(st2, "orders", "g", 10, T0 + 1) == [0]  # in flight at the drop: redelivered at once
    st2.close()


def test_caught_up_consumer_never_reads_a_frame_from_disk(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(frame_cache_bytes_max=1 << 20))
    for k in range(50):
        append(st_, *[M(f"{k}-{i}", subject=("a", "b")[i % 2], payload=b"x" * 100) for i in range(20)])
        b, h = pull(st_, ["a", "b"], "g", 100, T0)
        assert b.n == 20
    assert st_.counters["frame_cache_misses"] == 0
    tiny = open_store(tmp_path / "tiny", RealtimeSettings(frame_cache_bytes_max=1))
    for k in range(3):
        append(tiny, *[M(f"{k}-{i}") for i in range(5)])
    assert len(ids(tiny, "orders", "g", 100, T0)) == 15
    assert tiny.counters["frame_cache_misses"] == 3  # a cache of one frame: each frame read once, no more


def test_replay_reindexes_records_missing_from_the_index(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(3)])
    st_.flush()
    second = st_.messages.end_offset
    append(st_, *[M(i) for i in range(3, 6)], M(6, subject="fresh"))
    # crash between the log write and the index write: the last entries never reached the index,
    # and the run of the second frame was cut in the middle
    p = index_path(tmp_path)
    os.truncate(p, 4 * ENTRY_SIZE)
    os.truncate(index_path(tmp_path, "fresh"), 0)
    st2 = open_store(tmp_path)
    assert st2.counters["reindexed"] == 3
    r = st2.recovery  # what recovery found and did
    assert (r.reindex_from, r.entries_reindexed, r.dedup_entries, r.log_tail) == (second, 3, 7, None)
    assert ids(st2, "orders", "g", 100, T0) == [f"m{i}" for i in range(6)]
    assert ids(st2, "fresh", "g", 100, T0) == ["m6"]
    assert os.path.getsize(p) == 6 * ENTRY_SIZE


def test_torn_tail_of_index_file(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(5)])
    st_.close()
    p = index_path(tmp_path)
    with open(p, "ab") as f:
        f.write(b"\x01" * 10)  # a partial entry
    st_ = open_store(tmp_path)
    assert os.path.getsize(p) == 5 * ENTRY_SIZE
    st_.close()
    with open(p, "ab") as f:
        f.write(b"\x00" * ENTRY_SIZE * 2)  # zero-filled pages (lost write)
    data = bytearray(p.read_bytes())
    data[4 * ENTRY_SIZE + 3] ^= 0xFF  # and the last real entry fails its CRC
    p.write_bytes(bytes(data))
    st_ = open_store(tmp_path)
    assert st_.counters["reindexed"] == 1  # the dropped entry is rebuilt from the message log
    assert ids(st_, "orders", "g", 10, T0) == [f"m{i}" for i in range(5)]
    append(st_, M(5))
    assert handles(st_, "orders", "g", 10, T0) == [5]


def test_corrupt_entry_in_the_middle_of_an_index_is_reported(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(5)])
    st_.close()
    p = index_path(tmp_path)
    data = bytearray(p.read_bytes())
    data[2 * ENTRY_SIZE + 9] ^= 0x01  # one bit of entry 2
    p.write_bytes(bytes(data))
    st_ = open_store(tmp_path)  # not a tail: open keeps it, a read that reaches it refuses
    with pytest.raises(CorruptRecord) as e:
        st_.pull(["orders"], "g", "c", max_messages=10, now_ms=T0)
    assert e.value.path == str(p) and e.value.offset == 2 * ENTRY_SIZE


def test_torn_tail_of_message_log(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(4)])
    append(st_, M(4), M(5, subject="other"))
    st_.close()
    seg = segment_files(tmp_path)[-1]
    os.truncate(seg, seg.stat().st_size - 3)  # the last frame is torn
    last = segment_files(tmp_path)[-1].stat().st_size
    st_ = open_store(tmp_path)
    assert st_.messages.recovery is not None and st_.recovery.log_tail == st_.messages.recovery
    assert st_.recovery.log_tail.bytes_dropped > 0 and st_.recovery.log_tail.offset < last
    assert os.path.getsize(index_path(tmp_path)) == 4 * ENTRY_SIZE  # its index entries are dropped too
    assert os.path.getsize(index_path(tmp_path, "other")) == 0
    assert ids(st_, "orders", "g", 10, T0) == [f"m{i}" for i in range(4)]
    assert append(st_, M(4)).duplicates[0] == 0  # the lost message can be sent again
    b, h = pull(st_, "orders", "g", 10, T0)
    assert list(zip(h.tolist(), b.id_list())) == [(4, "m4")]


def test_reopen_without_epoch_bump_never_reuses_a_seq(tmp_path):
    st_ = open_store(tmp_path)
    a = append(st_, M(0), M(1)).seqs[1]
    st_.close()
    st_ = open_store(tmp_path, bump_epoch=False)
    b = append(st_, M(2)).seqs[0]
    assert b == a + 1 and b >> SEQ_EPOCH_SHIFT == a >> SEQ_EPOCH_SHIFT


def test_persisted_ack_survives_a_kill_without_flush(tmp_path):
    st_ = open_store(tmp_path)
    append(st_, *[M(i) for i in range(5)])
    st_.flush()
    h = handles(st_, "orders", "g", 5, T0)
    ack(st_, "orders", "g", h[:3])
    assert st_.persist_group("orders", "g")
    assert not st_.persist_group("orders", "g")  # unchanged: nothing written
    st2 = open_store(tmp_path, now=T0 + 5)  # abandoned without flush or close, as after kill -9
    assert ids(st2, "orders", "g", 10, T0 + 5) == ["m3", "m4"]
    st2.close()


# ---------------------------------------------------------------------- stateful model


SUBJECTS = ("s1", "s2")
GROUPS = ("g1", "g2")
INFLIGHT_MAX = 6
MODEL_SETTINGS = RealtimeSettings(segment_bytes=1 << 12, ack_timeout_ms=1_000, dedup_window_ms=10 ** 9,
                                  inflight_per_group_max=INFLIGHT_MAX, limits=Limits(payload_bytes_max=256))


class RealtimeModel(RuleBasedStateMachine):
    """The store against a dict subject -> list of ids and, per (subject, group), acked / in-flight handles."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="rt-model-")
        self.now = T0
        self.store = RealtimeStore.open(self.dir, MODEL_SETTINGS, now_ms=self.now)
        for s in SUBJECTS:
            self.store.create_subject(s)
        self.msgs: dict[str, list[str]] = {s: [] for s in SUBJECTS}
        self.next_id = 0
        self.acked = {(s, g): set() for s in SUBJECTS for g in GROUPS}          # acked, as the store knows now
        self.acked_durable = {(s, g): set() for s in SUBJECTS for g in GROUPS}  # acked at the last flush
        self.inflight = {(s, g): {} for s in SUBJECTS for g in GROUPS}          # handle -> pulled_at_ms

    def teardown(self):
        try:
            self._drain_and_check()
        finally:
            try:
                self.store.close()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _drain_and_check(self):
        self.now += 10 * MODEL_SETTINGS.ack_timeout_ms
        for g in GROUPS:
            for _ in range(sum(map(len, self.msgs.values())) + 10):
                got = self._pull(list(SUBJECTS), g, 5)
                if not got:
                    break
                for s in SUBJECTS:
                    self._ack(s, g, [h for ss, h in got if ss == s])
        for (s, g), acked in self.acked.items():
            assert acked == set(range(len(self.msgs[s]))), (s, g)  # everything reached every group
            assert self.store.lag(s, g) == 0

    def _pull(self, subjects, g, k):
        try:
            b, hs = self.store.pull(subjects, g, "c", max_messages=k, now_ms=self.now)
        except Overloaded:
            assert any(len(self.inflight[(s, g)]) >= INFLIGHT_MAX for s in subjects)
            return []
        assert b.n <= k
        out = []
        for s, h, mid in zip(b.subject_list(), hs.tolist(), b.id_list()):
            key = (s, g)
            assert s in subjects and mid == self.msgs[s][h]
            assert h not in self.acked[key], "an acked message was delivered again"
            prior = self.inflight[key].get(h)
            assert prior is None or self.now >= prior + MODEL_SETTINGS.ack_timeout_ms, "delivered while in flight"
            self.inflight[key][h] = self.now
            out.append((s, h))
        assert len(set(out)) == len(out)
        return out

    def _ack(self, s, g, hs):
        key = (s, g)
        n = self.store.ack(s, g, unpack_ranges(pack_ranges(hs)), now_ms=self.now) if hs else 0
        expected = {h for h in hs if h in self.inflight[key]}
        assert n == len(expected)
        for h in expected:
            del self.inflight[key][h]
            self.acked[key].add(h)

    @rule(s=st.sampled_from(SUBJECTS), n=st.integers(1, 4), other=st.booleans())
    def append(self, s, n, other):
        ms = []
        for _ in range(n):
            subj = SUBJECTS[1 - SUBJECTS.index(s)] if other and self.next_id % 2 else s
            ms.append(M(f"id{self.next_id}", subject=subj, payload=b"p" * (self.next_id % 50)))
            self.next_id += 1
        r = append(self.store, *ms, now=self.now)
        assert (r.codes == OK).all() and not r.duplicates.any()
        for m in ms:
            self.msgs[m.subject].append(m.id)

    @precondition(lambda self: any(self.msgs.values()))
    @rule(data=st.data())
    def resend_is_duplicate(self, data):
        s = data.draw(st.sampled_from([s for s in SUBJECTS if self.msgs[s]]))
        mid = data.draw(st.sampled_from(self.msgs[s]))
        assert append(self.store, M(mid, subject=s, payload=b"again"), now=self.now).duplicates[0] == 1

    @rule(subjects=st.sampled_from([["s1"], ["s2"], ["s1", "s2"], ["s2", "s1"]]), g=st.sampled_from(GROUPS),
          k=st.integers(1, 5))
    def pull(self, subjects, g, k):
        self._pull(subjects, g, k)

    @rule(s=st.sampled_from(SUBJECTS), g=st.sampled_from(GROUPS), data=st.data())
    def ack(self, s, g, data):
        pool = sorted(self.inflight[(s, g)]) + [10_000]
        self._ack(s, g, data.draw(st.lists(st.sampled_from(pool), max_size=4)))

    @rule(ms=st.sampled_from([1, 400, 1_000]))
    def advance(self, ms):
        self.now += ms

    @rule()
    def flush(self):
        self.store.flush()
        self.acked_durable = {k: set(v) for k, v in self.acked.items()}

    @rule(clean=st.booleans())
    def reopen(self, clean):
        if clean:
            self.store.close()
            self.acked_durable = {k: set(v) for k, v in self.acked.items()}
        # else: a process kill; appended bytes are in the page cache, acks after the last flush are lost
        self.store = RealtimeStore.open(self.dir, MODEL_SETTINGS, now_ms=self.now)
        self.acked = {k: set(v) for k, v in self.acked_durable.items()}
        for key in self.inflight:
            self.inflight[key] = {}  # deadlines are lost: everything unacked may come at once

    @invariant()
    def lag_matches(self):
        for (s, g), acked in self.acked.items():
            assert self.store.lag(s, g) == len(self.msgs[s]) - len(acked)


TestRealtimeModel = RealtimeModel.TestCase
TestRealtimeModel.pytestmark = [pytest.mark.integration]  # tier: the state machine alone takes over 20 s on a loaded machine
TestRealtimeModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_evicted_dirty_indexes_stay_dirty_until_a_checkpoint_fsyncs_them(tmp_path, monkeypatch):
    """More subjects than index_files_open_max: evicting a dirty index fd fsyncs nothing, and
    neither does a flush that writes no checkpoint (issue 27: a flood of new subjects paid one
    fsync per subject every 200 ms); the index stays dirty, and the checkpoint that vouches
    for its entries fsyncs it first (reopened by path)."""
    import os as _os

    from node.realtime.store import RealtimeSettings, RealtimeStore

    st = RealtimeStore.open(tmp_path, RealtimeSettings(index_files_open_max=2), now_ms=T0)
    for k in range(5):
        st.create_subject(f"s{k}")  # subjects.json is fsynced here, before the counting starts
    synced: list[int] = []
    real_fsync = _os.fsync
    monkeypatch.setattr(_os, "fsync", lambda fd: synced.append(_os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))
    for k in range(5):
        st.append(Batch.build(f"s{k}", [b"p"], [f"id{k}"], T0), now_ms=T0)
    assert not synced  # evictions of dirty fds fsynced nothing
    assert sum(ix.fd < 0 and ix.dirty for ix in st._indexes.by_subject.values()) == 3
    st.flush_plan(index_bytes_min=1 << 40).run_and_finish()  # no checkpoint due
    assert not [p for p in synced if "/index/" in p]
    assert all(st._indexes.by_subject[f"s{k}"].dirty for k in range(5))
    st.flush_plan().run_and_finish()
    assert {p.split("/index/")[1].split("/")[0] for p in synced if "/index/" in p} == {f"s{k}" for k in range(5)}
    assert not any(ix.dirty for ix in st._indexes.by_subject.values())
    assert st.indexed_offset == st.messages.end_offset
    monkeypatch.undo()
    st.close()
    reopened = RealtimeStore.open(tmp_path, RealtimeSettings(index_files_open_max=2), now_ms=T0 + 1)
    assert sum(reopened.lag(f"s{k}", "g") for k in range(5)) == 5
    reopened.close()


def test_a_capped_checkpoint_vouches_only_below_the_first_index_left_unsynced(tmp_path):
    """``fsyncs_max``: a checkpoint fsyncs the indexes with the oldest unsynced entries first and
    vouches only below the first one it left; the next ones catch up; the offset never goes
    back, and a crash before they do re-indexes what was not vouched for."""
    from node.realtime.store import RealtimeSettings, RealtimeStore

    st = RealtimeStore.open(tmp_path, RealtimeSettings(), now_ms=T0)
    offsets = []
    for k in range(6):
        offsets.append(st.messages.end_offset)
        st.append(Batch.build(f"s{k}", [b"p"], [f"id{k}"], T0), now_ms=T0)
    st.flush_plan(fsyncs_max=1).run_and_finish()  # s0's index and its new folder are two fsyncs: none fits
    assert st.indexed_offset == offsets[0]
    st.flush_plan(fsyncs_max=4).run_and_finish()  # s0 and s1
    assert st.indexed_offset == offsets[2]
    assert [ix.dirty for ix in (st._indexes.by_subject[f"s{k}"] for k in range(6))] == [False] * 2 + [True] * 4
    st.append(Batch.build("s0", [b"q"], ["id-late"], T0), now_ms=T0)  # s0 dirty again, after s2..s5
    st.flush_plan(fsyncs_max=4).run_and_finish()  # s2 and s3
    assert st.indexed_offset == offsets[4]
    end = st.messages.end_offset
    del st  # a crash: s4, s5 and s0's new entry were never vouched for; replay re-indexes them
    reopened = RealtimeStore.open(tmp_path, RealtimeSettings(), now_ms=T0 + 1)
    assert reopened.indexed_offset >= offsets[4] and reopened.messages.end_offset == end
    assert [reopened.lag(f"s{k}", "g") for k in range(6)] == [2, 1, 1, 1, 1, 1]
    reopened.flush_plan(fsyncs_max=100).run_and_finish()
    assert reopened.indexed_offset == end
    reopened.close()


# ---------------------------------------------------------------- messages stored ahead of their due time

AHEAD = RealtimeSettings(segment_bytes=1 << 16, ack_timeout_ms=60_000, visible_hold_ms_max=100, visible_step_ms=4)


def test_messages_stored_ahead_of_due_are_handed_out_when_due(tmp_path):
    """A delay node dispatches a round a few ms ahead: each message is handed out at its due
    time rounded up to visible_step_ms; a subject's later messages wait behind a held one."""
    st_ = open_store(tmp_path, AHEAD)
    append(st_, M("a", deliver_at_ms=T0 + 5), M("b", deliver_at_ms=T0 + 9), M("c", subject="audit", deliver_at_ms=T0 + 2))
    append(st_, M("x"), M("y", subject="logs"))  # due now
    subjects = ["orders", "audit", "logs"]
    assert ids(st_, subjects, "g", 10, T0) == ["y"]
    assert st_.held_next_ms == T0 + 4
    assert ids(st_, subjects, "g", 10, T0 + 3) == [] and st_.held_next_ms == T0 + 4
    assert ids(st_, subjects, "g", 10, T0 + 4) == ["c"]
    assert ids(st_, subjects, "g", 10, T0 + 8) == ["a"]  # b (T0 + 12) holds x back
    assert st_.held_next_ms == T0 + 12
    assert sorted(ids(st_, subjects, "g", 10, T0 + 12)) == ["b", "x"]
    assert ids(st_, subjects, "g", 10, T0 + 10_000) == [] and st_.held_next_ms is None


def test_held_messages_stay_held_across_a_restart(tmp_path):
    st_ = open_store(tmp_path, AHEAD)
    append(st_, M("a", deliver_at_ms=T0 + 20))
    st_.close()
    st_ = open_store(tmp_path, AHEAD, now=T0 + 1)
    assert ids(st_, "orders", "g", 10, T0 + 1) == [] and st_.held_next_ms == T0 + 20
    assert ids(st_, "orders", "g", 10, T0 + 20) == ["a"]
    st_.close()


def test_holding_is_bounded_by_the_limit_and_by_a_clock_that_stepped_back(tmp_path):
    st_ = open_store(tmp_path, AHEAD)
    append(st_, M("far", deliver_at_ms=T0 + 3_600_000))  # an hour ahead: held visible_hold_ms_max at most
    assert ids(st_, "orders", "g", 10, T0 + 99) == [] and st_.held_next_ms == T0 + 100
    assert ids(st_, "orders", "g", 10, T0 + 100) == ["far"]
    append(st_, M("late", deliver_at_ms=T0 + 50), now=T0)
    # the clock stepped back ten seconds: the entry is not held for ten seconds
    assert ids(st_, "orders", "g", 10, T0 - 10_000) == ["late"]


def test_a_lookahead_pull_hands_out_what_is_visible_by_its_horizon(tmp_path):
    """A pull with ``horizon_ms`` (a consumer that holds messages until due: lookahead) takes
    what becomes visible by then, and says when the first one it left becomes visible."""
    st_ = open_store(tmp_path, AHEAD)
    append(st_, M("a", deliver_at_ms=T0 + 5), M("b", deliver_at_ms=T0 + 30), M("c", deliver_at_ms=T0 + 60))
    assert ids(st_, "orders", "g", 10, T0) == [] and st_.held_next_ms == T0 + 8  # no horizon: due rounded up
    assert ids(st_, "orders", "g", 10, T0, horizon_ms=T0 + 20) == ["a"]  # a: T0 + 8; b: T0 + 32
    assert st_.held_next_ms == T0 + 32
    assert ids(st_, "orders", "g", 10, T0 + 1, horizon_ms=T0 + 31) == [] and st_.held_next_ms == T0 + 32
    assert ids(st_, "orders", "g", 10, T0 + 1, horizon_ms=T0 + 32) == ["b"]
    assert st_.held_next_ms == T0 + 60
    assert ids(st_, "orders", "g", 10, T0 + 2, horizon_ms=T0 + 59) == [] and st_.held_next_ms == T0 + 60
    assert ids(st_, "orders", "g", 10, T0 + 2, horizon_ms=T0 + 60) == ["c"]


def test_a_lookahead_pull_waits_until_something_is_a_third_of_it_from_visible_then_takes_all_of_it(tmp_path):
    """``pull_ahead``: with messages stored further ahead than the lookahead (a delay node's
    dispatch lead of 60 ms against a consumer's 30), a pull takes nothing until one is within a
    third of the lookahead of visible, then everything visible within the whole lookahead, so a
    consumer that pulls again at once gets nothing more until the next third."""
    st_ = open_store(tmp_path, AHEAD)
    append(st_, *[M(f"m{k}", deliver_at_ms=T0 + 20 + 4 * k) for k in range(12)])  # visible T0+20 .. T0+64

    def ahead(now):
        b, h = st_.pull_ahead(["orders"], "g", "c", max_messages=100, now_ms=now, lookahead_ms=30)
        assert len(h) == b.n
        return b.id_list()

    assert ahead(T0) == [] and st_.held_next_ms == T0 + 20  # m0 is 20 ms away, the trigger is 10
    assert ahead(T0 + 9) == []
    assert ahead(T0 + 10) == [f"m{k}" for k in range(6)]  # within T0+10+30: m0 (20) .. m5 (40)
    assert ahead(T0 + 11) == [] and st_.held_next_ms == T0 + 44  # at once again: nothing (m6 is 33 ms away)
    assert ahead(T0 + 34) == [f"m{k}" for k in range(6, 12)]
    b, _ = st_.pull_ahead(["orders"], "g", "c", max_messages=2, now_ms=T0 + 100, lookahead_ms=30)
    assert b.n == 0  # everything was handed out; max_messages is kept below (next test)


def test_a_lookahead_pull_reads_each_subject_once(tmp_path, monkeypatch):
    """``pull_ahead`` is one pass: each subject's entries are read once per pull, whether the
    third of the lookahead opens it (everything within the whole lookahead handed out) or not
    (nothing moves, ``held_next_ms`` says when it opens). It was a pull within the third and a
    second within the whole lookahead, which read every subject again."""
    from node.realtime.index import SubjectIndex

    st_ = open_store(tmp_path, AHEAD)
    for s in ("a", "b", "c"):
        st_.create_subject(s)
    append(st_, *[M(f"{s}{k}", subject=s, deliver_at_ms=T0 + 20 + 4 * k) for s in ("a", "b", "c") for k in range(6)])
    reads = []
    real = SubjectIndex.read
    monkeypatch.setattr(SubjectIndex, "read", lambda self, fd, pos, n: reads.append(self) or real(self, fd, pos, n))

    b, _ = st_.pull_ahead(["a", "b", "c"], "g", "c", max_messages=100, now_ms=T0, lookahead_ms=30)
    assert b.n == 0 and st_.held_next_ms == T0 + 20 and len(reads) == 3  # closed: a0/b0/c0 are 20 ms away
    reads.clear()
    b, h = st_.pull_ahead(["a", "b", "c"], "g", "c", max_messages=100, now_ms=T0 + 10, lookahead_ms=30)
    assert sorted(b.id_list()) == sorted(f"{s}{k}" for s in ("a", "b", "c") for k in range(6)) and len(h) == 18
    assert len(reads) == 3  # open: everything within T0+40, one read per subject


def test_a_lookahead_pull_keeps_max_messages(tmp_path):
    st_ = open_store(tmp_path, AHEAD)
    append(st_, *[M(f"m{k}", deliver_at_ms=T0 + k) for k in range(10)])
    b, h = st_.pull_ahead(["orders"], "g", "c", max_messages=4, now_ms=T0, lookahead_ms=30)
    assert b.id_list() == ["m0", "m1", "m2", "m3"] and len(h) == 4
    b, h = st_.pull_ahead(["orders"], "g", "c", max_messages=20, now_ms=T0, lookahead_ms=30)
    assert b.id_list() == [f"m{k}" for k in range(4, 10)]  # the first step's part and the rest, in order


def test_a_lookahead_pull_answers_its_first_step_when_the_in_flight_set_fills(tmp_path):
    """The first step's messages are in flight once taken: a second step refused for a full
    in-flight set (``Overloaded``) must not lose them from the answer."""
    st_ = open_store(tmp_path, dataclasses.replace(AHEAD, inflight_per_group_max=2))
    append(st_, *[M(f"m{k}", deliver_at_ms=T0 + 4 * k) for k in range(6)])
    b, h = st_.pull_ahead(["orders"], "g", "c", max_messages=100, now_ms=T0, lookahead_ms=30)
    assert b.id_list() == ["m0", "m1"] and len(h) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 6), st.lists(st.tuples(st.sampled_from(["s1", "s2"]),
                                                                         st.integers(-20, 150)), max_size=6)),
                      min_size=1, max_size=25),
       step=st.sampled_from([1, 3, 4]), lookahead=st.sampled_from([0, 0, 7, 30]))
def test_property_never_early_never_lost_in_order(tmp_path_factory, steps, step, lookahead):
    """Whatever the dues and pull times: a message is handed out no earlier than its due
    time (clamped to [stored, stored + hold]) less the pull's lookahead, each exactly once, in
    log order per subject."""
    cfg = RealtimeSettings(segment_bytes=1 << 16, ack_timeout_ms=600_000, visible_hold_ms_max=100,
                           visible_step_ms=step)
    st_ = open_store(tmp_path_factory.mktemp("ahead"), cfg)
    st_.create_subject("s1")
    st_.create_subject("s2")
    now, k, sent, got = T0, 0, {}, {}
    for dt, msgs in steps:
        now += dt
        if msgs:
            ms = [M(k + j, subject=s, deliver_at_ms=now + d) for j, (s, d) in enumerate(msgs)]
            k += len(ms)
            assert (append(st_, *ms, now=now).codes == OK).all()
            for m in ms:
                sent[m.id] = (m.subject, min(max(m.deliver_at_ms, now), now + 100))
        for i in ids(st_, ["s1", "s2"], "g", 1000, now, horizon_ms=now + lookahead if lookahead else None):
            assert i not in got and now + lookahead >= sent[i][1]
            got[i] = now
    got.update(dict.fromkeys(ids(st_, ["s1", "s2"], "g", 1000, now + 1000), now + 1000))
    assert set(got) == set(sent)
    for s in ("s1", "s2"):  # handed out in log (id) order within a subject
        order = [i for i in sorted(got, key=lambda i: (got[i], int(i[1:]))) if sent[i][0] == s]
        assert order == sorted(order, key=lambda i: int(i[1:]))
    st_.close()


def test_a_dispatch_lead_beyond_the_real_time_hold_is_refused(tmp_path):
    """A lead the real-time nodes would not hold for would deliver messages early: the
    settings refuse it (the CLI prints the one-line reason)."""
    from pydantic import ValidationError

    from node.config import NodeSettings

    base = dict(role="delay", node_id="n", data_dir=tmp_path)
    assert NodeSettings(**base).delay.dispatch_lead_ms < NodeSettings(**base).realtime.visible_hold_ms_max
    assert NodeSettings(**base, dispatch_lead_ms=99).delay.dispatch_lead_ms == 99
    for lead, hold in ((100, 100), (200, 100), (20, 10)):
        with pytest.raises(ValidationError, match="dispatch_lead_ms .* must be below visible_hold_ms_max"):
            NodeSettings(**base, dispatch_lead_ms=lead, visible_hold_ms_max=hold)
    assert NodeSettings(**base, dispatch_lead_ms=0, visible_hold_ms_max=0).delay.dispatch_lead_ms == 0


_U64 = st.one_of(st.sampled_from([0, 1, (1 << 62) - 1, 1 << 62, (1 << 62) + 1, (1 << 64) - 1]),
                 st.integers(0, (1 << 64) - 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(_U64, _U64), max_size=10), st.booleans()), min_size=1, max_size=4))
def test_acked_ranges_of_small_acks_decode_as_the_array_rule(subjects):
    """``consume.unpack_ranges`` decodes an ack of a small batch by a loop: the same pairs,
    and the same refusal (odd sizes, lo >= hi, an end past 2**62), as the array rule."""
    import struct

    import node.realtime.consume as consume

    items = []
    for k, (pairs, torn) in enumerate(subjects):
        raw = struct.pack(f"<{2 * len(pairs)}Q", *(v for p in pairs for v in p))
        items.append((f"s{k}", raw + (b"x" if torn else b"")))

    def decode(limit):
        saved, consume.SMALL_RANGES_MAX = consume.SMALL_RANGES_MAX, limit
        try:
            return consume.unpack_ranges(items)
        except InvalidArgument as e:
            return str(e)
        finally:
            consume.SMALL_RANGES_MAX = saved

    assert decode(consume.SMALL_RANGES_MAX) == decode(-1)
