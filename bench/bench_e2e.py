"""BENCHMARK.md phases 1, 1b, sustain and 2, end to end, Hourglass and a Redis sorted-set
delay queue side by side in one run.

Hourglass: SDK ``Producer.send_many`` (this process is the "SDK producer" process) ->
delay node -> real-time node -> SDK ``Consumer.batches()`` over all 16 subjects (a
separate process), nodes started by ``LocalCluster``.
Redis: the queue in ``bench_redis_baseline.py`` (redis-server with AOF, a poller
process, the same consumer process reading ready lists), once with
``appendfsync always`` (durability parity: acknowledged = fsynced, as Hourglass)
and once with ``appendfsync everysec`` (Redis's default AOF mode).

* phase 1: N messages, 256 random bytes, 16 subjects, due at send time + uniform
  3..13 s, sent in calls of ``--batch``; accepted msgs/s from first send to last
  acknowledgement; lateness = receive time - due time, p50/p99/p999/max; lost =
  acknowledged and not received by due + 30 s; duplicates.
* phase 1b: 1 message due in 30 s, then 1,000 due in 1 s: lateness of the 1,000.
* sustain: open loop; for each rate R of ``--rates`` (default the ladder 2k..160k),
  for ``--sustain-s``: every 10 ms send what R owes as one batch (a slow send makes
  the next batch larger; the sender never waits for the system to drain), each
  message due at send time + uniform 1..5 s. Per R: achieved rate (acknowledged /
  first send to last ack), lateness, lost, duplicates, and whether R *holds*:
  >= 98% of R and p99 <= 10 ms, lateness counted over every acknowledged message
  with a lost one as infinitely late. The climb stops after a rate fails badly
  (< 90% of R, or p99 over 1 s). Headline: highest R held, and highest held at
  p99 <= 50 ms.
* phase 2: a fresh server, M messages due in one hour; resident memory of the
  server process tree before and after (anon = heap, file = mmap'd file pages),
  memory and disk bytes per pending message, enqueue rate.

Every phase reports CPU seconds per message of each process (utime + stime from
``/proc/<pid>/stat``, children excluded): the producer (this process), each server
process, the consumer process (measured by itself), beside the load average.
One JSON line per system and phase, then a side-by-side table on stderr.

    python bench/bench_e2e.py --n 100000 --backlog 1000000
    python bench/bench_e2e.py --n 2000 --backlog 20000 --phases 1,sustain --rates 2000,5000 --sustain-s 5
    python bench/bench_e2e.py --systems redis-always --phases sustain

``--client user`` (issue 28) runs the README's code instead: a producer process and a
consumer process against ``hourglass dev up``'s cluster and Redis, phases sustain and burst
(``bench/e2e_user.py``; docs/benchmarks.md, "User-mode client (issue 28)"):

    python bench/bench_e2e.py --client user --sustain-s 30 --stalls
    python bench/bench_e2e.py --client user --delay-groups 2 --realtime-groups 3 --replicas 2   # any shape (issue 30)
    python bench/bench_e2e.py --client user --systems hourglass --phases sustain --delay-groups 4 --realtime-groups 4 \
        --node-cpu-quota 0.2 --producer-mode open --rates 1600,6400   # nodes under a CPU quota (bench_scale.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, CpuMeter, cpu_s, dir_bytes, emit, lateness_summary, machine, tree_mem  # noqa: E402

import bench_redis_baseline as rb  # noqa: E402

SUBJECTS = [f"bench.s{i}" for i in range(16)]
HOL_SUBJECT = "bench.hol"
LOST_AFTER_MS = 30_000
CONSUMER_START_TIMEOUT_S = 60.0
CONSUMER_POLL_S = 0.1          # how often the consumer looks at its expect / stop files
PAYLOAD_POOL = 1024
SETTLE_S = 3.0  # after the last ack of phase 2, before measuring (iterator, checkpoint, page-cache)
LADDER = (2_000, 5_000, 10_000, 20_000, 40_000, 80_000, 160_000)
SUSTAIN_TICK_S = 0.010
SUSTAIN_DUE_MS = (1_000, 5_000)
HOLD_RATE_FRACTION = 0.98
HOLD_P99_MS = 10
HOLD_P99_LOOSE_MS = 50
BAD_RATE_FRACTION = 0.90       # below this, or p99 above BAD_P99_MS: stop climbing
BAD_P99_MS = 1_000
SEND_FINISH_TIMEOUT_S = 120.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---------------------------------------------------------------------- consumer process
#
# The consumer records what it receives as blocks "T <received_ms>" + one id a line, and
# its own CPU seconds as the first line "#cpu <seconds>": cheap to write (one join per
# batch), so that the figure it reports is the SDK's, not the recording's.


class _Watch:
    """Stop rules of a consumer process: the deadline, the stop file, or ``expect``
    receipts (the expect file, written once the producer knows how many were acked,
    overrides the command line's)."""

    def __init__(self, a) -> None:
        self.deadline = time.monotonic() + a.timeout_s
        self.stop_file = a.stop_file
        self.expect_file = a.stop_file + ".expect"
        self.expect = a.expect
        self.got = 0

    def done(self) -> bool:
        if os.path.exists(self.expect_file):
            try:
                self.expect = int(Path(self.expect_file).read_text() or self.expect)
            except ValueError:
                pass
        return self.got >= self.expect or time.monotonic() > self.deadline or os.path.exists(self.stop_file)


async def _consume_hourglass(target: dict, subjects: list[str], watch: _Watch, out, stages: bool = False) -> None:
    from cluster.client import Consumer, StaticResolver

    resolver = StaticResolver(delay=target["delay"], realtime=target["realtime"])
    consumer = Consumer(resolver, subjects, group="bench", consumer_id="bench", batch_max=1000, wait_ms=200)

    async def watchdog() -> None:
        while not watch.done():
            await asyncio.sleep(CONSUMER_POLL_S)
        await consumer.close()  # ends the iteration below, in-flight long poll included

    dog = asyncio.create_task(watchdog())
    try:
        async for batch in consumer.batches():
            out.write(f"T {batch.received_ms}\n" + "\n".join(batch.ids) + "\n")
            if stages:  # when the real-time node stored each message (--stages)
                out.write("S " + " ".join(map(str, batch.batch.store_ms.tolist())) + "\n")
            watch.got += len(batch)
            await batch.ack(defer=True)  # rides on the next pull
    finally:
        dog.cancel()
        await consumer.close()


def _consume_redis(target: dict, subjects: list[str], watch: _Watch, out) -> None:
    import redis

    r = redis.Redis.from_url(target["url"])
    keys = [f"ready:{s}" for s in subjects]
    while not watch.done():
        res = r.blmpop(0.2, len(keys), *keys, direction="RIGHT", count=1000)
        if res is None:
            continue
        ids = [item.split(b"|", 1)[0].decode() for item in res[1]]
        out.write(f"T {now_ms()}\n" + "\n".join(ids) + "\n")
        watch.got += len(ids)


def consumer_main(a) -> None:
    target = json.loads(a.target)
    subjects = a.subjects.split(",")
    watch = _Watch(a)
    body = Path(a.out + ".body")
    Path(a.ready_file).write_text("ready")
    c0 = cpu_s()
    try:
        with open(body, "w") as out:
            if target["system"] == "hourglass":
                asyncio.run(_consume_hourglass(target, subjects, watch, out, a.stages))
            else:
                _consume_redis(target, subjects, watch, out)
    finally:  # what was received counts even if the consumer failed
        cpu = cpu_s() - c0
        with open(a.out, "w") as f:
            f.write(f"#cpu {cpu}\n")
            with open(body) as b:
                shutil.copyfileobj(b, f)
        body.unlink()


class ConsumerProcess:
    def __init__(self, work: Path, name: str, target: dict, subjects: list[str], expect: int, timeout_s: float,
                 stages: bool = False):
        self.out = work / f"{name}.recv"
        self.stages: list[tuple[int, np.ndarray]] = []  # (block number, store_ms per id) with --stages
        self.ready = work / f"{name}.ready"
        self.stop_file = work / f"{name}.stop"
        self.cpu_s = 0.0
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--consumer", "--target", json.dumps(target), "--subjects",
             ",".join(subjects), "--expect", str(expect), "--timeout-s", str(timeout_s), "--out", str(self.out),
             "--ready-file", str(self.ready), "--stop-file", str(self.stop_file), *(["--stages"] if stages else [])],
            cwd=REPO)
        deadline = time.monotonic() + CONSUMER_START_TIMEOUT_S
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("consumer did not start")
            time.sleep(0.02)

    def expect(self, n: int) -> None:
        """The producer is done: the consumer may stop after n receipts."""
        tmp = Path(str(self.stop_file) + ".expect.tmp")
        tmp.write_text(str(n))
        tmp.rename(str(self.stop_file) + ".expect")

    def wait(self, timeout_s: float) -> list[tuple[int, list[str]]]:
        """Blocks of (received_ms, ids) once the consumer has stopped."""
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
        blocks: list[tuple[int, list[str]]] = []
        with open(self.out) as f:
            head = f.readline()
            self.cpu_s = float(head.split()[1]) if head.startswith("#cpu") else 0.0
            for line in f:
                line = line.rstrip("\n")
                if line.startswith("T "):
                    blocks.append((int(line[2:]), []))
                elif line.startswith("S "):
                    self.stages.append((len(blocks) - 1, np.array(line[2:].split(), np.int64)))
                elif line and blocks:
                    blocks[-1][1].append(line)
        return blocks

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------------- scoring


