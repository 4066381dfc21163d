"""Timing wheel: examples, the TickState codec, and a stateful test against heapq."""

from __future__ import annotations

import doctest
import heapq
import struct
import zlib
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import node.wheel
from cluster.errors import CorruptRecord, Overloaded
from node.wheel import TICK_STATE_SIZE, Chunk, Fired, TickState, TimingWheel

TICK_MS = 10
WINDOW_MS = 2_000  # the examples below were worked with a 2 s window (the node's default is shorter)


def C(due, seq, ref: object = "f", idx=None) -> Chunk:
    """A chunk of frame ``ref``; idx defaults to 0..n-1."""
    due = np.asarray(due, np.int64)
    if idx is None:
        idx = np.arange(len(due))
    return Chunk(due, np.asarray(seq, np.uint64), np.asarray(idx, np.int32), ref)


def load_all(w: TimingWheel, disk: dict[int, list[Chunk]] | None = None) -> None:
    for s in w.seconds_to_load():
        w.load_second(s, (disk or {}).get(s, []))


def flat(fired: list[Fired]) -> list[tuple[int, int, object, int]]:
    """(due_ms, seq, ref, idx) of every fired entry, checking each Fired is consistent and in due order."""
    out = []
    for f in fired:
        assert len(f.idx) == len(f.seq) == len(f.due_ms) > 0
        assert f.due_ms.dtype == np.int64 and f.seq.dtype == np.uint64 and f.idx.dtype == np.int32
        assert np.all(np.diff(f.due_ms) >= 0)
        out += [(d, s, f.ref, i) for d, s, i in zip(f.due_ms.tolist(), f.seq.tolist(), f.idx.tolist())]
    return out


def seqs(fired: list[Fired]) -> list[int]:
    return [s for _, s, _, _ in sorted(flat(fired))]


def test_module_docstring_example_holds():
    assert doctest.testmod(node.wheel).failed == 0


# --- examples -------------------------------------------------------------------------


def test_advance_returns_due_entries_in_order_once():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=10_000)
    load_all(w)
    assert (w.cursor_ms, w.loaded_until_ms) == (10_000, 12_000)
    assert w.add(C([10_500, 10_020, 10_500, 11_999, 10_021], [3, 9, 1, 4, 2], "a")) == 5
    assert len(w) == 5
    assert w.advance(10_019) == []
    assert flat(w.advance(10_020)) == [(10_020, 9, "a", 1)]  # due == now is due
    got = w.advance(10_500)
    assert len(got) == 1 and got[0].ref == "a"
    assert got[0].due_ms.tolist() == [10_021, 10_500, 10_500]
    assert got[0].seq.tolist() == [2, 3, 1]  # same ms: input order
    assert got[0].idx.tolist() == [4, 0, 2]
    assert w.advance(10_500) == []
    assert w.cursor_ms == 10_501
    assert seqs(w.advance(20_000)) == [4]
    assert len(w) == 0 and w.next_due_ms() is None


def test_a_merged_second_fires_one_fired_per_ref_with_the_frame_positions():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    w.load_second(0, [C([300, 100, 200], [1, 2, 3], "x", idx=[7, 8, 9]), C([150, 100], [4, 5], "y", idx=[0, 1])])
    w.load_second(1, [C([1_100], [6], "z")])
    got = w.advance(250)
    assert sorted((f.ref, f.idx.tolist(), f.seq.tolist(), f.due_ms.tolist()) for f in got) == [
        ("x", [8, 9], [2, 3], [100, 200]),
        ("y", [1, 0], [5, 4], [100, 150]),
    ]
    assert flat(w.advance(2_000)) == [(300, 1, "x", 7), (1_100, 6, "z", 0)]


def test_overdue_entries_fire_on_next_advance():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=5_000)
    load_all(w)
    w.advance(5_700)
    assert w.add(C([5_700], [1]))  # due exactly at the last now: also behind the cursor
    assert w.add(C([100], [2]))  # long overdue, added later, fires first
    assert w.add(C([5_701], [3]))
    assert w.next_due_ms() == 100
    # even a now that went backwards must not hold back what is already overdue
    assert seqs(w.advance(5_000)) == [2, 1]
    assert w.cursor_ms == 5_701
    assert seqs(w.advance(5_701)) == [3]


