"""Chaos harness: a real cluster, a continuous delayed-message workload, seeded faults, and a
recorder writing every send-ack, cancel-ack and receive as JSON lines.

    python -m tests.chaos.harness --seed 7 --duration 60 --out /tmp/chaos-7

Pieces:

* ``fault_schedule(seed, duration_s)`` - pure: the same seed gives the same list of faults
  (kind, target, time, hold). Targets are named abstractly ("the master of delay group 1",
  "real-time node 2") and resolved when the fault fires;
* ``Recorder`` - append-only JSON lines files in the output directory
  (``sends.jsonl``, ``cancels.jsonl``, ``receives.jsonl``, ``faults.jsonl``, ``run.json``);
* ``run_chaos(config)`` - starts ``LocalCluster`` (3-member etcd, 2 meta servers, two delay
  groups of master + slave in ``sync`` mode, real-time nodes), runs producers, cancellers,
  consumers and the fault injector together, restores every fault, drains, stops the cluster
  and hands the directory to ``tests.chaos.checker`` which reads the files only.

Real-time groups are not replicated yet (one node each), so a real-time fault is SIGKILL and
restart of that node on its own files; see docs/reliability.md.
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

log = logging.getLogger("hourglass.chaos")

FAULT_KINDS = ("delay_master_kill", "delay_master_stop", "realtime_kill", "meta_kill", "etcd_kill")
# weights after the first shuffled pass (master kills dominate, as the acceptance asks for them)
FAULT_WEIGHTS = {"delay_master_kill": 6, "delay_master_stop": 2, "realtime_kill": 2, "meta_kill": 1,
                 "etcd_kill": 1}
N_DELAY_GROUPS = 2
N_REALTIME = 2  # real-time groups, each a master + slave
N_META = 2
ETCD_MEMBERS = 3
MASTER_FIND_TIMEOUT_S = 30.0
RECOVERY_TIMEOUT_S = 45.0
RESTART_TIMEOUT_S = 45.0
STATUS_TIMEOUT_S = 2.0
CANCELS_INFLIGHT_MAX = 64
SEND_BATCHES_INFLIGHT_MAX = 64
POLL_S = 0.1


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class ChaosConfig(BaseModel):
    seed: int = 7
    duration_s: float = Field(default=60.0, gt=0)   # workload + faults
    out_dir: Path
    rate_per_s: float = Field(default=25.0, gt=0)    # messages produced per second
    cancel_fraction: float = 0.1                     # of messages long enough to cancel
    fault_gap_s: float = 4.0                         # mean quiet time between faults
    first_fault_s: float = 5.0
    due_tail_s: float = 8.0                          # every message is due by send end + this
    drain_extra_s: float = 45.0                      # after the latest due, for failover + delivery
    subjects: tuple[str, ...] = ("chaos.a", "chaos.b", "chaos.c", "chaos.d")
    lease_ttl_ms: int = 2000
    kinds: tuple[str, ...] = FAULT_KINDS
    secure: bool = True                              # mutual TLS and tokens, as a production cluster runs


class Fault(BaseModel):
    index: int
    at_s: float          # offset from workload start
    kind: str
    target: int          # delay group / real-time node / meta server / etcd member index
    hold_s: float        # how long the process stays dead or frozen


def fault_schedule(seed: int, duration_s: float, *, gap_s: float = 4.0, first_s: float = 5.0,
                   kinds: tuple[str, ...] = FAULT_KINDS) -> list[Fault]:
    """Pure: faults for a run of ``duration_s``. Every kind once first (shuffled), then weighted draws.
    Times are nominal; a fault waits for the previous one to be restored and the cluster to recover."""
    rng = random.Random(seed)
    weights = {k: w for k, w in FAULT_WEIGHTS.items() if k in kinds}
    kinds = [k for k in FAULT_KINDS if k in kinds]
    rng.shuffle(kinds)
    out: list[Fault] = []
    t = first_s
    i = 0
    limit = max(first_s, duration_s - 10.0)  # leave the tail of the run fault-free
    while t < limit:
        kind = kinds[i] if i < len(kinds) else rng.choices(list(weights), list(weights.values()))[0]
        n = {"delay_master_kill": N_DELAY_GROUPS, "delay_master_stop": N_DELAY_GROUPS, "realtime_kill": N_REALTIME,
             "meta_kill": N_META, "etcd_kill": ETCD_MEMBERS}[kind]
        hold = round(rng.uniform(2.0, 6.0) if kind == "delay_master_stop" else rng.uniform(0.5, 4.0), 2)
        out.append(Fault(index=i, at_s=round(t, 2), kind=kind, target=rng.randrange(n), hold_s=hold))
        t += hold + rng.expovariate(1.0 / gap_s) + 1.0
        i += 1
    return out


class Recorder:
    """JSON lines, one file per event kind, flushed per line (a crash of the harness keeps them)."""

    NAMES = ("sends", "cancels", "receives", "faults")

    def __init__(self, out_dir: Path) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = {n: open(self.dir / f"{n}.jsonl", "a", buffering=1) for n in self.NAMES}

    def write(self, _file: str, **event) -> None:
        self.files[_file].write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# ---------------------------------------------------------------------- cluster probes


async def delay_statuses(channels, nodes) -> dict[str, dict]:
    from cluster.proto import hourglass_pb2 as pb

    out = {}
    for n in nodes:
        if not n.running:
            continue
        try:
            r = await channels.admin(n.address).Status(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
            out[n.name] = json.loads(r.json) | {"master": r.master}
        except Exception:
            pass
    return out


async def group_master(channels, nodes) -> str | None:
    """The single master of a group whose other running members are slaves, else None."""
    st = await delay_statuses(channels, nodes)
    masters = [k for k, v in st.items() if v["master"]]
    running = [n for n in nodes if n.running]
    if len(masters) == 1 and len(st) == len(running) and all(
            v.get("mode") == "slave" for k, v in st.items() if k != masters[0]):
        return masters[0]
    return None


async def wait_until(pred, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(POLL_S)
    return None


# ---------------------------------------------------------------------- the run


class ChaosRun:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.rec = Recorder(self.out)
        self.rng = random.Random(cfg.seed * 1_000_003 + 1)  # workload draws; faults have their own
        self.schedule = fault_schedule(cfg.seed, cfg.duration_s, gap_s=cfg.fault_gap_s, first_s=cfg.first_fault_s,
                                       kinds=cfg.kinds)
        self.cluster = None
        self.stop_sending = asyncio.Event()
        self.stop_consuming = asyncio.Event()
        self.expected: dict[str, set[str]] = {}   # group key -> ids still awaited (drain progress only)
        self.frozen: set[str] = set()

    def groups_for(self, subject: str) -> list[str]:
        # every subject has group g1; the first subject also g2 (two groups see the same messages)
        return ["g1", "g2"] if subject == self.cfg.subjects[0] else ["g1"]

    def delay_group(self, g: int):
        return self.cluster.delay[g * 2: g * 2 + 2]

    def realtime_group(self, g: int):
        return self.cluster.realtime[g * 2: g * 2 + 2]

    # ------------------------------------------------------------ workload

    def _delay_ms(self) -> int:
        r = self.rng.random()
        if r < 0.10:
            return -self.rng.randint(0, 2000)         # already due
        if r < 0.80:
            return self.rng.randint(0, 5000)
        if r < 0.95:
            return self.rng.randint(5000, 20000)
        return self.rng.randint(20000, 60000)

    async def produce(self, producer) -> None:
        period = 0.1
        per_tick = self.cfg.rate_per_s * period
        n = 0
        carry = 0.0
        inflight = asyncio.Semaphore(SEND_BATCHES_INFLIGHT_MAX)
        cancels = asyncio.Semaphore(CANCELS_INFLIGHT_MAX)
        tasks: set[asyncio.Task] = set()
        t_end_ms = self.t0_ms + int(self.cfg.duration_s * 1000)
        due_limit = t_end_ms + int(self.cfg.due_tail_s * 1000)
        while not self.stop_sending.is_set():
            carry += per_tick
            batch = []
            while carry >= 1:
                carry -= 1
                now = now_ms()
                deliver_at = max(1, min(now + self._delay_ms(), due_limit))
                subject = self.rng.choice(self.cfg.subjects)
                mid = f"s{self.cfg.seed}-m{n}"
                n += 1
                cancel_after = None
                if deliver_at - now > 2500 and self.rng.random() < self.cfg.cancel_fraction * 3:
                    cancel_after = self.rng.uniform(0.2, (deliver_at - now) / 1000 - 1.5)
                fut = await producer.send(subject, mid, id=mid, deliver_at_ms=deliver_at)
                batch.append((mid, subject, deliver_at, now, fut, cancel_after))
            if batch:
                await inflight.acquire()
                t = asyncio.create_task(self._await_sends(producer, batch, inflight, cancels, tasks))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            try:
                await asyncio.wait_for(self.stop_sending.wait(), period)
            except asyncio.TimeoutError:
                pass
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _await_sends(self, producer, batch, inflight, cancels, tasks) -> None:
        try:
            res = await asyncio.gather(*(b[4] for b in batch), return_exceptions=True)
        finally:
            inflight.release()
        for (mid, subject, deliver_at, t_req, _, cancel_after), r in zip(batch, res):
            ok = not isinstance(r, BaseException)
            self.rec.write("sends", id=mid, subject=subject, deliver_at=deliver_at, t_req=t_req, t_ack=now_ms(),
                           ok=ok, error=None if ok else f"{type(r).__name__}: {r}"[:200])
            if ok and cancel_after is not None:
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
        from cluster.client import Consumer

        failures = 0
        async with Consumer(resolver, subject, group=group, wait_ms=300, consumer_id=f"chaos-{group}-{subject}") as c:
            while not self.stop_consuming.is_set():
                try:
                    batch = await c.pull()
                except Exception as e:
                    failures += 1
                    if not isinstance(e, E.Unavailable):
                        log.warning("pull %s/%s: %s: %s", subject, group, type(e).__name__, e)
                    await asyncio.sleep(min(1.0, 0.05 * failures))
                    continue
                failures = 0
                t = now_ms()
                for m in batch:
                    self.rec.write("receives", id=m.id, wire_id=m.wire_id, subject=subject, group=group, t=t,
                                   deliver_at=m.deliver_at_ms, attempts=m.attempts)
                    self.expected.get(f"{subject}/{group}", set()).discard(m.id)
                try:
                    await c.ack(batch)
                except Exception as e:  # unacked messages come back: counted as duplicates
                    log.info("ack %s/%s failed: %s", subject, group, e)

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
        for g in range(N_DELAY_GROUPS):
            nodes = self.delay_group(g)
            if not all(n.running for n in nodes) or await group_master(channels, nodes) is None:
                return False
        for g in range(N_REALTIME):
            nodes = self.realtime_group(g)
            if not all(n.running for n in nodes) or await group_master(channels, nodes) is None:
                return False
        return all(n.running for n in self.cluster.meta)

    async def inject(self, fault: Fault, channels) -> dict:
        c = self.cluster
        ev = {"index": fault.index, "kind": fault.kind, "target": fault.target, "hold_s": fault.hold_s,
               "at_s": fault.at_s}
        t_start = now_ms()
        if fault.kind in ("delay_master_kill", "delay_master_stop", "realtime_kill"):
            nodes = (self.realtime_group(fault.target) if fault.kind == "realtime_kill"
                     else self.delay_group(fault.target))
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
        ok = await wait_until(lambda: self._healthy(channels), RECOVERY_TIMEOUT_S)
        ev["recovered_ms"] = now_ms() - t_start if ok else None
        return ev

    async def faults(self) -> None:
        from cluster.transport import Channels

        channels = Channels(self.cluster.node_security())
        try:
            for fault in self.schedule:
                if self.stop_sending.is_set():
                    break
                delay = self.t0_ms / 1000 + fault.at_s - time.time()
                if delay > 0:
                    try:
                        await asyncio.wait_for(self.stop_sending.wait(), delay)
                        break
                    except asyncio.TimeoutError:
                        pass
                log.warning("fault %d: %s target=%d hold=%.2fs", fault.index, fault.kind, fault.target, fault.hold_s)
                ev = await self.inject(fault, channels)
                self.rec.write("faults", **ev)
        finally:
            await channels.close()

    async def restore_all(self) -> list[str]:
        """Thaw and restart everything; errors (a process that does not come back) are returned."""
        errors = []
        for n in self.cluster.nodes + self.cluster.meta:
            if n.running:
                n.signal(signal.SIGCONT)
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
        self.cluster = LocalCluster(cluster_root, n_delay=2 * N_DELAY_GROUPS, delay_replicas=2,
                                    n_realtime=2 * N_REALTIME, realtime_replicas=2,
                                    meta=True, n_meta=N_META, etcd_members=ETCD_MEMBERS, ack_mode="sync",
                                    lease_ttl_ms=cfg.lease_ttl_ms, secure=cfg.secure)
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
                    await asyncio.sleep(cfg.duration_s)
                    self.stop_sending.set()
                    await faults
                    await prod
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
            for n in self.cluster.nodes + self.cluster.meta:
                n.signal(signal.SIGCONT)
            await asyncio.to_thread(self.cluster.stop)
            self.rec.close()
        run = {"seed": cfg.seed, "duration_s": cfg.duration_s, "config": json.loads(cfg.model_dump_json()),
               "t0_ms": self.t0_ms, "t_send_end": t_send_end, "t_drain_end": t_drain_end,
               "due_limit_ms": due_limit, "cluster_start_s": round(cluster_start_s, 1),
               "groups": {s: self.groups_for(s) for s in cfg.subjects},
               "schedule": [f.model_dump() for f in self.schedule],
               "log_dir": str(cluster_root), "restore_errors": restore_errors}
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
    ap = argparse.ArgumentParser(description="Hourglass chaos run")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("HOURGLASS_CHAOS_SEED", "7")))
    ap.add_argument("--duration", type=float, default=float(os.environ.get("HOURGLASS_CHAOS_DURATION_S", "60")))
    ap.add_argument("--rate", type=float, default=float(os.environ.get("HOURGLASS_CHAOS_RATE", "25")))
    ap.add_argument("--gap", type=float, default=float(os.environ.get("HOURGLASS_CHAOS_GAP_S", "4")))
    ap.add_argument("--kinds", default=os.environ.get("HOURGLASS_CHAOS_KINDS", ",".join(FAULT_KINDS)),
                    help="comma-separated fault kinds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--open", action="store_true", help="plaintext, no tokens (default: mutual TLS and tokens)")
    ap.add_argument("--schedule-only", action="store_true", help="print the fault schedule and exit")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    kinds = tuple(k for k in a.kinds.split(",") if k)
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
    if a.schedule_only:
        for f in fault_schedule(a.seed, a.duration, gap_s=a.gap, kinds=kinds):
            print(f.model_dump_json())
        return 0
    out = Path(a.out or f"/tmp/hourglass-chaos-{a.seed}-{int(time.time())}")
    from tests.chaos.checker import summarize

    report = run_chaos(ChaosConfig(seed=a.seed, duration_s=a.duration, out_dir=out, rate_per_s=a.rate,
                                   fault_gap_s=a.gap, kinds=kinds, secure=not a.open))
    print(summarize(report))
    print(f"report: {out / 'report.json'}")
    if not report["passed"]:
        print(f"CHAOS FAILED seed={a.seed} (reproduce the fault schedule: --seed {a.seed} --duration {a.duration})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
