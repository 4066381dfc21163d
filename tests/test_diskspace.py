"""The disk watermark's pure rules (``node/store/diskspace.py``) and the bounds of a write the
stores give it (``write_bytes_bound``), against real files.

* ``DiskWatermark``: the mark and the resume margin, both relative to the disk's size with a cap.
* ``DiskBudget`` as a state machine against a model disk (Hypothesis): a write lands partly at
  once and partly whenever the filer gets to it, readings are taken while writes land, space is
  freed now and then; the free space never falls below the mark and the estimate never exceeds
  the real free space. Examples: the margin, a disk that grew, ENOSPC, the logs.
* A store's bound is at least what storing and filing a batch takes on disk (``st_blocks`` of
  every file and folder of the data folder, before and after), for batches Hypothesis makes;
  and what a delay node reports as still to be written (``unfiled_bytes_bound``) is at least
  what its filer then writes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster import errors as E
from cluster import status
from cluster.codec import Batch
from node.config import NodeSettings
from node.delay.store import DelayStore
from node.realtime.store import RealtimeStore
from node.store.diskspace import DiskBudget, DiskMonitor, DiskReading, DiskWatermark
from node.store.records import Limits
from node.store.settings import RealtimeSettings, StoreSettings

MIB = 1 << 20
GIB = 1 << 30
DEFAULTS = NodeSettings().disk_watermark()  # the one place the defaults are written


# ---------------------------------------------------------------------- the mark and the margin


def test_defaults_mark_and_margin_scale_with_the_disk():
    assert DEFAULTS.threshold(1 << 40) == 2 * GIB                       # 1 TiB: 2 GiB kept free
    assert DEFAULTS.threshold(20 * GIB) == int(0.05 * 20 * GIB)         # 20 GiB: 5 %
    assert DEFAULTS.resume_margin(1 << 40) == 64 * MIB                  # capped
    assert DEFAULTS.resume_margin(24 * MIB) == int(0.02 * 24 * MIB)     # 2 % of a small disk
    assert DEFAULTS.resume_bytes(24 * MIB) == DEFAULTS.threshold(24 * MIB) + DEFAULTS.resume_margin(24 * MIB)


def test_a_disk_that_grew_from_24_to_64_mb_with_40_mb_free_takes_writes_again():
    """Issue 26: with a fixed 64 MiB margin this disk never resumed."""
    b = DiskBudget(DEFAULTS)
    b.reading(free_bytes=0, total_bytes=24 * MIB)
    assert b.low
    b.reading_started()
    assert b.reading(free_bytes=40 * MIB, total_bytes=64 * MIB) is False and not b.low
    assert b.admit(MIB) is None


def test_hysteresis_resume_needs_the_margin():
    wm = DiskWatermark(free_min_bytes=4 * MIB, free_min_ratio=0.5, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 * MIB)
    b = DiskBudget(wm)
    b.reading(free_bytes=3 * MIB, total_bytes=24 * MIB)
    assert b.low
    b.reading_started()
    b.reading(free_bytes=4 * MIB + 100, total_bytes=24 * MIB)  # above the mark, below mark + margin
    assert b.low
    b.reading_started()
    b.reading(free_bytes=wm.resume_bytes(24 * MIB), total_bytes=24 * MIB)
    assert not b.low


def test_the_worked_example_of_the_module_docstring():
    wm = DiskWatermark(free_min_bytes=4 << 20, free_min_ratio=0.5, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 << 20)
    b = DiskBudget(wm)
    b.reading_started()
    b.reading(free_bytes=10 << 20, total_bytes=24 << 20)
    assert b.admit(3 << 20) is None and b.estimated_free() == 7 << 20
    assert b.admit(3 << 20) is None and b.estimated_free() == 4 << 20
    refused = b.admit(1)
    assert refused is not None and refused.write_bytes == 1 and b.low
    b.reading_started(pending_bytes=2 << 20)
    b.reading(free_bytes=6 << 20, total_bytes=24 << 20)
    assert b.low and b.estimated_free() == 4 << 20
    b.reading_started(pending_bytes=0)
    assert b.reading(free_bytes=5 << 20, total_bytes=24 << 20) is False


def test_a_write_the_filer_has_not_written_when_the_reading_is_taken_still_counts():
    """Admitted before a reading began, its schedule copy not written yet then (``pending``):
    the reading cannot show it, so it is still subtracted; once written, the next reading shows it."""
    b = DiskBudget(WM)
    b.reading(free_bytes=20 * MIB, total_bytes=TOTAL)
    assert b.admit(4 * MIB) is None  # 1 MiB message-log frame at once, 3 MiB filed later
    b.reading_started(pending_bytes=3 * MIB)
    b.reading(free_bytes=19 * MIB, total_bytes=TOTAL)  # statvfs before the filer wrote
    assert b.estimated_free() == 16 * MIB
    b.reading_started(pending_bytes=0)
    b.reading(free_bytes=16 * MIB, total_bytes=TOTAL)  # now it shows
    assert b.estimated_free() == 16 * MIB


def test_a_write_that_does_not_fit_is_refused_and_the_node_refuses_until_the_margin():
    wm = DiskWatermark(free_min_bytes=GIB, free_min_ratio=0.05, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 * MIB)
    b = DiskBudget(wm)
    b.reading(free_bytes=GIB + 10 * MIB, total_bytes=100 * GIB)
    assert b.admit(11 * MIB) is not None and b.low
    assert b.admit(1) is not None  # low: everything is refused
    b.reading_started()
    b.reading(free_bytes=GIB + 10 * MIB, total_bytes=100 * GIB)
    assert b.low  # 10 MiB above the mark is not the 64 MiB margin


def test_enospc_refuses_until_a_reading_shows_the_margin():
    b = DiskBudget(DEFAULTS)
    b.reading(free_bytes=50 * GIB, total_bytes=100 * GIB)
    b.note_enospc()
    refused = b.admit(1)
    assert refused is not None and refused.enospc and "no space left" in refused.text("n:1")
    b.reading_started()
    b.reading(free_bytes=50 * GIB, total_bytes=100 * GIB)
    assert not b.low and b.admit(1) is None


@pytest.mark.parametrize("kw", [dict(free_min_bytes=-1), dict(free_min_ratio=1.0), dict(resume_margin_ratio=-0.1)])
def test_nonsense_thresholds_are_refused(kw):
    args = dict(free_min_bytes=0, free_min_ratio=0.0, resume_margin_ratio=0.0, resume_margin_bytes_max=0) | kw
    with pytest.raises(ValueError):
        DiskWatermark(**args)


def test_disk_full_names_the_node_and_its_free_space_and_survives_the_wire(tmp_path):
    wm = DiskWatermark(free_min_bytes=4 * MIB, free_min_ratio=0.5, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 * MIB)
    mon = DiskMonitor(tmp_path, wm, address=lambda: "10.0.0.7:7001")
    mon.update(DiskReading(5 * MIB, 24 * MIB))
    with pytest.raises(E.DiskFull) as ei:
        mon.admit(2 * MIB)
    err = ei.value
    assert err.node == "10.0.0.7:7001" and err.free_bytes == 5 * MIB
    assert str(err) == ("disk full: node 10.0.0.7:7001 has 5242880 bytes (5.00 MiB) free on its data disk; it keeps "
                        "4.00 MiB free and this write needs up to 2.00 MiB; writes resume at 4697620 bytes (4.48 MiB) "
                        "free")
    mon.budget.reading_started()
    mon.update(DiskReading(4 * MIB + 100_000, 24 * MIB))
    with pytest.raises(E.DiskFull) as ei:  # refusing: until free space is back at 4.48 MiB
        mon.admit(1)
    assert str(ei.value).endswith("(4.10 MiB) free on its data disk; it keeps 4.00 MiB free; writes resume at "
                                  "4697620 bytes (4.48 MiB) free")
    # a per-message answer carries only the text: the client reads node and free bytes back
    back = status.from_code(status.to_code(err), str(err))
    assert type(back) is E.DiskFull and (back.node, back.free_bytes) == ("10.0.0.7:7001", 5 * MIB)
    assert mon.refusals == 2 and mon.low


def test_each_change_of_state_is_logged_once(tmp_path, caplog):
    wm = DiskWatermark(free_min_bytes=4 * MIB, free_min_ratio=0.5, resume_margin_ratio=0.02,
                       resume_margin_bytes_max=64 * MIB)
    mon = DiskMonitor(tmp_path, wm)
    mon.update(DiskReading(10 * MIB, 24 * MIB))
    caplog.clear()
    for _ in range(5):
        with pytest.raises(E.DiskFull):
            mon.admit(8 * MIB)
        mon.note_enospc("x")
    for _ in range(3):
        mon.update(DiskReading(10 * MIB, 24 * MIB))
    lines = [r.getMessage() for r in caplog.records if r.name == "hourglass.store.disk"]
    assert [ln.split(":")[0] for ln in lines] == ["disk low", "disk space back"], lines


# ---------------------------------------------------------------------- the budget against a model disk

TOTAL = 64 * MIB
WM = DiskWatermark(free_min_bytes=8 * MIB, free_min_ratio=0.5, resume_margin_ratio=0.02,
                   resume_margin_bytes_max=64 * MIB)


class BudgetAgainstADisk(RuleBasedStateMachine):
    """The shell's protocol: ``reading_started(pending)``, statvfs while writes land,
    ``reading``. An admitted write lands in two parts, as a delay node's does: its message-log
    frame at once, the rest (schedule copy, id entries) whenever the filer gets to it, however
    many readings later; ``pending`` is what has not landed yet."""

    @initialize(free=st.integers(0, 24 * MIB).map(lambda k: min(TOTAL, WM.threshold(TOTAL) - 2 * MIB + k)))
    def start(self, free):  # around the mark: a few writes from it (Hypothesis favours small numbers)
        self.free = free                      # the disk's real free bytes
        self.floor = free                     # where it started
        self.pending: list[int] = []          # admitted parts not landed yet
        self.budget = DiskBudget(WM)
        self.budget.reading(free_bytes=self.free, total_bytes=TOTAL)  # the monitor's first reading
        self.started = False
        self.value: int | None = None         # the statvfs value of the reading in progress

    @rule(w=st.integers(0, 6 * MIB), now=st.integers(0, 100))
    def admit(self, w, now):
        if self.budget.admit(w) is None:
            at_once = w * now // 100          # the message-log part
            self.free -= at_once
            if w - at_once:
                self.pending.append(w - at_once)

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 100))
    def land(self, k):
        self.free -= self.pending.pop(k % len(self.pending))

    @rule(n=st.integers(0, 8 * MIB))
    def free_space(self, n):  # retention, an operator
        self.free = min(TOTAL, self.free + n)

    @precondition(lambda self: not self.started)
    @rule()
    def reading_started(self):
        self.budget.reading_started(pending_bytes=sum(self.pending))
        self.started, self.value = True, None

    @precondition(lambda self: self.started and self.value is None)
    @rule()
    def statvfs(self):
        self.value = self.free

    @precondition(lambda self: self.started and self.value is not None)
    @rule()
    def reading(self):
        self.budget.reading(free_bytes=self.value, total_bytes=TOTAL)
        self.started = False

    @invariant()
    def never_below_the_mark_when_everything_lands(self):
        """The node's writes never take the disk below the mark (a disk that started below it
        gets no write until it is back above it)."""
        assert self.landed_all() >= min(WM.threshold(TOTAL), self.floor), (self.free, self.pending)

    @invariant()
    def the_estimate_never_exceeds_the_real_free_space(self):
        assert self.budget.estimated_free() <= self.landed_all()

    def landed_all(self) -> int:
        return self.free - sum(self.pending)


TestBudgetAgainstADisk = BudgetAgainstADisk.TestCase
TestBudgetAgainstADisk.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


@given(free=st.integers(0, 16 * MIB).map(lambda k: WM.threshold(TOTAL) - 2 * MIB + k),
       burst=st.lists(st.integers(1, 4 * MIB), max_size=40))
def test_a_burst_between_two_readings_stops_at_the_mark(free, burst):
    """Every write of a burst lands at once and no reading comes: the free space stays at or
    above the mark (or where it started, if below)."""
    b = DiskBudget(WM)
    b.reading(free_bytes=free, total_bytes=TOTAL)
    disk = free
    for w in burst:
        if b.admit(w) is None:
            disk -= w
    assert disk >= min(free, WM.threshold(TOTAL))


@given(free=st.integers(WM.resume_bytes(TOTAL), TOTAL), written=st.integers(0, 32 * MIB))
def test_a_node_that_stops_writing_resumes_at_the_next_reading(free, written):
    b = DiskBudget(WM)
    b.reading(free_bytes=TOTAL, total_bytes=TOTAL)
    b.admit(written)
    b.note_enospc()
    b.reading_started(pending_bytes=0)  # everything written: the reading shows it all
    b.reading(free_bytes=free, total_bytes=TOTAL)
    assert not b.low and b.estimated_free() == free


# ---------------------------------------------------------------------- the stores' bounds against real files

T0 = 1_800_000_000_000
SUBJECTS = ["orders", "orders.cancel.with-a-longer-name", "s"]


def du(root: Path) -> int:
    """Bytes allocated on disk under ``root``: every file's and folder's blocks."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