class Acked:
    """Acknowledged messages of a phase whose ids are ``{prefix}{i}``: due time by i
    (-1 = not acknowledged), as one array."""

    def __init__(self, prefix: str, n: int) -> None:
        self.prefix = prefix
        self.due = np.full(n, -1, np.int64)

    def add(self, ids: list[str], due: np.ndarray) -> None:
        k = len(self.prefix)
        self.due[np.fromiter((int(i[k:]) for i in ids), np.int64, len(ids))] = due

    @property
    def count(self) -> int:
        return int((self.due >= 0).sum())


def score(acked: Acked, blocks: list[tuple[int, list[str]]], *, ignore: set[str] = frozenset()) -> dict:
    """received, lost (not received by due + 30 s), duplicates, early, lateness; and
    ``lateness_all_ms``: percentiles over every acked message, a lost one counted infinite."""
    k, n = len(acked.prefix), len(acked.due)
    first = np.full(n, np.iinfo(np.int64).max, np.int64)
    receipts = 0
    for t, ids in blocks:
        idx = np.fromiter((int(i[k:]) for i in ids if i.startswith(acked.prefix) and i not in ignore), np.int64)
        idx = idx[(idx >= 0) & (idx < n)]
        receipts += len(idx)
        np.minimum.at(first, idx, t)
    ok = acked.due >= 0
    got = ok & (first != np.iinfo(np.int64).max)
    late = (first - acked.due)[got]
    in_time = late <= LOST_AFTER_MS
    lost = int(ok.sum() - in_time.sum())
    all_late = np.concatenate((late[in_time].astype(float), np.full(lost, np.inf)))
    summary_all = lateness_summary(all_late.tolist()) if len(all_late) else lateness_summary([])
    distinct = int((first != np.iinfo(np.int64).max).sum())
    return {"received": int(got.sum()), "lost": lost, "duplicates": receipts - distinct,
            "early": int((late < 0).sum()), "lateness_ms": lateness_summary(late[in_time].tolist()),
            "lateness_all_ms": {q: summary_all[q] for q in ("p50", "p99", "p999", "max")}}


