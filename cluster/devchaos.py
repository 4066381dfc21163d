"""``hourglass dev chaos``: traffic against a running ``hourglass dev up`` cluster while faults
play on a seeded schedule; the verdict comes from ``cluster.chaoscheck`` (the checker of the
chaos suite), which reads only the files this run records.

Three plans (``cluster/chaosplan.py``):

* ``kills`` (the default): ``kills`` SIGKILLs of a delay master, one after the other;
* ``kinds``: the seeded random plan of ``fault_schedule`` over ``duration_s`` with the kinds
  given (``DEV_KINDS``: master kills and SIGSTOPs, and the starvation kinds: CPU and disk
  starvation, a cgroup CPU quota on the master, SIGSTOP stalls of a node, the meta server,
  etcd);
* ``scenario``: a named scenario's lanes (``meta-pause``, ``starved-kills``, ``starved``) with
  its load (rate, due times, two consumer groups), for ``duration_s`` or the scenario's length.

The cluster is found through its ``cluster.json`` (meta servers, and every process's role,
address and PID). A process is signalled by the PID listed there, after checking that the PID's
command line is that process's (a PID is never trusted by name alone); bringing a killed master
back is the job of the ``dev up`` supervisor, so a kill that is not followed by a restart within
``restart_timeout_s`` is recorded as a restart error and fails the run. Machine faults
(``cluster/chaosfaults.py``) are undone at their end and when the run stops, also on Ctrl-C.

Acknowledgement windows are checked when the delay nodes journal them: start ``dev up`` with
``HOURGLASS_ACK_JOURNAL=<absolute path>`` in its environment (its nodes inherit it; they may
share one file) and pass the same path as ``ack_journals``; ``*.acks.jsonl`` in the data folder
are read too.

What it shares with the chaos harness (``tests/chaos/harness.py``): ``cluster/chaosrun.py`` (the
recorder, consumers, status probes, load samples, the timing of fault lanes). Files written to
``out_dir`` (the harness's format, ``chaosrun.Recorder``): ``sends.jsonl``,
``cancels.jsonl`` (empty: this run does not cancel), ``receives.jsonl``, ``faults.jsonl``,
``load.jsonl``, ``run.json``; then ``report.json``.
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
from cluster.chaosfaults import FaultKit
from cluster.chaosplan import SCENARIOS, STARVATION_KINDS, Fault, Topology, fault_schedule, scenario_schedule
from cluster.chaosrun import (Recorder, consume, node_statuses, play_lanes, record_send, sample_load, send_ticks,
                              wait_until)
from cluster.clock import wall_ms as now_ms
from cluster.security import client_security_from

KILLS_MAX = 100
FIND_MASTER_TIMEOUT_S = 30.0
FAILOVER_TIMEOUT_S = 45.0
RESTART_TIMEOUT_S = 60.0
SEND_PERIOD_S = 0.1
DURATION_S_MAX = 86_400
# what dev chaos can play on a `dev up` cluster (meta and etcd kills are the harness's)
DEV_KINDS = ("delay_master_kill", "delay_master_stop", "realtime_kill") + STARVATION_KINDS
SUBJECTS_PER_REALTIME_GROUP = 2  # subjects of the traffic: this many per real-time group (the meta server
                                 # routes each by a hash, so most groups get some), at least 2


class DevChaosConfig(BaseModel):
    cluster_file: Path
    out_dir: Path
    seed: int = 1
    kills: int = Field(default=3, ge=1, le=KILLS_MAX)
    kill_roles: tuple[str, ...] = ("delay",)          # the kills hit masters of these groups: delay, realtime
    first_kill_s: float = Field(default=3.0, ge=0)
    kill_gap_s: float = Field(default=6.0, ge=0)     # mean quiet time between recovery and the next kill
    rate_per_s: float = Field(default=20.0, gt=0, le=10_000)
    delay_ms_max: int = Field(default=4000, ge=0)     # messages are due 0..delay_ms_max after sending
    tail_s: float = Field(default=3.0, ge=0)          # traffic after the last kill recovered
    drain_s_max: float = Field(default=30.0, gt=0)    # after the latest due time, for deliveries
    delay_ms_min: int = Field(default=0, ge=0)
    groups: tuple[str, ...] = ("g1",)                 # consumer groups, each on every subject
    scenario: str | None = None                       # a named plan (its load overrides the above)
    kinds: tuple[str, ...] = ()                       # the random plan of these kinds (instead of kills)
    duration_s: float | None = Field(default=None, gt=0, le=DURATION_S_MAX)  # scenario / kinds plans
    cpu_hogs_per_core: int = Field(default=8, ge=1, le=64)
    disk_writers: int = Field(default=2, ge=1, le=64)
    throttle_cpu_fraction: float = Field(default=0.2, gt=0, le=64)
    ack_journals: tuple[Path, ...] = ()               # expected: the run fails if they hold no window


def scenario_dev_config(name: str, **kw) -> DevChaosConfig:
    """The dev chaos settings of scenario ``name`` (its rate, due times, consumer groups); ``kw``
    (cluster_file, out_dir, seed, duration_s, rate_per_s ...) wins."""
    sc = SCENARIOS[name]
    base = dict(scenario=name, rate_per_s=sc.rate_per_s, delay_ms_min=sc.due_ms[0], delay_ms_max=sc.due_ms[1],
                groups=sc.groups_every_subject, duration_s=sc.duration_s)
    return DevChaosConfig(**(base | {k: v for k, v in kw.items() if v is not None}))


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
        self.rec = Recorder(self.out)
        self.rng = random.Random(cfg.seed * 1_000_003 + 1)
        run_id = f"{cfg.seed}-{now_ms() % 100_000_000}"  # fresh subjects: nothing of an earlier run is read
        n_subjects = max(2, SUBJECTS_PER_REALTIME_GROUP * self.realtime_groups())
        self.subjects = [f"devchaos.{run_id}.{chr(ord('a') + i)}" for i in range(min(n_subjects, 26))]
        self.run_id = run_id
        self.stop_sending = asyncio.Event()
        self.stop_consuming = asyncio.Event()
        self.acked: set[str] = set()      # drain progress only: the checker re-reads the files
        self.received: set[str] = set()
        self.log_lines: list[str] = []
        self.kit = FaultKit(Path(cfg.cluster_file).resolve().parent / "chaos-scratch", stop=self.stop_sending)
        self.group_names: list[str] = []
        self.teardown_errors: list[str] = []

    def say(self, line: str) -> None:
        self.log_lines.append(line)

    def info(self) -> dict:
        return json.loads(Path(self.cfg.cluster_file).read_text())

    def delay_nodes(self) -> dict[str, dict]:
        return self.processes("delay")

    def realtime_groups(self) -> int:
        """Real-time groups of the cluster (``cluster.json`` "groups"; one per node without it)."""
        info = self.info()
        groups = info.get("groups", {}).get("realtime")
        return len(groups) if groups else max(1, len(info.get("realtime", [])))

    def processes(self, role: str) -> dict[str, dict]:
        return {n: p for n, p in sorted(self.info().get("processes", {}).items()) if p["role"] == role}

    def verified_pid(self, name: str) -> int | None:
        """The PID cluster.json lists for process ``name``, if that PID's command line is that process's."""
        p = self.info().get("processes", {}).get(name)
        if not p or not p.get("pid"):
            return None
        cmd = _cmdline(p["pid"])
        port = p["address"].rsplit(":", 1)[-1]
        ok = {"delay": "--node-id" in cmd and name in cmd, "realtime": "--node-id" in cmd and name in cmd,
              "meta": "metaserver" in cmd and port in cmd,
              "etcd": bool(cmd) and cmd[0].endswith("etcd") and name in cmd}.get(p["role"], False)
        return p["pid"] if ok else None

    # ------------------------------------------------------------ probes

    async def statuses(self, channels, role: str = "delay") -> dict[str, dict]:
        """name -> Status document of the ``role`` nodes that answer (``node_statuses``)."""
        return await node_statuses(channels, {name: p["address"] for name, p in self.processes(role).items()})

    async def masters(self, channels, role: str = "delay") -> dict[str, str]:
        """group -> its single master, for groups whose other members all answer as slaves."""
        st = await self.statuses(channels, role)
        members: dict[str, list[str]] = {}
        for name, s in st.items():
            members.setdefault(s["group"], []).append(name)
        out = {}
        for g, names in members.items():
            ms = [n for n in names if st[n]["master"]]
            if len(ms) == 1 and all(st[n].get("mode") == "slave" for n in names if n != ms[0]):
                out[g] = ms[0]
        return out

    # ------------------------------------------------------------ workload

    async def produce(self, producer) -> None:
        """``rate_per_s`` messages a second on average, one ``send`` each, a tick every
        ``SEND_PERIOD_S`` (``chaosrun.send_ticks``)."""
        carry, n = 0.0, 0

        async def tick():
            nonlocal carry, n
            carry += self.cfg.rate_per_s * SEND_PERIOD_S
            batch = []
            while carry >= 1:
                carry -= 1
                t_req = now_ms()
                deliver_at = t_req + self.rng.randint(min(self.cfg.delay_ms_min, self.cfg.delay_ms_max),
                                                      self.cfg.delay_ms_max)
                subject = self.rng.choice(self.subjects)
                mid = f"dc{self.run_id}-m{n}"
                n += 1
                batch.append((mid, subject, deliver_at, t_req,
                              await producer.send(subject, mid, id=mid, deliver_at_ms=deliver_at)))
            return self._await_sends(batch) if batch else None
        await send_ticks(self.stop_sending, SEND_PERIOD_S, tick)

    async def _await_sends(self, batch) -> None:
        res = await asyncio.gather(*(b[4] for b in batch), return_exceptions=True)
        for (mid, subject, deliver_at, t_req, _), r in zip(batch, res):
            error = r if isinstance(r, BaseException) else None
            if error is None:
                self.acked.add(mid)
            record_send(self.rec, mid, subject, deliver_at, t_req, now_ms(), error, self.group_names)

    async def consume(self, resolver, subject: str, group: str) -> None:
        def received(m) -> None:  # drain progress only; may come before the send's answer
            self.received.add((m.id, group))
        await consume(resolver, subject, group, self.rec, self.stop_consuming, on_receive=received)

    # ------------------------------------------------------------ kills

    async def kill_one(self, index: int, draw: int, channels, label: str = "kill", role: str = "delay") -> dict:
        """SIGKILL the master of one ``role`` group (``draw`` picks among the groups with a master),
        wait for a master of that group again (its slave, or the killed node restarted by `dev up`
        when the group has one member) and for the killed node to be back."""
        kind = "delay_master_kill" if role == "delay" else "realtime_kill"
        ev = {"index": index, "kind": kind, "target": draw, "hold_s": 0}
        masters = await wait_until(lambda: self.masters(channels, role), FIND_MASTER_TIMEOUT_S)
        if not masters:
            return ev | {"skipped": f"no {role} master found", "t_start": now_ms(), "t_end": now_ms()}
        groups = sorted(masters)
        group = groups[draw % len(groups)]
        name = masters[group]
        node = self.processes(role)[name]
        pid = node["pid"]
        if pid is None or f"--node-id" not in _cmdline(pid) or name not in _cmdline(pid):
            return ev | {"skipped": f"pid {pid} of {name} is not that node", "t_start": now_ms(), "t_end": now_ms()}
        ev.update(process=name, group=group, pid=pid)
        t_start = now_ms()
        os.kill(pid, signal.SIGKILL)
        self.say(f"{label} {index + 1}: SIGKILL {name} pid={pid} (master of {group})")

        async def taken_over():
            m = (await self.masters(channels, role)).get(group)
            return m if m and (m != name or self.processes(role)[name]["pid"] != pid) else None
        new_master = await wait_until(taken_over, FAILOVER_TIMEOUT_S)
        ev["failover_ms"] = now_ms() - t_start if new_master else None
        ev["new_master"] = new_master
        if new_master:
            self.say(f"{label} {index + 1}: {new_master} is master of {group} after {ev['failover_ms']} ms")

        async def back():
            p = self.processes(role)[name]
            return p["pid"] not in (None, pid) and name in await self.statuses(channels, role)
        restarted = await wait_until(back, RESTART_TIMEOUT_S)
        ev["restart_error"] = None if restarted else (
            f"{name} not restarted within {RESTART_TIMEOUT_S} s (is `hourglass dev up` supervising it?)")
        ev["t_start"], ev["t_end"] = t_start, now_ms()

        async def healthy():
            st = await self.statuses(channels, role)
            return group in await self.masters(channels, role) and all(n in st for n in self.processes(role))
        ok = await wait_until(healthy, FAILOVER_TIMEOUT_S)
        ev["recovered_ms"] = now_ms() - t_start if ok else None
        if restarted:
            mode = (await self.statuses(channels, role)).get(name, {}).get("mode", "master")
            self.say(f"{label} {index + 1}: {name} back as {mode}"
                     f" pid={self.processes(role)[name]['pid']}")
        return ev

    async def kills(self, channels) -> None:
        for i, (wait_s, draw) in enumerate(kill_schedule(self.cfg.seed, self.cfg.kills, self.cfg.first_kill_s,
                                                         self.cfg.kill_gap_s)):
            await asyncio.sleep(wait_s)
            roles = self.cfg.kill_roles or ("delay",)
            role = roles[(draw >> 8) % len(roles)]  # the draw's high bits pick the kind of group, its low bits one
            self.rec.write("faults", **await self.kill_one(i, draw, channels, role=role))

    # ------------------------------------------------------------ plans of other faults

    def plan(self) -> list[Fault] | None:
        """The scenario's or the random plan's faults; None for the plain kills."""
        cfg = self.cfg
        if cfg.scenario:
            return scenario_schedule(SCENARIOS[cfg.scenario], cfg.seed, cfg.duration_s)
        if cfg.kinds:
            topo = Topology(delay_groups=max(1, len(self.group_names)), realtime_groups=self.realtime_groups(),
                            meta=max(1, len(self.processes("meta"))), etcd_members=max(1, len(self.processes("etcd"))))
            return fault_schedule(cfg.seed, cfg.duration_s or 60.0, kinds=cfg.kinds, topology=topo,
                                  first_s=cfg.first_kill_s, gap_s=cfg.kill_gap_s)
        return None

    async def play(self, plan: list[Fault], channels) -> None:
        await play_lanes(plan, self.t0, self.stop_sending, self.rec,
                         lambda name, i, faults: self.inject(faults[i], channels))

    async def inject(self, f: Fault, channels) -> dict:
        ev = {"index": f.index, "kind": f.kind, "target": f.target, "hold_s": f.hold_s, "at_s": f.at_s, "lane": f.lane}
        try:
            if f.kind in ("delay_master_kill", "realtime_kill"):
                role = "delay" if f.kind == "delay_master_kill" else "realtime"
                got = await self.kill_one(f.index, f.target, channels, label="fault", role=role)
                return ev | got | {"lane": f.lane}
            got = await self._inject(f, channels)
        except (OSError, E.HourglassError) as e:  # could not act: recorded, the run goes on
            return ev | {"skipped": f"injector error: {type(e).__name__}: {e}", "t_start": now_ms(), "t_end": now_ms()}
        ev |= got
        if not ev.get("skipped"):
            self.say(f"fault {f.index + 1}: {f.kind} {ev.get('process', '')} held {f.hold_s:g} s, undone")
        return ev

    async def _inject(self, f: Fault, channels) -> dict:
        cfg, kit = self.cfg, self.kit
        ev = await kit.machine_fault(f.kind, f.hold_s, per_core=cfg.cpu_hogs_per_core, writers=cfg.disk_writers)
        if ev is not None:
            return ev
        if f.kind in ("meta_stall", "etcd_stall"):
            names = list(self.processes("meta" if f.kind == "meta_stall" else "etcd"))
            if not names:
                return {"skipped": "no such process in cluster.json", "t_start": now_ms(), "t_end": now_ms()}
            name = names[f.target % len(names)]
            pid = self.verified_pid(name)
            if pid is None:
                return {"process": name, "skipped": f"the pid listed for {name} is not that process",
                        "t_start": now_ms(), "t_end": now_ms()}
            return {"process": name} | await kit.stall(pid, f.hold_s)
        # a member of a delay group: its master (node_stall: master or slave by the target's parity)
        masters = await wait_until(lambda: self.masters(channels), FIND_MASTER_TIMEOUT_S)
        if not masters:
            return {"skipped": "no delay master found", "t_start": now_ms(), "t_end": now_ms()}
        groups = sorted(masters)
        group = groups[(f.target // 2 if f.kind == "node_stall" else f.target) % len(groups)]
        name, role = masters[group], "master"
        if f.kind == "node_stall" and f.target % 2:
            st = await self.statuses(channels)
            slaves = sorted(n for n, v in st.items() if v["group"] == group and n != name)
            if not slaves:
                return {"group": group, "skipped": "no slave answers", "t_start": now_ms(), "t_end": now_ms()}
            name, role = slaves[0], "slave"
        pid = self.verified_pid(name)
        if pid is None:
            return {"process": name, "skipped": f"the pid listed for {name} is not that node", "t_start": now_ms(),
                    "t_end": now_ms()}
        ev = {"process": name, "group": group, "role": role}
        if f.kind == "node_throttle":
            return ev | await kit.throttle(pid, f.hold_s, cpu_fraction=cfg.throttle_cpu_fraction)
        return ev | await kit.stall(pid, f.hold_s)   # delay_master_stop, node_stall

    # ------------------------------------------------------------ main

    async def run(self) -> dict:
        from cluster.client import Producer
        from cluster.discovery import MetaResolver
        from cluster.transport import Channels

        info = self.info()
        if not info.get("meta"):
            raise E.InvalidArgument("cluster",
                                    "dev chaos needs a cluster with meta servers (`hourglass dev up --meta`)")
        resolver = MetaResolver(info["meta"], refresh_ms=500, security=client_security_from(info.get("security")))
        channels = Channels(client_security_from(info.get("security")))
        plan: list[Fault] | None = None
        try:
            self.group_names = [g for g, _ in await resolver.delay_groups()]
            plan = self.plan()
            self.t0 = t0 = now_ms()
            async with Producer(resolver, retries_max=40) as producer:
                consumers = [asyncio.create_task(self.consume(resolver, s, g))
                             for s in self.subjects for g in self.cfg.groups]
                prod = asyncio.create_task(self.produce(producer))
                load = asyncio.create_task(sample_load(self.rec, self.stop_sending))
                try:
                    if plan is None:
                        await self.kills(channels)
                        await asyncio.sleep(self.cfg.tail_s)
                    else:
                        self.say(f"plan: {len(plan)} faults over {self.cfg.duration_s or 60:g} s "
                                 f"({', '.join(sorted({f.kind for f in plan}))})")
                        play = asyncio.create_task(self.play(plan, channels))
                        end = time.monotonic() + (self.cfg.duration_s or 60.0)
                        await asyncio.wait([play], timeout=self.cfg.duration_s or 60.0)
                        if play.done():
                            play.result()  # a lane that failed fails the run now
                            await asyncio.sleep(max(0.0, end - time.monotonic()))  # traffic runs its length
                        self.stop_sending.set()
                        await play
                finally:
                    self.stop_sending.set()
                    self.teardown_errors += self.kit.restore_all()
                    await prod
                    await load
                t_send_end = now_ms()
                due_limit = t_send_end + self.cfg.delay_ms_max
                deadline = time.monotonic() + self.cfg.delay_ms_max / 1000 + self.cfg.drain_s_max
                want = {(mid, g) for mid in self.acked for g in self.cfg.groups}
                while want - self.received and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)  # late duplicates are seen too
                self.stop_consuming.set()
                await asyncio.gather(*consumers, return_exceptions=True)
        finally:
            self.teardown_errors += self.kit.restore_all()
            await channels.close()
            await resolver.close()
            self.rec.close()
        sc = SCENARIOS.get(self.cfg.scenario or "")
        run = {"seed": self.cfg.seed, "duration_s": round((t_send_end - t0) / 1000, 1),
               "config": json.loads(self.cfg.model_dump_json()), "t0_ms": t0, "t_send_end": t_send_end,
               "due_limit_ms": due_limit, "groups": {s: list(self.cfg.groups) for s in self.subjects},
               "log_dir": str(Path(self.cfg.cluster_file).resolve().parent), "restore_errors": [],
               "scenario": self.cfg.scenario, "schedule": [f.model_dump() for f in plan or []],
               "ack_mode": info.get("ack_mode", "async"), "ack_journals": [str(p) for p in self.cfg.ack_journals],
               "ack_journal_expected": bool(self.cfg.ack_journals), "teardown_errors": self.teardown_errors,
               "expect": {"master_changes_without_kill_max": sc.master_changes_without_kill_max if sc else None}}
        (self.out / "run.json").write_text(json.dumps(run, indent=2))
        return run


def run_dev_chaos(cfg: DevChaosConfig, say=print) -> dict:
    """Run against the cluster of ``cfg.cluster_file``, check the files, write ``report.json``."""
    from cluster.chaoscheck import check

    unknown = set(cfg.kinds) - set(DEV_KINDS)
    if unknown:
        raise E.InvalidArgument("kinds", f"dev chaos cannot play {sorted(unknown)}; it plays {', '.join(DEV_KINDS)}")
    chaos = DevChaos(cfg)
    chaos.say = say
    try:
        asyncio.run(chaos.run())
    finally:
        chaos.kit.restore_all()  # interrupted: nothing stays starved, throttled or frozen
    report = check(cfg.out_dir)
    (Path(cfg.out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    return report