def test_loaded_second_behind_the_cursor_is_overdue_and_fires_at_once():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=3_750)  # cursor 3750, loaded_until 3000
    assert w.load_second(3, [C([3_100, 3_900, 3_749], [1, 2, 3])]) == 3
    assert seqs(w.advance(3_000)) == [1, 3]  # now behind the cursor: only the overdue ones
    assert w.cursor_ms == 3_750
    assert seqs(w.advance(3_900)) == [2]


def test_add_beyond_loaded_window_returns_0_and_load_brings_it():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    assert w.loaded_until_ms == 2_000
    late = C([2_000], [1])
    assert w.add(late) == 0
    assert len(w) == 0 and w.next_due_ms() is None
    assert w.seconds_to_load() == []  # window full until the cursor moves
    w.advance(500)
    assert w.seconds_to_load() == [2]
    assert w.load_second(2, [late]) == 1
    assert seqs(w.advance(2_000)) == [1]


def test_add_of_a_chunk_across_the_loaded_edge_holds_exactly_the_loaded_part():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    assert w.add(C([2_500, 1_999, 4_000, 10], [1, 2, 3, 4], "r")) == 2
    assert len(w) == 2
    w.advance(1_000)
    w.load_second(2, [C([2_500], [1], "r", idx=[0])])  # the shell brings the rest from disk
    assert flat(w.advance(2_999)) == [(1_999, 2, "r", 1), (2_500, 1, "r", 0)]


def test_entries_max_stops_loading_and_add_never_refuses():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0, entries_max=3)
    load_all(w)
    assert w.add(C([1_500, 1_600], [1, 2])) == 2
    # the shell adds what it already filed into a loaded second: refusing would strand it
    assert w.add(C([30, 40], [3, 4])) == 2
    assert len(w) == 4
    assert w.add(C([5_000, 6_000], [5, 6])) == 0  # not loaded: not held
    assert seqs(w.advance(1_000)) == [3, 4]
    assert w.add(C([1_700], [7])) == 1
    assert w.seconds_to_load() == []  # full (3 held): no loading although the window moved
    assert seqs(w.advance(1_500)) == [1]
    assert w.seconds_to_load() == [2, 3]
    with pytest.raises(Overloaded):
        w.load_second(2, [C([2_001, 2_002], [5, 6])])
    assert (w.loaded_until_ms, len(w)) == (2_000, 2)  # nothing changed
    assert w.load_second(2, [C([2_001], [5])]) == 1


def test_load_second_contract():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=3_500)
    assert w.seconds_to_load() == [3, 4, 5]
    assert w.seconds_to_load(limit=2) == [3, 4]
    assert w.seconds_to_load(limit=0) == []
    with pytest.raises(ValueError, match="next second"):
        w.load_second(4, [])
    with pytest.raises(ValueError, match="not in second"):
        w.load_second(3, [C([3_100], [1]), C([3_100, 4_000], [1, 2])])
    with pytest.raises(ValueError, match="not in second"):
        w.load_second(3, [C([2_999], [1])])
    with pytest.raises(ValueError, match="1-D of one length"):
        w.load_second(3, [Chunk(np.array([3_100]), np.array([1, 2], np.uint64), np.array([0], np.int32), "f")])
    assert (w.loaded_until_ms, len(w)) == (3_000, 0)  # failed loads changed nothing
    assert w.load_second(3, [C([3_100], [1]), C([], []), C([3_600], [2])]) == 2
    assert w.load_second(4, []) == 0
    assert w.load_second(5, [C([5_000], [3])]) == 1
    with pytest.raises(ValueError, match="window"):
        w.load_second(6, [])
    assert w.seconds_to_load() == []
    assert seqs(w.advance(3_600)) == [1, 2]  # 1 was overdue at load time


def test_seconds_to_load_follows_the_cursor():
    w = TimingWheel(start_ms=0, window_ms=2_500)
    assert w.seconds_to_load() == [0, 1, 2]
    load_all(w)
    w.advance(498)  # horizon 499 + 2500 = 2999: second 2 done, 3 not yet
    assert w.seconds_to_load() == []
    w.advance(500)
    assert w.seconds_to_load() == [3]
    assert TimingWheel(start_ms=0, window_ms=0).seconds_to_load() == []