def stage_split(acked: Acked, blocks: list[tuple[int, list[str]]], stages: list[tuple[int, np.ndarray]]) -> dict:
    """Lateness split at the real-time node's store time (``--stages``): due -> stored (the
    delay node firing and dispatching, the real-time append) and stored -> received (group
    commit, the pull, the consumer), percentiles over every receipt."""
    k, n = len(acked.prefix), len(acked.due)
    before, after = [], []
    for b, store_ms in stages:
        t, ids = blocks[b]
        idx = np.fromiter((int(i[k:]) if i.startswith(acked.prefix) else -1 for i in ids), np.int64, len(ids))
        ok = (idx >= 0) & (idx < n)
        ok[ok] &= acked.due[idx[ok]] >= 0
        before.append(store_ms[ok] - acked.due[idx[ok]])
        after.append(t - store_ms[ok])
    if not before:
        return {}
    return {"due_to_stored": lateness_summary(np.concatenate(before).tolist()),
            "stored_to_received": lateness_summary(np.concatenate(after).tolist())}


# ---------------------------------------------------------------------- systems


class HourglassSender:
    """The SDK producer: ``submit`` is one ``send_many`` call; it waits only when the
    producer's bounded queue is full (the open loop then falls behind, and says so).
    ``acked``: (ids, due) per call, the refused left out (only counted without ``keep``)."""

    def __init__(self, producer, *, keep: bool = True) -> None:
        self.p = producer
        self.keep = keep
        self.futs: list[tuple[asyncio.Future, list[str], np.ndarray]] = []
        self.acked: list[tuple[list[str], np.ndarray]] = []
        self.count = 0
        self.errors = 0
        self.last_ack = time.perf_counter()

    def _done(self, fut: asyncio.Future) -> None:
        self.last_ack = time.perf_counter()

    async def submit(self, ids: list[str], subjects: list[str], payloads: list[bytes], due: np.ndarray, *,
                     wait: bool = True) -> None:
        fut = await self.p.send_many(subjects, payloads, ids=ids, deliver_at_ms=due)
        fut.add_done_callback(self._done)
        self.futs.append((fut, ids, due) if self.keep else (fut, [], due[:0]))

    async def finish(self) -> None:
        for fut, ids, due in self.futs:
            res = await fut
            self.count += len(res) - len(res.errors)
            self.errors += len(res.errors)
            if not self.keep:
                continue
            if res.errors:
                keep = np.ones(len(ids), bool)
                keep[list(res.errors)] = False
                self.acked.append(([i for i, k in zip(ids, keep) if k], due[keep]))
            else:
                self.acked.append((ids, due))
        self.futs = []


