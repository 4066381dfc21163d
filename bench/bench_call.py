"""What one awaited producer call costs, on a running cluster: ``CALLS`` awaited
``send_many`` calls of ``N`` fresh 256-byte messages (16 subjects, delays 1-5 s), one per 10 ms
tick as the README's producer makes them; prints wall p50/p99 of a call, this process's CPU per
call and the delay node's (``/proc/<DELAY_PID>/stat``) per call. ``UNARY=1`` sends every wire
batch as a unary ``SendBatch`` instead of the ordered stream (the SDK before 2026-11-28), so
the two can alternate against one cluster (docs/benchmarks.md, "Producer calls on the ordered
stream").

    hourglass dev up --data /tmp/hg &    # then, with its meta address and the delay node's pid:
    UNARY=1 python bench/bench_call.py META_ADDR 4 1000 DELAY_PID
    python bench/bench_call.py META_ADDR 4 1000 DELAY_PID
    EXTRA_MS=3600000 python bench/bench_call.py META_ADDR 4 1000 DELAY_PID   # due in an hour: no firing
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cluster.client as sdk  # noqa: E402
from cluster.client import Producer  # noqa: E402
from cluster.discovery import MetaResolver  # noqa: E402

SUBJECTS = [f"probe.s{i}" for i in range(16)]
TICK_S = 0.01
WARM_CALLS = 20
EXTRA_MS = int(os.environ.get("EXTRA_MS", "0"))  # added to every delay: 3600000 keeps firing out of the figure
FAILED_CALLS_MAX = 3  # calls in a row refused whole before the bench stops (one line, non-zero exit)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(meta: str, n: int, calls: int, delay_pid: int) -> None:
    if os.environ.get("UNARY"):
        sdk.STREAM_REQUEST_BYTES_MAX = -1
    run = os.urandom(4).hex()
    rnd = np.random.default_rng(1)
    resolver = MetaResolver(meta)
    producer = Producer(resolver)
    try:
        for _ in range(WARM_CALLS):  # connections and routes, as a running service has them
            await (await producer.send_many(SUBJECTS, [os.urandom(256) for _ in SUBJECTS], delay_ms=100))
        walls, errors, failed_whole = [], 0, 0
        c0, d0, t0 = time.process_time(), cpu_s(delay_pid), time.perf_counter()
        for k in range(calls):
            subjects = [SUBJECTS[i % len(SUBJECTS)] for i in range(n)]
            payloads = [os.urandom(256) for _ in range(n)]
            ids = [f"call-{run}-{k}-{i}" for i in range(n)]
            delays = (rnd.integers(1000, 5000, n) + EXTRA_MS).tolist()
            a = time.perf_counter()
            res = await (await producer.send_many(subjects, payloads, ids=ids, delay_ms=delays))
            walls.append((time.perf_counter() - a) * 1000)
            errors += len(res.errors)
            failed_whole = failed_whole + 1 if len(res.errors) == n else 0
            if failed_whole >= FAILED_CALLS_MAX:  # the cluster is gone: each call waits out its timeout
                sys.exit(f"bench_call: {FAILED_CALLS_MAX} calls in a row failed whole (is the cluster up?): "
                         f"{next(iter(res.errors.values()))}")
            wait = t0 + (k + 1) * TICK_S - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
        client, node = time.process_time() - c0, cpu_s(delay_pid) - d0
    finally:
        await producer.close()
        await resolver.close()
    w = np.array(walls)
    print(json.dumps({"bench": "call", "mode": "unary" if os.environ.get("UNARY") else "stream",
                      "messages_per_call": n, "calls": calls, "errors": errors,
                      "wall_ms_p50": round(float(np.percentile(w, 50)), 2),
                      "wall_ms_p99": round(float(np.percentile(w, 99)), 2),
                      "client_cpu_us_per_call": round(client / calls * 1e6),
                      "delay_node_cpu_us_per_call": round(node / calls * 1e6)}))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: bench_call.py META_ADDR MESSAGES_PER_CALL CALLS DELAY_PID")
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
