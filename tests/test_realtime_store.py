"""RealtimeStore on real files with time passed in: append -> index -> pull/ack -> restart."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.errors import InvalidArgument, Overloaded, PayloadTooLarge, UnknownSubject
from node.realtime.store import (DLQ_SUBJECT, ENTRY_SIZE, RealtimeSettings, RealtimeStore,
                                 Stored, tags_mask)
from node.store.records import SEQ_EPOCH_SHIFT, Limits, Message

T0 = 1_800_000_000_000
SMALL = RealtimeSettings(segment_bytes=1 << 14, ack_timeout_ms=1_000, dedup_window_ms=60_000,
                         limits=Limits(payload_bytes_max=1024))


def msg(i, subject="orders", payload=None, **kw):
    return Message(seq=0, store_ms=0, deliver_at_ms=kw.pop("deliver_at_ms", T0), msg_id=f"m{i}", subject=subject,
                   payload=payload if payload is not None else f"p{i}".encode(), **kw)


def open_store(path, s=SMALL, now=T0, **kw):
    return RealtimeStore.open(path, s, now_ms=now, **kw)


def ids(deliveries):
    return [d.message.msg_id for d in deliveries]


def index_path(root, subject="orders"):
    return Path(root) / "index" / subject / "entries"


def segment_files(root):
    return sorted((Path(root) / "messages").glob("*.log"))


# ---------------------------------------------------------------------- basics


def test_append_pull_ack_round_trip(tmp_path):
    st_ = open_store(tmp_path)
    res = st_.append([msg(i, tags=("eu",), properties=(("k", "v"),), deliver_at_ms=T0 - 5, attempts=2)
                      for i in range(3)], now_ms=T0)
    assert all(isinstance(r, Stored) and not r.duplicate for r in res)
    seqs = [r.seq for r in res]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert all(s >> SEQ_EPOCH_SHIFT == st_.epoch for s in seqs)
    st_.flush()
    got = st_.pull("orders", "billing", "c1", max_messages=10, now_ms=T0 + 1)
    assert [d.handle for d in got] == [0, 1, 2]
    m = got[1].message
    assert (m.msg_id, m.payload, m.tags, m.properties, m.seq) == ("m1", b"p1", ("eu",), (("k", "v"),), seqs[1])
    assert (m.store_ms, m.deliver_at_ms, m.attempts) == (T0, T0 - 5, 2)  # original due time and attempts kept
    assert st_.lag("orders", "billing") == 3
    assert st_.ack("orders", "billing", [0, 1, 2, 99], now_ms=T0 + 2) == 3
    assert st_.ack("orders", "billing", [0], now_ms=T0 + 2) == 0
    assert st_.lag("orders", "billing") == 0
    assert st_.pull("orders", "billing", "c1", max_messages=10, now_ms=T0 + 10_000) == []
    assert "orders" in st_.subjects() and DLQ_SUBJECT in st_.subjects()
    st_.close()


def test_two_consumers_in_one_group_share_work(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(10)], now_ms=T0)
    a = st_.pull("orders", "g", "c1", max_messages=4, now_ms=T0)
    b = st_.pull("orders", "g", "c2", max_messages=4, now_ms=T0)
    c = st_.pull("orders", "g", "c1", max_messages=4, now_ms=T0)
    assert (len(a), len(b), len(c)) == (4, 4, 2)
    all_ids = ids(a) + ids(b) + ids(c)
    assert sorted(all_ids) == sorted(f"m{i}" for i in range(10))
    assert st_.pull("orders", "g", "c2", max_messages=4, now_ms=T0 + 1) == []


def test_two_groups_each_get_everything(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(5)], now_ms=T0)
    for g in ("g1", "g2"):
        got = st_.pull("orders", g, "c", max_messages=100, now_ms=T0)
        assert ids(got) == [f"m{i}" for i in range(5)]
        st_.ack("orders", g, [d.handle for d in got], now_ms=T0)
    assert st_.lag("orders", "g1") == st_.lag("orders", "g2") == 0
    assert st_.lag("orders", "never-seen") == 5


def test_ack_timeout_redelivers(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(3)], now_ms=T0)
    first = st_.pull("orders", "g", "c1", max_messages=2, now_ms=T0)
    st_.ack("orders", "g", [first[0].handle], now_ms=T0)
    assert ids(st_.pull("orders", "g", "c2", max_messages=10, now_ms=T0 + 999)) == ["m2"]
    again = st_.pull("orders", "g", "c2", max_messages=10, now_ms=T0 + 1000)
    assert [(d.handle, d.message.msg_id) for d in again] == [(1, "m1")]
    assert st_.lag("orders", "g") == 2
    # both deadlines were (re)started by the last pulls
    assert st_.pull("orders", "g", "c1", max_messages=10, now_ms=T0 + 1500) == []
    st_.ack("orders", "g", [1, 2], now_ms=T0 + 1600)
    assert st_.pull("orders", "g", "c1", max_messages=10, now_ms=T0 + 100_000) == []
    assert st_.lag("orders", "g") == 0


def test_redelivery_deadline_is_restarted(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(0)], now_ms=T0)
    assert ids(st_.pull("orders", "g", "c", max_messages=1, now_ms=T0)) == ["m0"]
    assert ids(st_.pull("orders", "g", "c", max_messages=1, now_ms=T0 + 1000)) == ["m0"]
    assert st_.pull("orders", "g", "c", max_messages=1, now_ms=T0 + 1999) == []
    assert ids(st_.pull("orders", "g", "c", max_messages=1, now_ms=T0 + 2000)) == ["m0"]


def test_redeliveries_come_in_deadline_order(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(0), msg(1)], now_ms=T0)
    assert ids(st_.pull("orders", "g", "c", max_messages=1, now_ms=T0)) == ["m0"]
    assert ids(st_.pull("orders", "g", "c", max_messages=1, now_ms=T0 + 500)) == ["m1"]
    assert ids(st_.pull("orders", "g", "c", max_messages=5, now_ms=T0 + 1000)) == ["m0"]
    assert ids(st_.pull("orders", "g", "c", max_messages=5, now_ms=T0 + 1500)) == ["m1"]
    assert ids(st_.pull("orders", "g", "c", max_messages=5, now_ms=T0 + 2500)) == ["m0", "m1"]


def test_tag_filter_skips_non_matching(tmp_path):
    assert tags_mask(["red"]) & tags_mask(["blue"]) == 0  # the test relies on distinct bits
    st_ = open_store(tmp_path)
    st_.append([msg(0, tags=("red",)), msg(1, tags=("blue",)), msg(2), msg(3, tags=("blue", "red"))], now_ms=T0)
    got = st_.pull("orders", "reds", "c", max_messages=10, tags=["red"], now_ms=T0)
    assert ids(got) == ["m0", "m3"]
    assert st_.lag("orders", "reds") == 2  # skipped entries count as done for this group
    st_.ack("orders", "reds", [d.handle for d in got], now_ms=T0)
    assert st_.lag("orders", "reds") == 0
    assert ids(st_.pull("orders", "all", "c", max_messages=10, now_ms=T0)) == ["m0", "m1", "m2", "m3"]
    assert ids(st_.pull("orders", "bg", "c", max_messages=10, tags=["blue", "green"], now_ms=T0)) == ["m1", "m3"]


def test_dedup_within_window_and_not_after(tmp_path):
    st_ = open_store(tmp_path)
    (a,) = st_.append([msg(1)], now_ms=T0)
    b, c = st_.append([msg(1, payload=b"other"), msg(2)], now_ms=T0 + 59_999)
    assert b == Stored("m1", a.seq, duplicate=True) and not c.duplicate
    d, e = st_.append([msg(3), msg(3)], now_ms=T0 + 59_999)  # twice in one batch
    assert not d.duplicate and e == Stored("m3", d.seq, duplicate=True)
    assert not st_.append([msg(1, subject="other")], now_ms=T0 + 1)[0].duplicate  # dedup key is (subject, id)
    assert ids(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 60_000)) == ["m1", "m2", "m3"]
    # survives a restart: rebuilt from the log
    st_.close()
    st_ = open_store(tmp_path, now=T0 + 59_999)
    assert st_.append([msg(1)], now_ms=T0 + 59_999)[0] == Stored("m1", a.seq, duplicate=True)
    (f,) = st_.append([msg(1)], now_ms=T0 + 60_000)
    assert not f.duplicate and f.seq != a.seq
    st_.flush()
    assert [d.message.payload for d in st_.pull("orders", "g2", "c", max_messages=10, now_ms=T0 + 60_000)] == \
        [b"p1", b"p2", b"p3", b"p1"]


def test_dedup_map_is_bounded(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(dedup_entries_max=3, dedup_window_ms=1000))
    res = st_.append([msg(i) for i in range(5)], now_ms=T0)
    assert [type(r) for r in res] == [Stored] * 3 + [Overloaded] * 2
    assert all(isinstance(r, Stored) for r in st_.append([msg(i) for i in range(3, 6)], now_ms=T0 + 1000))


def test_unknown_subject_without_auto_create(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(auto_create_subjects=False))
    end = st_.messages.end_offset
    res = st_.append([msg(0, subject="nope")], now_ms=T0)
    assert isinstance(res[0], UnknownSubject)
    assert st_.messages.end_offset == end and "nope" not in st_.subjects()
    with pytest.raises(UnknownSubject):
        st_.pull("nope", "g", "c", max_messages=1, now_ms=T0)
    with pytest.raises(UnknownSubject):
        st_.lag("nope", "g")
    assert isinstance(st_.append([msg(1, subject=DLQ_SUBJECT)], now_ms=T0)[0], Stored)  # the DLQ always exists
    assert st_.create_subject("orders") is True and st_.create_subject("orders") is False
    assert isinstance(st_.append([msg(2, subject="orders")], now_ms=T0)[0], Stored)
    with pytest.raises(InvalidArgument):
        st_.create_subject("../etc")
    st_.close()
    st_ = open_store(tmp_path, RealtimeSettings(auto_create_subjects=False))
    assert st_.subjects() == sorted([DLQ_SUBJECT, "orders"])


def test_validation_errors_change_nothing(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(0)], now_ms=T0)
    end, subjects = st_.messages.end_offset, st_.subjects()
    bad = [msg(1, subject="bad subject"), msg(2, payload=b"x" * 2000), msg(3, tags=tuple(f"t{i}" for i in range(17))),
           msg(4, payload="text"), Message(0, 0, T0, "has space", "orders", b"x"), msg(5, attempts=-1),
           msg(6, properties=(("k",),)), "not a message"]
    res = st_.append(bad, now_ms=T0)
    assert all(isinstance(r, InvalidArgument) for r in res), res
    assert isinstance(res[1], PayloadTooLarge)
    assert st_.messages.end_offset == end and st_.subjects() == subjects
    mixed = st_.append([msg(7, subject="bad subject"), msg(8)], now_ms=T0)
    assert isinstance(mixed[0], InvalidArgument) and isinstance(mixed[1], Stored)
    # a far-future deliver_at is fine on the real-time side: the message is due now
    assert isinstance(st_.append([msg(9, deliver_at_ms=T0 + 10 * 366 * 86_400_000)], now_ms=T0)[0], Stored)
    assert ids(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)) == ["m0", "m8", "m9"]
    with pytest.raises(InvalidArgument):
        st_.pull("orders", "bad/group", "c", max_messages=1, now_ms=T0)
    with pytest.raises(InvalidArgument):
        st_.pull("orders", "g", "c", max_messages=0, now_ms=T0)
    with pytest.raises(InvalidArgument):
        st_.pull("orders", "g3", "c", max_messages=1, start="middle", now_ms=T0)


def test_start_latest(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(0), msg(1)], now_ms=T0)
    assert st_.pull("orders", "late", "c", max_messages=10, start="latest", now_ms=T0) == []
    st_.append([msg(2)], now_ms=T0)
    st_.close()
    st_ = open_store(tmp_path)  # the start position was persisted when the group was created
    assert ids(st_.pull("orders", "late", "c", max_messages=10, now_ms=T0)) == ["m2"]


def test_inflight_bound(tmp_path):
    st_ = open_store(tmp_path, RealtimeSettings(inflight_per_group_max=3, ack_timeout_ms=1000))
    st_.append([msg(i) for i in range(5)], now_ms=T0)
    assert len(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)) == 3
    with pytest.raises(Overloaded):
        st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)
    assert len(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 1000)) == 3  # redeliveries still flow
    st_.ack("orders", "g", [0], now_ms=T0)
    assert [d.handle for d in st_.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 1000)] == [3]


def test_nack_returns_inflight_records(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(0, attempts=3), msg(1)], now_ms=T0)
    got = st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)
    back = st_.nack("orders", "g", [got[0].handle, 77, got[0].handle], now_ms=T0 + 900)
    assert back == [got[0]] and back[0].message.attempts == 3
    assert st_.nack("orders", "unknown-group", [0], now_ms=T0) == []
    # nack restarted the deadline of handle 0 only
    assert [d.handle for d in st_.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 1000)] == [1]
    assert st_.ack("orders", "g", [0], now_ms=T0 + 1000) == 1
    assert st_.nack("orders", "g", [0], now_ms=T0 + 1000) == []


# ---------------------------------------------------------------------- restarts


def test_committed_positions_survive_reopen_and_unacked_are_redelivered(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(6)], now_ms=T0)
    got = st_.pull("orders", "g", "c", max_messages=5, now_ms=T0)
    st_.ack("orders", "g", [0, 1, 3], now_ms=T0)  # out of order: 2 and 4 stay in flight
    other = st_.pull("orders", "h", "c", max_messages=10, now_ms=T0)
    st_.ack("orders", "h", [d.handle for d in other], now_ms=T0)
    assert len(got) == 5 and st_.committed("orders", "g") == 2
    epoch = st_.epoch
    st_.close()
    st_ = open_store(tmp_path, now=T0 + 1)
    assert st_.epoch == epoch + 1
    assert st_.committed("orders", "g") == 2 and st_.lag("orders", "g") == 3
    # in-flight deadlines are lost: redelivered at once, then the never-pulled one; acked ones never again
    assert [d.handle for d in st_.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 1)] == [2, 4, 5]
    assert st_.pull("orders", "h", "c", max_messages=10, now_ms=T0 + 100_000) == []
    (r,) = st_.append([msg(99)], now_ms=T0 + 1)
    assert r.seq >> SEQ_EPOCH_SHIFT == epoch + 1


def test_kill_without_close_loses_nothing_flushed(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i, payload=b"x" * 500) for i in range(40)], now_ms=T0)  # several segments
    got = st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)
    st_.ack("orders", "g", [d.handle for d in got], now_ms=T0)
    st_.flush()
    st_.append([msg(100)], now_ms=T0)  # written (page cache) but never flushed: a process kill keeps it
    assert len(segment_files(tmp_path)) > 1
    # no close(): the old object is simply abandoned, as after kill -9
    st2 = open_store(tmp_path, now=T0 + 5)
    assert st2.lag("orders", "g") == 31
    assert ids(st2.pull("orders", "g", "c", max_messages=100, now_ms=T0 + 5)) == \
        [f"m{i}" for i in range(10, 40)] + ["m100"]
    assert st2.append([msg(5)], now_ms=T0 + 5)[0].duplicate  # dedup map rebuilt
    st2.close()


def test_replay_reindexes_records_missing_from_the_index(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(3)], now_ms=T0)
    st_.flush()
    st_.append([msg(i) for i in range(3, 6)] + [msg(6, subject="fresh")], now_ms=T0)
    # crash between the log write and the index write: the last entries never reached the index
    p = index_path(tmp_path)
    os.truncate(p, 4 * ENTRY_SIZE)
    os.truncate(index_path(tmp_path, "fresh"), 0)
    st2 = open_store(tmp_path)
    assert st2.counters["reindexed"] == 3
    assert ids(st2.pull("orders", "g", "c", max_messages=100, now_ms=T0)) == [f"m{i}" for i in range(6)]
    assert ids(st2.pull("fresh", "g", "c", max_messages=100, now_ms=T0)) == ["m6"]
    assert os.path.getsize(p) == 6 * ENTRY_SIZE


def test_torn_tail_of_index_file(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(5)], now_ms=T0)
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
    assert ids(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)) == [f"m{i}" for i in range(5)]
    st_.append([msg(5)], now_ms=T0)
    assert [d.handle for d in st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)] == [5]


def test_torn_tail_of_message_log(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(5)], now_ms=T0)
    st_.close()
    seg = segment_files(tmp_path)[-1]
    os.truncate(seg, seg.stat().st_size - 3)  # the last record is torn
    st_ = open_store(tmp_path)
    assert st_.messages.recovery is not None
    assert os.path.getsize(index_path(tmp_path)) == 4 * ENTRY_SIZE  # its index entry is dropped too
    assert ids(st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)) == [f"m{i}" for i in range(4)]
    assert not st_.append([msg(4)], now_ms=T0)[0].duplicate  # the lost message can be sent again
    assert [(d.handle, d.message.msg_id) for d in st_.pull("orders", "g", "c", max_messages=10, now_ms=T0)] == \
        [(4, "m4")]


def test_reopen_without_epoch_bump_never_reuses_a_seq(tmp_path):
    st_ = open_store(tmp_path)
    (a,) = st_.append([msg(0)], now_ms=T0)
    st_.close()
    st_ = open_store(tmp_path, bump_epoch=False)
    (b,) = st_.append([msg(1)], now_ms=T0)
    assert b.seq > a.seq and b.seq >> SEQ_EPOCH_SHIFT == a.seq >> SEQ_EPOCH_SHIFT


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
        self.delivered = {(s, g): set() for s in SUBJECTS for g in GROUPS}

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
        for key in self.acked:
            s, g = key
            for _ in range(len(self.msgs[s]) + 10):
                got = self._pull(s, g, 5)
                if not got:
                    break
                self._ack(s, g, [d.handle for d in got])
            assert self.acked[key] == set(range(len(self.msgs[s]))), key  # everything reached every group
            assert self.store.lag(s, g) == 0

    def _pull(self, s, g, k):
        key = (s, g)
        try:
            got = self.store.pull(s, g, "c", max_messages=k, now_ms=self.now)
        except Overloaded:
            assert len(self.inflight[key]) >= INFLIGHT_MAX
            return []
        for d in got:
            assert d.message.msg_id == self.msgs[s][d.handle]
            assert d.handle not in self.acked[key], "an acked message was delivered again"
            prior = self.inflight[key].get(d.handle)
            assert prior is None or self.now >= prior + MODEL_SETTINGS.ack_timeout_ms, "delivered while in flight"
            self.inflight[key][d.handle] = self.now
            self.delivered[key].add(d.handle)
        return got

    def _ack(self, s, g, handles):
        key = (s, g)
        n = self.store.ack(s, g, handles, now_ms=self.now)
        expected = {h for h in handles if h in self.inflight[key]}
        assert n == len(expected)
        for h in expected:
            del self.inflight[key][h]
            self.acked[key].add(h)

    @rule(s=st.sampled_from(SUBJECTS), n=st.integers(1, 4))
    def append(self, s, n):
        batch = []
        for _ in range(n):
            batch.append(Message(0, 0, self.now, f"id{self.next_id}", s, b"p" * (self.next_id % 50)))
            self.next_id += 1
        res = self.store.append(batch, now_ms=self.now)
        assert all(isinstance(r, Stored) and not r.duplicate for r in res)
        self.msgs[s].extend(m.msg_id for m in batch)

    @precondition(lambda self: any(self.msgs.values()))
    @rule(data=st.data())
    def resend_is_duplicate(self, data):
        s = data.draw(st.sampled_from([s for s in SUBJECTS if self.msgs[s]]))
        mid = data.draw(st.sampled_from(self.msgs[s]))
        (r,) = self.store.append([Message(0, 0, self.now, mid, s, b"again")], now_ms=self.now)
        assert r.duplicate

    @rule(s=st.sampled_from(SUBJECTS), g=st.sampled_from(GROUPS), k=st.integers(1, 5))
    def pull(self, s, g, k):
        self._pull(s, g, k)

    @rule(s=st.sampled_from(SUBJECTS), g=st.sampled_from(GROUPS), data=st.data())
    def ack(self, s, g, data):
        pool = sorted(self.inflight[(s, g)]) + [10_000]
        handles = data.draw(st.lists(st.sampled_from(pool), max_size=4))
        self._ack(s, g, handles)

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
TestRealtimeModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_persisted_ack_survives_a_kill_without_flush(tmp_path):
    st_ = open_store(tmp_path)
    st_.append([msg(i) for i in range(5)], now_ms=T0)
    st_.flush()
    got = st_.pull("orders", "g", "c", max_messages=5, now_ms=T0)
    st_.ack("orders", "g", [d.handle for d in got[:3]], now_ms=T0)
    assert st_.persist_group("orders", "g")
    assert not st_.persist_group("orders", "g")  # unchanged: nothing written
    st2 = open_store(tmp_path, now=T0 + 5)  # abandoned without flush or close, as after kill -9
    assert ids(st2.pull("orders", "g", "c", max_messages=10, now_ms=T0 + 5)) == ["m3", "m4"]
    st2.close()
