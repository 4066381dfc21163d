"""Lease timing under load (issue 26): how long a replicated delay node's event loop stalls and
how long its registration lease has to last between renewals, on a quiet machine, with every
core busy, and with every core busy while the meta server is paused as a GC pause would.

A replicated delay group (master + slave, ``sync``), one real-time node, etcd and one meta
server on this machine (``LocalCluster``); every node runs under ``bench/lease_probe.py``,
which records each Register/Heartbeat (send and return times, outcome) and the lateness of a
50 ms tick on the node's event loop, the same way for old and new code. A producer in this
process sends ``--rate`` msgs/s (``send_many`` every 100 ms, due 1-15 s later) and a consumer
takes them. Phases, one after the other:

1. ``quiet`` (``--quiet-s``): the load alone;
2. ``busy`` (``--busy-s``): plus ``--busy`` processes spinning (``while True: pass``, each
   also bounded in time by itself) on the machine's cores, stopped by their PIDs;
3. ``busy+pause`` (``--pause-s``): plus the meta server stopped (SIGSTOP) for ``--pause-ms``
   every ``--pause-every-ms``, continued by its PID.

Per delay node and phase: the loop's tick lateness (p50/p99/p99.9/max, stalls of 200 ms or
more), the renewal round trip and the renewal gap (from the send of one confirmed renewal
to the confirmation of the next: how long the lease had to last on its own; p50/p99/max),
leases lost, and master changes (``became MASTER`` in the node logs). One JSON line per
figure.

    python3 bench/bench_lease_timing.py --repo /work/main --out /tmp/beat-before   # old code
    python3 bench/bench_lease_timing.py --out /tmp/beat-after                      # this checkout

``--repo`` chooses whose code the cluster runs (its ``cluster.devcluster`` starts the
processes in that repository); the probe and this script are the same for both.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_REPO = Path(sys.argv[sys.argv.index("--repo") + 1]).resolve() if "--repo" in sys.argv else HERE.parent
sys.path.insert(0, str(RUN_REPO))

from bench.common import emit, machine, percentile  # noqa: E402
from cluster import errors as E  # noqa: E402
from cluster.client import Consumer, Producer  # noqa: E402
from cluster.devcluster import LocalCluster  # noqa: E402
from cluster.discovery import MetaResolver  # noqa: E402

SUBJECTS = [f"bench.lease.{i}" for i in range(16)]
SEND_PERIOD_S = 0.1
BUSY_GRACE_S = 60          # each busy process also stops by itself (phase length + this)
STALL_REPORT_MS = 200
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---------------------------------------------------------------------- load

async def produce(meta: list[str], rate: float, stop: asyncio.Event, counts: dict) -> None:
    rnd = random.Random(1)
    resolver = MetaResolver(meta, refresh_ms=500)
    payload = os.urandom(256)
    pending: set[asyncio.Future] = set()

    def settled(fut: asyncio.Future) -> None:
        pending.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            counts["failed_calls"] += 1
            return
        res = fut.result()
        counts["acked"] += len(res) - len(res.errors)
        counts["refused"] += len(res.errors)

    try:
        async with Producer(resolver, retries_max=60, linger_ms=5) as p:
            carry, t_next = 0.0, time.monotonic()
            while not stop.is_set():
                carry += rate * SEND_PERIOD_S
                n, carry = int(carry), carry - int(carry)
                if n:
                    due = [now_ms() + rnd.randint(1000, 15_000) for _ in range(n)]
                    fut = await p.send_many([SUBJECTS[i % 16] for i in range(n)], [payload] * n, deliver_at_ms=due)
                    counts["sent"] += n
                    pending.add(fut)
                    fut.add_done_callback(settled)
                t_next += SEND_PERIOD_S
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            if pending:
                await asyncio.wait(pending, timeout=30)
    finally:
        await resolver.close()


async def consume(meta: list[str], stop: asyncio.Event, counts: dict) -> None:
    resolver = MetaResolver(meta, refresh_ms=500)
    try:
        async with Consumer(resolver, SUBJECTS, group="bench", wait_ms=200, batch_max=1000) as c:
            while not stop.is_set():
                try:
                    batch = await c.pull()
                    if batch:
                        await c.ack(batch)
                        counts["received"] += len(batch)
                except E.HourglassError:
                    await asyncio.sleep(0.1)
    finally:
        await resolver.close()


def start_busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPU; each also stops by itself after ``seconds`` plus a grace."""
    spin = f"import time\nend = time.monotonic() + {seconds + BUSY_GRACE_S}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def stop_procs(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


