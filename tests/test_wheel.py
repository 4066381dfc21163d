"""Timing wheel: examples, the TickState codec, and a stateful test against heapq."""

from __future__ import annotations

import doctest
import heapq
import struct
import zlib
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import node.wheel
from cluster.errors import CorruptRecord, Overloaded
from node.wheel import TICK_STATE_SIZE, TickState, TimingWheel, WheelEntry


def E(deliver_at_ms: int, seq: int, msg_id: str | None = None) -> WheelEntry:
    return WheelEntry(deliver_at_ms, seq, msg_id if msg_id is not None else f"m{seq}")


def load_all(w: TimingWheel, disk: dict[int, list[WheelEntry]] | None = None) -> None:
    for s in w.seconds_to_load():
        w.load_second(s, (disk or {}).get(s, []))


def ids(entries: list[WheelEntry]) -> list[str]:
    return [e.msg_id for e in entries]


def test_module_docstring_example_holds():
    assert doctest.testmod(node.wheel).failed == 0


# --- examples -------------------------------------------------------------------------


def test_advance_returns_due_entries_in_order_once():
    w = TimingWheel(start_ms=10_000)
    load_all(w)
    assert (w.cursor_ms, w.loaded_until_ms) == (10_000, 12_000)
    for e in [E(10_500, 3), E(10_020, 9), E(10_500, 1), E(11_999, 4), E(10_021, 2)]:
        assert w.add(e)
    assert len(w) == 5 and "m3" in w
    assert ids(w.advance(10_019)) == []
    assert ids(w.advance(10_020)) == ["m9"]  # deliver_at == now is due
    assert ids(w.advance(10_500)) == ["m2", "m1", "m3"]  # same ms: by seq
    assert ids(w.advance(10_500)) == []
    assert w.cursor_ms == 10_501
    assert ids(w.advance(20_000)) == ["m4"]
    assert len(w) == 0 and "m3" not in w


def test_overdue_entries_fire_on_next_advance():
    w = TimingWheel(start_ms=5_000)
    load_all(w)
    w.advance(5_700)
    assert w.add(E(5_700, 1))  # due exactly at the last now: also behind the cursor
    assert w.add(E(100, 2))  # long overdue, added later, fires first
    assert w.add(E(5_701, 3))
    # even a now that went backwards must not hold back what is already overdue
    assert ids(w.advance(5_000)) == ["m2", "m1"]
    assert w.cursor_ms == 5_701
    assert ids(w.advance(5_701)) == ["m3"]


def test_add_beyond_loaded_window_returns_false_and_load_brings_it():
    w = TimingWheel(start_ms=0)
    load_all(w)
    assert w.loaded_until_ms == 2_000
    late = E(2_000, 1)
    assert not w.add(late)
    assert len(w) == 0 and "m1" not in w
    assert w.seconds_to_load() == []  # window full until the cursor moves
    w.advance(500)
    assert w.seconds_to_load() == [2]
    assert w.load_second(2, [late]) == 1
    assert ids(w.advance(2_000)) == ["m1"]


def test_add_twice_same_seq_is_noop_and_entries_max_is_enforced():
    w = TimingWheel(start_ms=0, entries_max=2)
    load_all(w)
    assert w.add(E(10, 1)) and w.add(E(10, 1)) and w.add(E(20, 2))
    assert len(w) == 2
    with pytest.raises(Overloaded):
        w.add(E(30, 3))
    assert not w.add(E(5_000, 3))  # not loaded: not held, so no limit applies
    with pytest.raises(ValueError, match="msg_id"):
        w.add(E(30, 4, msg_id="m1"))
    assert len(w) == 2
    w2 = TimingWheel(start_ms=0, entries_max=2)
    with pytest.raises(Overloaded):
        w2.load_second(0, [E(1, 1), E(2, 2), E(3, 3)])
    assert w2.loaded_until_ms == 0 and len(w2) == 0  # nothing changed


