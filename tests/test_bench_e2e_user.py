"""The pure parts of ``bench_e2e.py --client user`` (``bench/e2e_user.py``): the producer's
10 ms ticks (a tick that passed while a call was out is skipped and counted) and the
lateness per 100 ms window."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import e2e_user  # noqa: E402


class _Acked:  # bench_e2e.Acked's shape: ids "{prefix}{i}", due by i, -1 = not acknowledged
    def __init__(self, prefix: str, due: list[int]) -> None:
        self.prefix = prefix
        self.due = np.array(due, np.int64)


def test_ticks_on_time_calls_miss_nothing():
    t = e2e_user.Ticks(0.05)  # 5 ticks
    t.start(100.0)
    waits = [t.next_wait(100.0 + k * 0.01 + 0.002) for k in range(5)]
    assert waits[:4] == pytest.approx([0.008] * 4)
    assert waits[4] is None
    assert (t.calls, t.missed) == (5, 0)


def test_ticks_a_slow_call_skips_the_ticks_it_covered():
    t = e2e_user.Ticks(0.1)
    t.start(0.0)
    assert t.next_wait(0.035) == pytest.approx(0.005)  # ticks 1, 2, 3 passed: the next is tick 4 at 40 ms
    assert t.missed == 3
    assert t.k == 4
    assert t.next_wait(0.041) == pytest.approx(0.009)
    assert t.missed == 3


def test_windows_by_due_time_and_by_receive_time():
    t0 = 1_000_000
    acked = _Acked("u-", [t0 + 10, t0 + 20, t0 + 150, -1, t0 + 160])
    blocks = [(t0 + 30, ["u-0", "u-1", "warm-x"]), (t0 + 400, ["u-2", "u-0"])]  # u-0 twice: first counts
    rows = e2e_user.windows(acked, blocks, t0)
    assert [r["t_ms"] for r in rows] == [0, 100, 200, 300, 400]
    assert rows[0] | {} == {"t_ms": 0, "due": 2, "late_max_ms": 20, "late_p50_ms": 15, "unseen": 0, "seen": 2}
    assert rows[1]["due"] == 2 and rows[1]["late_max_ms"] == 250 and rows[1]["unseen"] == 1
    assert rows[4]["seen"] == 2 and rows[4]["due"] == 0
    s = e2e_user._window_summary(rows, 50)
    assert s["windows_over_50ms"] == 1 and s["worst_max_ms_at_s"][0] == [250, 0.1]


def test_producer_shares_split_each_tick():  # --producers P (issue 30)
    assert e2e_user.producer_shares(10, 1) == [10]
    assert e2e_user.producer_shares(10, 3) == [4, 3, 3]
    assert sum(e2e_user.producer_shares(40, 6)) == 40
    assert e2e_user.producer_shares(2, 4) == [1, 1, 1, 1]  # never 0 a tick: the rate offered rounds up


def test_merge_reports_of_several_producers():
    reps = [{"kind": "sustain", "start_ms": 10, "end_ms": 50, "sent": 5, "calls": 2, "ticks_missed": 1, "errors": 0,
             "acked": 5, "per_call": 3},
            {"kind": "sustain", "start_ms": 12, "end_ms": 40, "sent": 4, "calls": 2, "ticks_missed": 0, "errors": 1,
             "acked": 3, "per_call": 2, "call_errors": ["x"]}]
    m = e2e_user.merge_reports(reps)
    assert (m["start_ms"], m["end_ms"], m["sent"], m["calls"], m["ticks_missed"], m["errors"], m["acked"]) == \
        (10, 50, 9, 4, 1, 1, 8)
    assert m["call_errors"] == ["x"] and m["per_call"] == [3, 2]


def test_fails_badly_against_the_rate_offered():
    row = {"rate": 1000, "offered_per_s": 1000, "achieved_per_s": 950, "lateness_all_ms": {"p99": 30}}
    assert not e2e_user.fails_badly(row)
    assert e2e_user.fails_badly({**row, "achieved_per_s": 850})
    assert e2e_user.fails_badly({**row, "lateness_all_ms": {"p99": 1500}})
    assert e2e_user.fails_badly({**row, "lateness_all_ms": {"p99": None}})


def test_open_loop_carries_late_ticks():
    assert e2e_user.owed(5, 0.0, 0, 100) == 5         # the first tick
    assert e2e_user.owed(5, 0.001, 5, 100) == 0       # still the first tick: nothing more
    assert e2e_user.owed(5, 0.035, 5, 100) == 15      # woke 2 ticks late: ticks 2..4 in one call
    assert e2e_user.owed(5, 10.0, 90, 100) == 10      # never past the total
