"""Fault plans of chaos runs: pure functions of a seed (no clock, no processes). The harness
(``tests/chaos/harness.py``) and ``hourglass dev chaos`` (``cluster/devchaos.py``) play them;
``cluster/chaosfaults.py`` holds the injectors, ``cluster/chaoscheck.py`` the verdict.

A plan is a list of ``Fault`` (time from the workload start, kind, abstract target, hold).
Faults of one *lane* run one after the other; lanes run side by side (a kill lane beside a
meta-server-pause lane beside whole-run starvation). ``fault_schedule`` makes the one-lane
random plan of the classic runs; ``scenario_schedule`` the plan of a named scenario.

Kinds (targets are resolved when the fault fires, through the nodes' Admin ``Status``):

=================== =========================================================== ============
kind                what                                                        hold
=================== =========================================================== ============
delay_master_kill   SIGKILL of a delay group's master, restart after the hold  0.5-4 s
delay_master_stop   SIGSTOP of a delay group's master, then SIGCONT            2-6 s
realtime_kill       SIGKILL of a real-time group's master, restart             0.5-4 s
meta_kill           SIGKILL of a meta server, restart                           0.5-4 s
etcd_kill           SIGKILL of an etcd member, restart                          0.5-4 s
cpu_starve          busy processes on every core (``cpu_hogs_per_core`` each)   5-15 s
disk_saturate       writers appending + fdatasync back to back (same disk)     5-15 s
node_throttle       cgroup CPU quota on a delay master (a Kubernetes CPU limit) 3-10 s
node_stall          SIGSTOP of a delay member (master or slave): a GC pause     0.2-3 s
meta_stall          SIGSTOP of a meta server                                    0.2-3 s
etcd_stall          SIGSTOP of an etcd member                                   0.2-3 s
=================== =========================================================== ============

``node_stall`` targets ``2 * group + (0 master | 1 slave)``. The classic five keep their draws:
``fault_schedule(seed, d)`` with ``CLASSIC_KINDS`` is what it was before the starvation kinds
came (a documented seed still reproduces its run).
"""

from __future__ import annotations

import random

from pydantic import BaseModel, Field

CLASSIC_KINDS = ("delay_master_kill", "delay_master_stop", "realtime_kill", "meta_kill", "etcd_kill")
STARVATION_KINDS = ("cpu_starve", "disk_saturate", "node_throttle", "node_stall", "meta_stall", "etcd_stall")
FAULT_KINDS = CLASSIC_KINDS + STARVATION_KINDS
# weights after the first shuffled pass (master kills dominate, as the acceptance asks for them)
FAULT_WEIGHTS = {"delay_master_kill": 6, "delay_master_stop": 2, "realtime_kill": 2, "meta_kill": 1, "etcd_kill": 1,
                 "cpu_starve": 1, "disk_saturate": 1, "node_throttle": 1, "node_stall": 2, "meta_stall": 2,
                 "etcd_stall": 1}
HOLD_S = {"delay_master_stop": (2.0, 6.0), "cpu_starve": (5.0, 15.0), "disk_saturate": (5.0, 15.0),
          "node_throttle": (3.0, 10.0), "node_stall": (0.2, 3.0), "meta_stall": (0.2, 3.0), "etcd_stall": (0.2, 3.0)}
HOLD_S_DEFAULT = (0.5, 4.0)   # kills: dead this long before the restart
MACHINE_KINDS = ("cpu_starve", "disk_saturate")   # the whole machine: target 0
TAIL_FREE_S = 10.0            # the end of a random plan is fault-free


class Topology(BaseModel):
    """What a plan may target: groups of master + slave, meta servers, etcd members."""

    delay_groups: int = Field(default=2, ge=1)
    realtime_groups: int = Field(default=2, ge=1)
    meta: int = Field(default=2, ge=1)
    etcd_members: int = Field(default=3, ge=1)

    def targets(self, kind: str) -> int:
        return {"delay_master_kill": self.delay_groups, "delay_master_stop": self.delay_groups,
                "realtime_kill": self.realtime_groups, "meta_kill": self.meta, "etcd_kill": self.etcd_members,
                "node_throttle": self.delay_groups, "node_stall": 2 * self.delay_groups, "meta_stall": self.meta,
                "etcd_stall": self.etcd_members, "cpu_starve": 1, "disk_saturate": 1}[kind]


class Fault(BaseModel):
    index: int
    at_s: float          # offset from workload start
    kind: str
    target: int          # delay group / real-time group / meta server / etcd member index (see the table)
    hold_s: float        # how long the process stays dead, frozen or throttled, or the machine starved
    lane: str = "main"   # faults of one lane run one after the other; lanes side by side