def test_load_second_contract():
    w = TimingWheel(start_ms=3_500)
    assert w.seconds_to_load() == [3, 4, 5]
    assert w.seconds_to_load(limit=2) == [3, 4]
    with pytest.raises(ValueError, match="next second"):
        w.load_second(4, [])
    with pytest.raises(ValueError, match="not in second"):
        w.load_second(3, [E(3_100, 1), E(4_000, 2)])
    with pytest.raises(ValueError, match="not in second"):
        w.load_second(3, [E(2_999, 1)])
    assert (w.loaded_until_ms, len(w)) == (3_000, 0)  # failed loads changed nothing
    assert w.load_second(3, [E(3_100, 1), E(3_600, 2), E(3_100, 1)]) == 2
    assert w.load_second(4, []) == 0
    assert w.load_second(5, [E(5_000, 3)]) == 1
    with pytest.raises(ValueError, match="window"):
        w.load_second(6, [])
    assert w.seconds_to_load() == []
    assert ids(w.advance(3_600)) == ["m1", "m2"]  # m1 was overdue at load time


def test_cancel_before_fire_and_after_fire():
    w = TimingWheel(start_ms=0)
    load_all(w)
    for i in range(1, 5):
        w.add(E(100 * i, i))
    assert w.cancel("m2") and w.cancel_seq(3)
    assert not w.cancel("m2") and not w.cancel_seq(3) and not w.cancel("nope")
    assert "m2" not in w and len(w) == 2
    assert ids(w.advance(1_000)) == ["m1", "m4"]
    assert not w.cancel("m1") and not w.cancel_seq(4)  # already fired


def test_cancel_then_readd_same_seq_fires_once_at_the_new_time():
    w = TimingWheel(start_ms=0)
    load_all(w)
    w.add(E(100, 1, "a"))
    w.cancel("a")
    w.add(E(100, 1, "b"))  # same (deliver_at_ms, seq) in the slot as the dead item
    w.add(E(50, 2))
    w.cancel_seq(2)
    w.add(E(70, 2))  # the dead (50, 2) item must not fire it early
    w.add(E(60, 6))
    assert w.advance(55) == []
    assert [(e.deliver_at_ms, e.msg_id) for e in w.advance(500)] == [(60, "m6"), (70, "m2"), (100, "b")]
    w.add(E(200, 4))
    w.cancel_seq(4)
    w.add(E(300, 4))  # dead and live item of seq 4 both in the overdue list
    w.add(E(250, 7))
    assert [(e.deliver_at_ms, e.msg_id) for e in w.advance(500)] == [(250, "m7"), (300, "m4")]
    assert len(w) == 0


def test_many_cancels_compact_and_keep_the_rest():
    w = TimingWheel(start_ms=0)
    load_all(w)
    for i in range(20_000):
        w.add(E(i % 2_000, i))
    for i in range(0, 20_000, 4):
        w.cancel_seq(i)
    for i in range(0, 20_000, 4):  # re-add half of them
        if i % 8 == 0:
            w.add(E(i % 2_000, i))
    got = w.advance(1_999)
    want = sorted((i % 2_000, i) for i in range(20_000) if i % 4 or i % 8 == 0)
    assert [(e.deliver_at_ms, e.seq) for e in got] == want


def test_now_going_backwards_changes_nothing():
    w = TimingWheel(start_ms=1_000)
    load_all(w)
    w.add(E(1_200, 1))
    assert w.advance(1_100) == []
    assert w.cursor_ms == 1_101
    assert w.advance(900) == [] and w.cursor_ms == 1_101
    assert w.advance(1_100) == [] and w.cursor_ms == 1_101
    assert ids(w.advance(1_200)) == ["m1"]


