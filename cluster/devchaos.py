"""``hourglass dev chaos``: traffic against a running ``hourglass dev up`` cluster while delay
masters are SIGKILLed on a seeded schedule; the verdict comes from ``cluster.chaoscheck`` (the
checker of the chaos suite), which reads only the files this run records.

The cluster is found through its ``cluster.json`` (meta servers, and every process's role,
address and PID). A master is killed by the PID listed there, after checking that the PID's
command line is that node's (a PID is never trusted by name alone); bringing it back is the
job of the ``dev up`` supervisor, so a kill that is not followed by a restart within
``restart_timeout_s`` is recorded as a restart error and fails the run.

Files written to ``out_dir`` (the format of ``tests/chaos/harness.py``): ``sends.jsonl``,
``cancels.jsonl`` (empty: this run does not cancel), ``receives.jsonl``, ``faults.jsonl``,
``run.json``; then ``report.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

from pydantic import BaseModel, Field

from cluster import errors as E
from cluster.security import client_security_from

KILLS_MAX = 100
STATUS_TIMEOUT_S = 2.0
FIND_MASTER_TIMEOUT_S = 30.0
FAILOVER_TIMEOUT_S = 45.0
RESTART_TIMEOUT_S = 60.0
SEND_BATCHES_INFLIGHT_MAX = 64
POLL_S = 0.1
SEND_PERIOD_S = 0.1


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class DevChaosConfig(BaseModel):
    cluster_file: Path
    out_dir: Path
    seed: int = 1
    kills: int = Field(default=3, ge=1, le=KILLS_MAX)
    first_kill_s: float = Field(default=3.0, ge=0)
    kill_gap_s: float = Field(default=6.0, ge=0)     # mean quiet time between recovery and the next kill
    rate_per_s: float = Field(default=20.0, gt=0, le=10_000)
    delay_ms_max: int = Field(default=4000, ge=0)     # messages are due 0..delay_ms_max after sending
    tail_s: float = Field(default=3.0, ge=0)          # traffic after the last kill recovered
    drain_s_max: float = Field(default=30.0, gt=0)    # after the latest due time, for deliveries


def kill_schedule(seed: int, kills: int, first_s: float, gap_s: float) -> list[tuple[float, int]]:
    """Pure: (wait before the kill in seconds, group draw) per kill. The group draw picks among the
    groups that have a master when the kill fires (``draw % len(groups)``)."""
    rng = random.Random(seed)
    return [(round(first_s if i == 0 else rng.uniform(0.5, 1.5) * gap_s, 2), rng.randrange(1 << 16))
            for i in range(kills)]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class DevChaos:
    def __init__(self, cfg: DevChaosConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.files = {n: open(self.out / f"{n}.jsonl", "a", buffering=1)
                      for n in ("sends", "cancels", "receives", "faults")}
        self.rng = random.Random(cfg.seed * 1_000_003 + 1)
        run_id = f"{cfg.seed}-{now_ms() % 100_000_000}"  # fresh subjects: nothing of an earlier run is read
        self.subjects = [f"devchaos.{run_id}.a", f"devchaos.{run_id}.b"]
        self.run_id = run_id
        self.stop_sending = asyncio.Event()
        self.stop_consuming = asyncio.Event()
        self.acked: set[str] = set()      # drain progress only: the checker re-reads the files
        self.received: set[str] = set()
        self.log_lines: list[str] = []

    def say(self, line: str) -> None:
        self.log_lines.append(line)

    def record(self, file: str, **event) -> None:
        self.files[file].write(json.dumps(event, separators=(",", ":")) + "\n")

    def info(self) -> dict:
        return json.loads(Path(self.cfg.cluster_file).read_text())

    def delay_nodes(self) -> dict[str, dict]:
        return {n: p for n, p in self.info().get("processes", {}).items() if p["role"] == "delay"}

    # ------------------------------------------------------------ probes

    async def statuses(self, channels) -> dict[str, dict]:
        from cluster.proto import hourglass_pb2 as pb

        out = {}
        for name, p in self.delay_nodes().items():
            try:
                r = await channels.admin(p["address"]).Status(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
                out[name] = json.loads(r.json) | {"master": r.master, "group": r.group}
            except Exception:  # a node that does not answer is not listed
                pass
        return out

    async def masters(self, channels) -> dict[str, str]:
        """group -> its single master, for groups whose other members all answer as slaves."""
        st = await self.statuses(channels)
        members: dict[str, list[str]] = {}
        for name, s in st.items():
            members.setdefault(s["group"], []).append(name)
        out = {}
        for g, names in members.items():
            ms = [n for n in names if st[n]["master"]]
            if len(ms) == 1 and all(st[n].get("mode") == "slave" for n in names if n != ms[0]):
                out[g] = ms[0]
        return out

    async def wait(self, pred, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = await pred()
            if got:
                return got
            await asyncio.sleep(POLL_S)
        return None

    # ------------------------------------------------------------ workload

    async def produce(self, producer) -> None:
        inflight = asyncio.Semaphore(SEND_BATCHES_INFLIGHT_MAX)
        tasks: set[asyncio.Task] = set()
        carry, n = 0.0, 0
        while not self.stop_sending.is_set():
            carry += self.cfg.rate_per_s * SEND_PERIOD_S
            batch = []
            while carry >= 1:
                carry -= 1
                t_req = now_ms()
                deliver_at = t_req + self.rng.randint(0, self.cfg.delay_ms_max)
                subject = self.rng.choice(self.subjects)
                mid = f"dc{self.run_id}-m{n}"
                n += 1
                batch.append((mid, subject, deliver_at, t_req,
                              await producer.send(subject, mid, id=mid, deliver_at_ms=deliver_at)))
            if batch:
                await inflight.acquire()
                t = asyncio.create_task(self._await_sends(batch, inflight))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            try:
                await asyncio.wait_for(self.stop_sending.wait(), SEND_PERIOD_S)
            except asyncio.TimeoutError:
                pass
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _await_sends(self, batch, inflight) -> None:
        try:
            res = await asyncio.gather(*(b[4] for b in batch), return_exceptions=True)
        finally:
            inflight.release()
        for (mid, subject, deliver_at, t_req, _), r in zip(batch, res):
            ok = not isinstance(r, BaseException)
            if ok:
                self.acked.add(mid)
            self.record("sends", id=mid, subject=subject, deliver_at=deliver_at, t_req=t_req, t_ack=now_ms(),
                        ok=ok, error=None if ok else f"{type(r).__name__}: {r}"[:200])

    async def consume(self, resolver, subject: str) -> None:
        from cluster.client import Consumer

        failures = 0
        async with Consumer(resolver, subject, group="g1", wait_ms=300) as c:
            while not self.stop_consuming.is_set():
                try:
                    batch = await c.pull()
                except Exception:  # Unavailable during a failover: pull again
                    failures += 1
                    await asyncio.sleep(min(1.0, 0.05 * failures))
                    continue
                failures = 0
                t = now_ms()
                for m in batch:
                    self.record("receives", id=m.id, subject=subject, group="g1", t=t, deliver_at=m.deliver_at_ms,
                                attempts=m.attempts)
                    self.received.add(m.id)  # may come before the send's answer
                try:
                    await c.ack(batch)
                except Exception:  # unacked messages come back: counted as duplicates
                    pass

    # ------------------------------------------------------------ kills

    async def kill_one(self, index: int, draw: int, channels) -> dict:
        ev = {"index": index, "kind": "delay_master_kill", "target": draw, "hold_s": 0}
        masters = await self.wait(lambda: self.masters(channels), FIND_MASTER_TIMEOUT_S)
        if not masters:
            return ev | {"skipped": "no delay master found", "t_start": now_ms(), "t_end": now_ms()}
        groups = sorted(masters)
        group = groups[draw % len(groups)]
        name = masters[group]
        node = self.delay_nodes()[name]
        pid = node["pid"]
        if pid is None or f"--node-id" not in _cmdline(pid) or name not in _cmdline(pid):
            return ev | {"skipped": f"pid {pid} of {name} is not that node", "t_start": now_ms(), "t_end": now_ms()}
        ev.update(process=name, group=group, pid=pid)
        t_start = now_ms()
        os.kill(pid, signal.SIGKILL)
        self.say(f"kill {index + 1}: SIGKILL {name} pid={pid} (master of {group})")

        async def taken_over():
            m = (await self.masters(channels)).get(group)
            return m if m and (m != name or self.delay_nodes()[name]["pid"] != pid) else None
        new_master = await self.wait(taken_over, FAILOVER_TIMEOUT_S)
        ev["failover_ms"] = now_ms() - t_start if new_master else None
        ev["new_master"] = new_master
        if new_master:
            self.say(f"kill {index + 1}: {new_master} is master of {group} after {ev['failover_ms']} ms")

        async def back():
            p = self.delay_nodes()[name]
            return p["pid"] not in (None, pid) and name in await self.statuses(channels)
        restarted = await self.wait(back, RESTART_TIMEOUT_S)
        ev["restart_error"] = None if restarted else (
            f"{name} not restarted within {RESTART_TIMEOUT_S} s (is `hourglass dev up` supervising it?)")
        ev["t_start"], ev["t_end"] = t_start, now_ms()

        async def healthy():
            st = await self.statuses(channels)
            return group in await self.masters(channels) and all(n in st for n in self.delay_nodes())
        ok = await self.wait(healthy, FAILOVER_TIMEOUT_S)
        ev["recovered_ms"] = now_ms() - t_start if ok else None
        if restarted:
            self.say(f"kill {index + 1}: {name} back as {(await self.statuses(channels)).get(name, {}).get('mode', '?')}"
                     f" pid={self.delay_nodes()[name]['pid']}")
        return ev

    async def kills(self) -> None:
        from cluster.transport import Channels

        channels = Channels(client_security_from(self.info().get("security")))
        try:
            for i, (wait_s, draw) in enumerate(kill_schedule(self.cfg.seed, self.cfg.kills, self.cfg.first_kill_s,
                                                             self.cfg.kill_gap_s)):
                await asyncio.sleep(wait_s)
                self.record("faults", **await self.kill_one(i, draw, channels))
        finally:
            await channels.close()

    # ------------------------------------------------------------ main

    async def run(self) -> dict:
        from cluster.client import Producer
        from cluster.discovery import MetaResolver

        info = self.info()
        if not info.get("meta"):
            raise E.InvalidArgument("dev chaos needs a cluster with meta servers (`hourglass dev up --meta`)")
        resolver = MetaResolver(info["meta"], refresh_ms=500, security=client_security_from(info.get("security")))
        t0 = now_ms()
        try:
            async with Producer(resolver, retries_max=40) as producer:
                consumers = [asyncio.create_task(self.consume(resolver, s)) for s in self.subjects]
                prod = asyncio.create_task(self.produce(producer))
                try:
                    await self.kills()
                    await asyncio.sleep(self.cfg.tail_s)
                finally:
                    self.stop_sending.set()
                    await prod
                t_send_end = now_ms()
                due_limit = t_send_end + self.cfg.delay_ms_max
                deadline = time.monotonic() + self.cfg.delay_ms_max / 1000 + self.cfg.drain_s_max
                while self.acked - self.received and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)  # late duplicates are seen too
                self.stop_consuming.set()
                await asyncio.gather(*consumers, return_exceptions=True)
        finally:
            await resolver.close()
            for f in self.files.values():
                f.close()
        run = {"seed": self.cfg.seed, "duration_s": round((t_send_end - t0) / 1000, 1),
               "config": json.loads(self.cfg.model_dump_json()), "t0_ms": t0, "t_send_end": t_send_end,
               "due_limit_ms": due_limit, "groups": {s: ["g1"] for s in self.subjects},
               "log_dir": str(Path(self.cfg.cluster_file).resolve().parent), "restore_errors": []}
        (self.out / "run.json").write_text(json.dumps(run, indent=2))
        return run


def run_dev_chaos(cfg: DevChaosConfig, say=print) -> dict:
    """Run against the cluster of ``cfg.cluster_file``, check the files, write ``report.json``."""
    from cluster.chaoscheck import check

    chaos = DevChaos(cfg)
    chaos.say = say
    asyncio.run(chaos.run())
    report = check(cfg.out_dir)
    (Path(cfg.out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    return report