def fault_schedule(seed: int, duration_s: float, *, gap_s: float = 4.0, first_s: float = 5.0,
                   kinds: tuple[str, ...] = CLASSIC_KINDS, topology: Topology = Topology(),
                   hold_max_s: float | None = None, tail_free_s: float = TAIL_FREE_S) -> list[Fault]:
    """Pure: one lane of faults for a run of ``duration_s``. Every kind once first (shuffled),
    then weighted draws. Times are nominal; a fault waits for the previous one to be restored
    and the cluster to recover. ``hold_max_s`` caps every hold (short test runs): the faults
    come sooner, the draws (kinds, targets) stay the same. The last ``tail_free_s`` of the run get no fault."""
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
    rng = random.Random(seed)
    weights = {k: w for k, w in FAULT_WEIGHTS.items() if k in kinds}
    kinds = [k for k in FAULT_KINDS if k in kinds]
    rng.shuffle(kinds)
    out: list[Fault] = []
    t = first_s
    i = 0
    limit = max(first_s, duration_s - tail_free_s)
    while t < limit:
        kind = kinds[i] if i < len(kinds) else rng.choices(list(weights), list(weights.values()))[0]
        n = topology.targets(kind)
        hold = round(rng.uniform(*HOLD_S.get(kind, HOLD_S_DEFAULT)), 2)
        f = Fault(index=i, at_s=round(t, 2), kind=kind, target=rng.randrange(n), hold_s=hold)
        if hold_max_s is not None:
            f.hold_s = min(f.hold_s, hold_max_s)
        out.append(f)
        t += f.hold_s + rng.expovariate(1.0 / gap_s) + 1.0
        i += 1
    return out


# ---------------------------------------------------------------------- named scenarios


class Scenario(BaseModel):
    """A named run: its workload and its fault lanes. Durations and the rate are defaults the
    command line overrides (a short version for CI, the long one by hand)."""

    name: str
    about: str
    rate_per_s: float = 2000.0
    due_ms: tuple[int, int] = (1000, 15_000)          # every message due this long after sending (uniform)
    groups_every_subject: tuple[str, ...] = ("g1", "g2")
    cancel_fraction: float = 0.01
    duration_s: float = 60.0
    topology: Topology = Topology(delay_groups=1, realtime_groups=1, meta=1, etcd_members=1)
    kills: int = 0                                    # SIGKILLs of the delay master, ``kill_gap_s`` apart
    kill_gap_s: float = 10.0
    kill_hold_s: float = 1.0                          # dead this long after the slave took over
    first_kill_s: float = 5.0                         # + a seeded 0-2 s
    meta_stall_every_s: float = 0.0                   # 0: no meta server pauses
    meta_stall_hold_s: float = 1.8
    starve_cpu: bool = False                          # the whole workload long
    saturate_disk: bool = False
    master_changes_without_kill_max: int | None = None  # the run fails above this (None: reported only)


SCENARIOS = {s.name: s for s in (
    Scenario(name="meta-pause",
             about="issue 26's reproduction: 2,000 msgs/s due 1-15 s, two consumer groups, five SIGKILLs of the "
                   "delay master 10 s apart, the meta server SIGSTOPped 1.8 s every 5.3 s",
             kills=5, meta_stall_every_s=5.3),
    Scenario(name="starved-kills",
             about="the same load and kills with the machine's CPUs and disk starved the whole run",
             kills=5, starve_cpu=True, saturate_disk=True),
    Scenario(name="starved",
             about="the same load, CPUs and disk starved, no kills: no master may change",
             duration_s=600.0, starve_cpu=True, saturate_disk=True, master_changes_without_kill_max=0),
)}


def scenario_schedule(sc: Scenario, seed: int, duration_s: float | None = None) -> list[Fault]:
    """Pure: the faults of scenario ``sc`` for a workload of ``duration_s`` (default the
    scenario's). The seed moves the first kill (0-2 s later) and the phase of the meta server
    pauses against the kills, so runs of many seeds meet different alignments."""
    d = sc.duration_s if duration_s is None else duration_s
    rng = random.Random(seed)
    first_kill = sc.first_kill_s + round(rng.uniform(0.0, 2.0), 2)
    phase = round(rng.uniform(0.0, sc.meta_stall_every_s), 2) if sc.meta_stall_every_s else 0.0
    faults: list[tuple[float, str, int, float, str]] = []
    for k in range(sc.kills):
        at = first_kill + k * sc.kill_gap_s
        if at + sc.kill_hold_s >= d:
            break
        faults.append((at, "delay_master_kill", 0, sc.kill_hold_s, "kills"))
    if sc.meta_stall_every_s:
        at = phase
        while at + sc.meta_stall_hold_s < d:
            faults.append((at, "meta_stall", 0, sc.meta_stall_hold_s, "meta"))
            at += sc.meta_stall_every_s
    if sc.starve_cpu:
        faults.append((0.0, "cpu_starve", 0, d, "cpu"))
    if sc.saturate_disk:
        faults.append((0.0, "disk_saturate", 0, d, "disk"))
    faults.sort(key=lambda f: (f[0], f[4]))
    return [Fault(index=i, at_s=round(at, 2), kind=kind, target=target, hold_s=round(hold, 2), lane=lane)
            for i, (at, kind, target, hold, lane) in enumerate(faults)]


def lanes(plan: list[Fault]) -> dict[str, list[Fault]]:
    """The plan split by lane, each in time order."""
    out: dict[str, list[Fault]] = {}
    for f in sorted(plan, key=lambda f: (f.at_s, f.index)):
        out.setdefault(f.lane, []).append(f)
    return out
