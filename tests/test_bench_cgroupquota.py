"""The pure parts of ``bench/cgroupquota.py`` (issue 30: a fixed CPU quota per node process),
and the whole of it against a fake cgroup folder (plain files: no kernel, no root)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import cgroupquota as cq  # noqa: E402
import bench_scale  # noqa: E402


def test_quota_values():
    assert cq.quota_values(0.2) == (100_000, 20_000)
    assert cq.quota_values(0.1) == (100_000, 10_000)
    assert cq.quota_values(1.5, 10_000) == (10_000, 15_000)
    with pytest.raises(ValueError):
        cq.quota_values(0)
    with pytest.raises(ValueError):
        cq.quota_values(0.005, 100_000)  # 500 us: under the kernel's 1 ms minimum
    with pytest.raises(ValueError):
        cq.quota_values(0.2, 500)


def test_names_and_stale():
    assert cq.group_name(42) == "hourglass-bench-42"
    assert cq.owner_pid("hourglass-bench-42") == 42
    assert cq.owner_pid("hourglass-bench-x") is None
    assert cq.owner_pid("docker") is None
    names = ["docker", "hourglass-bench-1", "hourglass-bench-2", "k8s.io", "hourglass-bench-"]
    assert cq.stale_groups(names, lambda p: p == 2) == ["hourglass-bench-1"]


def test_cpu_stat_and_delta():
    a = cq.parse_cpu_stat("nr_periods 10\nnr_throttled 2\nthrottled_time 5000000\n")
    b = cq.parse_cpu_stat("nr_periods 110\nnr_throttled 52\nthrottled_time 1505000000\nnr_bursts 0\n")
    assert a == {"nr_periods": 10, "nr_throttled": 2, "throttled_time": 5_000_000}
    assert cq.throttle_delta(a, b) == {"periods": 100, "throttled": 50, "throttled_share": 0.5, "throttled_s": 1.5}
    assert cq.throttle_delta({}, {})["throttled_share"] is None


def test_quotas_on_a_fake_hierarchy(tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    (tmp_path / "cgroup.procs").write_text("")
    q = cq.CpuQuotas(0.2, root=tmp_path, owner=7)
    with q:
        g = q.limit("delay-1", 1234)
        assert (g / "cpu.cfs_period_us").read_text() == "100000"
        assert (g / "cpu.cfs_quota_us").read_text() == "20000"
        assert (g / "cgroup.procs").read_text() == "1234"
        (g / "cgroup.procs").unlink()  # a real cgroup's files vanish with it; plain files would keep rmdir busy
        for f in ("cpu.cfs_period_us", "cpu.cfs_quota_us"):
            (g / f).unlink()
        assert q.stat() == {"delay-1": {}}
    assert not (tmp_path / "hourglass-bench-7").exists()  # removed on the way out
    assert q.close() == []  # a second close does nothing


def test_ladder_and_held():
    assert bench_scale.ladder([500, 1000], groups=2, step=400) == [1200, 2000]  # rounded up to the step
    rows = [{"rate": 1000, "achieved_per_s": 1000, "lateness_all_ms": {"p99": 8}},
            {"rate": 2000, "achieved_per_s": 1990, "lateness_all_ms": {"p99": 30}},
            {"rate": 3000, "achieved_per_s": 2000, "lateness_all_ms": {"p99": 9}}]
    assert bench_scale.highest(rows, p99_ms=10) == 1000
    assert bench_scale.highest(rows, p99_ms=50) == 2000
    assert bench_scale.highest(rows, p99_ms=None) == 2000
    assert bench_scale.highest([], p99_ms=10) is None
    assert bench_scale.most(rows) == 2000 and bench_scale.most([]) is None
    assert bench_scale.linear_ratio({1: 1000, 4: 3200}, 4) == 0.8
    assert bench_scale.linear_ratio({1: None, 4: 3200}, 4) is None
