"""BENCHMARK.md phase 3 (failover) and the sync/async ingest ratio.

Phase 3: a replicated delay group (master + slave, ``sync``, 2 s lease), etcd, a meta
server and a real-time node on this machine; a producer sends ``--n`` messages (256 B
payload, 16 subjects, due send time + uniform ``--delay-min-s``..``--delay-max-s``) at
``--rate`` msgs/s; a consumer in a separate process records receive times. In the middle
of the send the delay master is SIGKILLed; a supervisor (this script) restarts it one
second later, as Kubernetes would (``--kills K``: K kills at seeded times in one run, each
after the group has a caught-up slave again; figures per kill and p50/max). Reports: seconds from the kill until deliveries resume
(the first delivery by the new master), acknowledged messages lost (must be 0),
duplicates, lateness of messages due during the gap.

Ingest ratio: ``--ingest-n`` messages sent as fast as the SDK allows into the same kind
of group, once in ``async`` and once in ``sync`` mode: accepted msgs/s of each and the
ratio (target: sync >= 70 % of async).

    python bench/bench_failover.py                       # both, defaults
    python bench/bench_failover.py --n 20000 --rate 2000 --skip-ingest
    python bench/bench_failover.py --rate 3000 --kills 20 --skip-ingest   # issue 15 target

One JSON line per figure on stdout, settings beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, lateness_summary, machine, percentile  # noqa: E402
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


SECURE = False  # --secure: mutual TLS and tokens (docs/security.md)
LEASE_TTL_MS = 6000  # --lease-ttl-ms: the node default (a killed master is reported dead, not waited out)


def group(root: Path, ack_mode: str) -> LocalCluster:
    c = LocalCluster(root, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode=ack_mode,
                     lease_ttl_ms=LEASE_TTL_MS, secure=SECURE)
    if SECURE:  # the producer here and the consumer process: a client certificate and the admin token
        os.environ.update(c.security.client_env())
    return c


# ---------------------------------------------------------------------- phase 3

async def phase3(a, work: Path) -> None:
    """One run: ``--kills`` master SIGKILLs at seeded times, each killed master restarted
    ``restart_after_ms`` later; the next kill waits until the group has a master and a
    caught-up slave again (in sync mode a group without a slave takes no writes)."""
    rnd = random.Random(a.seed)
    kill_rnd = random.Random(a.seed * 7919 + 1)
    with group(work / "p3", "sync") as c:
        c.wait_registered()
        await wait_master(c)
        out, ready, stop = work / "p3.recv", work / "p3.ready", work / "p3.stop"
        run_s_max = a.delay_max_s + 120 + a.kills * (a.kill_every_s + 30)
        cons = subprocess.Popen([sys.executable, __file__, "--consumer", "--meta", ",".join(c.meta_addresses),
                                 "--expect", str(1 << 40), "--timeout-s", str(run_s_max), "--out", str(out),
                                 "--ready-file", str(ready), "--stop-file", str(stop)])
        kills: list[dict] = []   # {"killed": name, "at_ms": wall ms}
        try:
            while not ready.exists():
                time.sleep(0.05)
            resolver = MetaResolver(c.meta_addresses, refresh_ms=500)
            acked: dict[str, int] = {}
            failed = 0
            t_start = time.monotonic()
            payload = os.urandom(256)
            chaos_done = asyncio.Event()

            async def chaos() -> None:
                """Kill the master, restart it a second later, wait for a caught-up slave; repeat."""
                try:
                    first = (a.n / 2) / a.rate if a.kills == 1 else a.delay_min_s + 2.0
                    await asyncio.sleep(max(0.0, t_start + first - time.monotonic()))
                    for k in range(a.kills):
                        master = await c.wait_master("delay", 60)
                        node = next(n for n in c.delay if n.name == master)
                        node.kill()
                        kills.append({"killed": master, "at_ms": now_ms()})
                        await asyncio.sleep(1.0)
                        node.start()
                        t_back = time.monotonic()
                        try:
                            await wait_master(c, 60)
                        except TimeoutError:  # no stable master and caught-up slave: recorded, one more try
                            kills[-1]["unstable"] = True
                            try:
                                await wait_master(c, 120)
                            except TimeoutError:
                                kills[-1]["gave_up"] = True
                                break
                        kills[-1]["whole_again_s"] = round(time.monotonic() - t_back, 1)
                        if k + 1 < a.kills:  # seeded spacing: kill at a random point of the load
                            await asyncio.sleep(kill_rnd.uniform(0.5, 1.0) * a.kill_every_s)
                finally:
                    chaos_done.set()

            async with Producer(resolver, retries_max=60, linger_ms=5) as p:
                chaos_task = asyncio.create_task(chaos())
                pending: list[tuple[str, int, asyncio.Future]] = []
                i = 0
                while (i < a.n if a.kills == 1 else not chaos_done.is_set()) and i < a.n_max:
                    target = t_start + i / a.rate
                    lag = target - time.monotonic()
                    if lag > 0:
                        await asyncio.sleep(lag)
                    due = now_ms() + rnd.randint(a.delay_min_s * 1000, a.delay_max_s * 1000)
                    mid = f"f{i}"
                    pending.append((mid, due, await p.send(SUBJECTS[i % 16], payload, id=mid, deliver_at_ms=due)))
                    i += 1
                    if i % 5000 == 0:  # settle acknowledgements as we go (memory, early failures)
                        keep = []
                        for mid_, due_, fut in pending:
                            if not fut.done():
                                keep.append((mid_, due_, fut))
                            elif fut.exception() is None:
                                acked[mid_] = due_
                            else:
                                failed += 1
                        pending = keep
                await chaos_task
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
        rows = [(mid, int(t), int(due)) for mid, t, due in (ln.split() for ln in out.read_text().splitlines())]
        first: dict[str, int] = {}
        for mid, t, _ in rows:
            first.setdefault(mid, t)
        lost = sorted(set(acked) - set(first))
        dupes = len(rows) - len(first)
        # deliveries resume: the first receive after a kill of a message due after that kill
        recv = sorted((t, due) for _, t, due in rows)
        resumes: list[float | None] = []
        during: list[int] = []
        for k in kills:
            at = k["at_ms"]
            after = next((t for t, due in recv if t > at and due > at), None)
            resumes.append(None if after is None else (after - at) / 1000)
            k["resume_s"] = resumes[-1]
            end = after if after is not None else at
            during += [first[m] - d for m, d in acked.items() if m in first and at <= d <= end]
        ok = sorted(r for r in resumes if r is not None)
        st = await delay_statuses(c)
        if a.keep_logs:  # node logs, for the breakdown of each failover
            keep = Path(a.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            for f in (work / "p3").glob("*.log"):
                shutil.copy(f, keep / f.name)
        emit({"system": "hourglass", "phase": "3-failover", "messages": i, "acked": len(acked),
              "refused_after_retries": failed, "lost": len(lost), "lost_ids": lost[:10], "duplicates": dupes,
              "kills": len(kills), "resumed": len(ok), "kill_log": kills,
              "resume_after_kill_s": {"p50": percentile(ok, 50), "max": ok[-1] if ok else None,
                                      "min": ok[0] if ok else None, "each": resumes},
              "send_s": round(send_s, 2),
              "lateness_due_during_gap_ms": lateness_summary(during),
              "new_master": [k for k, v in st.items() if v["master"]], "killed": [k["killed"] for k in kills],
              "settings": {"ack_mode": "sync", "lease_ttl_ms": LEASE_TTL_MS, "rate": a.rate, "seed": a.seed,
                           "delay_s": [a.delay_min_s, a.delay_max_s], "restart_after_ms": 1000,
                           "kill_every_s": a.kill_every_s},
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
    ap.add_argument("--kills", type=int, default=1,
                    help="master SIGKILLs in one run (1: halfway through --n messages; more: the producer "
                         "sends until the last kill's group has a caught-up slave again)")
    ap.add_argument("--kill-every-s", type=float, default=12.0,
                    help="with --kills > 1: seeded pause of 0.5-1x this after the group is whole again")
    ap.add_argument("--keep-logs", help="copy the cluster's logs to this folder at the end")
    ap.add_argument("--n-max", type=int, default=2_000_000, help="bound on messages sent in one run")
    ap.add_argument("--delay-min-s", type=int, default=3)
    ap.add_argument("--delay-max-s", type=int, default=13)
    ap.add_argument("--ingest-n", type=int, default=30_000)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--skip-phase3", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease-ttl-ms", type=int, default=6000,
                    help="nodes' meta lease (before issue 26 the benchmark used 2000)")
    ap.add_argument("--secure", action="store_true", help="mutual TLS on every port and tokens checked")
    a = ap.parse_args()
    global SECURE, LEASE_TTL_MS
    SECURE = a.secure
    LEASE_TTL_MS = a.lease_ttl_ms
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
