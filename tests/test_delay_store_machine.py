"""DelayStore against a model, as a Hypothesis state machine (issue 29).

The model is a dict id -> ``Rec`` (due time, seq, state in pending / in_flight / dispatched /
cancelled, whether its record is filed) and the message log's records in order (messages and
tombstones, how many are durable, how many filed). Rules: accept (fresh ids, re-sends, another
message under a used id, an id twice in one batch; due an hour ago, now, soon, several buckets
ahead), cancel (pending, in flight, dispatched, cancelled, unknown), flush, iterate, time
passing with every due message polled (acknowledged, partly released or kept in flight),
in-flight units settled later, checkpoint, retention, close and reopen, and a crash: the store
dropped without close and reopened on its files, as after a SIGKILL (every write survives in
the page cache; nothing is flushed, filed or checkpointed on the way down). A power loss, which
also drops what was not fsynced, is not modelled: fsync is a no-op in this file (``no_fsync``).

Only the store's public API is used (the core/shell split must keep it): ``accept``, ``cancel``,
``lookup``, ``flush_messages``, ``iterate``, ``poll_due``, ``ack_dispatched``, ``release``,
``checkpoint``, ``close``, ``pending_by_bucket``, ``inflight``, and ``node.delay.retention``.

What it asserts, after every step (docs/design.md "Cancel", "Ids", "Durability", "Lookup states";
tests/test_crash.py states the same for a SIGKILL loop):

* a message fires only at or after its due time, only while pending: never while in flight,
  never once acknowledged (``ack_dispatched``), also across crashes and reopens; a message in
  flight at a crash or a close may fire again (delivery is at least once);
* once the clock passes a filed message's due time (or, due in the past, the tick after it was
  filed) and the store is polled, it has fired;
* no message fires after its cancel was answered;
* a re-send is a duplicate with the first seq and stores nothing; other content under a used
  id, or a cancelled id, is refused;
* ``iterate`` files exactly the durable records not filed yet, in log order;
* ``lookup`` answers each id's model state; ``inflight`` and ``pending_by_bucket`` add up to
  the model's counts; seqs only grow, across restarts too.

At the end the clock runs past every due time: every message not cancelled was delivered, and
one more reopen fires nothing.

Three bugs it found (KNOWN BUG A, B, C, all fixed) are example tests at the end of this file;
the machine checks their paths too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.errors import NotFound, TooLate
from node.delay import retention as DR
from node.delay.store import DelayStore, StoreSettings
from node.store.records import Limits, Message

T0 = 1_800_000_000_000
BUCKET_MS = 10_000  # buckets of 10 s: a minute of due times crosses several (hourly in production)
SET = StoreSettings(bucket_ms=BUCKET_MS, message_segment_bytes=2048, dispatch_segment_bytes=1024,
                    schedule_segment_bytes=1 << 14, id_slots=64, id_entries_max=64,
                    limits=Limits(payload_bytes_max=256))
ALREADY_EXISTS = 4  # hourglass.v1.Code
# due time relative to now: an hour ago, just past, now, within the wheel's window, seconds
# ahead, several buckets ahead
DUE_OFFSETS_MS = (-3_600_000, -1_500, 0, 40, 700, 3_000, 12_000, 31_000, 58_000)
STEPS_MS = (0, 10, 90, 300, 450, 700, 2_000, 9_000, 26_000)
MACHINE_EXAMPLES = int(os.environ.get("HOURGLASS_DELAY_MACHINE_EXAMPLES", "30"))  # more for a long hunt
MACHINE_STEPS = 60
POLLS_MAX = 10_000  # poll_due calls per drain at most (a loop that never settles is a failure)

PENDING, IN_FLIGHT, DISPATCHED, CANCELLED = "pending", "in_flight", "dispatched", "cancelled"


@dataclass
class Rec:
    due_ms: int
    payload: bytes
    seq: int
    state: str = PENDING
    filed: bool = False          # its message record is in the schedule log
    tomb_filed: bool = False     # its tombstone (if cancelled by a new one) is filed
    fired: int = 0               # times poll_due handed it out
    fire_by_ms: int = 0          # filed: it has fired once the clock is here (below)


def message(msg_id: str, due_ms: int, payload: bytes) -> Message:
    return Message(seq=0, store_ms=0, deliver_at_ms=due_ms, msg_id=msg_id, subject="s", payload=payload)


class DelayStoreModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="delay-model-")
        self.now = T0
        self.store = DelayStore.open(self.dir, SET, now_ms=self.now)
        self.recs: dict[str, Rec] = {}
        self.log: list[tuple[str, str]] = []  # records appended, not filed: ("msg" | "tomb", id), log order
        self.durable = 0                       # how many of them are durable (a prefix)
        self.units: dict[int, list[str]] = {}  # in-flight unit -> its ids, by index
        self.next_id = 0
        self.seq_max = 0
        self.retention_ran = False

    # ------------------------------------------------------------------ helpers

    def _ids(self, *states: str) -> list[str]:
        return [k for k, r in self.recs.items() if not states or r.state in states]

    def _reopened(self) -> None:
        """After a close or a crash: the open replays the whole log (every write survived a kill);
        what was in flight is pending again and may fire once more."""
        self._filed(self.log)
        self.log, self.durable = [], 0
        for ids in self.units.values():
            for mid in ids:
                if mid is not None and self.recs[mid].state == IN_FLIGHT:
                    self.recs[mid].state = PENDING
        self.units = {}

    def _filed(self, records: list[tuple[str, str]]) -> None:
        """Records filed now. A message is filed under ``max(deliver_at_ms, persisted
        completed_ms)`` (docs/design.md, "Effective due time"), and completed_ms is at most the
        tick after the last poll: one due in the past fires within a tick."""
        tick = SET.tick_ms
        for kind, mid in records:
            r = self.recs[mid]
            if kind == "msg":
                r.filed = True
                r.fire_by_ms = max(r.due_ms, self.now - self.now % tick + tick)
            else:
                r.tomb_filed = True

    def _fired(self, unit: int, batch) -> None:
        ids = batch.id_list()
        assert len(set(ids)) == len(ids), f"one id twice in one unit: {ids}"
        for i, mid in enumerate(ids):
            r = self.recs.get(mid)
            assert r is not None, f"{mid} fired, never accepted"
            assert r.state == PENDING, f"{mid} fired while {r.state}"
            if r.fired:
                event("fired again (in flight at a restart, or released)")
            assert r.filed, f"{mid} fired before its record was filed"
            assert int(batch.seq[i]) == r.seq
            assert int(batch.deliver_at_ms[i]) == r.due_ms
            assert r.due_ms <= self.now, f"{mid} fired {r.due_ms - self.now} ms early"
            assert int(batch.effective_ms[i]) <= self.now
            r.state = IN_FLIGHT
            r.fired += 1
        self.units[unit] = ids

    def _ack(self, unit: int, idx: list[int]) -> None:
        ids = self.units[unit]
        want = sorted({i for i in idx if ids[i] is not None})
        got = self.store.ack_dispatched(unit, np.array(idx, np.int64), now_ms=self.now)
        assert got == len(want)
        for i in want:
            self.recs[ids[i]].state = DISPATCHED
            ids[i] = None
        self._forget_settled(unit)

    def _release(self, unit: int, idx: list[int]) -> None:
        ids = self.units[unit]
        self.store.release(unit, np.array(idx, np.int64))
        for i in idx:
            if ids[i] is not None:
                self.recs[ids[i]].state = PENDING
                ids[i] = None
        self._forget_settled(unit)

    def _forget_settled(self, unit: int) -> None:
        if all(m is None for m in self.units[unit]):
            del self.units[unit]

    def _drain(self, data=None, *, ack_all: bool = False) -> None:
        """Poll until nothing more is due at ``now``; each unit is acknowledged, partly released
        (first round only: released messages are due again at once) or kept in flight."""
        for polls in range(POLLS_MAX):
            due = self.store.poll_due(now_ms=self.now)
            if not due:
                break
            for d in due:
                self._fired(d.unit, d.batch)
                event("poll fired " + ("1" if d.batch.n == 1 else "several"))
                n = d.batch.n
                what = "ack" if ack_all else data.draw(
                    st.sampled_from(["ack", "ack", "ack", "keep"] + (["release"] if polls == 0 else [])), label="unit")
                if what == "ack":
                    self._ack(d.unit, list(range(n)))
                elif what == "release":
                    back = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True), label="back")
                    self._release(d.unit, back)
                    rest = [i for i in range(n) if i not in back]
                    if rest:
                        self._ack(d.unit, rest)
        else:
            raise AssertionError(f"poll_due still fires after {POLLS_MAX} polls at one time")
        late = sorted(k for k, r in self.recs.items() if r.state == PENDING and r.filed and r.fire_by_ms <= self.now)
        assert not late, f"filed, due and not fired at now={self.now}: {late}"

    # ------------------------------------------------------------------ rules: ingest

    @initialize(data=st.data(), n=st.integers(2, 6))
    def some_messages(self, data, n):
        self._accept(data, n, "flush+iterate")

    @rule(data=st.data(), n=st.integers(1, 4), then=st.sampled_from(["nothing", "flush", "flush+iterate"]))
    def accept(self, data, n, then):
        self._accept(data, n, then)

    def _accept(self, data, n, then):
        kinds = ["fresh"] * 3 + (["resend", "other_content"] if self.recs else []) + ["twice"]
        msgs, expect = [], []
        in_batch: set[str] = set()
        for _ in range(n):
            kind = data.draw(st.sampled_from(kinds), label="kind")
            if kind in ("fresh", "twice"):
                mid = f"m{self.next_id}"
                self.next_id += 1
                due = self.now + data.draw(st.sampled_from(DUE_OFFSETS_MS), label="due")
                payload = b"p%d" % self.next_id
                msgs.append(message(mid, due, payload))
                expect.append(("fresh", mid, due, payload))
                if kind == "twice":
                    msgs.append(message(mid, due, payload))
                    expect.append(("twice", mid, due, payload))
            else:
                mid = data.draw(st.sampled_from(sorted(self.recs)), label="id")
                r = self.recs[mid]
                payload = r.payload if kind == "resend" else b"other"
                msgs.append(message(mid, r.due_ms, payload))
                expect.append(("twice" if mid in in_batch else kind, mid, r.due_ms, payload))
            in_batch.add(mid)
        res = self.store.accept(msgs, now_ms=self.now)
        assert res.n == len(msgs)
        appended = []
        for i, (kind, mid, due, payload) in enumerate(expect):
            code, seq, dup = int(res.codes[i]), int(res.seqs[i]), bool(res.duplicates[i])
            if kind == "fresh":
                assert code == 0 and not dup, (mid, code, res.errors.get(i))
                assert seq > self.seq_max, "a seq was reused"
                self.seq_max = seq
                self.recs[mid] = Rec(due, payload, seq)
                appended.append(mid)
            elif kind == "twice":  # an id twice in one batch: the first stands
                assert code == ALREADY_EXISTS, (mid, code)
            else:
                r = self.recs[mid]
                retired = self.retention_ran and r.state in (DISPATCHED, CANCELLED)
                if retired and code == 0 and dup:
                    event("re-send of an id whose bucket retention deleted")
                    continue  # its bucket is gone: answered from the id index, inside the dedupe window
                if r.state == CANCELLED or kind == "other_content":
                    assert code == ALREADY_EXISTS, (kind, mid, r.state, code, res.errors.get(i))
                else:
                    assert code == 0 and dup and seq == r.seq, (mid, r.state, code, dup, seq, r.seq)
        self.log += [("msg", mid) for mid in appended]
        if then != "nothing":
            self.flush()
        if then == "flush+iterate":
            self.iterate(None)

    @rule()
    def flush(self):
        self.store.flush_messages()
        self.durable = len(self.log)

    @rule(limit=st.sampled_from([None, 1, 3]))
    def iterate(self, limit):
        n = self.store.iterate(limit=limit)
        if limit is None:
            assert n == self.durable, "iterate did not file exactly the durable records"
        assert n <= self.durable
        self._filed(self.log[:n])
        del self.log[:n]
        self.durable -= n

    # ------------------------------------------------------------------ rules: cancel

    @rule(data=st.data())
    def cancel(self, data):
        known = sorted(self.recs)
        pending = self._ids(PENDING)
        soon = [k for k in pending if self.now < self.recs[k].due_ms <= self.now + 1_000]  # maybe in the wheel
        choices = [st.sampled_from(ids) for ids in (soon, pending) if ids]
        choices.append(st.sampled_from(known + ["never-sent"]) if known else st.just("never-sent"))
        mid = data.draw(st.one_of(*choices), label="id")
        r = self.recs.get(mid)
        if r is None:
            with pytest.raises(NotFound):
                self.store.cancel(mid, now_ms=self.now)
            return
        if r.state in (IN_FLIGHT, DISPATCHED):
            event(f"cancel of a message {r.state}")
            with pytest.raises(TooLate):
                self.store.cancel(mid, now_ms=self.now)
            return
        if r.state == CANCELLED:  # answered as the first time, or TooLate once retention took its record
            try:
                assert self.store.cancel(mid, now_ms=self.now) == r.seq
            except TooLate:
                assert self.retention_ran
            return
        got = self.store.cancel(mid, now_ms=self.now)
        assert got == r.seq
        event(f"cancel of a pending message, {'filed' if r.filed else 'not filed'}"
              f"{', due within 1 s' if r.due_ms <= self.now + 1_000 else ''}")
        r.state = CANCELLED
        self.log.append(("tomb", mid))

    # ------------------------------------------------------------------ rules: time and dispatch

    @rule(step=st.sampled_from(STEPS_MS), data=st.data())
    def advance(self, step, data):
        self.now += step
        self._drain(data)

    @precondition(lambda self: any(r.state == PENDING and r.filed and r.due_ms > self.now for r in self.recs.values()))
    @rule(data=st.data(), early_ms=st.sampled_from([0, 1, 30]))
    def advance_to_next_due(self, data, early_ms):
        """To the next due time or just before it: the edge where nothing may fire early, and
        where a message is in the wheel, not fired, for a cancel to take out."""
        nxt = min(r.due_ms for r in self.recs.values() if r.state == PENDING and r.filed and r.due_ms > self.now)
        self.now = max(self.now, nxt - early_ms)
        self._drain(data)

    @precondition(lambda self: self.units)
    @rule(data=st.data(), how=st.sampled_from(["ack", "release", "partial"]))
    def settle_inflight(self, data, how):
        unit = data.draw(st.sampled_from(sorted(self.units)), label="unit")
        ids = self.units[unit]
        live = [i for i, m in enumerate(ids) if m is not None]
        if how == "ack":
            self._ack(unit, live)
        elif how == "release":
            self._release(unit, live)
            self._drain(data)  # released messages are due: they fire again
        else:
            some = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True), label="some")
            self._ack(unit, some)

    # ------------------------------------------------------------------ rules: durability

    @rule()
    def checkpoint(self):
        self.store.checkpoint()

    @rule(checkpoint_first=st.booleans())
    def retention(self, checkpoint_first):
        if any(kind == "tomb" for kind, _ in self.log):
            event("retention with a tombstone not filed")
        if checkpoint_first:
            self.store.checkpoint()
        work, _report = DR.plan(self.store, now_ms=self.now, dedupe_window_ms=SET.dedupe_window_ms,
                                id_compact_ratio_min=SET.id_compact_ratio_min)
        work.run()
        DR.finish(self.store, work, same_store=True)
        self.retention_ran = True

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self.store = DelayStore.open(self.dir, SET, now_ms=self.now)
        self._reopened()

    @rule()
    def crash_and_reopen(self):
        # no close(): nothing is flushed, filed or checkpointed; the dropped store's descriptors
        # are given back by its finalizers, which write nothing
        event(f"crash with {len(self.log)} records not filed, {len(self.units)} units in flight")
        if any(kind == "tomb" for kind, _ in self.log):
            event("crash with a tombstone not filed")
        self.store = DelayStore.open(self.dir, SET, now_ms=self.now)
        self._reopened()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def lookups_match(self):
        for mid, r in self.recs.items():
            try:
                got = self.store.lookup(mid)
            except NotFound:
                assert self.retention_ran and r.state in (DISPATCHED, CANCELLED), (mid, r.state)
                event("lookup: record expired (retention)")
                continue
            assert got.status == r.state, (mid, got.status, r)
            if r.state != CANCELLED:
                assert got.seq == r.seq
        with pytest.raises(NotFound):
            self.store.lookup("never-sent")

    @invariant()
    def counts_match(self):
        assert self.store.inflight == sum(r.state == IN_FLIGHT for r in self.recs.values())
        pending = sum(r.filed and (r.state in (PENDING, IN_FLIGHT) or (r.state == CANCELLED and not r.tomb_filed))
                      for r in self.recs.values())
        assert sum(self.store.pending_by_bucket().values()) == pending, self.store.pending_by_bucket()

    def teardown(self):
        try:
            for unit in sorted(self.units):
                self._ack(unit, [i for i, m in enumerate(self.units[unit]) if m is not None])
            self.flush()
            self.iterate(None)
            end = max([self.now, *(r.due_ms for r in self.recs.values())]) + 1_000
            while self.now < end:
                self.now = min(end, self.now + 5_000)
                self._drain(ack_all=True)
            for mid, r in self.recs.items():
                assert r.state in (DISPATCHED, CANCELLED), (mid, r)
                assert r.fired >= (r.state == DISPATCHED)
            self.store.close()
            self.store = DelayStore.open(self.dir, SET, now_ms=self.now + 1_000)
            self.now += 1_000
            self._drain(ack_all=True)  # fails on any message firing again
        finally:
            try:
                self.store.close()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """The crash here is a process kill: every write is in the page cache, so fsync changes
    nothing this file can see; on a shared disk it was four fifths of the machine's time."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