class Hourglass:
    name = "hourglass"

    def __init__(self, work: Path, args) -> None:
        from cluster.devcluster import LocalCluster

        from common import free_port

        self.root = work / "hourglass"
        env = {"HOURGLASS_LOG_LEVEL": "WARNING"}
        for kv in args.node_env:  # e.g. HOURGLASS_DISPATCH_ROUND_INTERVAL_MS=5: settings under test
            k, _, v = kv.partition("=")
            env[k] = v
        self.cluster = LocalCluster(self.root, env=env, secure=args.secure)
        if args.secure:  # the producer here and the consumer process: a client certificate and the admin token
            os.environ.update(self.cluster.security.client_env())
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
                "realtime": [n.address for n in self.cluster.realtime]}

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
        return {"producer": {"api": "send_many", "call": self.args.batch, "linger_ms": 2,
                             "batch_max": self._batch_max(), "inflight_max": self.args.inflight},
                "consumer": {"api": "batches()", "subjects": 16, "batch_max": 1000, "wait_ms": 200,
                             "ack": "every batch"},
                "nodes": "1 delay + 1 real-time (LocalCluster defaults)", "node_env": self.args.node_env,
                "secure": self.args.secure}

    def sender(self):
        from cluster.client import Producer, StaticResolver

        t = self.target()
        return Producer(StaticResolver(delay=t["delay"], realtime=t["realtime"]), batch_max=self._batch_max(),
                        inflight_max=self.args.inflight, timeout_s=60)

    def _batch_max(self) -> int:
        from cluster.clientsettings import CLIENT_DEFAULTS

        return self.args.sdk_batch_max or max(self.args.batch, CLIENT_DEFAULTS.producer.batch_max)

    async def produce(self, chunks, *, keep: bool = True) -> HourglassSender:
        async with self.sender() as p:
            s = HourglassSender(p, keep=keep)
            await chunks(s)
            await s.finish()
        return s


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
        out = {"redis-server": self.server.proc.pid}
        if self.poller is not None:
            out["poller"] = self.poller.pid
        return out

    def data_dirs(self) -> list[Path]:
        return [self.root]

    def settings(self) -> dict:
        return {"appendonly": "yes", "appendfsync": self.server.appendfsync, "poll_ms": self.args.redis_poll_ms,
                "producer": {"pipeline_batch": self.args.batch, "inflight_max": self.args.inflight},
                "poller": "Lua ZRANGEBYSCORE+ZREM+HMGET+HDEL+LPUSH, 1000 per call", "consumer": "BLMPOP 16 lists"}

    def used_memory(self) -> int:
        import redis

        return int(redis.Redis.from_url(self.server.url).info("memory")["used_memory"])

    async def produce(self, chunks, *, keep: bool = True) -> rb.RedisSender:
        s = rb.RedisSender(self.server.url, inflight_max=self.args.inflight, keep=keep)
        await chunks(s)
        await s.finish()
        return s


def make_system(name: str, work: Path, args):
    if name == "hourglass":
        return Hourglass(work, args)
    if name.startswith("redis-"):
        return Redis(work, args, name.split("-", 1)[1])
    raise SystemExit(f"unknown system {name}")


# ---------------------------------------------------------------------- phases


def payloads() -> list[bytes]:
    rnd = np.random.default_rng(42)
    return [rnd.bytes(256) for _ in range(PAYLOAD_POOL)]