batches = st.builds(
    lambda n, payload, spread_ms, subjects, runs, ids_missing, seed: (n, payload, spread_ms, subjects, runs,
                                                                      ids_missing, seed),
    n=st.integers(1, 400), payload=st.integers(0, 3000), spread_ms=st.sampled_from([0, 1000, 60_000, 7_200_000]),
    subjects=st.integers(1, 3), runs=st.integers(1, 5), ids_missing=st.booleans(), seed=st.integers(0, 2**31))


def make_batch(spec, k: int) -> Batch:
    n, payload, spread_ms, subjects, runs, ids_missing, seed = spec
    rng = np.random.default_rng(seed)
    due = T0 + 1000 + (rng.integers(0, spread_ms + 1, n) if spread_ms else np.zeros(n, np.int64))
    if runs > 1:  # a few due-ordered runs, as a concatenation of sorted calls would be
        due = np.concatenate([np.sort(part) for part in np.array_split(due, runs)])
    else:
        due = np.sort(due)
    ids = ["" if ids_missing and i % 3 == 0 else f"b{k}-{seed}-{i}" for i in range(n)]
    pays = [rng.bytes(int(rng.integers(0, payload + 1))) for _ in range(n)]
    return Batch.build([SUBJECTS[i % subjects] for i in range(n)], pays, ids, due.astype(np.int64))