def test_cancel_before_fire_and_after_fire():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    w.add(C([100, 200, 300, 400], [1, 2, 3, 4]))
    assert w.cancel([2, 3, 3]) == 2
    assert w.cancel(np.array([2, 3, 99], np.uint64)) == 0  # already cancelled, never held
    assert w.cancel([]) == 0
    assert len(w) == 2
    assert seqs(w.advance(1_000)) == [1, 4]
    assert w.cancel([1, 4]) == 0  # already fired


def test_cancel_then_readd_same_seq_fires_once_at_the_new_time():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    w.add(C([100], [1], "a"))
    assert w.cancel([1]) == 1
    w.add(C([100], [1], "b"))  # same (due, seq) as the cancelled entry
    w.add(C([50], [2]))
    w.cancel([2])
    w.add(C([70], [2]))  # the cancelled (50, 2) must not fire it early
    w.add(C([60], [6]))
    assert w.next_due_ms() == 60
    assert w.advance(55) == []
    assert [(d, s, r) for d, s, r, _ in sorted(flat(w.advance(500)))] == [(60, 6, "f"), (70, 2, "f"), (100, 1, "b")]
    assert len(w) == 0


def test_fired_then_given_back_fires_again_and_can_be_cancelled():
    # the shell's release(): a failed dispatch is added back (overdue) with the same seqs
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    w.add(C([10, 20], [1, 2]))
    assert seqs(w.advance(30)) == [1, 2]
    assert w.add(C([10, 20], [1, 2], "mem")) == 2
    assert w.cancel([2]) == 1
    assert flat(w.advance(30)) == [(10, 1, "mem", 0)]


def test_next_due_ms_skips_cancelled_entries():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    assert w.next_due_ms() is None
    load_all(w)
    w.add(C([500, 100, 300], [1, 2, 3]))
    w.add(C([200], [4]))
    assert w.next_due_ms() == 100
    w.cancel([2, 4])
    assert w.next_due_ms() == 300
    w.cancel([1, 3])
    assert w.next_due_ms() is None and len(w) == 0
    assert w.advance(1_000) == []


@pytest.mark.integration  # tier: ~10 s on a loaded machine
def test_many_chunks_cancels_and_readds_at_scale():
    # enough entries to index in several batches, merge index runs and rebuild the index
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0, entries_max=10**6)
    load_all(w)
    rng = np.random.default_rng(7)
    n = 3 * node.wheel.INDEX_PENDING_MAX
    due = rng.integers(0, 2_000, n)
    all_seq = np.arange(n, dtype=np.uint64)
    for a in range(0, n, 100):
        assert w.add(C(due[a : a + 100], all_seq[a : a + 100], a)) == len(due[a : a + 100])
    assert w.cancel(all_seq[::4]) == len(all_seq[::4])
    readd = all_seq[::8]
    w.add(C(due[::8], readd, "again"))
    assert w.cancel(all_seq[::4]) == len(readd)  # only the re-added ones are held again
    w.add(C(due[::8], readd, "third"))
    assert len(w) == n - len(all_seq[::4]) + len(readd)
    got = []
    for now in range(0, 2_001, 10):
        got += flat(w.advance(now))
        assert all(d <= now for d, *_ in got[-50:])
    keep = (np.arange(n) % 4 != 0) | (np.arange(n) % 8 == 0)
    assert sorted((d, s) for d, s, _, _ in got) == sorted(zip(due[keep].tolist(), all_seq[keep].tolist()))
    assert sorted(s for _, s, r, _ in got if r == "third") == readd.tolist()
    assert len(w) == 0
    # firing left every mapping stale; the next batches rebuild the index from what is held
    late = np.arange(n, n + 2 * node.wheel.INDEX_PENDING_MAX, dtype=np.uint64)
    assert w.add(C(np.full(len(late), 1_999), late, "late")) == len(late)
    assert w.cancel(late[:10]) == 10
    assert w._index.size <= 2 * len(late) + node.wheel._INDEX_STALE_MIN
    assert len(w) == len(late) - 10