def dispatch_split(before: dict[float, float], after: dict[float, float]) -> dict:
    """Quantiles (as histogram bucket upper bounds, ms) of the delay node's due -> dispatched time."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0
    out = {"count": int(total)}
    for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
        le = next((le for le, c in delta if c >= q * total), None) if total else None
        out[f"{name}_le_ms"] = None if le is None else ("inf" if le == float("inf") else round(le * 1000, 1))
    return out


EAGER_MAX = 200_000  # closed loops up to this size build their lists before the clock (and CPU meter) starts


def closed_loop(prefix: str, n: int, call: int, due_ms, pool: list[bytes], subjects: list[str] = SUBJECTS):
    """Chunks of ``call`` messages ``{prefix}{i}``, sent as fast as the sender takes them;
    ``due_ms(k)`` gives the offsets from send time of k messages. Small runs build
    their id/subject/payload lists up front so the producer's CPU is the SDK's."""
    def chunk(lo: int) -> tuple[list[str], list[str], list[bytes]]:
        hi = min(n, lo + call)
        return ([f"{prefix}{i}" for i in range(lo, hi)], [subjects[i % len(subjects)] for i in range(lo, hi)],
                [pool[i % PAYLOAD_POOL] for i in range(lo, hi)])

    ready = [chunk(lo) for lo in range(0, n, call)] if n <= EAGER_MAX else None

    async def run(sender) -> None:
        for k, lo in enumerate(range(0, n, call)):
            ids, subs, pays = ready[k] if ready is not None else chunk(lo)
            await sender.submit(ids, subs, pays, now_ms() + due_ms(len(ids)))
    return run


def cpu_report(meter: CpuMeter, counts: dict[str, int], consumer: ConsumerProcess, received: int) -> dict:
    out = meter.per_message_us(counts)
    out["consumer"] = {"cpu_s": round(consumer.cpu_s, 3), "messages": received,
                       "us_per_msg": round(consumer.cpu_s / received * 1e6, 2) if received else None}
    return out


def _acked(prefix: str, n: int, sender) -> Acked:
    acked = Acked(prefix, n)
    for ids, due in sender.acked:
        acked.add(ids, due)
    return acked


def produce_and_receive(system, cons, batches, prefix: str, n_max: int):
    """Send ``batches``, then wait until the consumer has everything acknowledged or the
    last due time + LOST_AFTER_MS has passed; the consumer is stopped either way."""
    try:
        sender = asyncio.run(system.produce(batches))
        acked = _acked(prefix, n_max, sender)
        cons.expect(acked.count)
        last_due = int(acked.due.max()) if acked.count else now_ms()
        blocks = cons.wait(max(5.0, (last_due + LOST_AFTER_MS - now_ms()) / 1000 + 5))
    finally:
        cons.kill()
    return sender, acked, blocks


def phase1(system, work: Path, args) -> dict:
    pool = payloads()
    rnd = np.random.default_rng(args.seed)
    horizon_s = 13 + args.n / 5000 + LOST_AFTER_MS / 1000 + 30  # sending time is bounded by ~5k/s at worst
    hist0 = system.dispatch_histogram() if hasattr(system, "dispatch_histogram") else None
    cons = ConsumerProcess(work, f"{system.name}-p1", system.target(), SUBJECTS, args.n, horizon_s)
    chunks = closed_loop("p1-", args.n, args.batch, lambda k: rnd.integers(3000, 13001, k), pool)
    meter = CpuMeter({"producer": "self", **system.pids()}).start()
    t0 = time.perf_counter()
    sender, acked, blocks = produce_and_receive(system, cons, chunks, "p1-", args.n)
    seconds = sender.last_ack - t0
    sc = score(acked, blocks)
    counts = {"producer": acked.count, **{k: acked.count for k in system.pids()}}
    out = {"bench": "e2e", "phase": "1", "system": system.name, "n": args.n, "acked": acked.count,
           "send_errors": sender.errors, "accepted_per_s": round(acked.count / seconds) if seconds > 0 else None,
           "send_seconds": round(seconds, 2), **sc,
           "cpu_us_per_msg": cpu_report(meter, counts, cons, sc["received"])}
    if hist0 is not None:
        # the part of the lateness spent before the real-time node had the message stored
        out["delay_node_due_to_dispatched"] = dispatch_split(hist0, system.dispatch_histogram())
    return out


def phase1b(system, work: Path, args) -> dict:
    pool = payloads()
    hist0 = system.dispatch_histogram() if hasattr(system, "dispatch_histogram") else None
    cons = ConsumerProcess(work, f"{system.name}-p1b", system.target(), [HOL_SUBJECT], 1000, 60)
    meter = CpuMeter({"producer": "self", **system.pids()}).start()
    try:
        async def go(sender) -> None:
            await sender.submit(["hol-head"], [HOL_SUBJECT], [pool[0]], np.array([now_ms() + 30_000]))
            await closed_loop("hol-", 1000, 1000, lambda k: np.full(k, 1000), pool, [HOL_SUBJECT])(sender)
        sender = asyncio.run(system.produce(go))
        acked = Acked("hol-", 1000)
        for ids, due in sender.acked:
            keep = [k for k, i in enumerate(ids) if i != "hol-head"]
            acked.add([ids[k] for k in keep], due[keep])
        cons.expect(acked.count)
        blocks = cons.wait(1 + LOST_AFTER_MS / 1000 + 5)
    finally:
        cons.kill()
    sc = score(acked, blocks, ignore={"hol-head"})
    counts = {"producer": acked.count, **{k: acked.count for k in system.pids()}}
    out = {"bench": "e2e", "phase": "1b", "system": system.name, "short_acked": acked.count, **sc,
           "cpu_us_per_msg": cpu_report(meter, counts, cons, sc["received"])}
    if hist0 is not None:
        out["delay_node_due_to_dispatched"] = dispatch_split(hist0, system.dispatch_histogram())
    return out


def open_loop(prefix: str, rate: int, seconds: float, pool: list[bytes], rnd):
    """The sustain sender: every 10 ms, what ``rate`` owes since the start, as one batch."""
    async def run(sender) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        tick = 0
        while (elapsed := loop.time() - t0) < seconds:
            owed = int(rate * elapsed) - sent
            if owed > 0:
                ids = [f"{prefix}{i}" for i in range(sent, sent + owed)]
                subs = [SUBJECTS[i % 16] for i in range(sent, sent + owed)]
                pays = [pool[i % PAYLOAD_POOL] for i in range(sent, sent + owed)]
                await sender.submit(ids, subs, pays, now_ms() + rnd.integers(*SUSTAIN_DUE_MS, owed, endpoint=True),
                                    wait=False)
                sent += owed
            tick += 1
            await asyncio.sleep(max(0.0, t0 + tick * SUSTAIN_TICK_S - loop.time()))
    return run


def sustain_step(system, work: Path, args, rate: int) -> dict:
    pool = payloads()
    rnd = np.random.default_rng(args.seed + rate)
    n_max = int(rate * args.sustain_s) + rate  # ids are indices below this
    prefix = f"r{rate}-"
    horizon_s = args.sustain_s + SUSTAIN_DUE_MS[1] / 1000 + LOST_AFTER_MS / 1000 + SEND_FINISH_TIMEOUT_S
    cons = ConsumerProcess(work, f"{system.name}-r{rate}", system.target(), SUBJECTS, n_max, horizon_s,
                           stages=args.stages and system.name == "hourglass")
    meter = CpuMeter({"producer": "self", **system.pids()}).start()
    sampler = Sampler(system, args.sample_s).start() if args.sample_s and hasattr(system, "data_dirs") else None
    t0 = time.perf_counter()
    try:
        sender, acked, blocks = produce_and_receive(system, cons,
                                                    open_loop(prefix, rate, args.sustain_s, pool, rnd), prefix, n_max)
    finally:
        samples = sampler.stop() if sampler else None
    seconds = max(sender.last_ack - t0, args.sustain_s)
    sc = score(acked, blocks)
    achieved = acked.count / seconds
    p99 = sc["lateness_all_ms"]["p99"]
    holds = achieved >= HOLD_RATE_FRACTION * rate and p99 is not None and p99 <= HOLD_P99_MS
    holds_loose = achieved >= HOLD_RATE_FRACTION * rate and p99 is not None and p99 <= HOLD_P99_LOOSE_MS
    bad = achieved < BAD_RATE_FRACTION * rate or p99 is None or p99 > BAD_P99_MS
    counts = {"producer": acked.count, **{k: acked.count for k in system.pids()}}
    if cons.stages:
        sc["stages_ms"] = stage_split(acked, blocks, cons.stages)
    out = {"bench": "e2e", "phase": "sustain", "system": system.name, "rate": rate, "seconds": args.sustain_s,
           "acked": acked.count, "send_errors": sender.errors, "achieved_per_s": round(achieved),
           "holds": holds, "holds_p99_50ms": holds_loose, "fails_badly": bad, **sc,
           "cpu_us_per_msg": cpu_report(meter, counts, cons, sc["received"])}
    if samples:
        out["samples"] = samples
    return out


class Sampler:
    """Every ``every_s`` during a sustain step (``--sample-s``, a soak): bytes on disk of
    each node's data folder and anonymous memory of each node process, on a thread."""

    def __init__(self, system, every_s: float) -> None:
        import threading

        self.system, self.every_s = system, every_s
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:

        pids = self.system.pids()
        while not self._stop.wait(self.every_s):
            self.rows.append({"t_s": round(time.monotonic() - self._t0),
                              "disk_mb": {d.name: round(dir_bytes(d) / 2**20, 1) for d in self.system.data_dirs()},
                              "anon_mb": {k: round(tree_mem(p)["anon"] / 2**20, 1) for k, p in pids.items()}})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.rows


