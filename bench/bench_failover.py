"""BENCHMARK.md phase 3 (failover) and the sync/async ingest ratio.

Phase 3: a replicated delay group (master + slave, ``sync``, 2 s lease), etcd, a meta
server and a real-time node on this machine; a producer sends ``--n`` messages (256 B
payload, 16 subjects, due send time + uniform ``--delay-min-s``..``--delay-max-s``) at
``--rate`` msgs/s; a consumer in a separate process records receive times. In the middle
of the send the delay master is SIGKILLed; a supervisor (this script) restarts it one
second later, as Kubernetes would. Reports: seconds from the kill until deliveries resume
(the first delivery by the new master), acknowledged messages lost (must be 0),
duplicates, lateness of messages due during the gap.

Ingest ratio: ``--ingest-n`` messages sent as fast as the SDK allows into the same kind
of group, once in ``async`` and once in ``sync`` mode: accepted msgs/s of each and the
ratio (target: sync >= 70 % of async).

    python bench/bench_failover.py                       # both, defaults
    python bench/bench_failover.py --n 20000 --rate 2000 --skip-ingest

One JSON line per figure on stdout, settings beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, lateness_summary, machine  # noqa: E402
from cluster import errors as E  # noqa: E402
from cluster.client import Consumer, Producer  # noqa: E402
from cluster.devcluster import LocalCluster  # noqa: E402
from cluster.discovery import MetaResolver  # noqa: E402

SUBJECTS = [f"bench.fo.{i}" for i in range(16)]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---------------------------------------------------------------------- consumer process

async def _consume(meta: list[str], expect: int, deadline: float, stop_file: str, out: str) -> None:
    resolver = MetaResolver(meta, refresh_ms=500)
    seen: set[str] = set()
    f = open(out, "w", buffering=1)

    async def one(subject: str) -> None:
        async with Consumer(resolver, subject, group="bench", wait_ms=200, batch_max=500) as c:
            while time.monotonic() < deadline and len(seen) < expect and not os.path.exists(stop_file):
                try:
                    batch = await c.pull()
                except E.HourglassError:
                    await asyncio.sleep(0.1)
                    continue
                t = now_ms()
                for m in batch:
                    f.write(f"{m.id} {t} {m.deliver_at_ms}\n")
                    seen.add(m.id)
                if batch:
                    try:
                        await c.ack(batch)
                    except E.HourglassError:
                        pass
    try:
        await asyncio.gather(*(one(s) for s in SUBJECTS))
    finally:
        f.close()
        await resolver.close()


def consumer_main(a) -> None:
    Path(a.ready_file).write_text("ready")
    asyncio.run(_consume(a.meta.split(","), a.expect, time.monotonic() + a.timeout_s, a.stop_file, a.out))


# ---------------------------------------------------------------------- helpers

async def delay_statuses(cluster) -> dict[str, dict]:
    return await cluster.statuses("delay")


async def wait_master(cluster, timeout_s: float = 30) -> str:
    master = await cluster.wait_master("delay", timeout_s)
    for n in cluster.delay:
        if n.name != master:
            await cluster.wait_caught_up_slave(n.name, "delay", timeout_s)
    return master


def group(root: Path, ack_mode: str) -> LocalCluster:
    return LocalCluster(root, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode=ack_mode,
                        lease_ttl_ms=2000)


# ---------------------------------------------------------------------- phase 3

async def phase3(a, work: Path) -> None:
    rnd = random.Random(a.seed)
    with group(work / "p3", "sync") as c:
        c.wait_registered()
        master = await wait_master(c)
        out, ready, stop = work / "p3.recv", work / "p3.ready", work / "p3.stop"
        cons = subprocess.Popen([sys.executable, __file__, "--consumer", "--meta", ",".join(c.meta_addresses),
                                 "--expect", str(a.n), "--timeout-s", str(a.delay_max_s + 120), "--out", str(out),
                                 "--ready-file", str(ready), "--stop-file", str(stop)])
        try:
            while not ready.exists():
                time.sleep(0.05)
            resolver = MetaResolver(c.meta_addresses, refresh_ms=500)
            acked: dict[str, int] = {}
            failed = 0
            killed_at = restarted = None
            t_start = time.monotonic()
            payload = os.urandom(256)
            async with Producer(resolver, retries_max=60, linger_ms=5) as p:
                pending: list[tuple[str, int, asyncio.Future]] = []
                for i in range(a.n):
                    target = t_start + i / a.rate
                    lag = target - time.monotonic()
                    if lag > 0:
                        await asyncio.sleep(lag)
                    due = now_ms() + rnd.randint(a.delay_min_s * 1000, a.delay_max_s * 1000)
                    mid = f"f{i}"
                    pending.append((mid, due, await p.send(SUBJECTS[i % 16], payload, id=mid, deliver_at_ms=due)))
                    if killed_at is None and i == a.n // 2:
                        next(n for n in c.delay if n.name == master).kill()
                        killed_at = now_ms()
                    if killed_at and restarted is None and now_ms() - killed_at > 1000:
                        old = next(n for n in c.delay if n.name == master)
                        old.start()
                        restarted = now_ms()
                for mid, due, fut in pending:
                    try:
                        await fut
                        acked[mid] = due
                    except E.HourglassError:
                        failed += 1
            send_s = time.monotonic() - t_start
            await resolver.close()
            last_due = max(acked.values())
            while now_ms() < last_due + 15_000:
                await asyncio.sleep(0.5)
                if out.exists() and len({ln.split()[0] for ln in out.read_text().splitlines()}) >= len(acked):
                    break
            stop.write_text("stop")
            cons.wait(timeout=60)
        finally:
            if cons.poll() is None:
                cons.kill()
                cons.wait()
        rows = [ln.split() for ln in out.read_text().splitlines()]
        first: dict[str, int] = {}
        for mid, t, _ in rows:
            first.setdefault(mid, int(t))
        lost = sorted(set(acked) - set(first))
        dupes = len(rows) - len(first)
        # deliveries resume: first receive after the kill of a message due after the kill
        after = sorted(int(t) for mid, t, due in rows if int(t) > killed_at and int(due) > killed_at)
        resume_s = (after[0] - killed_at) / 1000 if after else None
        gap_end = after[0] if after else killed_at
        during = [first[m] - d for m, d in acked.items() if m in first and killed_at <= d <= gap_end]
        others = [first[m] - d for m, d in acked.items() if m in first and not killed_at <= d <= gap_end]
        st = await delay_statuses(c)
        emit({"system": "hourglass", "phase": "3-failover", "messages": a.n, "acked": len(acked),
              "refused_after_retries": failed, "lost": len(lost), "lost_ids": lost[:10], "duplicates": dupes,
              "resume_after_kill_s": resume_s, "send_s": round(send_s, 2),
              "lateness_due_during_gap_ms": lateness_summary(during),
              "lateness_others_ms": lateness_summary(others),
              "new_master": [k for k, v in st.items() if v["master"]], "killed": master,
              "settings": {"ack_mode": "sync", "lease_ttl_ms": 2000, "rate": a.rate,
                           "delay_s": [a.delay_min_s, a.delay_max_s], "restart_after_ms": 1000},
              "machine": machine()})


# ---------------------------------------------------------------------- ingest ratio

async def ingest(a, work: Path, ack_mode: str) -> float:
    with group(work / f"ingest-{ack_mode}", ack_mode) as c:
        c.wait_registered()
        await wait_master(c)
        resolver = MetaResolver(c.meta_addresses, refresh_ms=2000)
        payload = os.urandom(256)
        async with Producer(resolver, linger_ms=2, batch_max=500, inflight_max=8) as p:
            warm = [await p.send(SUBJECTS[0], payload, id=f"w{i}", delay_ms=3_600_000) for i in range(500)]
            await asyncio.gather(*warm)
            t0 = time.monotonic()
            futs = [await p.send(SUBJECTS[i % 16], payload, id=f"i{i}", delay_ms=3_600_000)
                    for i in range(a.ingest_n)]
            await asyncio.gather(*futs)
            dt = time.monotonic() - t0
        await resolver.close()
        rate = a.ingest_n / dt
        emit({"system": "hourglass", "phase": "ingest", "ack_mode": ack_mode, "messages": a.ingest_n,
              "msgs_per_s": round(rate), "seconds": round(dt, 2),
              "settings": {"group": "master + slave", "payload": 256, "batch_max": 500, "inflight_max": 8},
              "machine": machine()})
        return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--meta", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=300, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=20_000, help="phase 3 messages")
    ap.add_argument("--rate", type=float, default=2000, help="phase 3 send rate, msgs/s")
    ap.add_argument("--delay-min-s", type=int, default=3)
    ap.add_argument("--delay-max-s", type=int, default=13)
    ap.add_argument("--ingest-n", type=int, default=30_000)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--skip-phase3", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.consumer:
        consumer_main(a)
        return
    with tempfile.TemporaryDirectory(prefix="hourglass-failover-") as tmp:
        work = Path(tmp)
        if not a.skip_phase3:
            asyncio.run(phase3(a, work))
        if not a.skip_ingest:
            r_async = asyncio.run(ingest(a, work, "async"))
            r_sync = asyncio.run(ingest(a, work, "sync"))
            emit({"system": "hourglass", "phase": "ingest-ratio", "sync_over_async": round(r_sync / r_async, 3),
                  "target": 0.7})


if __name__ == "__main__":
    main()