async def pause_meta(pid: int, pause_ms: int, every_ms: int, until: float) -> int:
    """SIGSTOP the meta server for ``pause_ms`` every ``every_ms`` until ``until`` (monotonic); always continued."""
    pauses = 0
    try:
        while time.monotonic() + pause_ms / 1000 < until:
            await asyncio.sleep((every_ms - pause_ms) / 1000)
            os.kill(pid, signal.SIGSTOP)
            pauses += 1
            try:
                await asyncio.sleep(pause_ms / 1000)
            finally:
                os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)
    return pauses


# ---------------------------------------------------------------------- analysis

def summary(values: list[float]) -> dict:
    v = sorted(values)
    return {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99), "p999": percentile(v, 99.9),
            "max": v[-1] if v else None}


def read_beats(path: Path) -> list[tuple[int, int, str, str]]:
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        a, b, m, o = ln.split()
        out.append((int(a), int(b), m, o))
    return sorted(out)


def beat_figures(beats, t0: int, t1: int) -> dict:
    """Round trips of calls sent in [t0, t1); renewal gaps whose confirmation falls in it."""
    rtt, gaps, lost, failed = [], [], 0, 0
    prev_sent = None  # send time of the previous confirmed call under the current lease
    for sent, back, method, outcome in beats:
        inside = t0 <= back < t1
        if outcome != "ok":
            if outcome == "NotFound":
                lost += inside
                prev_sent = None
            else:
                failed += inside
            continue
        if t0 <= sent < t1:
            rtt.append((back - sent) / 1e6)
        if method == "Register":
            prev_sent = sent
            continue
        if prev_sent is not None and inside:
            gaps.append((back - prev_sent) / 1e6)
        prev_sent = sent
    return {"renewal_rtt_ms": summary(rtt), "renewal_gap_ms": summary(gaps), "leases_lost": lost,
            "renewals_failed": failed}


def lag_figures(path: Path, t0: int, t1: int) -> dict:
    late = []
    if path.exists():
        for ln in path.read_text().splitlines():
            t, us = ln.split()
            if t0 <= int(t) < t1:
                late.append(int(us) / 1000)
    s = summary(late)
    s["stalls_200ms"] = sum(1 for x in late if x >= STALL_REPORT_MS)
    return {"loop_tick_late_ms": s}


def log_events(path: Path, w0: float, w1: float) -> dict:
    """Counts of the lines that matter, logged in wall-clock seconds [w0, w1)."""
    keys = {"became_master": "became MASTER", "registration_lost": "registration lost",
            "heartbeats_withheld": "heartbeats withheld", "stall_lines": "event loop stalled"}
    counts = dict.fromkeys(keys, 0)
    if not path.exists():
        return counts
    for ln in path.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(ln)
        if not m:
            continue
        t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if w0 <= t < w1:
            for k, needle in keys.items():
                if needle in ln:
                    counts[k] += 1
    return counts


# ---------------------------------------------------------------------- run

