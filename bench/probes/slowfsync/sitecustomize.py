"""A fault for benchmarks: one fsync in SLOW_FSYNC_EVERY_S seconds (default 3) of a file
whose path contains SLOW_FSYNC_MATCH (default the real-time node's message log) takes
SLOW_FSYNC_MS longer (default 0: off). Python imports ``sitecustomize`` at start-up from
``PYTHONPATH``, and ``hourglass dev up`` passes its environment to the nodes, so

    SLOW_FSYNC_MS=300 PYTHONPATH=bench/probes/slowfsync:. python3 bench/bench_e2e.py --client user ...

runs the benchmark's cluster with a disk that stalls now and then (this VM's disk takes
50-130 ms for some fsyncs on its own: docs/benchmarks.md, "A slow fsync at the real-time node").
Only for benchmarks: nothing in the nodes imports it."""

import os
import time

_fsync = os.fsync
SLOW_MS = int(os.environ.get("SLOW_FSYNC_MS", "0"))
EVERY_S = float(os.environ.get("SLOW_FSYNC_EVERY_S", "3"))
MATCH = os.environ.get("SLOW_FSYNC_MATCH", "realtime-1/messages/")
_next = [time.monotonic() + EVERY_S]


def _slow_fsync(fd: int) -> None:
    _fsync(fd)
    if time.monotonic() < _next[0]:
        return
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if MATCH in path:
        _next[0] = time.monotonic() + EVERY_S
        time.sleep(SLOW_MS / 1000)


if SLOW_MS > 0:
    os.fsync = _slow_fsync