TestDelayStoreModel = DelayStoreModel.TestCase
TestDelayStoreModel.settings = settings(max_examples=MACHINE_EXAMPLES, stateful_step_count=MACHINE_STEPS,
                                        deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- what the machine found
# Each is the machine's failing case shrunk by hand to a few calls.


def fire(store, now):
    """poll_due and acknowledge everything: the ids fired."""
    ids = []
    for d in store.poll_due(now_ms=now):
        ids += d.batch.id_list()
        store.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
    return ids


def sent(store, now, *msgs):
    store.accept(list(msgs), now_ms=now)
    store.flush_messages()
    store.iterate(limit=None)


def test_pending_counts_after_a_crash_replays_a_tombstone(tmp_path):
    store = DelayStore.open(tmp_path, SET, now_ms=T0)
    sent(store, T0, message("m1", T0 + 100, b"a"), message("m2", T0 + 5_000, b"b"))
    store.cancel("m1", now_ms=T0)
    store.flush_messages()  # the tombstone is durable, not filed yet (filing lags)
    assert fire(store, T0 + 1_000) == []  # completed_ms passes m1: it left the wheel at the cancel
    store.checkpoint()
    assert sum(store.pending_by_bucket().values()) == 2  # m2, and m1 until its tombstone is filed
    crashed = DelayStore.open(tmp_path, SET, now_ms=T0 + 1_000)  # no close: a kill
    assert crashed.lookup("m2").status == "pending"
    assert sum(crashed.pending_by_bucket().values()) == 1  # was 0: m2 was not counted (KNOWN BUG A)


def test_a_tombstone_filed_after_retention_deleted_its_bucket(tmp_path):
    store = DelayStore.open(tmp_path, SET, now_ms=T0)
    for i in range(3):  # one frame each: m2 lies past the first frame of its bucket
        sent(store, T0, message(f"m{i}", T0 + 100 + i, b"a"))
    sent(store, T0, message("m9", T0 + 9_000, b"z"))
    store.cancel("m9", now_ms=T0)
    store.flush_messages()  # durable, not filed yet
    now = T0
    while now < T0 + 12_000:  # past the end of bucket T0
        now += 500
        fire(store, now)
    store.checkpoint()
    work, _ = DR.plan(store, now_ms=now, dedupe_window_ms=SET.dedupe_window_ms,
                      id_compact_ratio_min=SET.id_compact_ratio_min)
    work.run()
    DR.finish(store, work, same_store=True)
    with pytest.raises(NotFound, match="expired"):
        store.lookup("m2")
    store.iterate(limit=None)  # the tombstone goes into bucket T0 again
    res = store.accept([message("m2", T0 + 102, b"a")], now_ms=now)  # raised OffsetOutOfRange (KNOWN BUG B)
    assert res.codes[0] == 0 and res.duplicates[0] == 1
    with pytest.raises(NotFound, match="expired"):
        store.lookup("m2")


def test_a_message_filed_behind_the_cursor_is_not_dispatched_before_it_fires(tmp_path):
    store = DelayStore.open(tmp_path, SET, now_ms=T0)
    sent(store, T0, message("m1", T0 + 50, b"a"))
    (unit,) = store.poll_due(now_ms=T0 + 100)  # m1 in flight
    sent(store, T0 + 100, message("m2", T0 - 1_000, b"b"))  # due in the past: overdue in the wheel
    assert store.lookup("m2").status == "pending"
    store.ack_dispatched(unit.unit, np.arange(unit.batch.n), now_ms=T0 + 100)
    assert store.lookup("m2").status == "pending"  # was 'dispatched' (KNOWN BUG C)
    assert store.cancel("m2", now_ms=T0 + 100) > 0  # raised TooLate
    assert fire(store, T0 + 110) == []


def test_a_released_message_is_not_dispatched_before_it_fires_again(tmp_path):
    store = DelayStore.open(tmp_path, SET, now_ms=T0)
    sent(store, T0, message("m1", T0 + 50, b"a"))
    (unit,) = store.poll_due(now_ms=T0 + 100)
    store.release(unit.unit, np.arange(unit.batch.n))  # back in the wheel, overdue
    assert store.lookup("m1").status == "pending"
    assert store.cancel("m1", now_ms=T0 + 100) > 0
    assert fire(store, T0 + 110) == []


def test_an_index_repeated_in_one_ack_records_its_message_once(tmp_path):
    store = DelayStore.open(tmp_path, SET, now_ms=T0)
    sent(store, T0, message("m1", T0 + 50, b"a"), message("m2", T0 + 50, b"b"))
    (unit,) = store.poll_due(now_ms=T0 + 100)
    assert store.inflight == 2
    assert store.ack_dispatched(unit.unit, np.array([0, 0]), now_ms=T0 + 100) == 1
    assert store.inflight == 1
    store.release(unit.unit, np.array([1, 1]))
    assert store.inflight == 0
    assert store.counters["dispatched"] == 1
    assert fire(store, T0 + 110) == [unit.batch.id(1)]  # the released one, once
    assert store.inflight == 0


def test_a_slave_does_not_file_a_tombstone_into_a_bucket_its_retention_deleted(tmp_path):
    """KNOWN BUG B on a slave: it files up to the master's checkpoint and retains on the master's
    completed_ms, so its retention can delete the bucket of a tombstone it has not filed yet."""
    def replicate(master, slave):
        for name in ("messages", "dispatch"):
            a, b = getattr(master, name), getattr(slave, name)
            while b.end_offset < a.end_offset:
                b.append_raw(b.end_offset, a.read_bytes(b.end_offset, 8192))
            b.flush()
        slave.appended()
        slave.follow(master.replication_doc())
        slave.iterate(limit=None)

    master = DelayStore.open(tmp_path / "m", SET, now_ms=T0)
    slave = DelayStore.open(tmp_path / "s", SET, now_ms=T0, follower=True)
    slave.follow()
    for i in range(3):
        sent(master, T0, message(f"m{i}", T0 + 100 + i, b"a"))
    sent(master, T0, message("m9", T0 + 9_000, b"z"))
    master.checkpoint()
    replicate(master, slave)  # the slave filed the four messages
    master.cancel("m9", now_ms=T0)
    master.flush_messages()  # durable, not filed on the master: its checkpoint stops before it
    now = T0
    while now < T0 + 12_000:
        now += 500
        fire(master, now)
    master.checkpoint()
    replicate(master, slave)  # the slave holds the tombstone, not filed
    slave.checkpoint()
    work, _ = DR.plan(slave, now_ms=now, dedupe_window_ms=SET.dedupe_window_ms,
                      id_compact_ratio_min=SET.id_compact_ratio_min)
    work.run()
    DR.finish(slave, work, same_store=True)
    assert not slave.schedule.exists(T0)
    master.iterate(limit=None)
    master.checkpoint()
    replicate(master, slave)  # now the slave files the tombstone
    assert not slave.schedule.exists(T0)
    for mid in ("m2", "m9"):
        with pytest.raises(NotFound, match="expired"):
            slave.lookup(mid)
    slave.promote(now + 1_000)
    res = slave.accept([message("m2", T0 + 102, b"a")], now_ms=now + 1_000)
    assert res.codes[0] == 0 and res.duplicates[0] == 1
    assert fire(slave, now + 2_000) == []