def test_catch_up_never_passes_loaded_until_and_fires_everything_once_in_order():
    # A restored cursor 20 s behind the wall clock, entries all over those 20 s.
    disk: dict[int, list[WheelEntry]] = defaultdict(list)
    entries = [E((i * 7_919) % 20_000, i) for i in range(3_000)]
    for e in entries:
        disk[e.deliver_at_ms // 1000].append(e)
    w = TimingWheel.restore(TickState(epoch=3, tick=-1, index_in_second=0, dispatch_offset=0))
    assert (w.cursor_ms, w.loaded_until_ms, w.epoch) == (0, 0, 3)
    now = 20_000
    assert w.advance(now) == []  # nothing loaded: the cursor may not move
    assert w.cursor_ms == 0
    fired: list[WheelEntry] = []
    rounds = 0
    while w.cursor_ms < now + 1:
        rounds += 1
        assert rounds < 100
        load_all(w, disk)
        fired += w.advance(now)
        assert w.cursor_ms <= w.loaded_until_ms
    assert fired == sorted(entries, key=lambda e: (e.deliver_at_ms, e.seq))
    assert rounds > 5  # it really went window by window


def test_a_full_window_from_mid_second_never_collides_across_laps():
    w = TimingWheel(start_ms=1_010)
    load_all(w)
    assert (w.cursor_ms, w.loaded_until_ms) == (1_010, 4_000)  # 2990 ms ahead: 299 ticks
    dues = list(range(1_010, 4_000, 7)) + [3_999]
    for i, d in enumerate(dues):
        assert w.add(E(d, i))
    fired = []
    for now in range(1_010, 4_100, 10):
        got = w.advance(now)
        assert all(e.deliver_at_ms <= now for e in got)
        fired += got
    assert [e.deliver_at_ms for e in fired] == sorted(dues)


def test_state_never_claims_the_tick_of_a_held_overdue_entry():
    w = TimingWheel(start_ms=5_000)
    load_all(w)
    w.advance(6_000)
    w.add(E(5_432, 1))  # behind the cursor, not returned yet
    assert w.state(completed_ms=6_001, dispatch_offset=0).tick == 542
    r = TimingWheel.restore(w.state(completed_ms=6_001, dispatch_offset=0))
    assert r.seconds_to_load()[0] == 5  # its second is read from disk again
    w.advance(6_000)
    assert w.state(completed_ms=6_001, dispatch_offset=0).tick == 599


def test_restore_puts_cursor_after_the_state_tick():
    w = TimingWheel(start_ms=0)
    load_all(w)
    w.add(E(15, 1))
    w.add(E(25, 2))
    w.advance(21)
    w.epoch = 7
    st_ = w.state(completed_ms=21, dispatch_offset=99)
    assert st_ == TickState(epoch=7, tick=1, index_in_second=1, dispatch_offset=99)
    r = TimingWheel.restore(TickState.decode(st_.encode()))
    assert (r.cursor_ms, r.loaded_until_ms, r.epoch) == (20, 0, 7)
    with pytest.raises(ValueError):
        w.state(completed_ms=23, dispatch_offset=0)  # beyond the cursor


def test_index_in_second_counts_dispatched_entries_of_the_second():
    w = TimingWheel(start_ms=1_000)
    load_all(w)
    for i, d in enumerate([990, 1_000, 1_005, 1_500, 1_990, 2_000]):
        w.add(E(d, i))
    w.advance(2_500)
    assert w.state(completed_ms=1_010, dispatch_offset=0).index_in_second == 2
    assert w.state(completed_ms=2_000, dispatch_offset=0).index_in_second == 4
    assert w.state(completed_ms=2_010, dispatch_offset=0).index_in_second == 1


# --- TickState codec ------------------------------------------------------------------

states = st.builds(
    TickState,
    epoch=st.integers(-(2**63), 2**63 - 1),
    tick=st.integers(-1, 2**63 - 1),
    index_in_second=st.integers(0, 2**32 - 1),
    dispatch_offset=st.integers(0, 2**64 - 1),
)


def test_tick_state_layout():
    data = TickState(1, 2, 3, 4).encode()
    assert len(data) == TICK_STATE_SIZE == 37
    assert data[:5] == b"HGTS\x01"


@settings(max_examples=200, deadline=None)
@given(states)
def test_tick_state_round_trip(s):
    assert TickState.decode(s.encode()) == s


@settings(max_examples=20, deadline=None)
@given(states)
def test_tick_state_every_bit_flip_and_truncation_is_corrupt(s):
    data = s.encode()
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptRecord) as info:
            TickState.decode(bytes(flipped))
        assert info.value.path == "<tick-state>" and info.value.offset == 0
    for n in range(len(data)):
        with pytest.raises(CorruptRecord, match="length"):
            TickState.decode(data[:n])
    with pytest.raises(CorruptRecord, match="length"):
        TickState.decode(data + b"\x00")


