"""Chaos harness: a real cluster, a continuous delayed-message workload, seeded faults, and a
recorder writing every send-ack, cancel-ack and receive as JSON lines.

    python -m tests.chaos.harness --seed 7 --duration 60 --out /tmp/chaos-7
    python -m tests.chaos.harness --scenario meta-pause --seed 3
    python -m tests.chaos.harness --seed 5 --duration 120 --kinds all

Pieces:

* the fault plan (``cluster/chaosplan.py``, pure): ``fault_schedule(seed, duration_s)`` - the same
  seed gives the same list of faults (kind, target, time, hold) - or a named scenario's plan
  (``scenario_schedule``: lanes of faults that run side by side). Targets are named abstractly
  ("the master of delay group 1", "real-time group 2") and resolved when the fault fires;
* the injectors of the machine faults (``cluster/chaosfaults.py``: CPU and disk starvation,
  a cgroup CPU quota, SIGSTOP stalls), undone at each fault's end and at teardown;
* what it shares with ``hourglass dev chaos`` (``cluster/chaosrun.py``): ``Recorder`` -
  append-only JSON lines files in the output directory (``sends.jsonl``, ``cancels.jsonl``,
  ``receives.jsonl``, ``faults.jsonl``, ``load.jsonl``; the harness adds ``run.json``) - the
  consumers, the node status probes, the load samples and the timing of the fault lanes;
  the delay nodes journal their acknowledgement windows beside their logs
  (``<node>.acks.jsonl``, ``HOURGLASS_ACK_JOURNAL``);
* ``run_chaos(config)`` - starts ``LocalCluster`` (etcd, meta servers, delay groups of master +
  slave in ``sync`` mode, replicated real-time groups), runs producers, cancellers, consumers
  and the fault lanes together, restores every fault, drains, stops the cluster and hands the
  directory to ``tests.chaos.checker`` which reads the files only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field

from cluster import errors as E
from cluster.chaosfaults import FaultKit, at_nice
from cluster.chaosplan import (CLASSIC_KINDS, FAULT_KINDS, SCENARIOS, STARVATION_KINDS, Fault,  # noqa: F401
                               Topology, fault_schedule, scenario_schedule)
from cluster.chaosrun import (Recorder, consume, node_statuses, play_lanes, record_send, sample_load, send_ticks,
                              wait_until)
from cluster.clock import wall_ms as now_ms

log = logging.getLogger("hourglass.chaos")

MASTER_FIND_TIMEOUT_S = 30.0
RECOVERY_TIMEOUT_S = 45.0
RESTART_TIMEOUT_S = 45.0
CANCELS_INFLIGHT_MAX = 64
SEND_PERIOD_S = 0.1          # the producer sends one batch a tick
CATCH_UP_S = 0.5             # a tick sends at most this many seconds' worth of owed messages


class ChaosConfig(BaseModel):
    seed: int = 7
    duration_s: float = Field(default=60.0, gt=0)   # workload + faults
    out_dir: Path
    rate_per_s: float = Field(default=25.0, gt=0)    # messages produced per second
    cancel_fraction: float = 0.1                     # of messages long enough to cancel
    fault_gap_s: float = 4.0                         # mean quiet time between faults
    first_fault_s: float = 5.0
    tail_free_s: float = 10.0                        # no fault of the random plan starts in the last seconds
    due_tail_s: float = 8.0                          # every message is due by send end + this
    due_ms: tuple[int, int] | None = None            # uniform due range; None: the mixed distribution below
    drain_extra_s: float = 45.0                      # after the latest due, for failover + delivery
    subjects: tuple[str, ...] = ("chaos.a", "chaos.b", "chaos.c", "chaos.d")
    groups_every_subject: tuple[str, ...] = ("g1",)  # consumer groups on every subject
    groups_first_subject: tuple[str, ...] = ("g2",)  # ... and on the first subject only
    lease_ttl_ms: int = 2000
    kinds: tuple[str, ...] = CLASSIC_KINDS
    hold_max_s: float | None = None                  # caps every hold of a random plan (short test runs)
    scenario: str | None = None                      # a named plan (cluster/chaosplan.py SCENARIOS)
    topology: Topology = Topology()
    cpu_hogs_per_core: int = Field(default=8, ge=1, le=64)
    disk_writers: int = Field(default=2, ge=1, le=64)
    throttle_cpu_fraction: float = Field(default=0.2, gt=0, le=64)  # node_throttle: a 200m CPU limit
    ack_journal: bool = True                         # delay nodes journal their acknowledgement windows
    master_changes_without_kill_max: int | None = None  # fails the run above this (None: reported only)
    secure: bool = True                              # mutual TLS and tokens, as a production cluster runs


SCENARIO_LEASE_TTL_MS = 6000  # the scenarios run the leases `hourglass dev up` and the node default use


def scenario_config(name: str, *, seed: int, out_dir: Path, duration_s: float | None = None,
                    rate_per_s: float | None = None, **over) -> ChaosConfig:
    """The harness settings of a named scenario; ``duration_s``/``rate_per_s`` override its defaults."""
    sc = SCENARIOS[name]
    return ChaosConfig(seed=seed, out_dir=out_dir, scenario=name,
                       duration_s=sc.duration_s if duration_s is None else duration_s,
                       rate_per_s=sc.rate_per_s if rate_per_s is None else rate_per_s,
                       due_ms=sc.due_ms, due_tail_s=sc.due_ms[1] / 1000, cancel_fraction=sc.cancel_fraction,
                       groups_every_subject=sc.groups_every_subject, groups_first_subject=(),
                       topology=over.pop("topology", sc.topology),
                       master_changes_without_kill_max=sc.master_changes_without_kill_max,
                       lease_ttl_ms=over.pop("lease_ttl_ms", SCENARIO_LEASE_TTL_MS), **over)


def plan(cfg: ChaosConfig) -> list[Fault]:
    """The run's faults: the scenario's lanes, or the one-lane random plan."""
    if cfg.scenario:
        return scenario_schedule(SCENARIOS[cfg.scenario], cfg.seed, cfg.duration_s)
    return fault_schedule(cfg.seed, cfg.duration_s, gap_s=cfg.fault_gap_s, first_s=cfg.first_fault_s,
                          kinds=cfg.kinds, topology=cfg.topology, hold_max_s=cfg.hold_max_s,
                          tail_free_s=cfg.tail_free_s)


# ---------------------------------------------------------------------- cluster probes


async def delay_statuses(channels, nodes) -> dict[str, dict]:
    """name -> Status document of the running ``nodes`` that answer (``node_statuses``)."""
    return await node_statuses(channels, {n.name: n.address for n in nodes if n.running})


async def group_master(channels, nodes) -> str | None:
    """The single master of a group whose other running members are slaves, else None."""
    st = await delay_statuses(channels, nodes)
    masters = [k for k, v in st.items() if v["master"]]
    running = [n for n in nodes if n.running]
    if len(masters) == 1 and len(st) == len(running) and all(
            v.get("mode") == "slave" for k, v in st.items() if k != masters[0]):
        return masters[0]
    return None


# ---------------------------------------------------------------------- the run


class ChaosRun:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.rec = Recorder(self.out)
        self.rng = random.Random(cfg.seed * 1_000_003 + 1)  # workload draws; faults have their own
        self.schedule = plan(cfg)
        self.cluster = None
        self.stop_sending = asyncio.Event()
        self.stop_consuming = asyncio.Event()
        self.kit = FaultKit(self.out / "scratch", stop=self.stop_sending)  # same file system as the cluster's data
        self.expected: dict[str, set[str]] = {}   # group key -> ids still awaited (drain progress only)
        self.frozen: set[str] = set()
        self.teardown_errors: list[str] = []      # faults the kit could not undo (none expected)
        self.delay_group_names = sorted(f"delay-g{g + 1}" for g in range(cfg.topology.delay_groups))

    def groups_for(self, subject: str) -> list[str]:
        # by default g1 on every subject and g2 on the first (two groups see the same messages)
        extra = self.cfg.groups_first_subject if subject == self.cfg.subjects[0] else ()
        return list(self.cfg.groups_every_subject) + [g for g in extra if g not in self.cfg.groups_every_subject]

    def delay_group(self, g: int):
        return self.cluster.delay[g * 2: g * 2 + 2]

    def realtime_group(self, g: int):
        return self.cluster.realtime[g * 2: g * 2 + 2]

    # ------------------------------------------------------------ workload

    def _delay_ms(self) -> int:
        if self.cfg.due_ms is not None:
            return self.rng.randint(*self.cfg.due_ms)
        r = self.rng.random()
        if r < 0.10:
            return -self.rng.randint(0, 2000)         # already due
        if r < 0.80:
            return self.rng.randint(0, 5000)
        if r < 0.95:
            return self.rng.randint(5000, 20000)
        return self.rng.randint(20000, 60000)

    async def produce(self, producer) -> None:
        """Messages at ``rate_per_s`` on average from the workload start (open loop: time lost to
        back-pressure during a failover is caught up afterwards, at most CATCH_UP_S of messages a
        tick), one ``send_many`` call a tick (``chaosrun.send_ticks``)."""
        n = 0
        cancels = asyncio.Semaphore(CANCELS_INFLIGHT_MAX)
        cancel_tasks: set[asyncio.Task] = set()
        t_end_ms = self.t0_ms + int(self.cfg.duration_s * 1000)
        due_limit = t_end_ms + int(self.cfg.due_tail_s * 1000)

        async def tick():
            nonlocal n
            owed = int(self.cfg.rate_per_s * (now_ms() - self.t0_ms) / 1000) - n
            batch = []
            for _ in range(max(0, min(owed, int(self.cfg.rate_per_s * CATCH_UP_S) + 1))):
                now = now_ms()
                deliver_at = max(1, min(now + self._delay_ms(), due_limit))
                subject = self.rng.choice(self.cfg.subjects)
                mid = f"s{self.cfg.seed}-m{n}"
                n += 1
                cancel_after = None
                if deliver_at - now > 2500 and self.rng.random() < self.cfg.cancel_fraction * 3:
                    cancel_after = self.rng.uniform(0.2, (deliver_at - now) / 1000 - 1.5)
                batch.append((mid, subject, deliver_at, now, cancel_after))
            if not batch:
                return None
            # one call per tick (a producer at 2,000 msgs/s sends this way, as issue 26's did)
            fut = await producer.send_many([b[1] for b in batch], [b[0].encode() for b in batch],
                                           ids=[b[0] for b in batch], deliver_at_ms=[b[2] for b in batch])
            return self._await_sends(producer, batch, fut, cancels, cancel_tasks)
        await send_ticks(self.stop_sending, SEND_PERIOD_S, tick)
        if cancel_tasks:
            await asyncio.gather(*cancel_tasks, return_exceptions=True)

    async def _await_sends(self, producer, batch, fut, cancels, tasks) -> None:
        try:
            errors = (await fut).errors
        except Exception as e:  # the whole call failed
            errors = dict.fromkeys(range(len(batch)), e)
        t_ack = now_ms()
        for i, (mid, subject, deliver_at, t_req, cancel_after) in enumerate(batch):
            record_send(self.rec, mid, subject, deliver_at, t_req, t_ack, errors.get(i), self.delay_group_names)
            if i not in errors and cancel_after is not None:
                t = asyncio.create_task(self._cancel_later(producer, mid, cancel_after, cancels))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

    async def _cancel_later(self, producer, mid: str, after_s: float, cancels) -> None:
        await asyncio.sleep(max(0.0, after_s))
        async with cancels:
            t_req = now_ms()
            try:
                await producer.cancel(mid)
                result = "ok"
            except E.NotFound:
                result = "not_found"
            except E.TooLate:
                result = "too_late"
            except Exception as e:  # Unavailable during a failover, etc.: recorded, not acknowledged
                result = f"error:{type(e).__name__}"
            self.rec.write("cancels", id=mid, t_req=t_req, t_ack=now_ms(), result=result)

    async def consume(self, resolver, subject: str, group: str) -> None:
        expected = self.expected

        def received(m) -> None:  # drain progress only
            expected.get(f"{subject}/{group}", set()).discard(m.id)
        await consume(resolver, subject, group, self.rec, self.stop_consuming, on_receive=received, log=log)

    # ------------------------------------------------------------ faults

    async def _restart(self, proc) -> str | None:
        """Start a killed process on its own files; the error text if it does not come up."""
        try:
            await asyncio.to_thread(proc.start)
            await asyncio.to_thread(proc.wait_ready, RESTART_TIMEOUT_S)
            return None
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[-800:]}"

    async def _healthy(self, channels) -> bool:
        for g in range(self.cfg.topology.delay_groups):
            nodes = self.delay_group(g)
            if not all(n.running for n in nodes) or await group_master(channels, nodes) is None:
                return False
        for g in range(self.cfg.topology.realtime_groups):
            nodes = self.realtime_group(g)
            if not all(n.running for n in nodes) or await group_master(channels, nodes) is None:
                return False
        return all(n.running for n in self.cluster.meta)

    async def inject(self, fault: Fault, channels, recovery_s: float | None = RECOVERY_TIMEOUT_S) -> dict:
        """Play one fault, restore it, then wait up to ``recovery_s`` (None: not) for every group
        to have a master and a slave again (the recovery time)."""
        ev = {"index": fault.index, "kind": fault.kind, "target": fault.target, "hold_s": fault.hold_s,
              "at_s": fault.at_s, "lane": fault.lane}
        try:
            if fault.kind in STARVATION_KINDS:
                ev |= await self._inject_starvation(fault, channels)
            else:
                ev |= await self._inject_classic(fault, channels)
        except (OSError, E.HourglassError) as e:  # an injector that could not act: recorded, the run goes on
            log.error("fault %d %s could not be injected: %s", fault.index, fault.kind, e)
            return ev | {"skipped": f"injector error: {type(e).__name__}: {e}", "t_start": now_ms(), "t_end": now_ms()}
        if ev.get("skipped"):
            return ev
        if self.stop_sending.is_set() or recovery_s is None:
            ev["recovery_measured"] = False  # the workload is over (restore_all and the drain follow), or a pause lane
            return ev
        ok = await wait_until(lambda: self._healthy(channels), max(1.0, recovery_s))
        ev["recovered_ms"] = now_ms() - ev["t_start"] if ok else None
        return ev

    async def _delay_roles(self, group: int, channels) -> tuple | None:
        """(master, slave) processes of delay group ``group``, or None without a master."""
        nodes = self.delay_group(group)
        master = await wait_until(lambda: group_master(channels, nodes), MASTER_FIND_TIMEOUT_S)
        if master is None:
            return None
        return next(n for n in nodes if n.name == master), next(n for n in nodes if n.name != master)

    async def _inject_starvation(self, fault: Fault, channels) -> dict:
        cfg, c, kit = self.cfg, self.cluster, self.kit
        ev = await kit.machine_fault(fault.kind, fault.hold_s, per_core=cfg.cpu_hogs_per_core,
                                     writers=cfg.disk_writers)
        if ev is not None:
            return ev
        if fault.kind in ("node_throttle", "node_stall"):
            group = fault.target if fault.kind == "node_throttle" else fault.target // 2
            roles = await self._delay_roles(group, channels)
            if roles is None:
                return {"skipped": "no master found", "t_start": now_ms(), "t_end": now_ms()}
            node = roles[0] if fault.kind == "node_throttle" or fault.target % 2 == 0 else roles[1]
            ev = {"process": node.name, "group": f"delay-g{group + 1}",
                  "role": "master" if node is roles[0] else "slave"}
            if fault.kind == "node_throttle":
                return ev | await kit.throttle(node.proc.pid, fault.hold_s, cpu_fraction=cfg.throttle_cpu_fraction)
            return ev | await kit.stall(node.proc.pid, fault.hold_s)
        proc = c.meta[fault.target] if fault.kind == "meta_stall" else c.etcd.members[fault.target]
        if not proc.running:
            return {"process": proc.name, "skipped": "not running", "t_start": now_ms(), "t_end": now_ms()}
        return {"process": proc.name} | await kit.stall(proc.proc.pid, fault.hold_s)

    async def _inject_classic(self, fault: Fault, channels) -> dict:
        c = self.cluster
        ev: dict = {}
        t_start = now_ms()
        if fault.kind in ("delay_master_kill", "delay_master_stop", "realtime_kill"):
            nodes = (self.realtime_group(fault.target) if fault.kind == "realtime_kill"
                     else self.delay_group(fault.target))
            ev["group"] = f"realtime-g{fault.target + 1}" if fault.kind == "realtime_kill" \
                else f"delay-g{fault.target + 1}"
            master = await wait_until(lambda: group_master(channels, nodes), MASTER_FIND_TIMEOUT_S)
            if master is None:
                return ev | {"skipped": "no master found", "t_start": t_start, "t_end": now_ms()}
            node = next(n for n in nodes if n.name == master)
            other = [n for n in nodes if n.name != master]
            ev["process"] = master
            t_start = now_ms()
            if fault.kind in ("delay_master_kill", "realtime_kill"):
                await asyncio.to_thread(node.kill)
            else:
                node.signal(signal.SIGSTOP)
                self.frozen.add(node.name)

            async def promoted():
                st = await delay_statuses(channels, other)
                return any(v["master"] for v in st.values())
            wait_s = fault.hold_s if fault.kind == "delay_master_stop" else RECOVERY_TIMEOUT_S
            got = await wait_until(promoted, wait_s)
            ev["failover_ms"] = now_ms() - t_start if got else None
            elapsed = (now_ms() - t_start) / 1000
            await asyncio.sleep(max(0.0, fault.hold_s - elapsed))
            if fault.kind != "delay_master_stop":
                ev["restart_error"] = await self._restart(node)
            else:
                node.signal(signal.SIGCONT)
                self.frozen.discard(node.name)
        else:
            if fault.kind == "meta_kill":
                proc = c.meta[fault.target]
            else:
                proc = c.etcd.members[fault.target]
            ev["process"] = proc.name
            await asyncio.to_thread(proc.kill)
            await asyncio.sleep(fault.hold_s)
            if fault.kind == "etcd_kill":
                try:
                    await asyncio.to_thread(proc.start)
                    await asyncio.to_thread(c.etcd.wait_ready, RESTART_TIMEOUT_S)
                    ev["restart_error"] = None
                except Exception as e:
                    ev["restart_error"] = f"{type(e).__name__}: {str(e)[-800:]}"
            else:
                ev["restart_error"] = await self._restart(proc)
        ev["t_start"] = t_start
        ev["t_end"] = now_ms()   # process restarted / thawed
        ev["restored"] = True
        return ev

    async def _play(self, name: str, i: int, plan: list[Fault], channels) -> dict:
        """Fault ``i`` of lane ``name`` (``play_lanes`` keeps the time); the main lane waits for
        recovery after each (up to RECOVERY_TIMEOUT_S), the kill lane until its next kill's time
        at most, the others (periodic pauses, whole-run starvation) not at all: they keep their
        period."""
        fault = plan[i]
        log.warning("fault %d (%s): %s target=%d hold=%.2fs", fault.index, name, fault.kind, fault.target,
                    fault.hold_s)
        recovery_s: float | None = RECOVERY_TIMEOUT_S
        if name not in ("main", "kills"):
            recovery_s = None
        elif name != "main" and i + 1 < len(plan):
            recovery_s = min(RECOVERY_TIMEOUT_S, self.t0_ms / 1000 + plan[i + 1].at_s - time.time())
        return await self.inject(fault, channels, recovery_s)

    async def faults(self) -> None:
        from cluster.transport import Channels

        channels = Channels(self.cluster.node_security())
        try:
            await play_lanes(self.schedule, self.t0_ms, self.stop_sending, self.rec,
                             lambda name, i, plan: self._play(name, i, plan, channels))
        finally:
            await channels.close()

    async def restore_all(self) -> list[str]:
        """Undo every fault in force, thaw and restart everything; errors (a process that does
        not come back, a helper that does not stop) are returned."""
        self.teardown_errors += self.kit.restore_all()
        errors = []
        for n in self.cluster.nodes + self.cluster.meta:
            if n.running:
                n.signal(signal.SIGCONT)
        for m in self.cluster.etcd.members:
            if m.running:
                os.kill(m.proc.pid, signal.SIGCONT)
        for m in self.cluster.etcd.members:
            if not m.running:
                await asyncio.to_thread(m.start)
        for n in self.cluster.meta + self.cluster.nodes:
            if not n.running:
                err = await self._restart(n)
                if err:
                    errors.append(f"{n.name}: {err}")
        return errors

    # ------------------------------------------------------------ main

    async def run(self) -> dict:
        from cluster.client import Producer
        from cluster.devcluster import LocalCluster
        from cluster.discovery import MetaResolver

        cfg = self.cfg
        cluster_root = self.out / "cluster"
        topo = cfg.topology
        self.cluster = LocalCluster(cluster_root, n_delay=2 * topo.delay_groups, delay_replicas=2,
                                    n_realtime=2 * topo.realtime_groups, realtime_replicas=2,
                                    meta=True, n_meta=topo.meta, etcd_members=topo.etcd_members, ack_mode="sync",
                                    lease_ttl_ms=cfg.lease_ttl_ms, secure=cfg.secure)
        if any(f.kind == "cpu_starve" for f in self.schedule):
            for p in self.cluster.nodes + self.cluster.meta:  # (re)started at the nodes' nice, never boosted
                p.prefix = [*at_nice(self.kit.base_nice), *p.prefix]
        journals = [cluster_root / f"{n.name}.acks.jsonl" for n in self.cluster.delay] if cfg.ack_journal else []
        for n, path in zip(self.cluster.delay, journals):
            n.env["HOURGLASS_ACK_JOURNAL"] = str(path)
        t_cluster = time.monotonic()
        await asyncio.to_thread(self.cluster.start)
        restore_errors: list[str] = []
        try:
            await asyncio.to_thread(self.cluster.wait_registered)
            from cluster.transport import Channels
            ch = Channels(self.cluster.node_security())
            try:
                ok = await wait_until(lambda: self._healthy(ch), RECOVERY_TIMEOUT_S)
            finally:
                await ch.close()
            if not ok:
                raise E.Unavailable("cluster did not elect delay masters")
            cluster_start_s = time.monotonic() - t_cluster
            resolver = MetaResolver(self.cluster.meta_addresses, refresh_ms=500,
                                    security=self.cluster.client_security())
            self.t0_ms = now_ms()
            try:
                async with Producer(resolver, retries_max=40) as producer:
                    consumers = [asyncio.create_task(self.consume(resolver, s, g))
                                 for s in cfg.subjects for g in self.groups_for(s)]
                    prod = asyncio.create_task(self.produce(producer))
                    faults = asyncio.create_task(self.faults())
                    load = asyncio.create_task(sample_load(self.rec, self.stop_sending))
                    await asyncio.sleep(cfg.duration_s)
                    self.stop_sending.set()
                    await faults
                    await prod
                    await load
                    t_send_end = now_ms()
                    restore_errors = await self.restore_all()
                    # drain: until everything acked and not cancelled has arrived, or the latest due
                    # + drain_extra_s
                    self.rec.files["sends"].flush()
                    self._load_expected()
                    due_limit = self.t0_ms + int((cfg.duration_s + cfg.due_tail_s) * 1000)
                    drain_deadline = max(due_limit, now_ms()) + int(cfg.drain_extra_s * 1000)
                    while now_ms() < drain_deadline and any(self.expected.values()):
                        await asyncio.sleep(0.5)
                    # a little longer so late duplicates are seen too
                    await asyncio.sleep(2.0)
                    self.stop_consuming.set()
                    await asyncio.gather(*consumers, return_exceptions=True)
                    t_drain_end = now_ms()
            finally:
                await resolver.close()
        finally:
            self.stop_sending.set()
            self.teardown_errors += self.kit.restore_all()  # every helper stopped by PID, cgroups removed
            if self.teardown_errors:
                log.error("teardown: %s", self.teardown_errors)
            for n in self.cluster.nodes + self.cluster.meta:
                n.signal(signal.SIGCONT)
            for m in self.cluster.etcd.members:
                if m.running:
                    os.kill(m.proc.pid, signal.SIGCONT)
            await asyncio.to_thread(self.cluster.stop)
            self.rec.close()
        run = {"seed": cfg.seed, "duration_s": cfg.duration_s, "config": json.loads(cfg.model_dump_json()),
               "t0_ms": self.t0_ms, "t_send_end": t_send_end, "t_drain_end": t_drain_end,
               "due_limit_ms": due_limit, "cluster_start_s": round(cluster_start_s, 1),
               "groups": {s: self.groups_for(s) for s in cfg.subjects},
               "schedule": [f.model_dump() for f in self.schedule], "scenario": cfg.scenario,
               "log_dir": str(cluster_root), "restore_errors": restore_errors, "teardown_errors": self.teardown_errors,
               "ack_mode": self.cluster.ack_mode,
               "ack_journals": [str(p) for p in journals], "ack_journal_expected": cfg.ack_journal,
               "expect": {"master_changes_without_kill_max": cfg.master_changes_without_kill_max}}
        (self.out / "run.json").write_text(json.dumps(run, indent=2))
        return run

    def _load_expected(self) -> None:
        """Drain progress only (the checker re-derives everything from the files)."""
        acked, cancelled = {}, set()
        for line in (self.out / "sends.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["ok"]:
                acked[e["id"]] = e["subject"]
        for line in (self.out / "cancels.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["result"] == "ok":
                cancelled.add(e["id"])
        received = set()
        for line in (self.out / "receives.jsonl").read_text().splitlines():
            e = json.loads(line)
            received.add((e["id"], e["subject"], e["group"]))
        exp: dict[str, set[str]] = {}
        for mid, subject in acked.items():
            if mid in cancelled:
                continue
            for g in self.groups_for(subject):
                if (mid, subject, g) not in received:
                    exp.setdefault(f"{subject}/{g}", set()).add(mid)
        self.expected.clear()
        self.expected.update(exp)


def run_chaos(cfg: ChaosConfig) -> dict:
    """Run, check, write ``report.json`` and ``summary.txt``; returns the report."""
    from tests.chaos.checker import check, summarize

    asyncio.run(ChaosRun(cfg).run())
    report = check(cfg.out_dir)
    (Path(cfg.out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    summary = summarize(report)
    (Path(cfg.out_dir) / "summary.txt").write_text(summary + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    ap = argparse.ArgumentParser(description="Hourglass chaos run")
    ap.add_argument("--seed", type=int, default=int(env("HOURGLASS_CHAOS_SEED", "7")))
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default=env("HOURGLASS_CHAOS_SCENARIO") or None,
                    help="a named run (docs/reliability.md): its own load, cluster and fault lanes")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of workload (default 60, or the scenario's; env HOURGLASS_CHAOS_DURATION_S)")
    ap.add_argument("--rate", type=float, default=None,
                    help="messages per second (default 25, or the scenario's; env HOURGLASS_CHAOS_RATE)")
    ap.add_argument("--gap", type=float, default=float(env("HOURGLASS_CHAOS_GAP_S", "4")))
    ap.add_argument("--kinds", default=env("HOURGLASS_CHAOS_KINDS", ",".join(CLASSIC_KINDS)),
                    help="comma-separated fault kinds of the random plan, or 'all' (default: the classic five)")
    ap.add_argument("--hold-max", type=float, default=None, help="cap every hold of the random plan (seconds)")
    ap.add_argument("--cpu-hogs-per-core", type=int, default=8, help="cpu_starve: busy processes per core")
    ap.add_argument("--disk-writers", type=int, default=2, help="disk_saturate: fdatasync writers")
    ap.add_argument("--throttle-cpu", type=float, default=0.2, help="node_throttle: CPUs allowed (0.2 = 200m)")
    ap.add_argument("--topology", default=None, metavar="D,R,M,E",
                    help="delay groups, real-time groups, meta servers, etcd members (default 2,2,2,3, or the "
                         "scenario's 1,1,1,1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--open", action="store_true", help="plaintext, no tokens (default: mutual TLS and tokens)")
    ap.add_argument("--schedule-only", action="store_true", help="print the fault schedule and exit")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    kinds = FAULT_KINDS if a.kinds == "all" else tuple(k for k in a.kinds.split(",") if k)
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
    duration = a.duration if a.duration is not None else (
        float(env("HOURGLASS_CHAOS_DURATION_S")) if env("HOURGLASS_CHAOS_DURATION_S") else None)
    rate = a.rate if a.rate is not None else (float(env("HOURGLASS_CHAOS_RATE")) if env("HOURGLASS_CHAOS_RATE")
                                              else None)
    out = Path(a.out or f"/tmp/hourglass-chaos-{a.scenario or 'random'}-{a.seed}-{int(time.time())}")
    knobs = dict(cpu_hogs_per_core=a.cpu_hogs_per_core, disk_writers=a.disk_writers,
                 throttle_cpu_fraction=a.throttle_cpu, secure=not a.open)
    if a.topology:
        try:
            d, r, m, e = (int(x) for x in a.topology.split(","))
            knobs["topology"] = Topology(delay_groups=d, realtime_groups=r, meta=m, etcd_members=e)
        except ValueError as err:
            ap.error(f"--topology {a.topology!r}: {err}")
    if a.scenario:
        cfg = scenario_config(a.scenario, seed=a.seed, out_dir=out, duration_s=duration, rate_per_s=rate, **knobs)
    else:
        cfg = ChaosConfig(seed=a.seed, duration_s=duration or 60.0, out_dir=out, rate_per_s=rate or 25.0,
                          fault_gap_s=a.gap, kinds=kinds, hold_max_s=a.hold_max, **knobs)
    if a.schedule_only:
        for f in plan(cfg):
            print(f.model_dump_json())
        return 0
    from tests.chaos.checker import summarize

    def stop(signum, _frame):  # SIGTERM (a series' timeout): unwind, so the cluster and faults are stopped
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    report = run_chaos(cfg)
    print(summarize(report))
    print(f"report: {out / 'report.json'}")
    if not report["passed"]:
        again = f"--scenario {a.scenario} " if a.scenario else ""
        print(f"CHAOS FAILED seed={a.seed} (reproduce the fault schedule: {again}--seed {a.seed} "
              f"--duration {cfg.duration_s})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
