"""Launcher that runs one node process with timing probes (``bench/bench_lease_timing.py``).

    python bench/lease_probe.py OUT_DIR  python -m cluster.cli node --node-id delay-1 ...

It runs ``cluster.cli`` in this same process (same PID, so the harness stops it by its PID
as it would the node) from the current directory's code (the repository the cluster runs,
old or new), after two patches that read the same quantities from either version:

* every ``MetaClient.call("Register" | "Heartbeat")``: monotonic send and return times
  and the outcome, on whichever thread or loop makes the call
  -> ``OUT_DIR/{node_id}.beats`` (``t0_ns t1_ns method outcome``);
* a task on the node's event loop that sleeps 50 ms and records how late it woke
  -> ``OUT_DIR/{node_id}.lag`` (``t_ns late_us``).

A thread writes both files once a second. Nothing of this is loaded by a node in
production: it exists to compare the renewal path before and after a change.
"""

from __future__ import annotations

import asyncio
import os
import runpy
import sys
import threading
import time

TICK_S = 0.05
FLUSH_S = 1.0


def main() -> None:
    out_dir, rest = sys.argv[1], sys.argv[2:]
    if rest[1:3] != ["-m", "cluster.cli"]:
        raise SystemExit(f"lease_probe: expected '<python> -m cluster.cli ...', got {rest[:3]}")
    node_id = rest[rest.index("--node-id") + 1] if "--node-id" in rest else f"pid{os.getpid()}"
    sys.path[0] = os.getcwd()  # the cluster's repository, as `python -m` would have it

    import node.lifecycle
    from cluster.discovery import MetaClient

    beats: list[tuple] = []
    lags: list[tuple] = []
    original_call = MetaClient.call

    async def call(self, method, request, **kw):
        if method not in ("Register", "Heartbeat"):
            return await original_call(self, method, request, **kw)
        t0 = time.monotonic_ns()
        outcome = "ok"
        try:
            return await original_call(self, method, request, **kw)
        except BaseException as e:
            outcome = type(e).__name__
            raise
        finally:
            beats.append((t0, time.monotonic_ns(), method, outcome))

    MetaClient.call = call

    async def lag_sampler() -> None:
        while True:
            t = time.monotonic_ns()
            await asyncio.sleep(TICK_S)
            lags.append((t, max(0, (time.monotonic_ns() - t) // 1000 - int(TICK_S * 1e6))))

    original_side_tasks = node.lifecycle.side_tasks

    def side_tasks(tg, nd, log, **kw):
        tasks = original_side_tasks(tg, nd, log, **kw)
        tasks.append(tg.create_task(lag_sampler(), name="probe-lag"))
        return tasks

    node.lifecycle.side_tasks = side_tasks  # before node.replication.roles / services import it

    def writer() -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{node_id}.beats"), "a") as fb, \
                open(os.path.join(out_dir, f"{node_id}.lag"), "a") as fl:
            while True:
                time.sleep(FLUSH_S)
                n, m = len(beats), len(lags)
                fb.writelines(f"{a} {b} {c} {d}\n" for a, b, c, d in beats[:n])
                fl.writelines(f"{a} {b}\n" for a, b in lags[:m])
                del beats[:n], lags[:m]
                fb.flush()
                fl.flush()

    threading.Thread(target=writer, name="probe-writer", daemon=True).start()
    sys.argv = ["cluster.cli", *rest[3:]]
    runpy.run_module("cluster.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