def test_now_going_backwards_changes_nothing():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=1_000)
    load_all(w)
    w.add(C([1_200], [1]))
    assert w.advance(1_100) == []
    assert w.cursor_ms == 1_101
    assert w.advance(900) == [] and w.cursor_ms == 1_101
    assert w.advance(1_100) == [] and w.cursor_ms == 1_101
    assert seqs(w.advance(1_200)) == [1]


def test_catch_up_never_passes_loaded_until_and_fires_everything_once_in_order():
    # A restored cursor 20 s behind the wall clock, chunks all over those 20 s.
    disk: dict[int, list[Chunk]] = defaultdict(list)
    due = (np.arange(3_000) * 7_919) % 20_000
    for s in range(20):
        sel = np.flatnonzero(due // 1000 == s)
        for part in np.array_split(sel, 3):
            disk[s].append(C(due[part], part, ref=(s, len(disk[s])), idx=part))
    w = TimingWheel.restore(TickState(epoch=3, tick=-1, index_in_second=0, dispatch_offset=0), window_ms=WINDOW_MS)
    assert (w.cursor_ms, w.loaded_until_ms, w.epoch) == (0, 0, 3)
    now = 20_000
    assert w.advance(now) == []  # nothing loaded: the cursor may not move
    assert w.cursor_ms == 0
    fired = []
    rounds = 0
    while w.cursor_ms < now + 1:
        rounds += 1
        assert rounds < 100
        load_all(w, disk)
        got = flat(w.advance(now))
        assert all(d < w.cursor_ms <= w.loaded_until_ms for d, *_ in got)
        fired += sorted(got)
    assert [(d, s) for d, s, _, _ in fired] == sorted(zip(due.tolist(), range(3_000)))
    assert all(s == i for _, s, _, i in fired)
    assert rounds > 5  # it really went window by window


def test_state_never_claims_the_tick_of_a_held_overdue_entry():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=5_000)
    load_all(w)
    w.advance(6_000)
    w.add(C([5_432], [1]))  # behind the cursor, not returned yet
    assert w.state(completed_ms=6_001, dispatch_offset=0).tick == 542
    r = TimingWheel.restore(w.state(completed_ms=6_001, dispatch_offset=0), window_ms=WINDOW_MS)
    assert r.seconds_to_load()[0] == 5  # its second is read from disk again
    w.advance(6_000)
    assert w.state(completed_ms=6_001, dispatch_offset=0).tick == 599


def test_restore_puts_cursor_after_the_state_tick():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=0)
    load_all(w)
    w.add(C([15, 25], [1, 2]))
    w.advance(21)
    w.epoch = 7
    st_ = w.state(completed_ms=21, dispatch_offset=99)
    assert st_ == TickState(epoch=7, tick=1, index_in_second=1, dispatch_offset=99)
    r = TimingWheel.restore(TickState.decode(st_.encode()), window_ms=1_000, entries_max=5)
    assert (r.cursor_ms, r.loaded_until_ms, r.epoch, len(r)) == (20, 0, 7, 0)
    assert (r.window_ms, r.entries_max) == (1_000, 5)
    with pytest.raises(ValueError):
        w.state(completed_ms=23, dispatch_offset=0)  # beyond the cursor


def test_index_in_second_counts_dispatched_entries_of_the_second():
    w = TimingWheel(window_ms=WINDOW_MS, start_ms=1_000)
    load_all(w)
    w.add(C([990, 1_000, 1_005, 1_500, 1_990, 2_000], range(6)))
    w.advance(2_500)
    assert w.state(completed_ms=1_010, dispatch_offset=0).index_in_second == 2
    assert w.state(completed_ms=2_000, dispatch_offset=0).index_in_second == 4
    assert w.state(completed_ms=2_010, dispatch_offset=0).index_in_second == 1


def test_constructor_rejects_bad_settings():
    for kw in [dict(tick_ms=7), dict(tick_ms=0), dict(window_ms=-1), dict(entries_max=0), dict(start_ms=-1)]:
        with pytest.raises(ValueError):
            TimingWheel(**{"start_ms": 0, **kw})


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



