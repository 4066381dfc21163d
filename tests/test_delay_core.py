"""The delay store's pure core and its seams (node/delay/core.py, ingest.py, recovery.py,
heal.py's ``HealedStore``): decisions without files, time as an argument, invariants asserted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.codec import Batch
from cluster.errors import CorruptRecord, Overloaded
from node.delay import ingest
from node.delay.core import DelayCore
from node.delay.heal import REBUILD_WINDOW_MS, REBUILDS_PER_BUCKET_MAX, HealedStore
from node.delay.inflight import InFlight
from node.delay.ingest import Retired, Unfiled
from node.delay.store import DelayStore, StoreSettings
from node.store import records
from node.store.records import SEQ_COUNTER_MAX, Limits, Message
from node.store.schedule import FrameRef
from node.wheel import Chunk

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000
SMALL = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14, schedule_segment_bytes=1 << 16,
                      id_slots=256, id_entries_max=4096, limits=Limits(payload_bytes_max=1024))


def msg(i, due, msg_id=None, payload=b"x"):
    return Message(seq=0, store_ms=0, deliver_at_ms=due, msg_id=f"m{i}" if msg_id is None else msg_id,
                   subject="orders", payload=payload)


def core_at(now_ms=T0) -> DelayCore:
    core = DelayCore(SMALL, epoch=3, follower=False)
    core.restore_tick({}, dispatch_offset=0, now_ms=now_ms)
    return core


def hold(core: DelayCore, due: list[int], first_seq: int = 1) -> Batch:
    """Messages due at ``due`` handed to the core's wheel as filed (seconds loaded first)."""
    b = records.batch_from_messages([msg(first_seq + i, d) for i, d in enumerate(due)])
    b = b.replace(seq=np.arange(first_seq, first_seq + b.n, dtype=np.uint64), effective_ms=b.deliver_at_ms)
    for s in core.wheel.seconds_to_load():
        core.wheel.load_second(s, [])
    assert core.offer(core.chunk(FrameRef(-1, -1, 0, b), reload=False))
    return b


DELAY = Path(__file__).resolve().parent.parent / "node" / "delay"


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_the_core_and_the_ingest_rules_touch_no_file_thread_or_clock():
    for name in ("core.py", "inflight.py", "ingest.py", "voided.py"):
        got = imported(DELAY / name)
        assert not got & {"time", "os", "uuid", "pathlib", "random", "threading", "asyncio", "datetime"}, name
        assert not re.search(r"\bopen\(|\.append\(\[|write_atomic|flush\(", (DELAY / name).read_text()), name


def test_the_healer_reads_no_clock_and_no_private_attribute_of_its_store():
    text = (DELAY / "heal.py").read_text()
    assert not re.search(r"time\.(monotonic|time)\(|loop\.time", text)
    assert not re.search(r"\b(s|store|self\.store)\._[a-z]", text)


# ---------------------------------------------------------------------- DelayCore


def test_seqs_are_contiguous_in_the_epoch_and_the_space_is_bounded():
    core = core_at()
    a, b = core.next_seqs(3), core.next_seqs(2)
    assert (np.concatenate([a, b]) == np.arange(a[0], a[0] + 5, dtype=np.uint64)).all()
    assert int(a[0]) >> records.SEQ_EPOCH_SHIFT == 3
    core.counter = SEQ_COUNTER_MAX
    with pytest.raises(Overloaded):
        core.next_seqs(2)


def test_fire_ack_release_settle_once_and_completed_ms_follows_in_flight():
    core = core_at()
    hold(core, [T0 + 100, T0 + 200, T0 + 300])
    (due,) = core.fire(T0 + 250)
    assert due.batch.id_list() == ["m1", "m2"] and core.inflight == 2
    core.advance_completed()
    assert core.completed_ms == T0 + 100  # held behind the earliest in flight
    live, rec = core.dispatch_record(due.unit, [0], now_ms=T0 + 260, outcome=0)
    assert rec.seq.tolist() == [1]
    assert core.acked(due.unit, live, rec, offset=0, dead_letter=False) == 1
    assert core.dispatch_record(due.unit, [0], now_ms=T0 + 260, outcome=0) is None  # settled already
    assert core.status(1, T0 + 100) == "dispatched" and core.status(2, T0 + 200) == "in_flight"
    assert core.release(due.unit, [1]) is True and core.inflight == 0
    assert core.release(due.unit, [1]) is None
    assert core.status(3, T0 + 300) == "pending"
    core.check_invariants()
    assert [d.batch.id_list() for d in core.fire(T0 + 400)] == [["m2", "m3"]]  # m2 again, overdue


