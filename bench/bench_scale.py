"""Scale-out under CPU quotas (issue 30): the sustain benchmark of ``bench_e2e.py --client user``
on clusters of 1, 2 and 4 groups of each kind, each node process limited to a fixed CPU quota
(cgroup v1, ``bench/cgroupquota.py``), a rate ladder per shape; the highest rate held per shape,
per group, and the ratio to linear.

For each shape G (``--groups``, default 1,2,4): ``bench_e2e.py --client user --systems hourglass
--phases sustain --delay-groups G --realtime-groups G --node-cpu-quota Q --producers P --climb
--rates <ladder x G>`` in a process of its own (a fresh cluster per shape; the cgroups are
removed when it ends, and what a killed run left is removed before the next). The ladder is per
group (``--per-group-rates``) times G, so every shape climbs the same steps per group.

A rate R is **held** when the messages acknowledged per second (first tick to last answer)
reach 98% of the rate offered and the lateness p99 (lost = infinitely late) is <= 10 ms. The
load generator must not be the bottleneck, and must not back off when the cluster slows: by
default the producer runs an **open loop** (``--producer-mode open``): every 10 ms tick it
queues that tick's R/100 messages with one ``send_many`` and awaits the answers only after the
last tick, so a slow node does not lower the rate offered (the SDK coalesces queued calls into
fuller wire requests, as it does for any user who does not await each call; its bounded queue
is the only back-pressure, and a tick it delays is counted in ``ticks_missed``). The README's
awaited call per tick (``--producer-mode awaited``, with ``--producers P`` processes sharing each
tick) measures the client's round trip as much as the cluster: under a quota a node's call takes
tens of ms, so an awaited producer skips most ticks. The client processes (producers, consumer)
and the meta server and etcd are not under a quota; their CPU per message is in the JSON.

One JSON line per step and per shape on stdout (as bench_e2e), the markdown table on stderr.

    PYTHONPATH=. python3 bench/bench_scale.py --quota 0.2 --per-group-rates 200,400,800,1600 --sustain-s 10 --no-climb
    PYTHONPATH=. python3 bench/bench_scale.py --quota 0.2 --per-group-rates 3200,6400,12800 --sustain-s 10 --no-climb
    PYTHONPATH=. python3 bench/bench_scale.py --groups 1 --per-group-rates 200,400 --sustain-s 5   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HOLD_RATE_FRACTION = 0.98
HOLD_P99_MS = 10
LOOSE_P99_MS = 50
PER_GROUP_RATES = (250, 500, 750, 1000, 1500, 2000, 3000)
SHAPE_TIMEOUT_S = 3600.0


def ladder(per_group: list[int], groups: int, step: int = 100) -> list[int]:
    """The rates of a shape: each per-group rate x groups, rounded up to ``step`` msgs/s (a whole
    number of messages per 10 ms tick for every producer)."""
    return [int(math.ceil(r * groups / step) * step) for r in per_group]


def held(r: dict, p99_ms: int | None) -> bool:
    """Achieved >= 98% of offered, and p99 <= ``p99_ms`` (None: any lateness)."""
    offered = r.get("offered_per_s") or r["rate"]
    if r["achieved_per_s"] < HOLD_RATE_FRACTION * offered:
        return False
    p99 = r["lateness_all_ms"]["p99"]
    return p99_ms is None or (p99 is not None and p99 <= p99_ms)


def highest(rows: list[dict], p99_ms: int | None) -> int | None:
    return max((r.get("offered_per_s") or r["rate"] for r in rows if held(r, p99_ms)), default=None)


def most(rows: list[dict]) -> int | None:
    """The most acknowledged per second in any step (any lateness, any share of offered)."""
    return max((r["achieved_per_s"] for r in rows), default=None)


def linear_ratio(best: dict[int, int | None], groups: int) -> float | None:
    """Rate held at ``groups`` over ``groups`` x the rate held at 1 group."""
    one, g = best.get(1), best.get(groups)
    if not one or g is None:
        return None
    return round(g / (groups * one), 2)


def run_shape(groups: int, args) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_e2e.py"), "--client", "user",
           "--systems", "hourglass", "--phases", "sustain", "--delay-groups", str(groups),
           "--realtime-groups", str(groups), "--node-cpu-quota", str(args.quota),
           "--node-cpu-period-us", str(args.period_us),
           "--producers", str(args.producers), "--producer-mode", args.producer_mode,
           "--sustain-s", str(args.sustain_s),
           "--rates", ",".join(map(str, ladder(args.per_group_rates, groups, step=100 * args.producers))),
           "--windows-json", str(Path(args.out_dir) / f"scale-g{groups}-windows.json"), *args.extra]
    if not args.no_climb:
        cmd.append("--climb")
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    rows = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.monotonic() + SHAPE_TIMEOUT_S
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            r["groups"] = groups
            print(json.dumps(r), flush=True)
            if r.get("phase") == "sustain":
                rows.append(r)
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # SIGTERM first: bench_e2e removes its cgroups on the way out
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        import cgroupquota

        cgroupquota.remove_stale()
    return rows


def cpu_cell(r: dict) -> str:
    """CPU us per message, summed per kind of process."""
    cpu = r.get("cpu_us_per_msg") or {}
    sums: dict[str, float] = {}
    for k, v in cpu.items():
        kind = k.split("-")[0]
        sums[kind] = sums.get(kind, 0.0) + (v.get("us_per_msg") or 0.0)
    return " / ".join(f"{sums.get(k, 0):.0f}" for k in ("delay", "realtime", "meta", "producer", "consumer"))


def table(by_shape: dict[int, list[dict]], args) -> str:
    best = {g: highest(rows, HOLD_P99_MS) for g, rows in by_shape.items()}
    loose = {g: highest(rows, LOOSE_P99_MS) for g, rows in by_shape.items()}
    thr = {g: highest(rows, None) for g, rows in by_shape.items()}
    top = {g: most(rows) for g, rows in by_shape.items()}
    out = ["| groups (delay + real-time) | nodes at " + f"{args.quota} core | rates tried (achieved/s, p99 ms) | "
           "held at p99 <= 10 ms | per group | held at p99 <= 50 ms | per group | 98% of offered, any p99 | "
           "per group | most acknowledged/s | load average at start |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g, rows in by_shape.items():
        tried = ", ".join(f"{r.get('offered_per_s') or r['rate']} ({r['achieved_per_s']}, "
                          f"{r['lateness_all_ms']['p99']})" for r in rows)
        loads = [r.get("settings", {}).get("loadavg_at_start", [None])[0] for r in rows]
        loads = [x for x in loads if x is not None]

        def per(v):
            return "-" if v is None else f"{v / g:,.0f}"
        out.append(f"| {g} + {g} | {2 * g} | {tried} | {best[g] or '-'} | {per(best[g])} | {loose[g] or '-'} | "
                   f"{per(loose[g])} | {thr[g] or '-'} | {per(thr[g])} | {top[g] or '-'} | "
                   f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} |")
    gmax = max(by_shape)
    out.append("")
    out.append(f"ratio to linear at {gmax} groups: p99 <= 10 ms {linear_ratio(best, gmax)}, "
               f"p99 <= 50 ms {linear_ratio(loose, gmax)}, any p99 {linear_ratio(thr, gmax)}, "
               f"most acknowledged {linear_ratio(top, gmax)}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="1,2,4", help="shapes: groups of each kind")
    p.add_argument("--quota", type=float, default=0.2, help="CPU cores per node process")
    p.add_argument("--period-us", type=int, default=100_000, help="cpu.cfs_period_us")
    p.add_argument("--per-group-rates", default=",".join(map(str, PER_GROUP_RATES)),
                   help="the ladder per group, msgs/s (x groups per shape)")
    p.add_argument("--producers", type=int, default=1, help="producer processes")
    p.add_argument("--producer-mode", choices=("open", "awaited"), default="open",
                   help="open: each tick's send_many queued, answers awaited after the last tick (default); "
                        "awaited: the README's one awaited call per tick (a slow call skips ticks)")
    p.add_argument("--sustain-s", type=float, default=15.0)
    p.add_argument("--no-climb", action="store_true", help="run every rate even after one fails badly")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("extra", nargs="*", help="after --: more bench_e2e.py arguments")
    a = p.parse_args()
    a.per_group_rates = [int(x) for x in a.per_group_rates.split(",") if x]
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    import cgroupquota

    why = cgroupquota.CpuQuotas.available()
    if why:
        raise SystemExit(why)
    cgroupquota.remove_stale()
    by_shape = {}
    for g in [int(x) for x in a.groups.split(",") if x]:
        by_shape[g] = run_shape(g, a)
        print(table(by_shape, a), file=sys.stderr, flush=True)
    head = {"bench": "scale", "quota_cores": a.quota, "period_us": a.period_us,
            "highest_held": {g: highest(r, HOLD_P99_MS) for g, r in by_shape.items()},
            "highest_held_p99_50ms": {g: highest(r, LOOSE_P99_MS) for g, r in by_shape.items()},
            "highest_98pct_any_p99": {g: highest(r, None) for g, r in by_shape.items()},
            "most_acknowledged_per_s": {g: most(r) for g, r in by_shape.items()},
            "machine": {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}}
    print(json.dumps(head), flush=True)
    print(table(by_shape, a), file=sys.stderr)


if __name__ == "__main__":
    main()
