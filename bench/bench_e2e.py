"""BENCHMARK.md phases 1, 1b and 2, end to end, Hourglass and a Redis sorted-set delay
queue side by side in one run.

Hourglass: SDK ``Producer`` (this process) -> delay node -> real-time node -> SDK
``Consumer`` (a separate process), nodes started by ``LocalCluster``.
Redis: the queue in ``bench_redis_baseline.py`` (redis-server with AOF, a poller
process, the same consumer process reading ready lists), once with
``appendfsync always`` (durability parity: acknowledged = fsynced, as Hourglass)
and once with ``appendfsync everysec`` (Redis's default AOF mode).

* phase 1: N messages, 256 random bytes, 16 subjects, due at send time + uniform
  3..13 s; accepted msgs/s from first send to last acknowledgement; lateness =
  receive time - due time, p50/p99/p999/max; lost = acknowledged and not received
  by due + 30 s; duplicates.
* phase 1b: 1 message due in 30 s, then 1,000 due in 1 s: lateness of the 1,000.
* phase 2: a fresh server, M messages due in one hour; resident memory of the
  server process tree before and after (anon = heap, file = mmap'd file pages),
  memory and disk bytes per pending message, enqueue rate.

One JSON line per system and phase, then a side-by-side table on stderr.

    python bench/bench_e2e.py --n 100000 --backlog 1000000
    python bench/bench_e2e.py --n 2000 --backlog 20000          # quick
    python bench/bench_e2e.py --systems hourglass --phases 2 --backlog 10000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, dir_bytes, emit, lateness_summary, machine, tree_mem  # noqa: E402

import bench_redis_baseline as rb  # noqa: E402

SUBJECTS = [f"bench.s{i}" for i in range(16)]
HOL_SUBJECT = "bench.hol"
LOST_AFTER_MS = 30_000
CONSUMER_START_TIMEOUT_S = 60.0
PAYLOAD_POOL = 1024
SETTLE_S = 3.0  # after the last ack of phase 2, before measuring (iterator, checkpoint, page-cache)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---------------------------------------------------------------------- consumer process


async def _consume_hourglass(target: dict, subjects: list[str], expect: int, deadline: float, stop_file: str,
                             got: list[tuple[str, int]]) -> None:
    ack_interval_s = target.get("ack_interval_ms", 0) / 1000
    from cluster.client import Consumer, StaticResolver
    from cluster.errors import HourglassError

    resolver = StaticResolver(delay=target["delay"], realtime=target["realtime"])
    seen: set[str] = set()
    done = asyncio.Event()

    async def one(subject: str) -> None:
        async with Consumer(resolver, subject, group="bench", consumer_id=f"bench-{subject}", batch_max=1000,
                            wait_ms=200) as c:
            unacked: list = []
            last_ack = [0.0]
            while not done.is_set() and time.monotonic() < deadline:
                try:
                    batch = await c.pull()
                except HourglassError:  # a transient error: keep consuming until the deadline
                    await asyncio.sleep(0.05)
                    continue
                for m in batch:
                    got.append((m.id, m.received_ms))
                    seen.add(m.id)
                unacked.extend(batch)
                if unacked and time.monotonic() - last_ack[0] >= ack_interval_s:
                    await c.ack(unacked)
                    unacked.clear()
                    last_ack[0] = time.monotonic()
                if len(seen) >= expect or os.path.exists(stop_file):
                    done.set()

    await asyncio.gather(*(one(s) for s in subjects))


def _consume_redis(target: dict, subjects: list[str], expect: int, deadline: float, stop_file: str,
                   got: list[tuple[str, int]]) -> None:
    import redis

    r = redis.Redis.from_url(target["url"])
    keys = [f"ready:{s}" for s in subjects]
    seen: set[str] = set()
    while time.monotonic() < deadline and len(seen) < expect:
        res = r.blmpop(0.2, len(keys), *keys, direction="RIGHT", count=1000)
        if res is None:
            if os.path.exists(stop_file):
                break
            continue
        t = now_ms()
        for item in res[1]:
            mid = item.split(b"|", 1)[0].decode()
            got.append((mid, t))
            seen.add(mid)


def consumer_main(a) -> None:
    target = json.loads(a.target)
    subjects = a.subjects.split(",")
    got: list[tuple[str, int]] = []
    deadline = time.monotonic() + a.timeout_s
    Path(a.ready_file).write_text("ready")
    try:
        if target["system"] == "hourglass":
            asyncio.run(_consume_hourglass(target, subjects, a.expect, deadline, a.stop_file, got))
        else:
            _consume_redis(target, subjects, a.expect, deadline, a.stop_file, got)
    finally:  # what was received counts even if the consumer failed
        with open(a.out, "w") as f:
            f.writelines(f"{i} {t}\n" for i, t in got)


class ConsumerProcess:
    def __init__(self, work: Path, name: str, target: dict, subjects: list[str], expect: int, timeout_s: float):
        self.out = work / f"{name}.recv"
        self.ready = work / f"{name}.ready"
        self.stop_file = work / f"{name}.stop"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--consumer", "--target", json.dumps(target), "--subjects",
             ",".join(subjects), "--expect", str(expect), "--timeout-s", str(timeout_s), "--out", str(self.out),
             "--ready-file", str(self.ready), "--stop-file", str(self.stop_file)], cwd=REPO)
        deadline = time.monotonic() + CONSUMER_START_TIMEOUT_S
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("consumer did not start")
            time.sleep(0.02)

    def wait(self, timeout_s: float) -> list[tuple[str, int]]:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop_file.write_text("stop")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self.out.exists():
            return []
        return [(ln.split()[0], int(ln.split()[1])) for ln in self.out.read_text().splitlines()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def score(acked: list[tuple[str, int]], got: list[tuple[str, int]]) -> dict:
    first: dict[str, int] = {}
    receipts = 0
    for mid, t in got:
        receipts += 1
        if mid not in first:
            first[mid] = t
    due = dict(acked)
    late = [first[m] - d for m, d in due.items() if m in first and first[m] <= d + LOST_AFTER_MS]
    lost = sum(1 for m, d in due.items() if m not in first or first[m] > d + LOST_AFTER_MS)
    early = sum(1 for m, d in due.items() if m in first and first[m] < d)
    return {"received": len(first), "lost": lost, "duplicates": receipts - len(first), "early": early,
            "lateness_ms": lateness_summary(late)}


# ---------------------------------------------------------------------- systems


class Hourglass:
    name = "hourglass"

    def __init__(self, work: Path, args) -> None:
        from cluster.devcluster import LocalCluster

        from common import free_port

        self.root = work / "hourglass"
        self.cluster = LocalCluster(self.root, env={"HOURGLASS_LOG_LEVEL": "WARNING"})
        self.metrics_port = free_port()
        self.cluster.delay[0].env["HOURGLASS_METRICS_PORT"] = str(self.metrics_port)
        self.args = args

    def start(self):
        self.cluster.start()
        return self

    def stop(self) -> None:
        self.cluster.stop()

    def target(self) -> dict:
        return {"system": "hourglass", "delay": [n.address for n in self.cluster.delay],
                "realtime": [n.address for n in self.cluster.realtime], "ack_interval_ms": self.args.ack_interval_ms}

    def pids(self) -> dict[str, int]:
        return {n.name: n.proc.pid for n in self.cluster.nodes}

    def data_dirs(self) -> list[Path]:
        return [n.data_dir for n in self.cluster.nodes]

    def dispatch_histogram(self) -> dict[float, float]:
        """The delay node's "due -> stored on the real-time node" histogram: {upper bound s: count}."""
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("hourglass_delivery_lateness_seconds_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        return out

    def settings(self) -> dict:
        return {"producer": {"linger_ms": 2, "batch_max": self.args.batch, "inflight_max": self.args.inflight},
                "consumer": {"subjects": 16, "batch_max": 1000, "wait_ms": 200,
                             "ack": f"every {self.args.ack_interval_ms} ms" if self.args.ack_interval_ms
                             else "after every pull"},
                "nodes": "1 delay + 1 real-time (LocalCluster defaults: tick 10 ms, fsync group commit)"}

    async def produce(self, msgs, *, keep: bool = True) -> tuple[list[tuple[str, int]], float, int]:
        from cluster.client import Producer, StaticResolver

        t = self.target()
        acked: list[tuple[str, int]] = []
        errors = 0
        resolver = StaticResolver(delay=t["delay"], realtime=t["realtime"])
        t0 = time.perf_counter()
        last_ack = t0
        async with Producer(resolver, batch_max=self.args.batch, inflight_max=self.args.inflight,
                            queue_max=20_000, timeout_s=60) as p:
            def done(f, mid, due):
                nonlocal errors, last_ack
                if f.exception() is None:
                    last_ack = time.perf_counter()
                    if keep:
                        acked.append((mid, due))
                    else:
                        acked.append(None)
                else:
                    errors += 1

            for mid, subject, payload, due_fn in msgs:
                due = due_fn()
                f = await p.send(subject, payload, deliver_at_ms=due, id=mid)
                f.add_done_callback(lambda f, mid=mid, due=due: done(f, mid, due))
            await p.flush()
        return acked, last_ack - t0, errors


class Redis:
    def __init__(self, work: Path, args, appendfsync: str) -> None:
        self.name = f"redis-{appendfsync}"
        self.root = work / self.name
        self.server = rb.RedisServer(self.root, appendfsync=appendfsync)
        self.args = args
        self.poller: subprocess.Popen | None = None
        self.stop_file = self.root / "poller.stop"

    def start(self):
        self.server.start()
        self.poller = subprocess.Popen([sys.executable, rb.__file__, "poller", self.server.url,
                                        str(self.args.redis_poll_ms), "1000", str(self.stop_file)], cwd=REPO)
        return self

    def stop(self) -> None:
        if self.poller is not None and self.poller.poll() is None:
            self.stop_file.write_text("stop")
            try:
                self.poller.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.poller.kill()
                self.poller.wait(timeout=10)
        self.server.stop()

    def target(self) -> dict:
        return {"system": "redis", "url": self.server.url}

    def pids(self) -> dict[str, int]:
        return {"redis-server": self.server.proc.pid}

    def data_dirs(self) -> list[Path]:
        return [self.root]

    def settings(self) -> dict:
        return {"appendonly": "yes", "appendfsync": self.server.appendfsync, "poll_ms": self.args.redis_poll_ms,
                "producer": {"pipeline_batch": self.args.batch, "inflight_max": self.args.inflight},
                "poller": "Lua ZRANGEBYSCORE+ZREM+HMGET+HDEL+LPUSH, 1000 per call", "consumer": "BLMPOP 16 lists"}

    def used_memory(self) -> int:
        import redis

        return int(redis.Redis.from_url(self.server.url).info("memory")["used_memory"])

    async def produce(self, msgs, *, keep: bool = True) -> tuple[list[tuple[str, int]], float, int]:
        t0 = time.perf_counter()
        acked = await rb.produce(self.server.url, msgs, batch=self.args.batch, inflight=self.args.inflight)
        return acked, time.perf_counter() - t0, 0


def make_system(name: str, work: Path, args):
    if name == "hourglass":
        return Hourglass(work, args)
    if name.startswith("redis-"):
        return Redis(work, args, name.split("-", 1)[1])
    raise SystemExit(f"unknown system {name}")


# ---------------------------------------------------------------------- phases


def payloads() -> list[bytes]:
    rnd = random.Random(42)
    return [rnd.randbytes(256) for _ in range(PAYLOAD_POOL)]


def dispatch_split(before: dict[float, float], after: dict[float, float]) -> dict:
    """Quantiles (as histogram bucket upper bounds, ms) of the delay node's due -> dispatched time."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0
    out = {"count": int(total)}
    for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
        le = next((le for le, c in delta if c >= q * total), None) if total else None
        out[f"{name}_le_ms"] = None if le is None else ("inf" if le == float("inf") else round(le * 1000, 1))
    return out


def phase1(system, work: Path, args) -> dict:
    pool = payloads()
    rnd = random.Random(args.seed)
    horizon_s = 13 + args.n / 5000 + LOST_AFTER_MS / 1000 + 30  # sending time is bounded by ~5k/s at worst
    hist0 = system.dispatch_histogram() if hasattr(system, "dispatch_histogram") else None
    cons = ConsumerProcess(work, f"{system.name}-p1", system.target(), SUBJECTS, args.n, horizon_s)
    try:
        msgs = ((f"p1-{i:08d}", SUBJECTS[i % 16], pool[i % PAYLOAD_POOL],
                 lambda: now_ms() + rnd.randint(3000, 13000)) for i in range(args.n))
        acked, seconds, errors = asyncio.run(system.produce(msgs))
        last_due = max(d for _, d in acked) if acked else now_ms()
        got = cons.wait(max(5.0, (last_due + LOST_AFTER_MS - now_ms()) / 1000 + 5))
    finally:
        cons.kill()
    out = {"bench": "e2e", "phase": "1", "system": system.name, "n": args.n, "acked": len(acked),
           "send_errors": errors, "accepted_per_s": round(len(acked) / seconds) if seconds else None,
           "send_seconds": round(seconds, 2), **score(acked, got)}
    if hist0 is not None:
        # the part of the lateness spent before the real-time node had the message stored
        out["delay_node_due_to_dispatched"] = dispatch_split(hist0, system.dispatch_histogram())
    return out


def phase1b(system, work: Path, args) -> dict:
    pool = payloads()
    hist0 = system.dispatch_histogram() if hasattr(system, "dispatch_histogram") else None
    cons = ConsumerProcess(work, f"{system.name}-p1b", system.target(), [HOL_SUBJECT], 1000, 60)
    try:
        async def go():
            head, _, _ = await system.produce(iter([("hol-head", HOL_SUBJECT, pool[0], lambda: now_ms() + 30_000)]))
            short, _, _ = await system.produce(
                ((f"hol-{i:05d}", HOL_SUBJECT, pool[i % PAYLOAD_POOL], lambda: now_ms() + 1000) for i in range(1000)))
            return short
        acked = asyncio.run(go())
        got = cons.wait(1 + LOST_AFTER_MS / 1000 + 5)
    finally:
        cons.kill()
    got = [(m, t) for m, t in got if m != "hol-head"]
    out = {"bench": "e2e", "phase": "1b", "system": system.name, "short_acked": len(acked), **score(acked, got)}
    if hist0 is not None:
        out["delay_node_due_to_dispatched"] = dispatch_split(hist0, system.dispatch_histogram())
    return out


def phase2(system, args) -> dict:
    pool = payloads()
    # warm the path once (connections, subject creation) so "before" is a serving server
    asyncio.run(system.produce(iter([("p2-warm", SUBJECTS[0], pool[0], lambda: now_ms() + 3_600_000)])))
    time.sleep(1)
    before = {name: tree_mem(p) for name, p in system.pids().items()}
    disk0 = sum(dir_bytes(d) for d in system.data_dirs())
    used0 = system.used_memory() if hasattr(system, "used_memory") else None
    m = args.backlog
    msgs = ((f"p2-{i:09d}", SUBJECTS[i % 16], pool[i % PAYLOAD_POOL], lambda: now_ms() + 3_600_000)
            for i in range(m))
    acked, seconds, errors = asyncio.run(system.produce(msgs, keep=False))
    time.sleep(SETTLE_S)
    after = {name: tree_mem(p) for name, p in system.pids().items()}
    disk1 = sum(dir_bytes(d) for d in system.data_dirs())
    n = len(acked)

    def total(d):
        return {k: sum(v[k] for v in d.values()) for k in ("rss", "anon", "file")}

    b, a = total(before), total(after)
    out = {"bench": "e2e", "phase": "2", "system": system.name, "pending": n, "send_errors": errors,
           "enqueue_per_s": round(n / seconds) if seconds else None,
           "tree_rss_mb_before": {k: round(v / 2**20, 1) for k, v in b.items()},
           "tree_rss_mb_after": {k: round(v / 2**20, 1) for k, v in a.items()},
           "memory_bytes_per_pending": {k: round((a[k] - b[k]) / max(1, n), 1) for k in ("rss", "anon", "file")},
           "disk_bytes_per_pending": round((disk1 - disk0) / max(1, n), 1),
           "per_process_rss_mb_after": {name: {k: round(v[k] / 2**20, 1) for k in ("rss", "anon", "file")}
                                         for name, v in after.items()}}
    if used0 is not None:
        out["redis_used_memory_bytes_per_pending"] = round((system.used_memory() - used0) / max(1, n), 1)
    return out


# ---------------------------------------------------------------------- main


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["phase"] == "1":
            la = r["lateness_ms"]
            lines.append(f"phase 1  {r['system']:16} accepted/s {r['accepted_per_s']!s:>8}  lateness p50 {la['p50']!s:>6}"
                         f" p99 {la['p99']!s:>6} p999 {la['p999']!s:>6} max {la['max']!s:>6} ms  lost {r['lost']}"
                         f"  dup {r['duplicates']}")
        elif r["phase"] == "1b":
            la = r["lateness_ms"]
            lines.append(f"phase 1b {r['system']:16} short ones: p50 {la['p50']!s:>6} p99 {la['p99']!s:>6} "
                         f"max {la['max']!s:>6} ms  lost {r['lost']}")
        elif r["phase"] == "2":
            mb = r["memory_bytes_per_pending"]
            lines.append(f"phase 2  {r['system']:16} pending {r['pending']}  enqueue/s {r['enqueue_per_s']}  "
                         f"memory B/pending rss {mb['rss']} (anon {mb['anon']}, file {mb['file']})  "
                         f"disk B/pending {r['disk_bytes_per_pending']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000, help="phase 1 messages")
    p.add_argument("--backlog", type=int, default=1_000_000, help="phase 2 pending messages")
    p.add_argument("--systems", default="hourglass,redis-always,redis-everysec")
    p.add_argument("--phases", default="1,1b,2")
    p.add_argument("--batch", type=int, default=500, help="client batch (Hourglass batch_max, Redis pipeline)")
    p.add_argument("--inflight", type=int, default=8, help="batches in flight")
    p.add_argument("--redis-poll-ms", type=int, default=10, help="Redis poller interval (Hourglass tick is 10 ms)")
    p.add_argument("--ack-interval-ms", type=int, default=0,
                   help="Hourglass consumer: ack at most this often per subject (0: after every pull)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None, help="where servers keep data (default: system temp)")
    p.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    for k in ("target", "subjects", "out", "ready-file", "stop-file"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    p.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.consumer:
        consumer_main(a)
        return

    phases = a.phases.split(",")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="hg-bench-e2e-", dir=a.dir))
    try:
        for name in a.systems.split(","):
            if "1" in phases or "1b" in phases:
                sysm = make_system(name, work / "p1", a).start()
                try:
                    for ph, fn in (("1", phase1), ("1b", phase1b)):
                        if ph in phases:
                            load = machine()["loadavg"]
                            r = fn(sysm, work, a)
                            r["settings"] = {**sysm.settings(), "loadavg_at_start": load}
                            emit(r)
                            rows.append(r)
                finally:
                    sysm.stop()
            if "2" in phases:
                sysm = make_system(name, work / "p2", a).start()  # a fresh server
                try:
                    load = machine()["loadavg"]
                    r = phase2(sysm, a)
                    r["settings"] = {**sysm.settings(), "payload_bytes": 256, "due": "now + 1 h",
                                     "loadavg_at_start": load}
                    emit(r)
                    rows.append(r)
                finally:
                    sysm.stop()
                shutil.rmtree(work / "p2", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