def test_in_flight_units_settle_each_message_once():
    b = records.batch_from_messages([msg(i, T0 + 100 * i) for i in range(3)])
    b = b.replace(seq=np.arange(1, 4, dtype=np.uint64), effective_ms=b.deliver_at_ms)
    flight = InFlight()
    due = flight.add(b)
    assert (due.unit, flight.count, flight.low_ms()) == (1, 3, T0)
    assert flight.settle(due.unit, [0, 0, 2]).id_list() == ["m0", "m2"] and flight.count == 1
    assert flight.settle(due.unit, [0]) is None and flight.live(due.unit, [2]) is None
    assert flight.contains(2) and not flight.contains(1) and flight.seqs().tolist() == [2]
    assert flight.low_ms() == T0 + 100
    flight.check()
    assert flight.settle(due.unit, [1]).id_list() == ["m1"] and flight.batch(due.unit) is None
    assert (flight.count, flight.seqs(), flight.low_ms()) == (0, None, None)
    assert flight.add(b).unit == 2  # unit ids never repeat


def test_completed_ms_never_goes_back_past_a_checkpoint():
    core = core_at()
    for now in range(T0, T0 + 5_001, 500):  # the wheel moves over loaded seconds only
        for s in core.wheel.seconds_to_load():
            core.wheel.load_second(s, [])
        core.wheel.advance(now)
    core.advance_completed()
    doc, persisted = core.checkpoint_doc(iterate_offset=0, dispatch_end_offset=0, log_end=0)
    persisted()
    assert core.persisted_completed_ms == doc["completed_ms"] == T0 + 5_000
    core.behind(T0 + 5_000 + 7)  # filed behind the cursor, at or after the checkpoint: fine
    with pytest.raises(AssertionError):
        core.behind(T0 + 4_000)  # before the durable checkpoint: a broken invariant crashes


def test_voided_ranges_cut_and_come_back():
    core = core_at()
    seqs = np.array([10, 11, 12], np.uint64)
    core.void(seqs)
    assert core.voided_mask(np.array([9, 10, 12, 13], np.uint64)).tolist() == [False, True, True, False]
    assert core.unvoid(np.array([11], np.uint64))
    assert core.voided == [(10, 11), (12, 13)] and core.refile_seq_max == 12
    assert not core.unvoid(np.array([20], np.uint64))


def test_pending_counts_per_bucket_stay_positive():
    core = core_at()
    core.pending_add(np.array([T0, T0 + SMALL.bucket_ms], np.int64), 1)
    core.pending_add(np.array([T0], np.int64), -1)
    assert core.pending == {T0 + SMALL.bucket_ms - (T0 + SMALL.bucket_ms) % SMALL.bucket_ms: 1}
    core.check_invariants()


# ---------------------------------------------------------------------- ingest rules, no files


def test_admit_decides_duplicates_and_names_ids_without_a_clock_or_uuid():
    unfiled, counters = Unfiled(), {"accepted": 0, "duplicates": 0}
    prior = msg(1, T0 + 1_000)
    known = {"m1": (Message(seq=7, store_ms=T0, deliver_at_ms=T0 + 1_000, msg_id="m1", subject="orders",
                            payload=b"x"), T0 + 1_000),
             "old": (Retired(5), None)}
    names = iter(["made-0", "made-1"])
    batch = records.batch_from_messages([prior, msg(2, T0 + 5, payload=b"y"), msg(3, T0 + 5, "old"),
                                         msg(4, T0 + 9, ""), msg(5, T0 + 9, "m2")])
    got = ingest.admit(batch, now_ms=T0, settings=SMALL, unfiled=unfiled,
                       probe=lambda h, ids: np.array([i in (b"m1", b"old") for i in ids]),
                       find=lambda i: known.get(i), next_seqs=lambda k: np.arange(100, 100 + k, dtype=np.uint64),
                       new_id=lambda: next(names), counters=counters)
    res = got.result
    assert res.seqs.tolist()[:3] == [7, 100, 5] and res.duplicates.tolist()[:3] == [1, 0, 1]
    assert res.codes[4] == ingest.ALREADY_EXISTS  # m2 twice in one batch: the first stands
    (frame, hashes), = got.frames
    assert frame.id_list() == ["m2", "made-0"] and len(hashes) == 2 and counters == {"accepted": 2, "duplicates": 2}


# ---------------------------------------------------------------------- the store's seams