class WheelVsHeap(RuleBasedStateMachine):
    """A fake clock, a fake disk (second -> seq -> entry) and a heapq model.

    The shell's contract is mirrored: every chunk is written to disk first (as
    the store files frames per second); ``add`` is tried, and the entries whose
    second is not loaded wait on disk for ``load_second``, which gets the
    second's entries grouped by ref. Fired and cancelled entries leave the disk;
    a fired entry may be given back (a failed dispatch). A restore rebuilds the
    wheel from an encoded TickState and reloads from disk. The seq index
    thresholds are drawn small so its batching, merging and rebuilds all run.
    """

    @initialize(start=st.integers(0, 5_000), pending_max=st.sampled_from([1, 3, 50, 65_536]),
                stale_min=st.sampled_from([0, 5, 65_536]))
    def start(self, start, pending_max, stale_min):
        self.saved = (node.wheel.INDEX_PENDING_MAX, node.wheel._INDEX_STALE_MIN)
        node.wheel.INDEX_PENDING_MAX, node.wheel._INDEX_STALE_MIN = pending_max, stale_min
        self.now = start
        self.wheel = TimingWheel(tick_ms=TICK_MS, window_ms=WINDOW_MS, start_ms=start)
        self.disk: dict[int, dict[int, tuple[int, int, object, int]]] = defaultdict(dict)
        self.heap: list[tuple[int, int]] = []  # model: everything pending, due or not
        self.pending: dict[int, tuple[int, int, object, int]] = {}  # seq -> (due, seq, ref, idx)
        self.cancelled: set[int] = set()
        self.fired: dict[int, int] = {}  # seq -> due_ms: fired and not given back
        self.m_cursor = start - start % TICK_MS
        self.m_loaded = start - start % 1000
        self.next_seq = 1
        self.next_ref = 0

    def teardown(self):
        if hasattr(self, "saved"):
            node.wheel.INDEX_PENDING_MAX, node.wheel._INDEX_STALE_MIN = self.saved

    def held_by_model(self, due: int) -> bool:
        return due < self.m_loaded

    def schedule(self, dues: list[int], seqs: list[int] | None = None) -> None:
        if seqs is None:
            seqs = list(range(self.next_seq, self.next_seq + len(dues)))
            self.next_seq += len(dues)
        ref = self.next_ref
        self.next_ref += 1
        idx = [3 * i + 1 for i in range(len(dues))]  # positions inside the frame, not 0..n-1
        for d, s, i in zip(dues, seqs, idx):
            e = (d, s, ref, i)
            self.disk[d // 1000][s] = e
            self.pending[s] = e
            heapq.heappush(self.heap, (d, s))
        got = self.wheel.add(C(dues, seqs, ref, idx))
        assert got == sum(self.held_by_model(d) for d in dues)

    @rule(offsets=st.lists(st.one_of(st.integers(-3_000, 3_000), st.integers(3_000, 8_000)), min_size=1, max_size=30),
          same_ms=st.booleans())
    def add(self, offsets, same_ms):
        dues = [max(0, self.now + o) for o in offsets]
        if same_ms and self.pending:  # pile several entries onto one ms
            dues[0] = next(iter(self.pending.values()))[0]
        self.schedule(dues)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), offset=st.integers(-3_000, 3_000))
    def reschedule(self, data, offset):
        # cancel, then schedule the same seq at another time (the cancelled entry stays in its run)
        d, s, _, _ = data.draw(st.sampled_from(sorted(self.pending.values(), key=lambda e: e[1])))
        assert self.wheel.cancel([s]) == self.held_by_model(d)
        del self.pending[s]
        del self.disk[d // 1000][s]
        self.schedule([max(0, d + offset)], seqs=[s])

    @precondition(lambda self: self.fired)
    @rule(data=st.data())
    def give_back(self, data):
        # a failed dispatch: fired entries come back, overdue, in one in-memory chunk
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.fired)), min_size=1, max_size=10, unique=True))
        self.schedule([self.fired.pop(s) for s in chosen], seqs=chosen)

    @rule(limit=st.one_of(st.none(), st.integers(0, 4)))
    def load(self, limit):
        seconds = self.wheel.seconds_to_load(limit)
        expect = []
        s = self.m_loaded // 1000
        while s * 1000 < self.m_cursor + WINDOW_MS and (limit is None or len(expect) < limit):
            expect.append(s)
            s += 1
        assert seconds == expect
        for s in seconds:
            by_ref: dict[object, list[tuple[int, int, object, int]]] = defaultdict(list)
            for e in self.disk.get(s, {}).values():
                by_ref[e[2]].append(e)
            chunks = [C([e[0] for e in es], [e[1] for e in es], ref, [e[3] for e in es]) for ref, es in by_ref.items()]
            assert self.wheel.load_second(s, chunks) == sum(len(es) for es in by_ref.values())
            self.m_loaded += 1000

    @precondition(lambda self: self.next_seq > 1)
    @rule(data=st.data())
    def cancel(self, data):
        chosen = data.draw(st.lists(st.integers(1, self.next_seq + 5), max_size=12))
        expect = 0
        for s in set(chosen):
            e = self.pending.pop(s, None)
            if e is None:
                continue
            expect += self.held_by_model(e[0])
            del self.disk[e[0] // 1000][s]  # the shell cancels on disk too
            self.cancelled.add(s)
        assert self.wheel.cancel(np.array(chosen, np.uint64)) == expect

    @rule(step=st.one_of(st.integers(0, 30), st.integers(0, 3_000), st.integers(-500, -1)))
    def advance(self, step):
        self.now = max(0, self.now + step)
        got = flat(self.wheel.advance(self.now))
        horizon = max(self.m_cursor, min(self.now + 1, self.m_loaded))
        want = []
        # The cursor may sit up to 999 ms past loaded_until (start, restore):
        # what is due there is still on disk, fired once its second is loaded.
        while self.heap and self.heap[0][0] < min(horizon, self.m_loaded):
            d, s = heapq.heappop(self.heap)
            if s in self.pending and self.pending[s][0] == d:
                want.append(self.pending.pop(s))
                del self.disk[d // 1000][s]
        self.m_cursor = horizon
        assert sorted(got) == sorted(want)
        assert len({e[1] for e in got}) == len(got)  # nothing twice
        for d, s, _, _ in got:
            assert s not in self.cancelled and s not in self.fired
            assert d < horizon and d < self.m_loaded  # never early, never past loaded_until
            self.fired[s] = d

    @rule(lag_ms=st.integers(0, 1_500), epoch=st.integers(0, 2**63 - 1))
    def restore(self, lag_ms, epoch):
        # The shell dispatched everything fired; completed_ms may trail the cursor.
        completed = max(0, self.wheel.cursor_ms - lag_ms)
        self.wheel.epoch = epoch
        state = TickState.decode(self.wheel.state(completed_ms=completed, dispatch_offset=5).encode())
        # held entries behind the cursor have not fired yet: the state must not claim their tick
        overdue = [e[0] for e in self.pending.values() if e[0] < min(self.m_cursor, self.m_loaded)]
        completed = min([completed, *overdue])
        assert state.tick == completed // TICK_MS - 1
        self.wheel = TimingWheel.restore(state, tick_ms=TICK_MS, window_ms=WINDOW_MS)
        assert self.wheel.epoch == epoch
        self.m_cursor = completed - completed % TICK_MS
        self.m_loaded = self.m_cursor - self.m_cursor % 1000
        self.fired.clear()  # dispatched: nothing to give back to the new wheel
        assert (self.wheel.cursor_ms, self.wheel.loaded_until_ms) == (self.m_cursor, self.m_loaded)

    @invariant()
    def positions_and_contents_match(self):
        w = self.wheel
        assert (w.cursor_ms, w.loaded_until_ms) == (self.m_cursor, self.m_loaded)
        assert w.loaded_until_ms % 1000 == 0
        held = [e[0] for e in self.pending.values() if self.held_by_model(e[0])]
        assert len(w) == len(held)
        assert w.next_due_ms() == (min(held) if held else None)


WheelVsHeap.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_wheel_against_heapq = WheelVsHeap.TestCase
test_wheel_against_heapq.pytestmark = [pytest.mark.integration]  # tier: the state machine alone takes over 20 s on a loaded machine
