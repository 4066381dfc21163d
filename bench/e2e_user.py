"""``bench_e2e.py --client user`` (issue 28, "Measure what users run"): the README's code as
two client processes against ``hourglass dev up``'s cluster, and a Redis sorted-set queue
driven by the same two processes in the same way.

* cluster: ``LocalCluster`` as ``hourglass dev up`` makes it (etcd, one meta server, by
  default one delay node and one real-time node: ``--delay-groups N --realtime-groups M
  --replicas R`` give any shape, issue 30; nodes' meta lease 6 s, log level INFO, open);
  the clients find it through the meta server (``MetaResolver``), as the README shows. No
  supervisor: a process that dies is reported, not restarted.
* producer process: ``async with Producer(resolver) as p`` with the SDK's defaults; every
  10 ms tick one call ``await (await p.send_many(subjects, payloads, ids=ids,
  delay_ms=delays))`` of rate/100 fresh random 256-byte payloads (``os.urandom``, built
  inside the tick) over the 16 subjects, each due 1..5 s later (uniform). A call is answered
  before the next tick; a tick whose time passed while a call was still out is skipped (and
  counted: ``ticks_missed``), so a slow call lowers the achieved rate instead of piling up.
  Due times are the node's (``BatchSendResult.deliver_at_ms``).
* consumer process: ``Consumer(resolver, subjects, group=...)`` with the SDK's defaults and
  ``async for batch in consumer.batches(): handle(batch.ids, batch.payloads); await
  batch.ack()``; ``handle`` takes the time when the loop sees the batch and records it with
  the ids (one write per batch). Lateness = that time - the message's deliver_at.
* Redis: ``bench_redis_baseline.py``'s server (AOF) and Lua poller; the producer process
  sends each tick as one awaited pipeline (``ZADD dq`` + ``HSET dq:body``, due computed by
  the client), the consumer process loops on ``BLMPOP`` over the 16 ready lists (no ack:
  a Redis list has none).
* burst: ``--burst-n`` (100,000) messages due 3..13 s later, as one awaited ``send_many``
  (or calls of ``--burst-call``; Redis: one pipeline per call); accepted msgs/s = messages
  / (first call -> last answer), and lateness.

Per step: lateness p50/p99/p999/max (a lost message, not seen by due + 30 s, counts
infinitely late in ``lateness_all_ms``), achieved msgs/s, lost, duplicates, and CPU
seconds per message of every process (``/proc/<pid>/stat`` utime + stime read by this
process before the producer starts and after the consumer has seen everything, both
client processes still alive): the nodes, the meta server, etcd, the producer and the
consumer. Lateness per 100 ms window (by due time: messages, max and p50 lateness; and
messages seen per window by receive time) goes to ``--windows-json``. ``--stalls`` collects
the nodes' ``event loop stalled`` lines logged during each step.

Control of the client processes: a line protocol on their stdin/stdout (``ready``, ``go``,
``done``, ``expect N DEADLINE_MS``, ``exit``); every wait is bounded, every child is stopped
by its PID.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, CpuMeter, emit, machine  # noqa: E402

SUBJECTS = [f"bench.s{i}" for i in range(16)]
GROUP = "bench-user"
PAYLOAD_BYTES = 256
TICK_S = 0.010
SUSTAIN_DELAY_MS = (1_000, 5_000)
BURST_DELAY_MS = (3_000, 13_000)
LOST_AFTER_MS = 30_000
WINDOW_MS = 100
USER_RATES = (2_000, 5_000, 10_000, 20_000, 40_000)
READY_TIMEOUT_S = 90.0          # a client process: imports, connections, warm-up
SEND_FINISH_TIMEOUT_S = 120.0   # the producer's last call after its last tick
EXIT_TIMEOUT_S = 20.0
CHILD_RUNTIME_MAX_S = 3600.0    # a client process gives up on its own after this
CONSUMER_GRACE_S = 1.0          # the consumer's first long poll is out before it says ready
LEASE_TTL_MS = 6000             # cluster/cli/dev.py LEASE_TTL_MS: ``dev up``'s nodes' meta lease
STALL_RE = re.compile(r"event loop (still )?stalled stall_ms=(\d+)|gc pause (?:generation=\d+ )?ms=(\d+)")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ====================================================================== client processes


class Control:
    """The child side of the line protocol: a thread reads stdin; the loop polls this."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.exit = threading.Event()
        self.expect: int | None = None
        self.deadline_ms: int | None = None
        threading.Thread(target=self._read, name="control", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            w = line.split()
            if not w:
                continue
            if w[0] == "go":
                self.go.set()
            elif w[0] == "expect":
                self.deadline_ms = int(w[2])
                self.expect = int(w[1])
            elif w[0] == "exit":
                break
        self.exit.set()  # "exit" or the parent's end of the pipe closed

    @staticmethod
    def say(word: str) -> None:
        sys.stdout.write(word + "\n")
        sys.stdout.flush()

    def wait_exit(self) -> None:
        self.exit.wait(CHILD_RUNTIME_MAX_S)


def _payloads(n: int) -> list[bytes]:
    blob = os.urandom(PAYLOAD_BYTES * n)
    return [blob[k:k + PAYLOAD_BYTES] for k in range(0, len(blob), PAYLOAD_BYTES)]


class Ticks:
    """Every 10 ms from ``start()``; a tick whose time has passed is skipped and counted."""

    def __init__(self, seconds: float) -> None:
        self.n_max = int(round(seconds / TICK_S))
        self.t0 = 0.0
        self.k = 0
        self.calls = 0
        self.missed = 0

    def start(self, t: float) -> None:
        self.t0 = t

    def next_wait(self, t: float) -> float | None:
        """After a call ending at ``t``: seconds to sleep before the next tick, None when over."""
        self.calls += 1
        k = self.k + 1
        due = int((t - self.t0) / TICK_S) + 1  # the first tick not yet passed
        if due > k:
            self.missed += due - k
            k = due
        self.k = k
        if k >= self.n_max:
            return None
        return max(0.0, self.t0 + k * TICK_S - t)


def owed(per: int, elapsed_s: float, sent: int, total: int) -> int:
    """The open loop's next call: the messages of every tick begun by ``elapsed_s`` (``per`` a
    tick) not sent yet, at most ``total`` in all."""
    return max(0, min(total, (int(elapsed_s / TICK_S) + 1) * per) - sent)


async def _produce(cfg: dict, ctl: Control) -> dict:
    """The producer's run; returns its report (the due array is saved beside it)."""
    import asyncio

    rnd = np.random.default_rng(cfg["seed"])
    prefix, kind, system = cfg["prefix"], cfg["kind"], cfg["target"]["system"]
    n_max = cfg["n_max"]
    base = cfg.get("id_base", 0)  # --producers P: producer j's ids start at its base (issue 30)
    due = np.full(n_max, -1, np.int64)
    loop = asyncio.get_running_loop()
    if system == "hourglass":
        from cluster.client import Producer
        from cluster.discovery import MetaResolver

        resolver = MetaResolver(cfg["target"]["meta"])
        client = Producer(resolver)

        def record(lo: int, res) -> int:
            due[lo:lo + len(res)] = res.deliver_at_ms
            if res.errors:
                due[lo + np.fromiter(res.errors, np.int64, len(res.errors))] = -1
            return len(res.errors)

        async def call(lo: int, ids, subjects, payloads, delays) -> int:
            return record(lo, await (await client.send_many(subjects, payloads, ids=ids, delay_ms=delays)))

        open_futs: list = []  # --producer-mode open: (lo, n, future) of calls queued and not awaited yet

        async def call_open(lo: int, ids, subjects, payloads, delays) -> int:
            open_futs.append((lo, len(ids), await client.send_many(subjects, payloads, ids=ids, delay_ms=delays)))
            return 0

        async def drain_open() -> tuple[int, list[str]]:
            errs, msgs = 0, []
            for lo, n, fut in open_futs:
                try:
                    errs += record(lo, await fut)
                except Exception as e:  # the whole call failed
                    errs += n
                    msgs.append(repr(e)[:200])
            open_futs.clear()
            return errs, msgs

        async def warm() -> None:  # connections and routes, as a running service has them
            await call(0, [f"warm-{prefix}{base}-{k}" for k in range(16)], SUBJECTS, _payloads(16), [100] * 16)
            due[:16] = -1

        async def close() -> None:
            await client.close()
            await resolver.close()
    else:
        import redis.asyncio as aredis

        client = aredis.Redis.from_url(cfg["target"]["url"])

        async def call(lo: int, ids, subjects, payloads, delays) -> int:
            d = now_ms() + np.asarray(delays, np.int64)
            async with client.pipeline(transaction=False) as pl:
                pl.zadd("dq", dict(zip(ids, d.tolist())))
                pl.hset("dq:body", mapping={i: s.encode() + b"|" + p for i, s, p in zip(ids, subjects, payloads)})
                await pl.execute()
            due[lo:lo + len(ids)] = d
            return 0

        async def warm() -> None:
            await client.ping()

        async def close() -> None:
            await client.aclose()

    errors = 0
    out: dict = {"kind": kind}
    try:
        await warm()
        ctl.say("ready")
        if not await asyncio.to_thread(ctl.go.wait, READY_TIMEOUT_S * 4):
            raise SystemExit("producer: no go")
        out["start_ms"] = now_ms()
        if kind == "sustain":
            opened = cfg.get("mode") == "open" and system == "hourglass"
            send = call_open if opened else call
            per = cfg.get("per") or max(1, cfg["rate"] // 100)
            ticks = Ticks(cfg["seconds"])
            ticks.start(loop.time())
            sent = 0
            call_s: list[float] = []  # each answered call's time, payloads built to answer (awaited mode)
            total = ticks.n_max * per  # what the open loop owes by its end
            while sent + per <= n_max and not ctl.exit.is_set():
                # awaited: one tick's messages per call. open: what the clock owes so far (a tick the
                # loop woke up late for is carried by the next call, as bench_e2e's open loop does)
                n = per if not opened else owed(per, loop.time() - ticks.t0, sent, total)
                if n > 0:
                    ids = [f"{prefix}{base + i}" for i in range(sent, sent + n)]
                    subjects = [SUBJECTS[i % 16] for i in range(sent, sent + n)]
                    delays = rnd.integers(SUSTAIN_DELAY_MS[0], SUSTAIN_DELAY_MS[1], n, endpoint=True).tolist()
                    t_call = loop.time()
                    try:
                        errors += await send(sent, ids, subjects, _payloads(n), delays)
                        call_s.append(loop.time() - t_call)
                    except Exception as e:  # a whole call failed: its messages are not acknowledged
                        errors += n
                        out.setdefault("call_errors", []).append(repr(e)[:200])
                    sent += n
                wait = ticks.next_wait(loop.time())
                if wait is None:
                    break
                if wait:
                    await asyncio.sleep(wait)
            if opened and sent < total and not ctl.exit.is_set():  # the last ticks' messages, if the loop was late
                lo, n = sent, total - sent
                ids = [f"{prefix}{base + i}" for i in range(lo, lo + n)]
                delays = rnd.integers(SUSTAIN_DELAY_MS[0], SUSTAIN_DELAY_MS[1], n, endpoint=True).tolist()
                errors += await send(lo, ids, [SUBJECTS[i % 16] for i in range(lo, lo + n)], _payloads(n), delays)
                sent = total
            if opened:  # every answer, after the last tick
                out["last_enqueue_ms"] = now_ms()
                e, msgs = await drain_open()
                errors += e
                if msgs:
                    out.setdefault("call_errors", []).extend(msgs)
            out.update(sent=sent, per_call=per, calls=ticks.calls, ticks_missed=ticks.missed,
                       mode="open" if opened else "awaited", call_ms=_call_ms(call_s))
        else:  # burst: built first, then timed from the first call to the last answer
            n, step = cfg["n"], cfg["call"] or cfg["n"]
            chunks = []
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                chunks.append((lo, [f"{prefix}{i}" for i in range(lo, hi)], [SUBJECTS[i % 16] for i in range(lo, hi)],
                               _payloads(hi - lo),
                               rnd.integers(BURST_DELAY_MS[0], BURST_DELAY_MS[1], hi - lo, endpoint=True).tolist()))
            out["start_ms"] = now_ms()
            for lo, ids, subjects, payloads, delays in chunks:
                try:
                    errors += await call(lo, ids, subjects, payloads, delays)
                except Exception as e:
                    errors += len(ids)
                    out.setdefault("call_errors", []).append(repr(e)[:200])
            out.update(sent=n, per_call=step, calls=len(chunks))
        out["end_ms"] = now_ms()
    finally:
        await close()
    out["errors"] = errors
    out["acked"] = int((due >= 0).sum())
    np.save(cfg["out"] + ".npy", due)
    return out


def _call_ms(call_s: list[float]) -> dict:
    """p50 / p99 / max of the producer's answered calls, ms (what a tick's ``send_many`` took)."""
    if not call_s:
        return {}
    a = np.asarray(call_s) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "max": round(float(a.max()), 2)}


def producer_main(cfg: dict) -> None:
    import asyncio

    ctl = Control()
    report = asyncio.run(_produce(cfg, ctl))
    Path(cfg["out"] + ".json").write_text(json.dumps(report))
    ctl.say("done")
    ctl.wait_exit()


class _Seen:
    """What the consumer's handler keeps: one block per batch (the time the loop saw it,
    the ids), written as it goes; and the count of this step's ids."""

    def __init__(self, path: str, prefix: str, ctl: Control) -> None:
        self.f = open(path, "w")
        self.prefix = prefix
        self.ctl = ctl
        self.got = 0
        self.t_end = time.monotonic() + CHILD_RUNTIME_MAX_S

    def handle(self, ids: list[str], payloads: list[bytes]) -> None:
        t = now_ms()
        self.f.write(f"T {t}\n" + "\n".join(ids) + "\n")
        p = self.prefix
        self.got += sum(1 for i in ids if i.startswith(p))

    def done(self) -> bool:
        c = self.ctl
        if c.exit.is_set() or time.monotonic() > self.t_end:
            return True
        if c.expect is None:
            return False
        return self.got >= c.expect or now_ms() > c.deadline_ms

    def close(self) -> None:
        self.f.close()


async def _consume_hourglass(cfg: dict, seen: _Seen, ctl: Control) -> None:
    import asyncio

    from cluster import errors as E
    from cluster.client import Consumer
    from cluster.discovery import MetaResolver

    resolver = MetaResolver(cfg["target"]["meta"])
    consumer = Consumer(resolver, SUBJECTS, group=GROUP)

    handling = False  # between a batch's arrival and its ack's answer: the watchdog leaves it be

    async def loop_() -> None:  # the README's loop
        nonlocal handling
        try:
            async for batch in consumer.batches():
                handling = True
                seen.handle(batch.ids, batch.payloads)
                await batch.ack()
                handling = False
                if seen.done():
                    break
        except E.HourglassError:
            if not seen.done():  # not the watchdog's close: a real failure
                raise

    async def watchdog() -> None:
        while not seen.done() or handling:
            await asyncio.sleep(0.05)
        await consumer.close()  # ends the loop waiting in a long poll

    task = asyncio.create_task(loop_())
    dog = asyncio.create_task(watchdog())
    await asyncio.sleep(CONSUMER_GRACE_S)
    ctl.say("ready")
    try:
        await task
    finally:
        dog.cancel()
        await consumer.close()
        await resolver.close()


def _consume_redis(cfg: dict, seen: _Seen, ctl: Control) -> None:
    import redis

    r = redis.Redis.from_url(cfg["target"]["url"])
    keys = [f"ready:{s}" for s in SUBJECTS]
    ctl.say("ready")
    while not seen.done():
        res = r.blmpop(0.2, len(keys), *keys, direction="RIGHT", count=1000)
        if res is None:
            continue
        items = [item.split(b"|", 1) for item in res[1]]
        seen.handle([i[0].decode() for i in items], [i[1] for i in items])
    r.close()


def consumer_main(cfg: dict) -> None:
    import asyncio

    ctl = Control()
    seen = _Seen(cfg["out"], cfg["prefix"], ctl)
    try:
        if cfg["target"]["system"] == "hourglass":
            asyncio.run(_consume_hourglass(cfg, seen, ctl))
        else:
            _consume_redis(cfg, seen, ctl)
    finally:
        seen.close()
    ctl.say(f"done {seen.got}")
    ctl.wait_exit()


# ====================================================================== the parent side


class Child:
    """A client process: started with its config, spoken to on stdin, heard on stdout."""

    def __init__(self, role: str, cfg: dict) -> None:
        self.role = role
        self.proc = subprocess.Popen([sys.executable, __file__, role, json.dumps(cfg)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, word: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role} pid={self.pid}: no '{word}' within {timeout_s:.0f} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.role} pid={self.pid} exited ({self.proc.wait(timeout=10)}) "
                                   f"before '{word}'")
            if line.split(" ", 1)[0] == word:
                return line

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def stop(self) -> None:
        """``exit``, then SIGKILL by PID if it does not go."""
        if self.proc.poll() is None:
            self.send("exit")
            try:
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class HourglassDev:
    """``hourglass dev up``'s cluster (cluster/cli/dev.py ``up``): etcd, a meta server and the
    shape given (``--delay-groups --realtime-groups --replicas --realtime-replicas``; default a
    delay node and a real-time node); the nodes register through the meta server."""

    name = "hourglass"

    def __init__(self, work: Path, args) -> None:
        from cluster.devcluster import LocalCluster

        from cluster.devcluster import ClusterShape

        env = dict(kv.partition("=")[::2] for kv in args.node_env)  # settings under test, if any
        self.shape = getattr(args, "shape", None) or ClusterShape()
        self.cluster = LocalCluster(work / "hourglass", meta=True, **self.shape.cluster_kwargs(), ack_mode="async",
                                    lease_ttl_ms=LEASE_TTL_MS, env=env)
        from common import free_port

        self.metrics_ports = {}  # node -> its /metrics port: requests served per method (issue 30)
        for n in self.cluster.nodes:
            self.metrics_ports[n.name] = free_port()
            n.env["HOURGLASS_METRICS_PORT"] = str(self.metrics_ports[n.name])
        self.node_env = args.node_env
        self.console = getattr(args, "console", False)
        self.viewer = None
        self.work = work
        self.cpu_quota = getattr(args, "node_cpu_quota", None)
        self.cpu_period_us = getattr(args, "node_cpu_period_us", None) or 100_000
        self.quotas = None

    def start(self) -> "HourglassDev":
        self.cluster.start()
        try:
            self.cluster.wait_registered()
            if self.cpu_quota:  # issue 30: every node process under its own fixed CPU quota (bench/cgroupquota.py)
                from cgroupquota import CpuQuotas

                self.quotas = CpuQuotas(self.cpu_quota, self.cpu_period_us).open()
                for n in self.cluster.nodes:
                    self.quotas.limit(n.name, n.proc.pid)
            if self.console:  # an operator with the Cluster and Schedule pages open (issue 31)
                from console_viewer import ConsoleViewer

                self.viewer = ConsoleViewer(self.cluster.meta_addresses, self.work / "console.log").start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.viewer is not None:
            self.viewer.stop()
        try:
            self.cluster.stop()
        finally:
            if self.quotas is not None:
                problems = self.quotas.close()
                if problems:
                    print(f"cgroup clean-up: {problems}", file=sys.stderr)

    def probe(self) -> dict:
        """What a step reads before and after: each node cgroup's ``cpu.stat``, etcd's gRPC counters
        and each node's requests served by method."""
        return {"cg": self.quotas.stat() if self.quotas is not None else {},
                "etcd": etcd_counters(self.cluster.etcd.endpoints if self.cluster.etcd is not None else []),
                "requests": {name: node_requests(port) for name, port in self.metrics_ports.items()}}

    def probe_delta(self, a: dict, b: dict, seconds: float) -> dict:
        from cgroupquota import throttle_delta

        out = {"etcd_per_s": {k: round((v - a["etcd"].get(k, 0)) / seconds, 1) for k, v in sorted(b["etcd"].items())
                              if v - a["etcd"].get(k, 0) > 0}}
        out["requests"] = {node: {m: int(v - a["requests"].get(node, {}).get(m, 0))
                                  for m, v in sorted(per.items()) if v - a["requests"].get(node, {}).get(m, 0) > 0}
                           for node, per in b["requests"].items()}
        if self.quotas is not None:
            out["cpu_quota"] = {"cores": self.cpu_quota, "period_us": self.quotas.period_us,
                                "quota_us": self.quotas.quota_us}
            out["throttling"] = {k: throttle_delta(a["cg"].get(k, {}), v) for k, v in b["cg"].items()}
        return out

    def target(self) -> dict:
        return {"system": "hourglass", "meta": self.cluster.meta_addresses}

    def pids(self) -> dict[str, int]:
        out = {n.name: n.proc.pid for n in self.cluster.nodes + self.cluster.meta}
        for m in self.cluster.etcd.members if self.cluster.etcd is not None else []:
            out[m.name] = m.proc.pid
        if self.viewer is not None:
            out["console"] = self.viewer.pid
        return out

    def logs(self) -> dict[str, Path]:
        return {n.name: n.log_path for n in self.cluster.nodes if n.log_path}

    def settings(self) -> dict:
        return {"cluster": f"hourglass dev up: etcd + 1 meta server + {self.shape.describe()}, "
                           f"meta lease {LEASE_TTL_MS} ms, log level INFO, open", "node_env": self.node_env,
                "console": ("hourglass console open on the Cluster and Schedule pages, each loaded every "
                            f"{self.viewer.every_s:g} s ({self.viewer.fetched} loads so far)") if self.viewer else None,
                "shape": self.shape.as_dict(),
                "producer": "Producer(MetaResolver) defaults; await (await send_many(..., ids, delay_ms)) per tick",
                "consumer": f"Consumer(MetaResolver, 16 subjects, group={GROUP!r}) defaults; "
                            "async for batch in batches(): handle(ids, payloads); await batch.ack()"}