def test_store_invariants_hold_through_accept_fire_cancel_and_crash(tmp_path):
    s = DelayStore.open(tmp_path, SMALL, now_ms=T0)
    assert s.recovery.checkpoint_found is False and s.recovery.records_refiled == 0
    s.accept([msg(i, T0 + 100 * i) for i in range(1, 40)], now_ms=T0)
    s.flush_messages()
    s.iterate(limit=None)
    s.check_invariants()
    s.cancel("m30", now_ms=T0)
    for now in range(T0, T0 + 2_000, 50):
        for d in s.poll_due(now_ms=now):
            s.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        s.check_invariants()
    s.checkpoint()
    s.accept([msg(i, T0 + 100 * i) for i in range(40, 50)], now_ms=T0 + 2_000)
    s.flush_messages()  # appended and durable, not filed: the reopen refiles them
    s = DelayStore.open(tmp_path, SMALL, now_ms=T0 + 2_000)
    rep = s.recovery
    assert rep.checkpoint_found and rep.records_refiled >= 10 and rep.iterate_offset_was is None
    assert rep.dispatch_records_replayed > 0  # the checkpoint's dispatch offset lags one checkpoint
    s.check_invariants()
    assert sum(s.pending_by_bucket().values()) == 49 - 19 - 1
    fired = []
    for now in range(T0 + 2_000, T0 + 6_000, 50):
        for d in s.poll_due(now_ms=now):
            fired += d.batch.id_list()
            s.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        s.check_invariants()
    assert fired == [f"m{i}" for i in range(20, 50) if i != 30]  # nothing twice, the cancelled one never


def test_recovery_reports_a_torn_message_log_tail(tmp_path):
    s = DelayStore.open(tmp_path, SMALL, now_ms=T0)
    s.accept([msg(i, T0 + 10_000) for i in range(5)], now_ms=T0)
    s.close()
    seg = sorted((tmp_path / "messages").glob("*.log"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\x07" * 9)  # a write a crash cut short
    s = DelayStore.open(tmp_path, SMALL, now_ms=T0)
    assert s.recovery.messages_bytes_dropped == 9
    assert s.lookup("m4").status == "pending"


def test_the_healer_needs_only_its_interface_and_takes_time_as_an_argument(tmp_path):
    s = DelayStore.open(tmp_path, SMALL, now_ms=T0)
    for name in [n for n in dir(HealedStore) if not n.startswith("_")] + list(HealedStore.__annotations__):
        assert hasattr(s, name), name
    s.accept([msg(i, T0 + 60_000) for i in range(5)], now_ms=T0)
    s.flush_messages()
    s.iterate(limit=None)
    s.checkpoint()
    start = s.schedule.bucket_start(T0 + 60_000)
    why = CorruptRecord("test", 0, "a check failed")
    for _ in range(REBUILDS_PER_BUCKET_MAX):
        s.healer.rebuild(start, why, now_ms=T0)
    with pytest.raises(CorruptRecord):
        s.healer.rebuild(start, why, now_ms=T0 + REBUILD_WINDOW_MS - 1)  # keeps failing: raised
    s.healer.rebuild(start, why, now_ms=T0 + REBUILD_WINDOW_MS)  # the window passed
    assert s.lookup("m3").status == "pending"
    s.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "popleft", "cut"]),
                          st.lists(st.integers(0, 12), max_size=6)), max_size=25),
       st.lists(st.integers(0, 14), max_size=10))
def test_unfiled_holds_what_an_isin_over_its_frames_finds(steps, probe):
    """``Unfiled.holds`` (a send's check of the ids waiting to be filed) answers as ``np.isin``
    over every waiting frame's hashes, through appends, filings and cuts, with an id hash in
    several frames (a cancel and its target) and twice in one."""
    unfiled, offset = Unfiled(), 0
    for op, hs in steps:
        if op == "append":
            b = Batch.build(["s"] * len(hs), [b""] * len(hs), [f"i{h}" for h in hs], [0] * len(hs))
            unfiled.append(offset, offset + 10, b, np.array(hs, np.uint64))
            offset += 10
        elif op == "popleft" and unfiled:
            unfiled.popleft()
        elif op == "cut" and unfiled:
            unfiled.cut(unfiled.frames[len(unfiled.frames) // 2].offset)
        q = np.array(probe, np.uint64)
        want = np.isin(q, np.concatenate([u.hashes for u in unfiled.frames])) if unfiled else np.zeros(len(q), bool)
        assert unfiled.holds(q).tolist() == want.tolist()
        for h in probe:  # the newest waiting record of a hash, as a scan of every frame finds it
            scan = next(((int(u.batch.seq[int(np.flatnonzero(u.hashes == np.uint64(h))[-1])]), u.offset)
                         for u in reversed(unfiled.frames) if (u.hashes == np.uint64(h)).any()), None)
            assert unfiled.lookup(h) == scan