def test_tick_state_bad_magic_and_version_with_valid_crc():
    for body, reason in [
        (struct.pack("<4sBqqIQ", b"XGTS", 1, 0, 0, 0, 0), "magic"),
        (struct.pack("<4sBqqIQ", b"HGTS", 2, 0, 0, 0, 0), "version"),
        (struct.pack("<4sBqqIQ", b"HGTS", 1, 0, -2, 0, 0), "tick"),
    ]:
        with pytest.raises(CorruptRecord, match=reason):
            TickState.decode(body + struct.pack("<I", zlib.crc32(body)))


def test_tick_state_encode_rejects_out_of_range_fields():
    with pytest.raises(ValueError):
        TickState(0, 0, 2**32, 0).encode()
    with pytest.raises(ValueError):
        TickState(0, -2, 0, 0).encode()


# --- stateful: the wheel against heapq --------------------------------------------------

TICK_MS = 10
WINDOW_MS = 2_000


class WheelVsHeap(RuleBasedStateMachine):
    """A fake clock, a fake disk (second -> pending entries) and a heapq model.

    The shell's contract is mirrored: every scheduled entry is written to disk;
    ``add`` is tried and, if the second is not loaded, the entry waits on disk
    for ``load_second``. Fired and cancelled entries leave the disk. A restore
    rebuilds the wheel from an encoded TickState and reloads from disk.
    """

    @initialize(start=st.integers(0, 5_000))
    def start(self, start):
        self.now = start
        self.wheel = TimingWheel(tick_ms=TICK_MS, window_ms=WINDOW_MS, start_ms=start)
        self.disk: dict[int, dict[int, WheelEntry]] = defaultdict(dict)
        self.heap: list[tuple[int, int]] = []  # model: everything pending, due or not
        self.pending: dict[int, WheelEntry] = {}
        self.cancelled: set[int] = set()
        self.fired: set[int] = set()
        self.m_cursor = start - start % TICK_MS
        self.m_loaded = start - start % 1000
        self.next_seq = 1

    # model helpers
    def held_by_model(self, e: WheelEntry) -> bool:
        return e.deliver_at_ms < self.m_loaded

    def schedule(self, deliver: int, seq: int | None = None) -> None:
        if seq is None:
            seq = self.next_seq
            self.next_seq += 1
        e = E(deliver, seq)
        self.disk[deliver // 1000][e.seq] = e
        self.pending[e.seq] = e
        heapq.heappush(self.heap, (e.deliver_at_ms, e.seq))
        assert self.wheel.add(e) == self.held_by_model(e)

    @rule(offset=st.one_of(st.integers(-3_000, 3_000), st.integers(3_000, 8_000)), same_ms=st.booleans())
    def add(self, offset, same_ms):
        deliver = max(0, self.now + offset)
        if same_ms and self.pending:  # pile several entries onto one ms
            deliver = next(iter(self.pending.values())).deliver_at_ms
        self.schedule(deliver)

    @rule(offsets=st.lists(st.integers(-3_000, 3_000), min_size=2, max_size=8))
    def add_batch(self, offsets):
        # many adds between two advances: overdue ones must still come out sorted
        for offset in offsets:
            self.schedule(max(0, self.now + offset))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), offset=st.integers(-3_000, 3_000))
    def reschedule(self, data, offset):
        # cancel, then schedule the same seq at another time (a dead item with the same seq stays behind)
        e = data.draw(st.sampled_from(sorted(self.pending.values(), key=lambda e: e.seq)))
        assert self.wheel.cancel_seq(e.seq) == self.held_by_model(e)
        del self.pending[e.seq]
        del self.disk[e.deliver_at_ms // 1000][e.seq]
        self.schedule(max(0, e.deliver_at_ms + offset), seq=e.seq)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def add_again(self, data):
        e = data.draw(st.sampled_from(sorted(self.pending.values(), key=lambda e: e.seq)))
        before = len(self.wheel)
        assert self.wheel.add(e) == self.held_by_model(e)
        assert len(self.wheel) == before

    @rule(limit=st.integers(1, 4))
    def load(self, limit):
        seconds = self.wheel.seconds_to_load(limit)
        expect = []
        s = self.m_loaded // 1000
        while s * 1000 < self.m_cursor + WINDOW_MS and len(expect) < limit:
            expect.append(s)
            s += 1
        assert seconds == expect
        for s in seconds:
            on_disk = list(self.disk.get(s, {}).values())
            assert self.wheel.load_second(s, on_disk) == len(on_disk)
            self.m_loaded += 1000

    @precondition(lambda self: self.next_seq > 1)
    @rule(data=st.data(), by_seq=st.booleans())
    def cancel(self, data, by_seq):
        seq = data.draw(st.integers(1, self.next_seq - 1))
        e = self.pending.get(seq)
        expect = e is not None and self.held_by_model(e)
        got = self.wheel.cancel_seq(seq) if by_seq else self.wheel.cancel(f"m{seq}")
        assert got == expect
        if e is not None:  # the shell cancels on disk too
            del self.pending[seq]
            del self.disk[e.deliver_at_ms // 1000][seq]
            self.cancelled.add(seq)

    @rule(step=st.one_of(st.integers(0, 30), st.integers(0, 3_000), st.integers(-500, -1)))
    def advance(self, step):
        self.now = max(0, self.now + step)
        got = self.wheel.advance(self.now)
        horizon = max(self.m_cursor, min(self.now + 1, self.m_loaded))
        want = []
        # The cursor may sit up to 999 ms past loaded_until (start, restore):
        # what is due there is still on disk, fired once its second is loaded.
        while self.heap and self.heap[0][0] < min(horizon, self.m_loaded):
            d, s = heapq.heappop(self.heap)
            if s in self.pending and self.pending[s].deliver_at_ms == d:
                want.append(self.pending.pop(s))
                del self.disk[d // 1000][s]
        self.m_cursor = horizon
        assert got == want
        for e in got:
            assert e.seq not in self.cancelled and e.seq not in self.fired
            self.fired.add(e.seq)

    @rule(lag_ms=st.integers(0, 1_500), epoch=st.integers(0, 2**63 - 1))
    def restore(self, lag_ms, epoch):
        # The shell dispatched everything fired; completed_ms may trail the cursor.
        completed = max(0, self.wheel.cursor_ms - lag_ms)
        self.wheel.epoch = epoch
        state = TickState.decode(self.wheel.state(completed_ms=completed, dispatch_offset=5).encode())
        # held entries behind the cursor have not fired yet: the state must not claim their tick
        overdue = [e.deliver_at_ms for e in self.pending.values() if e.deliver_at_ms < min(self.m_cursor, self.m_loaded)]
        completed = min([completed, *overdue])
        assert state.tick == completed // TICK_MS - 1
        self.wheel = TimingWheel.restore(state, tick_ms=TICK_MS, window_ms=WINDOW_MS)
        assert self.wheel.epoch == epoch
        self.m_cursor = completed - completed % TICK_MS
        self.m_loaded = self.m_cursor - self.m_cursor % 1000
        assert (self.wheel.cursor_ms, self.wheel.loaded_until_ms) == (self.m_cursor, self.m_loaded)

    @invariant()
    def positions_and_contents_match(self):
        w = self.wheel
        assert (w.cursor_ms, w.loaded_until_ms) == (self.m_cursor, self.m_loaded)
        assert w.loaded_until_ms % 1000 == 0
        held = [e for e in self.pending.values() if self.held_by_model(e)]
        assert len(w) == len(held)
        for e in held[:5]:
            assert e.msg_id in w
        for seq in list(self.cancelled)[:5]:
            assert f"m{seq}" not in w


WheelVsHeap.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_wheel_against_heapq = WheelVsHeap.TestCase