def sustain(system, work: Path, args) -> list[dict]:
    rows = []
    for rate in args.rates:
        load = machine()["loadavg"]
        r = sustain_step(system, work, args, rate)
        r["settings"] = {**system.settings(), "due": "send + uniform 1..5 s", "tick_ms": 10, "loadavg_at_start": load,
                         "holds": f">= {HOLD_RATE_FRACTION:.0%} of R and p99 <= {HOLD_P99_MS} ms "
                                  "(lost = infinitely late)"}
        emit(r)
        rows.append(r)
        if r["fails_badly"]:
            break
    held = [r["rate"] for r in rows if r["holds"]]
    held_loose = [r["rate"] for r in rows if r["holds_p99_50ms"]]
    head = {"bench": "e2e", "phase": "sustain-headline", "system": system.name,
            "highest_rate_held": max(held, default=None), "highest_rate_held_p99_50ms": max(held_loose, default=None),
            "rates_tried": [r["rate"] for r in rows]}
    emit(head)
    return rows + [head]


def phase2(system, args) -> dict:
    pool = payloads()
    hour = lambda k: np.full(k, 3_600_000)  # noqa: E731
    # warm the path once (connections, subject creation) so "before" is a serving server
    asyncio.run(system.produce(closed_loop("p2-warm-", 1, 1, hour, pool)))
    time.sleep(1)
    before = {name: tree_mem(p) for name, p in system.pids().items()}
    disk0 = sum(dir_bytes(d) for d in system.data_dirs())
    used0 = system.used_memory() if hasattr(system, "used_memory") else None
    meter = CpuMeter({"producer": "self", **system.pids()}).start()
    t0 = time.perf_counter()
    sender = asyncio.run(system.produce(closed_loop("p2-", args.backlog, args.batch, hour, pool), keep=False))
    seconds = sender.last_ack - t0
    n = sender.count
    cpu = meter.per_message_us({"producer": n, **{k: n for k in system.pids()}})
    time.sleep(SETTLE_S)
    after = {name: tree_mem(p) for name, p in system.pids().items()}
    disk1 = sum(dir_bytes(d) for d in system.data_dirs())

    def total(d):
        return {k: sum(v[k] for v in d.values()) for k in ("rss", "anon", "file")}

    b, a = total(before), total(after)
    out = {"bench": "e2e", "phase": "2", "system": system.name, "pending": n, "send_errors": sender.errors,
           "enqueue_per_s": round(n / seconds) if seconds > 0 else None,
           "tree_rss_mb_before": {k: round(v / 2**20, 1) for k, v in b.items()},
           "tree_rss_mb_after": {k: round(v / 2**20, 1) for k, v in a.items()},
           "memory_bytes_per_pending": {k: round((a[k] - b[k]) / max(1, n), 1) for k in ("rss", "anon", "file")},
           "disk_bytes_per_pending": round((disk1 - disk0) / max(1, n), 1),
           "per_process_rss_mb_after": {name: {k: round(v[k] / 2**20, 1) for k in ("rss", "anon", "file")}
                                         for name, v in after.items()},
           "cpu_us_per_msg": cpu}
    if used0 is not None:
        out["redis_used_memory_bytes_per_pending"] = round((system.used_memory() - used0) / max(1, n), 1)
    return out