SMALL = StoreSettings(message_segment_bytes=1 << 17, schedule_segment_bytes=1 << 18, id_slots=1024,
                      id_entries_max=512, bucket_ms=3_600_000, frame_bytes_max=1 << 16,  # segments and id files roll
                      limits=Limits(payload_bytes_max=1 << 16))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(batches, min_size=1, max_size=4))
def test_the_delay_stores_bound_covers_what_accepting_and_filing_take(tmp_path_factory, specs):
    root = tmp_path_factory.mktemp("delay")
    store = DelayStore.open(root / "d", SMALL, now_ms=T0)
    try:
        for k, spec in enumerate(specs):
            b = make_batch(spec, k)
            bound = store.write_bytes_bound(b)
            before = du(root)
            store.accept(b, now_ms=T0)
            store.flush_messages()
            pending, accepted = store.unfiled_bytes_bound(), du(root)  # what a reading begun now cannot show
            store.iterate(limit=None)
            store.schedule.flush()
            store.ids.flush()
            assert store.unfiled_bytes_bound() == 0
            used = du(root) - before
            assert used <= bound, (spec, used, bound)
            assert du(root) - accepted <= pending, (spec, du(root) - accepted, pending)
    finally:
        store.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(batches, min_size=1, max_size=4))
def test_the_realtime_stores_bound_covers_what_appending_takes(tmp_path_factory, specs):
    root = tmp_path_factory.mktemp("rt")
    store = RealtimeStore.open(root / "r", RealtimeSettings(segment_bytes=1 << 18,
                                                           limits=Limits(payload_bytes_max=1 << 16)), now_ms=T0)
    try:
        for k, spec in enumerate(specs):
            b = make_batch(spec, k)
            b = b.replace(deliver_at_ms=np.full(b.n, T0, np.int64))
            bound = store.write_bytes_bound(b)
            before = du(root)
            store.append(b, now_ms=T0)
            store.flush(groups=False)
            used = du(root) - before
            assert used <= bound, (spec, used, bound)
    finally:
        store.close()