async def run(a) -> None:
    out = Path(a.out).resolve()
    probe_dir = out / "probe"
    probe = [sys.executable, str(HERE / "lease_probe.py"), str(probe_dir)]
    names = ["delay-1", "delay-2", "realtime-1"]
    c = LocalCluster(out / "cluster", n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                     lease_ttl_ms=a.ttl_ms, env={"HOURGLASS_LOOP_STALL_REPORT_MS": str(STALL_REPORT_MS),
                                                 "HOURGLASS_META_HEARTBEAT_MS": str(a.heartbeat_ms)},
                     prefixes={n: probe for n in names})
    phases: list[dict] = []
    counts = {"sent": 0, "acked": 0, "refused": 0, "failed_calls": 0, "received": 0}
    busy: list[subprocess.Popen] = []
    with c:  # started here, every process stopped by its PID at the end
        c.wait_registered()
        master = await c.wait_master("delay", 60)
        for n in c.delay:
            if n.name != master:
                await c.wait_caught_up_slave(n.name, "delay", 60)
        stop = asyncio.Event()
        load = [asyncio.create_task(produce(c.meta_addresses, a.rate, stop, counts)),
                asyncio.create_task(consume(c.meta_addresses, stop, counts))]

        def mark(name: str) -> dict:
            ph = {"phase": name, "t0": time.monotonic_ns(), "w0": time.time(), "sent0": counts["sent"]}
            phases.append(ph)
            return ph

        def end(ph: dict) -> None:
            ph.update(t1=time.monotonic_ns(), w1=time.time(), sent=counts["sent"] - ph["sent0"],
                      loadavg=[round(x, 2) for x in os.getloadavg()])

        try:
            await asyncio.sleep(a.warmup_s)
            ph = mark("quiet")
            await asyncio.sleep(a.quiet_s)
            end(ph)
            busy = start_busy(a.busy, a.busy_s + a.pause_s)
            ph = mark("busy")
            await asyncio.sleep(a.busy_s)
            end(ph)
            if a.pause_s:
                ph = mark("busy+pause")
                ph["pauses"] = await pause_meta(c.meta[0].proc.pid, a.pause_ms, a.pause_every_ms,
                                                time.monotonic() + a.pause_s)
                end(ph)
        finally:
            stop_procs(busy)
            stop.set()
            await asyncio.wait(load, timeout=60)
            for t in load:
                t.cancel()
        await asyncio.sleep(a.flush_s)  # the probes write once a second
    for ph in phases:
        for name in ("delay-1", "delay-2"):
            rec = {"system": "hourglass", "bench": "lease-timing", "repo": str(RUN_REPO), "phase": ph["phase"],
                   "node": name, "seconds": round((ph["t1"] - ph["t0"]) / 1e9, 1),
                   "msgs_per_s": round(ph["sent"] / ((ph["t1"] - ph["t0"]) / 1e9)), "loadavg_end": ph["loadavg"],
                   **lag_figures(probe_dir / f"{name}.lag", ph["t0"], ph["t1"]),
                   **beat_figures(read_beats(probe_dir / f"{name}.beats"), ph["t0"], ph["t1"]),
                   **log_events(out / "cluster" / f"{name}.log", ph["w0"], ph["w1"])}
            if "pauses" in ph:
                rec["meta_pauses"] = ph["pauses"]
            emit(rec)
    emit({"system": "hourglass", "bench": "lease-timing", "repo": str(RUN_REPO), "totals": counts,
          "settings": {"ttl_ms": a.ttl_ms, "heartbeat_ms": a.heartbeat_ms, "rate": a.rate, "busy": a.busy,
                       "busy_s": a.busy_s, "pause_s": a.pause_s, "pause_ms": a.pause_ms, "pause_every_ms": a.pause_every_ms,
                       "ack_mode": "sync", "group": "master + slave"},
          "machine": machine()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", help="repository whose code the cluster runs (default: this one)")
    ap.add_argument("--out", required=True, help="folder for the cluster, probe files and logs (kept)")
    ap.add_argument("--rate", type=float, default=2000)
    ap.add_argument("--ttl-ms", type=int, default=2000)
    ap.add_argument("--heartbeat-ms", type=int, default=0, help="0 = a third of the TTL (the default)")
    ap.add_argument("--warmup-s", type=float, default=10)
    ap.add_argument("--quiet-s", type=float, default=30)
    ap.add_argument("--busy", type=int, default=16, help="spinning processes in the busy phases")
    ap.add_argument("--busy-s", type=float, default=120)
    ap.add_argument("--pause-s", type=float, default=60, help="busy phase with meta server pauses (0 = none)")
    ap.add_argument("--pause-ms", type=int, default=1800)
    ap.add_argument("--pause-every-ms", type=int, default=5300)
    ap.add_argument("--flush-s", type=float, default=2)
    a = ap.parse_args()
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