# ---------------------------------------------------------------------- main


def _cpu_cell(r: dict) -> str:
    cpu = r.get("cpu_us_per_msg") or {}
    return "  cpu us/msg " + " ".join(f"{k}={v['us_per_msg']}" for k, v in cpu.items()) if cpu else ""


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        la = r.get("lateness_ms") or {}
        if r["phase"] == "1":
            lines.append(f"phase 1  {r['system']:16} accepted/s {r['accepted_per_s']!s:>8}  "
                         f"lateness p50 {la['p50']!s:>6}"
                         f" p99 {la['p99']!s:>6} p999 {la['p999']!s:>6} max {la['max']!s:>6} ms  lost {r['lost']}"
                         f"  dup {r['duplicates']}" + _cpu_cell(r))
        elif r["phase"] == "1b":
            lines.append(f"phase 1b {r['system']:16} short ones: p50 {la['p50']!s:>6} p99 {la['p99']!s:>6} "
                         f"max {la['max']!s:>6} ms  lost {r['lost']}" + _cpu_cell(r))
        elif r["phase"] == "sustain":
            verdict = "HOLDS" if r["holds"] else ("holds@50ms" if r["holds_p99_50ms"] else "fails")
            lines.append(f"sustain  {r['system']:16} R {r['rate']:>7}  achieved/s {r['achieved_per_s']:>7}  "
                         f"p50 {la['p50']!s:>6} p99 {la['p99']!s:>6} p999 {la['p999']!s:>6} max {la['max']!s:>6} ms"
                         f"  lost {r['lost']}  dup {r['duplicates']}  {verdict}" + _cpu_cell(r))
            for name, st in (r.get("stages_ms") or {}).items():
                lines.append(f"           {name:>20}: p50 {st['p50']!s:>6} p99 {st['p99']!s:>6} p999 {st['p999']!s:>6} "
                             f"max {st['max']!s:>6} ms")
        elif r["phase"] == "sustain-headline":
            lines.append(f"sustain  {r['system']:16} headline: highest R held (p99 <= {HOLD_P99_MS} ms) "
                         f"{r['highest_rate_held']}, at p99 <= {HOLD_P99_LOOSE_MS} ms "
                         f"{r['highest_rate_held_p99_50ms']}")
        elif r["phase"] == "2":
            mb = r["memory_bytes_per_pending"]
            lines.append(f"phase 2  {r['system']:16} pending {r['pending']}  enqueue/s {r['enqueue_per_s']}  "
                         f"memory B/pending rss {mb['rss']} (anon {mb['anon']}, file {mb['file']})  "
                         f"disk B/pending {r['disk_bytes_per_pending']}" + _cpu_cell(r))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000, help="phase 1 messages")
    p.add_argument("--backlog", type=int, default=1_000_000, help="phase 2 pending messages")
    p.add_argument("--client", choices=("bench", "user"), default="bench",
                   help="bench: this process sends through its own open loop (phases 1, 1b, sustain, 2); "
                        "user: the README's code in a producer and a consumer process against `hourglass dev up`'s "
                        "cluster (phases sustain, burst; bench/e2e_user.py, docs/benchmarks.md issue 28)")
    p.add_argument("--systems", default=None,
                   help="default hourglass,redis-always,redis-everysec (--client user: hourglass,redis-always)")
    p.add_argument("--phases", default=None, help="default 1,1b,sustain,2 (--client user: sustain,burst)")
    p.add_argument("--rates", default=None,
                   help="sustain: rates to climb, msgs/s (default the ladder 2k..160k; --client user: "
                        "2000,5000,10000,20000,40000, every one run)")
    p.add_argument("--burst-n", type=int, default=100_000, help="--client user, burst: messages due 3..13 s later")
    p.add_argument("--burst-call", type=int, default=0,
                   help="--client user, burst: messages per awaited call (0: the whole burst in one send_many)")
    p.add_argument("--windows-json", default=None,
                   help="--client user: lateness per 100 ms window of every step, as JSON "
                        "(default bench/out/e2e-user-windows-<time>.json)")
    p.add_argument("--window-over-ms", type=int, default=50,
                   help="--client user: a 100 ms window whose max lateness passes this is counted in the table")
    p.add_argument("--stalls", action="store_true",
                   help="--client user: collect the nodes' 'event loop stalled' log lines of each step into the "
                        "report (threshold: node setting loop_stall_report_ms, default 200; e.g. "
                        "--node-env HOURGLASS_LOOP_STALL_REPORT_MS=20)")
    p.add_argument("--console", action="store_true",
                   help="--client user: hourglass console open on the Cluster and Schedule pages throughout "
                        "(bench/console_viewer.py); its CPU is the 'console' figure (issue 31)")
    p.add_argument("--sustain-s", type=float, default=30.0, help="sustain: seconds per rate")
    p.add_argument("--batch", type=int, default=1000,
                   help="messages per send call (Hourglass send_many, Redis pipeline)")
    p.add_argument("--sdk-batch-max", type=int, default=None,
                   help="Hourglass SDK: messages per wire request (default: the SDK's batch_max "
                        "default; calls queued together share a request)")
    p.add_argument("--inflight", type=int, default=8, help="batches in flight")
    p.add_argument("--redis-poll-ms", type=int, default=10, help="Redis poller interval")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--node-env", action="append", default=[], metavar="HOURGLASS_X=V",
                   help="a node setting for the Hourglass nodes (repeatable), e.g. HOURGLASS_DISPATCH_ROUND_INTERVAL_MS=5")
    p.add_argument("--secure", action="store_true",
                   help="hourglass: mutual TLS on every port and tokens checked (docs/security.md)")
    p.add_argument("--dir", default=None, help="where servers keep data (default: system temp)")
    p.add_argument("--sample-s", type=float, default=0,
                   help="sustain: sample each node's disk and memory this often (a soak)")
    p.add_argument("--stages", action="store_true",
                   help="sustain: split lateness at the real-time node's store time (due -> stored -> received)")
    p.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    for k in ("target", "subjects", "out", "ready-file", "stop-file"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    from cluster.devcluster import add_shape_arguments, shape_from_args
    add_shape_arguments(p)  # --client user: the shape of the `dev up` cluster (bench/e2e_user.py)
    p.add_argument("--node-cpu-quota", type=float, default=None, metavar="CORES",
                   help="--client user: each node process in its own cgroup v1 cpu group limited to CORES (e.g. 0.2; "
                        "root; bench/cgroupquota.py, issue 30); the meta server, etcd and the clients are not limited")
    p.add_argument("--node-cpu-period-us", type=int, default=100_000,
                   help="--client user with --node-cpu-quota: cpu.cfs_period_us (quota = CORES x this)")
    p.add_argument("--producers", type=int, default=1,
                   help="--client user, sustain: producer processes sharing each tick's messages (issue 30: enough "
                        "of them that one awaited call per process does not cap the rate offered)")
    p.add_argument("--producer-mode", choices=("awaited", "open"), default="awaited",
                   help="--client user, sustain: awaited = one call per tick, answered before the next (a slow call "
                        "skips ticks); open = every tick's send_many queued at once and its answer awaited after the "
                        "last tick (an open loop: the rate offered does not fall when calls slow down; issue 30)")
    p.add_argument("--climb", action="store_true",
                   help="--client user: stop a system's ladder after a rate under 90%% of offered or p99 over 1 s")
    p.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.consumer:
        consumer_main(a)
        return
    user = a.client == "user"
    a.shape = shape_from_args(p, a)
    if not user and a.shape.nodes > 2:
        p.error("--delay-groups/--realtime-groups/--replicas/--realtime-replicas: with --client user only "
                "(--client bench runs one delay and one real-time node, static)")
    import e2e_user  # noqa: E402  (the user mode; its constants are the defaults below)

    if a.systems is None:
        a.systems = "hourglass,redis-always" if user else "hourglass,redis-always,redis-everysec"
    if a.phases is None:
        a.phases = "sustain,burst" if user else "1,1b,sustain,2"
    if a.rates is None:
        a.rates = ",".join(map(str, e2e_user.USER_RATES if user else LADDER))
    a.rates = [int(x) for x in a.rates.split(",") if x]
    if user:
        if a.windows_json is None:
            a.windows_json = str(REPO / "bench" / "out" / f"e2e-user-windows-{time.strftime('%Y%m%d-%H%M%S')}.json")
        if a.dir:
            Path(a.dir).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="hg-bench-e2e-user-", dir=a.dir))
        try:
            e2e_user.run(a, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return

    phases = a.phases.split(",")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="hg-bench-e2e-", dir=a.dir))
    try:
        for name in a.systems.split(","):
            if {"1", "1b", "sustain"} & set(phases):
                sysm = make_system(name, work / "p1", a).start()
                try:
                    for ph, fn in (("1", phase1), ("1b", phase1b)):
                        if ph in phases:
                            load = machine()["loadavg"]
                            r = fn(sysm, work, a)
                            r["settings"] = {**sysm.settings(), "loadavg_at_start": load}
                            emit(r)
                            rows.append(r)
                    if "sustain" in phases:
                        rows += sustain(sysm, work, a)
                finally:
                    sysm.stop()
                shutil.rmtree(work / "p1", ignore_errors=True)
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