def node_requests(port: int) -> dict[str, float]:
    """A node's ``hourglass_requests_total`` by method (cluster/wire.py ``REQUESTS``: a unary call
    or one request of a stream), from its ``/metrics``; {} when unreadable."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hourglass_requests_total{"):
            m = re.search(r'method="([^"]+)"', line)
            if m:
                out[m.group(1)] = float(line.rsplit(" ", 1)[1])
    return out


def etcd_counters(endpoints: list[str]) -> dict[str, float]:
    """etcd's own gRPC counters summed over its members: ``<method>`` calls started (unary calls and
    streams opened) and ``<method>.msgs`` messages received (a keep-alive stream's refreshes, watch
    requests), from its ``/metrics`` on the client port; {} when unreadable."""
    import urllib.request

    out: dict[str, float] = {}
    for ep in endpoints:
        try:
            text = urllib.request.urlopen(f"http://{ep}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            for metric, suffix in (("grpc_server_started_total{", ""), ("grpc_server_msg_received_total{", ".msgs")):
                if line.startswith(metric):
                    m = re.search(r'grpc_method="([^"]+)"', line)
                    if m:
                        key = m.group(1) + suffix
                        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def make_user_system(name: str, work: Path, args):
    if name == "hourglass":
        return HourglassDev(work, args)
    import bench_e2e

    s = bench_e2e.make_system(name, work, args)  # Redis: the server and its poller process
    s.logs = lambda: {}
    return s


def _log_offsets(system) -> dict[str, int]:
    return {k: p.stat().st_size if p.exists() else 0 for k, p in system.logs().items()}


def _stall_lines(system, offsets: dict[str, int], t0_ms: int) -> list[dict]:
    """The nodes' ``event loop stalled`` and ``gc pause`` lines (``node/aio.py`` ``GcPauses``)
    logged since ``offsets``, with their time from the step's start (the log's ``asctime``, local time, millisecond)."""
    out = []
    for name, path in system.logs().items():
        if not path.exists():
            continue
        with open(path, "rb") as f:
            f.seek(offsets.get(name, 0))
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            m = STALL_RE.search(line)
            if not m:
                continue
            row = {"node": name, "stall_ms": int(m.group(2) or m.group(3)), "still": bool(m.group(1)),
                   "gc": m.group(3) is not None, "line": line.strip()[:500]}
            try:
                stamp, ms = line[:23].split(",")
                row["at_s"] = round((time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) * 1000 + int(ms)
                                     - t0_ms) / 1000, 3)
            except ValueError:
                pass
            out.append(row)
    return out


def _read_blocks(path: Path) -> list[tuple[int, list[str]]]:
    blocks: list[tuple[int, list[str]]] = []
    if not path.exists():
        return blocks
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("T "):
                blocks.append((int(line[2:]), []))
            elif line and blocks:
                blocks[-1][1].append(line)
    return blocks


def windows(acked, blocks, t0_ms: int) -> list[dict]:
    """Per 100 ms window from ``t0_ms``: by due time, messages, max and p50 lateness (first
    receipt; one not seen counts as None in its window's ``unseen``); by receive time,
    messages seen (gaps show when nothing came)."""
    k, n = len(acked.prefix), len(acked.due)
    big = np.iinfo(np.int64).max
    first = np.full(n, big, np.int64)
    seen_t = []
    for t, ids in blocks:
        idx = np.fromiter((int(i[k:]) for i in ids if i.startswith(acked.prefix)), np.int64)
        idx = idx[(idx >= 0) & (idx < n)]
        np.minimum.at(first, idx, t)
        seen_t.append(np.full(len(idx), t, np.int64))
    ok = acked.due >= 0
    if not ok.any():
        return []
    due = acked.due[ok]
    got = first[ok]
    w_due = (due - t0_ms) // WINDOW_MS
    seen = np.concatenate(seen_t) if seen_t else np.zeros(0, np.int64)
    w_seen = (seen - t0_ms) // WINDOW_MS
    lo = int(min(w_due.min(), w_seen.min() if len(w_seen) else w_due.min()))
    hi = int(max(w_due.max(), w_seen.max() if len(w_seen) else w_due.max()))
    seen_counts = np.bincount(w_seen - lo, minlength=hi - lo + 1) if len(w_seen) else np.zeros(hi - lo + 1, int)
    order = np.argsort(w_due, kind="stable")
    w_sorted, due_s, got_s = w_due[order], due[order], got[order]
    cuts = np.flatnonzero(np.diff(w_sorted)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(w_sorted)]))
    by_w = {int(w_sorted[a]): (a, b) for a, b in zip(starts.tolist(), ends.tolist())}
    out = []
    for w in range(lo, hi + 1):
        row = {"t_ms": w * WINDOW_MS, "due": 0, "late_max_ms": None, "late_p50_ms": None, "unseen": 0,
               "seen": int(seen_counts[w - lo])}
        if w in by_w:
            a, b = by_w[w]
            g = got_s[a:b]
            has = g != big
            late = (g[has] - due_s[a:b][has])
            row.update(due=b - a, unseen=int((~has).sum()))
            if len(late):
                row.update(late_max_ms=int(late.max()), late_p50_ms=int(np.median(late)))
        out.append(row)
    return out


def _window_summary(rows: list[dict], over_ms: int) -> dict:
    lat = [(r["late_max_ms"], r["t_ms"]) for r in rows if r["late_max_ms"] is not None]
    if not lat:
        return {}
    worst = sorted(lat, reverse=True)[:5]
    over = [t for m, t in lat if m > over_ms]
    gaps = np.diff(over).tolist() if len(over) > 1 else []
    return {"windows": len(rows), "worst_max_ms_at_s": [[m, round(t / 1000, 1)] for m, t in worst],
            f"windows_over_{over_ms}ms": len(over),
            "spacing_s_of_those_median": round(float(np.median(gaps)) / 1000, 2) if gaps else None}


def producer_shares(per_tick: int, producers: int) -> list[int]:
    """Messages per 10 ms tick of each of ``producers`` processes: ``per_tick`` split as evenly as
    integers allow (the first ones take the remainder), none under 1."""
    q, r = divmod(per_tick, producers)
    return [max(1, q + (1 if j < r else 0)) for j in range(producers)]


def merge_reports(reps: list[dict]) -> dict:
    """The reports of several sustain producers as one: counts summed, first start, last end."""
    out = {"kind": reps[0]["kind"], "start_ms": min(r["start_ms"] for r in reps),
           "end_ms": max(r["end_ms"] for r in reps)}
    for k in ("sent", "calls", "ticks_missed", "errors", "acked"):
        out[k] = sum(r.get(k, 0) for r in reps)
    out["per_call"] = [r.get("per_call") for r in reps]
    out["call_ms"] = [r.get("call_ms") for r in reps]
    errs = [e for r in reps for e in r.get("call_errors", [])]
    if errs:
        out["call_errors"] = errs
    return out


def run_step(system, work: Path, args, kind: str, rate: int | None) -> dict:
    import bench_e2e as e2e

    tag = f"r{rate}" if kind == "sustain" else "burst"
    prefix = f"u{tag}-"
    if kind == "sustain":
        n_max = int(rate * args.sustain_s) + rate
        send_s = args.sustain_s
    else:
        n_max = args.burst_n
        send_s = args.burst_n / 2_000  # bounded by ~2k/s at worst
    base = {"target": system.target(), "prefix": prefix}
    out_c = str(work / f"{system.name}-{tag}.recv")
    # --producers P (issue 30): P producer processes, each its share of every tick's messages and its own
    # range of ids, so that one awaited call at a time per process does not cap the rate offered
    n_prod = max(1, getattr(args, "producers", 1)) if kind == "sustain" else 1
    shares = producer_shares(max(1, rate // 100), n_prod) if kind == "sustain" else [0]
    per_max = [int(sh * 100 * args.sustain_s) + sh * 100 for sh in shares] if kind == "sustain" else [n_max]
    id_bases = np.concatenate(([0], np.cumsum(per_max)[:-1])).astype(int).tolist()
    n_max = int(sum(per_max))
    offered = sum(shares) * 100 if kind == "sustain" else None
    load = machine()["loadavg"]
    cons = None
    prods: list[Child] = []
    outs = [str(work / f"{system.name}-{tag}.producer{j}") for j in range(n_prod)]
    try:
        cons = Child("consumer", {**base, "out": out_c})
        cons.wait_for("ready", READY_TIMEOUT_S)
        for j in range(n_prod):
            prods.append(Child("producer", {**base, "out": outs[j], "kind": kind, "rate": rate, "per": shares[j],
                                            "mode": getattr(args, "producer_mode", "awaited"),
                                            "seconds": args.sustain_s, "n": args.burst_n, "call": args.burst_call,
                                            "n_max": per_max[j], "id_base": id_bases[j],
                                            "seed": args.seed + (rate or 0) + 7919 * j}))
        for prod in prods:
            prod.wait_for("ready", READY_TIMEOUT_S)
        offsets = _log_offsets(system) if args.stalls else {}
        names = ["producer"] if n_prod == 1 else [f"producer-{j}" for j in range(n_prod)]
        meter = CpuMeter({**system.pids(), **dict(zip(names, (p.pid for p in prods))), "consumer": cons.pid}).start()
        probe0 = system.probe() if hasattr(system, "probe") else None
        t0_ms = now_ms()
        for prod in prods:
            prod.send("go")
        for prod in prods:
            prod.wait_for("done", send_s + SEND_FINISH_TIMEOUT_S)
        reps = [json.loads(Path(o + ".json").read_text()) for o in outs]
        acked = e2e.Acked(prefix, n_max)
        for o, b, m in zip(outs, id_bases, per_max):
            acked.due[b:b + m] = np.load(o + ".npy")
        last_due = int(acked.due.max()) if acked.count else now_ms()
        deadline_ms = last_due + LOST_AFTER_MS
        cons.send(f"expect {acked.count} {deadline_ms}")
        cons.wait_for("done", max(5.0, (deadline_ms - now_ms()) / 1000) + 30)
        cpu = meter.seconds()  # both clients still alive: their CPU is readable
        t1_ms = now_ms()
        probe1 = system.probe() if probe0 is not None else None
    finally:
        for c in (*prods, cons):
            if c is not None:
                c.stop()
    rep = reps[0] if n_prod == 1 else merge_reports(reps)
    blocks = _read_blocks(Path(out_c))
    sc = e2e.score(acked, blocks)
    wins = windows(acked, blocks, t0_ms)
    counts = {name: acked.count for name in cpu}
    counts["consumer"] = sc["received"]
    r = {"bench": "e2e", "client": "user", "phase": kind, "system": system.name, "acked": acked.count,
         "send_errors": rep["errors"], **{k: rep[k] for k in ("sent", "per_call", "calls", "call_ms") if k in rep}}
    if kind == "sustain":
        seconds = max((rep["end_ms"] - rep["start_ms"]) / 1000, args.sustain_s)
        r.update(rate=rate, offered_per_s=offered, producers=n_prod, seconds=args.sustain_s,
                 ticks_missed=rep["ticks_missed"], achieved_per_s=round(acked.count / seconds))
    else:
        seconds = (rep["end_ms"] - rep["start_ms"]) / 1000
        r.update(n=args.burst_n, accepted_per_s=round(acked.count / seconds) if seconds > 0 else None,
                 send_seconds=round(seconds, 2))
    if rep.get("call_errors"):
        r["call_errors"] = rep["call_errors"][:5]
    r.update(sc)
    r["cpu_us_per_msg"] = CpuMeter({}).per_message_us(counts, cpu)
    r["window_s"] = round((t1_ms - t0_ms) / 1000, 1)
    if probe0 is not None:  # per-node cgroup throttling, etcd calls per second (issue 30)
        r.update(system.probe_delta(probe0, probe1, (t1_ms - t0_ms) / 1000))
        if r.get("requests") and acked.count:  # what a node's CPU is mostly paid per (issue 30)
            r["requests_per_1k_msgs"] = {node: round(sum(per.values()) * 1000 / acked.count, 1)
                                         for node, per in r["requests"].items()}
    r["windows_100ms"] = _window_summary(wins, args.window_over_ms)
    if args.stalls:  # None: the system has no loop watchdog (Redis)
        r["stalls"] = _stall_lines(system, offsets, t0_ms) if system.logs() else None
    due = "send + uniform 1..5 s" if kind == "sustain" else "send + uniform 3..13 s"
    r["settings"] = {**system.settings(), "loadavg_at_start": load, "tick_ms": 10, "payload_bytes": PAYLOAD_BYTES,
                     "subjects": 16, "due": due}
    r["_windows"] = {"system": system.name, "phase": kind, "rate": rate, "t0_ms": t0_ms, "window_ms": WINDOW_MS,
                     "windows": wins}
    return r


def fails_badly(r: dict) -> bool:
    """A sustain step so far off that a higher rate is pointless: under 90% of the rate offered
    or p99 over 1 s (bench_e2e.py's open-loop rule)."""
    import bench_e2e as e2e

    offered = r.get("offered_per_s") or r["rate"]
    p99 = r["lateness_all_ms"]["p99"]
    return r["achieved_per_s"] < e2e.BAD_RATE_FRACTION * offered or p99 is None or p99 > e2e.BAD_P99_MS


def _cpu_cell(r: dict) -> str:
    cpu = r.get("cpu_us_per_msg") or {}
    cell = " ".join(f"{k}={v['us_per_msg']}" for k, v in cpu.items())
    req = r.get("requests_per_1k_msgs")
    return cell + ("  requests per 1k msgs: " + " ".join(f"{k}={v}" for k, v in req.items()) if req else "")


def table(rows: list[dict]) -> str:
    lines = ["client=user  lateness ms (lost = infinitely late)  CPU us per message per process", ""]
    head = (f"{'system':16} {'phase':8} {'R/s':>7} {'achieved/s':>10} {'missed':>6} {'p50':>6} {'p99':>6} "
            f"{'p999':>6} {'max':>6} {'lost':>5} {'dup':>5} {'win>' :>5}  cpu us/msg")
    lines.append(head)
    lines.append("-" * len(head))
    for r in rows:
        la = r["lateness_all_ms"]
        w = r.get("windows_100ms") or {}
        over = next((v for k, v in w.items() if k.startswith("windows_over_")), "-")
        rate = r.get("rate") if r["phase"] == "sustain" else r.get("n")
        got = r.get("achieved_per_s") if r["phase"] == "sustain" else r.get("accepted_per_s")
        lines.append(f"{r['system']:16} {r['phase']:8} {rate!s:>7} {got!s:>10} {r.get('ticks_missed', '-')!s:>6} "
                     f"{la['p50']!s:>6} {la['p99']!s:>6} {la['p999']!s:>6} {la['max']!s:>6} {r['lost']:>5} "
                     f"{r['duplicates']:>5} {over!s:>5}  {_cpu_cell(r)}")
        if r.get("stalls") is None and "stalls" in r:
            lines.append(f"{'':16} stalls: n/a (no event-loop watchdog)")
        elif "stalls" in r:
            st = r["stalls"]
            lines.append(f"{'':16} stalls logged: {len(st)}" + (
                f", longest {max(s['stall_ms'] for s in st)} ms ("
                + ", ".join(sorted({s['node'] for s in st})) + ")" if st else ""))
    lines.append("")
    lines.append("R/s: rate asked (burst: messages); achieved/s (burst: accepted/s); missed: 10 ms ticks skipped "
                 "while a call was out; win>: 100 ms windows (by due time) whose max lateness passed --window-over-ms")
    return "\n".join(lines)


def run(args, work: Path) -> None:
    """The user mode of bench_e2e.py: per system, the sustain rates then the burst."""
    import shutil

    phases = args.phases.split(",")
    rows, win_dump = [], []
    try:
        for name in args.systems.split(","):
            sysm = make_user_system(name, work / name, args).start()
            try:
                steps = ([("sustain", r) for r in args.rates] if "sustain" in phases else []) + \
                        ([("burst", None)] if "burst" in phases else [])
                for kind, rate in steps:
                    r = run_step(sysm, work, args, kind, rate)
                    win_dump.append(r.pop("_windows"))
                    emit(r)
                    rows.append(r)
                    if kind == "sustain" and getattr(args, "climb", False) and fails_badly(r):
                        break  # --climb (issue 30): no higher rate of this ladder is tried
            finally:
                sysm.stop()
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if win_dump:
            path = Path(args.windows_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(win_dump))
            print(f"lateness per {WINDOW_MS} ms window: {path}", file=sys.stderr)
    print(table(rows), file=sys.stderr)


if __name__ == "__main__":
    # python bench/e2e_user.py producer|consumer CONFIG_JSON (started by run_step)
    role, config = sys.argv[1], json.loads(sys.argv[2])
    {"producer": producer_main, "consumer": consumer_main}[role](config)
