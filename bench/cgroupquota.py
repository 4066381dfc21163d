"""A fixed CPU quota per process with cgroup v1 ``cpu`` (issue 30, "Scale-out measured").

Each limited process gets its own cgroup ``/sys/fs/cgroup/cpu/hourglass-bench-<pid>/<name>/``
(``<pid>`` is the benchmark's own process) with ``cpu.cfs_period_us`` = the period (default
100,000 us) and ``cpu.cfs_quota_us`` = cores x period (0.2 core: 20,000 us), and the process's
PID written to ``cgroup.procs`` (the whole thread group moves; children it forks later inherit
the cgroup). ``close()`` moves whatever is still in them back to the root cgroup and removes
them, bounded; it runs from ``with``, from ``atexit`` and (SIGTERM is turned into SystemExit
while a ``CpuQuotas`` is open) on a terminating signal. SIGKILL leaves them behind:
``stale_groups`` names those whose owner is gone, ``remove_stale`` removes them.

The pure parts (``quota_values``, ``group_name``, ``owner_pid``, ``parse_cpu_stat``,
``throttle_delta``, ``stale_groups``) are tested in ``tests/test_bench_cgroupquota.py``.
Needs root and a mounted cgroup v1 ``cpu`` hierarchy.
"""

from __future__ import annotations

import atexit
import errno
import os
import signal
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PREFIX = "hourglass-bench-"
PERIOD_US_DEFAULT = 100_000
PERIOD_US_MIN, PERIOD_US_MAX = 1_000, 1_000_000   # the kernel's bounds for cfs_period_us
QUOTA_US_MIN = 1_000                              # and the smallest cfs_quota_us it takes
RMDIR_TRIES = 50                                  # x 0.1 s: a cgroup is busy briefly after its last task exits


def quota_values(cores: float, period_us: int = PERIOD_US_DEFAULT) -> tuple[int, int]:
    """(cfs_period_us, cfs_quota_us) for ``cores`` of CPU; ValueError if the kernel would refuse."""
    if not PERIOD_US_MIN <= period_us <= PERIOD_US_MAX:
        raise ValueError(f"period {period_us} us is not in {PERIOD_US_MIN}..{PERIOD_US_MAX}")
    if not cores > 0:
        raise ValueError(f"cores must be > 0, not {cores}")
    quota = int(round(cores * period_us))
    if quota < QUOTA_US_MIN:
        raise ValueError(f"{cores} core of a {period_us} us period is {quota} us, under the kernel's "
                         f"{QUOTA_US_MIN} us minimum: use a longer period")
    return period_us, quota


def group_name(owner: int) -> str:
    return f"{PREFIX}{owner}"


def owner_pid(name: str) -> int | None:
    """The benchmark PID in a ``hourglass-bench-<pid>`` name, None for any other name."""
    if not name.startswith(PREFIX):
        return None
    tail = name[len(PREFIX):]
    return int(tail) if tail.isdigit() else None


def stale_groups(names: list[str], alive) -> list[str]:
    """Names of ``hourglass-bench-<pid>`` groups whose owner is not alive (``alive(pid)``)."""
    return [n for n in names if (p := owner_pid(n)) is not None and not alive(p)]


def parse_cpu_stat(text: str) -> dict[str, int]:
    """``cpu.stat`` (``nr_periods``, ``nr_throttled``, ``throttled_time`` ns, ...) as a dict."""
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k and v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def throttle_delta(before: dict[str, int], after: dict[str, int]) -> dict:
    """Periods, throttled periods, their share and the throttled seconds between two ``cpu.stat``s."""
    periods = after.get("nr_periods", 0) - before.get("nr_periods", 0)
    thr = after.get("nr_throttled", 0) - before.get("nr_throttled", 0)
    return {"periods": periods, "throttled": thr, "throttled_share": round(thr / periods, 3) if periods else None,
            "throttled_s": round((after.get("throttled_time", 0) - before.get("throttled_time", 0)) / 1e9, 3)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_out(group: Path, root: Path) -> None:
    """Every task still in ``group`` back to the root cgroup (so that the group can be removed)."""
    try:
        pids = (group / "cgroup.procs").read_text().split()
    except OSError:
        return
    for p in pids:
        try:
            (root / "cgroup.procs").write_text(p)
        except OSError:  # gone meanwhile
            pass


def _rmdir(group: Path) -> str | None:
    for _ in range(RMDIR_TRIES):
        try:
            group.rmdir()
            return None
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.EBUSY:
                return f"{group}: {e}"
            time.sleep(0.1)
    return f"{group}: still busy"


def remove_stale(root: Path = CPU_ROOT) -> list[str]:
    """Remove the groups of benchmarks that are gone (SIGKILLed); returns what was removed."""
    if not root.is_dir():
        return []
    done = []
    for name in stale_groups([p.name for p in root.iterdir() if p.is_dir()], _alive):
        parent = root / name
        for child in [c for c in parent.iterdir() if c.is_dir()]:
            _move_out(child, root)
            _rmdir(child)
        _move_out(parent, root)
        if _rmdir(parent) is None:
            done.append(name)
    return done


class CpuQuotas:
    """The cgroups of one benchmark run: ``limit(name, pid)`` puts a process under the quota."""

    def __init__(self, cores: float, period_us: int = PERIOD_US_DEFAULT, *, root: Path = CPU_ROOT,
                 owner: int | None = None) -> None:
        self.cores = cores
        self.period_us, self.quota_us = quota_values(cores, period_us)
        self.root = Path(root)
        self.parent = self.root / group_name(owner if owner is not None else os.getpid())
        self.groups: dict[str, Path] = {}
        self._closed = False
        self._old_term = None

    @staticmethod
    def available(root: Path = CPU_ROOT) -> str | None:
        """None if quotas can be set here, else why not."""
        if not (root / "cpu.cfs_quota_us").exists():
            return f"no cgroup v1 cpu hierarchy at {root}"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable (root needed)"
        return None

    def open(self) -> "CpuQuotas":
        why = self.available(self.root)
        if why:
            raise RuntimeError(why)
        self.parent.mkdir(exist_ok=True)
        atexit.register(self.close)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_term = signal.SIG_DFL

            def _term(signum, frame):  # run the finally blocks (and close) instead of dying at once
                raise SystemExit(128 + signum)
            signal.signal(signal.SIGTERM, _term)
        return self

    def __enter__(self) -> "CpuQuotas":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def limit(self, name: str, pid: int) -> Path:
        g = self.parent / name
        g.mkdir(exist_ok=True)
        (g / "cpu.cfs_period_us").write_text(str(self.period_us))
        (g / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        (g / "cgroup.procs").write_text(str(pid))
        self.groups[name] = g
        return g

    def stat(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, g in self.groups.items():
            try:
                out[name] = parse_cpu_stat((g / "cpu.stat").read_text())
            except OSError:
                out[name] = {}
        return out

    def close(self) -> list[str]:
        """Everything back to the root cgroup, the groups removed; returns the problems (none: [])."""
        if self._closed:
            return []
        self._closed = True
        problems = []
        children = [c for c in self.parent.iterdir() if c.is_dir()] if self.parent.is_dir() else []
        for g in children:
            _move_out(g, self.root)
            if (p := _rmdir(g)) is not None:
                problems.append(p)
        if self.parent.is_dir():
            _move_out(self.parent, self.root)
            if (p := _rmdir(self.parent)) is not None:
                problems.append(p)
        self.groups.clear()
        if self._old_term is not None:
            try:
                signal.signal(signal.SIGTERM, self._old_term)
            except ValueError:  # not the main thread
                pass
        return problems
