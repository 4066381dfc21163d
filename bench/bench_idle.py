"""Idle CPU of every process of a local cluster at rest (issue 28, "idle means idle").

Starts a local cluster with an etcd, a meta server and the shape of ``hourglass dev up``
(``--delay-groups N --realtime-groups M --replicas R [--realtime-replicas R2]``, default one
group of each kind of one node; ``--replicas 2``: each delay group a master and a slave), loads
it with ``N`` messages due a day ahead plus ``N // 10`` due at once that a consumer pulls
and acks ("some consumed"), waits ``--settle`` seconds, then reads each process's CPU
seconds (utime + stime of ``/proc/<pid>/stat``) over ``--seconds`` of no traffic and
prints the share of one core each used: one JSON line per case and a table at the end.

    PYTHONPATH=. python bench/bench_idle.py --messages 0,20,200000 --replicas 1 --seconds 60
    PYTHONPATH=. python bench/bench_idle.py --messages 200000 --replicas 2 --seconds 60
    PYTHONPATH=. python bench/bench_idle.py --messages 20 --delay-groups 2 --realtime-groups 3 --seconds 10

``--hold S`` keeps the cluster up S more seconds after measuring, printing the PIDs, so
that ``strace -c -f -p PID`` or ``py-spy dump --pid PID`` can look at a process at rest.
The etcd is not one of our processes; its figure is printed for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cpu_s, emit  # noqa: E402,F401

from cluster.client import Consumer, Producer  # noqa: E402
from cluster.devcluster import ClusterShape, LocalCluster, add_shape_arguments, shape_from_args  # noqa: E402
from cluster.discovery import MetaResolver  # noqa: E402

SUBJECT = "bench.idle"
DAY_MS = 86_400_000
LOAD_TIMEOUT_S = 300.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def load(meta: list[str], far: int, soon: int, payload: int) -> dict:
    """``far`` messages due a day ahead, ``soon`` due in a second, pulled and acked."""
    resolver = MetaResolver(meta, refresh_ms=500)
    t0 = time.monotonic()
    try:
        async with Producer(resolver, linger_ms=2, batch_max=5000) as p:
            body = b"x" * payload
            futs = []
            step = 10_000
            for lo in range(0, far, step):
                n = min(step, far - lo)
                futs.append(await p.send_many(SUBJECT, [body] * n, deliver_at_ms=now_ms() + DAY_MS))
            if soon:
                futs.append(await p.send_many(SUBJECT, [body] * soon, deliver_at_ms=now_ms() + 1000))
            await p.flush()
            errors = 0
            for f in futs:
                r = await f
                errors += len(r.errors)
            if errors:
                raise RuntimeError(f"{errors} messages refused while loading")
        got = 0
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        if soon:
            async with Consumer(resolver, SUBJECT, group="idle", batch_max=1000, wait_ms=500) as c:
                while got < soon and time.monotonic() < deadline:
                    for rb in await c.pull_batch():
                        got += len(rb)
                        await rb.ack()
        if got < soon:
            raise RuntimeError(f"consumed {got} of {soon} within {LOAD_TIMEOUT_S} s")
    finally:
        await resolver.close()
    return {"load_s": round(time.monotonic() - t0, 2), "consumed": got}


def processes(c: LocalCluster) -> dict[str, int]:
    out = {}
    for m in c.etcd.members if c.etcd is not None else []:
        out[m.name + " (not ours)"] = m.proc.pid
    for n in c.meta + c.realtime + c.delay:
        out[n.name] = n.proc.pid
    return out


def measure(pids: dict[str, int], seconds: float) -> dict[str, float]:
    t0 = {k: cpu_s(p) for k, p in pids.items()}
    w0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - w0
    return {k: round(100 * (cpu_s(p) - t0[k]) / wall, 2) for k, p in pids.items()}


def one_case(root: Path, messages: int, shape: ClusterShape, args) -> dict:
    c = LocalCluster(root, meta=True, **shape.cluster_kwargs())
    with c:
        c.wait_registered()
        masters = {}
        slaves: list[tuple[str, str]] = []  # (node, role) of every slave
        for role, r in (("delay", shape.replicas), ("realtime", shape.realtime_replicas)):
            if r > 1:
                ms = asyncio.run(c.wait_masters(role, timeout_s=60))
                masters[f"{role}_masters"] = ms
                slaves += [(n, role) for g, members in c.groups()[role].items() for n in members if n != ms[g]]
        for n, role in slaves:
            asyncio.run(c.wait_caught_up_slave(n, role, timeout_s=60))
        loaded = asyncio.run(load(c.meta_addresses, messages, messages // 10, args.payload))
        for n, role in slaves:
            asyncio.run(c.wait_caught_up_slave(n, role, timeout_s=120))
        viewer = None
        if args.console:  # an operator with the Cluster and Schedule pages open (issue 31)
            from console_viewer import ConsoleViewer

            viewer = ConsoleViewer(c.meta_addresses, root / "console.log").start()
        try:
            time.sleep(args.settle)
            pids = processes(c) | ({"console": viewer.pid} if viewer else {})
            pct = measure(pids, args.seconds)
        finally:
            if viewer is not None:
                viewer.stop()
        rec = {"bench": "idle", "messages": messages, "consumed": loaded["consumed"], "replicas": shape.replicas,
               "shape": shape.as_dict(),
               "seconds": args.seconds, "settle_s": args.settle, "load_s": loaded["load_s"],
               "cpu_pct_of_core": pct, **masters,
               **({"console_pages_loaded": viewer.fetched, "console_errors": viewer.errors} if viewer else {})}
        emit(rec)
        if args.hold:
            print(json.dumps({"hold_s": args.hold, "pids": pids}), flush=True)
            time.sleep(args.hold)
        return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", default="0,20,200000", help="comma-separated: one case per count")
    add_shape_arguments(p)  # --delay-groups --realtime-groups --replicas --realtime-replicas
    p.add_argument("--seconds", type=float, default=60.0, help="measured window of no traffic")
    p.add_argument("--settle", type=float, default=15.0, help="seconds after loading before measuring")
    p.add_argument("--payload", type=int, default=100)
    p.add_argument("--hold", type=float, default=0.0, help="keep the cluster up this long after measuring")
    p.add_argument("--dir", default=None)
    p.add_argument("--console", action="store_true",
                   help="hourglass console open on the Cluster and Schedule pages during the measured window "
                        "(bench/console_viewer.py); its own CPU is the 'console' column")
    a = p.parse_args()
    shape = shape_from_args(p, a)
    rows = []
    for n in [int(x) for x in a.messages.split(",") if x]:
        root = Path(tempfile.mkdtemp(prefix="hg-bench-idle-", dir=a.dir))
        try:
            rows.append(one_case(root, n, shape, a))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    names = sorted({k for r in rows for k in r["cpu_pct_of_core"]})
    print("\n% of one core over", a.seconds, "s at rest;", shape.describe())
    print("| messages | replicas | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['messages']:,} | {r['replicas']} | "
              + " | ".join(f"{r['cpu_pct_of_core'].get(k, '-')}" for k in names) + " |")


if __name__ == "__main__":
    main()
