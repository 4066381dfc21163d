"""Shared helpers of the benchmarks: memory and CPU seconds of a process (tree),
percentiles, the machine's load, one JSON line per figure. No I/O beyond /proc and stdout."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def proc_mem(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of one process in bytes, split as the kernel counts it:
    ``anon`` (heap, Python objects: what the process really holds), ``file``
    (mmap'd file pages: page cache the kernel can drop and re-read), ``shmem``."""
    out = {"rss": 0, "anon": 0, "file": 0, "shmem": 0}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k = keys.get(line.split(" ", 1)[0].split("\t", 1)[0])
            if k:
                out[k] = int(line.split()[1]) * 1024
    return out


def tree_mem(pid: int) -> dict[str, int]:
    """proc_mem summed over a process and its descendants."""
    import psutil

    total = {"rss": 0, "anon": 0, "file": 0, "shmem": 0}
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return total
    for p in procs:
        try:
            m = proc_mem(p.pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        for k in total:
            total[k] += m[k]
    return total


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | str = "self") -> float:
    """CPU seconds a process has used: utime + stime from ``/proc/<pid>/stat`` (children
    excluded); 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


class CpuMeter:
    """CPU seconds of named processes over a phase: ``start()``, then ``per_message(counts)``
    gives microseconds of CPU per message each process handled."""

    def __init__(self, pids: dict[str, int | str]) -> None:
        self.pids = dict(pids)
        self.t0: dict[str, float] = {}

    def start(self) -> "CpuMeter":
        self.t0 = {name: cpu_s(pid) for name, pid in self.pids.items()}
        return self

    def seconds(self) -> dict[str, float]:
        return {name: round(cpu_s(pid) - self.t0[name], 3) for name, pid in self.pids.items()}

    def per_message_us(self, counts: dict[str, int], seconds: dict[str, float] | None = None) -> dict:
        secs = self.seconds() if seconds is None else seconds
        return {name: {"cpu_s": secs[name], "messages": counts.get(name, 0),
                       "us_per_msg": round(secs[name] / counts[name] * 1e6, 2) if counts.get(name) else None}
                for name in secs}


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk under a folder (st_blocks, so sparse files count what they use)."""
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                n += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return n


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def lateness_summary(values: list[float]) -> dict[str, float | None]:
    v = sorted(values)
    return {"p50": percentile(v, 50), "p99": percentile(v, 99), "p999": percentile(v, 99.9),
            "max": v[-1] if v else None, "min": v[0] if v else None}


def machine() -> dict:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "python": platform.python_version()}


def free_port() -> int:
    from cluster.devcluster import free_port as fp  # below the ephemeral range (restarts rebind)

    return fp()


def emit(record: dict) -> None:
    """One JSON line per figure; the machine's load is recorded beside it."""
    record.setdefault("machine", machine())
    print(json.dumps(record), flush=True)
