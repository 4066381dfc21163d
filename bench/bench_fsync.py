"""What an append + fsync costs on this machine's disk, alone and beside another writer: the
floor under every acknowledged send (the WAL's group commit) and every dispatch round (the
real-time node's). Appends ``--bytes`` bytes ``--rate`` times a second to one file and syncs
it, for ``--seconds``; reports the sync's p50 / p99 / p999 / max in ms. ``--neighbour-mib-s``
runs a second process that appends that many MiB a second to another file on the same
filesystem and fsyncs it every 200 ms (another node's log, a schedule log, a checkpoint), as
the nodes of a cluster on one machine do to each other. ``--mode``: ``fsync`` on a growing
file (what the logs do), ``fdatasync`` on a growing file, or ``fdatasync-prewritten`` on a
file whose blocks were written (zeros) and synced before the run, so that an append changes
neither its size nor its block map (no journal commit for the sync to wait on).

    python bench/bench_fsync.py --mode fsync --neighbour-mib-s 8
    python bench/bench_fsync.py --mode fdatasync-prewritten --neighbour-mib-s 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

from common import emit, machine

NEIGHBOUR_SYNC_S = 0.2
NEIGHBOUR_CHUNK = 256 * 1024
PREWRITE_CHUNK = 1 << 20


def _neighbour(path: str, mib_s: float, stop_at: float) -> None:
    chunk = os.urandom(NEIGHBOUR_CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    t0 = time.monotonic()
    written, next_sync = 0, t0 + NEIGHBOUR_SYNC_S
    try:
        while (now := time.monotonic()) < stop_at:
            owed = int((now - t0) * mib_s * (1 << 20)) - written
            if owed >= len(chunk):
                os.write(fd, chunk)
                written += len(chunk)
            else:
                time.sleep(0.002)
            if now >= next_sync:
                os.fsync(fd)
                next_sync = now + NEIGHBOUR_SYNC_S
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["fsync", "fdatasync", "fdatasync-prewritten"], default="fsync")
    p.add_argument("--bytes", type=int, default=300 * 200, help="bytes per append (a 200-message call)")
    p.add_argument("--rate", type=int, default=100, help="appends + syncs per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--neighbour-mib-s", type=float, default=0.0)
    p.add_argument("--dir", default=None, help="where the files go (default: the system temp dir)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hg-bench-fsync-") as d:
        path = os.path.join(d, "log")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        total = int(a.bytes * a.rate * a.seconds) + PREWRITE_CHUNK
        if a.mode == "fdatasync-prewritten":
            zeros = bytes(PREWRITE_CHUNK)
            for _ in range(0, total, PREWRITE_CHUNK):
                os.write(fd, zeros)
            os.fsync(fd)
            os.lseek(fd, 0, os.SEEK_SET)
        sync = os.fsync if a.mode == "fsync" else os.fdatasync
        body = os.urandom(a.bytes)
        stop_at = time.monotonic() + a.seconds
        neighbour = None
        if a.neighbour_mib_s > 0:
            neighbour = mp.Process(target=_neighbour, args=(os.path.join(d, "neighbour"), a.neighbour_mib_s, stop_at))
            neighbour.start()
        took, offset = [], 0
        t_next = time.monotonic()
        try:
            while (now := time.monotonic()) < stop_at:
                if now < t_next:
                    time.sleep(t_next - now)
                t_next += 1 / a.rate
                os.pwrite(fd, body, offset)
                offset += len(body)
                t = time.perf_counter()
                sync(fd)
                took.append(time.perf_counter() - t)
        finally:
            os.close(fd)
            if neighbour is not None:
                neighbour.join(a.seconds + 10)
        ms = np.array(took) * 1000
        emit({"bench": "fsync", "mode": a.mode, "bytes": a.bytes, "rate": a.rate, "syncs": len(ms),
              "neighbour_mib_s": a.neighbour_mib_s,
              "sync_ms": {"p50": round(float(np.percentile(ms, 50)), 2), "p99": round(float(np.percentile(ms, 99)), 2),
                          "p999": round(float(np.percentile(ms, 99.9)), 2), "max": round(float(ms.max()), 2)},
              "machine": machine()})


if __name__ == "__main__":
    main()
