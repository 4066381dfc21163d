"""Run one chaos scenario over many seeds in a row and sum up the figures that
docs/reliability.md reports: runs passed, kills, master changes with no kill, failover
and resume p50/max, acknowledged lost, overlapping acknowledgement windows.

    python -m tests.chaos.series --scenario meta-pause --seeds 1-30 --out /tmp/series-mp

Each run is ``python -m tests.chaos.harness`` in its own process (a run that hangs is
stopped after ``--run-timeout-s``); the series stops at the first failed run unless
``--keep-going``. One JSON line per run goes to ``OUT/series.jsonl``, the sum to
``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN_TIMEOUT_S = 900.0


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def run_one(scenario: str, seed: int, out: Path, extra: list[str], timeout_s: float) -> dict:
    run_dir = out / f"seed-{seed}"
    cmd = [sys.executable, "-m", "tests.chaos.harness", "--scenario", scenario, "--seed", str(seed),
           "--out", str(run_dir), *extra]
    t0 = time.monotonic()
    with open(out / f"seed-{seed}.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the harness stops its cluster on SIGTERM
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    row = {"seed": seed, "rc": rc, "wall_s": round(time.monotonic() - t0, 1)}
    try:
        row["report"] = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError) as e:
        row["report"] = None
        row["error"] = f"no report: {e}"
    return row


def summarize(rows: list[dict]) -> dict:
    """Sum of the runs' reports (tests/chaos/checker.py). Failover and resume: the median of
    the runs' p50s and the largest of their maxima (a report keeps percentiles, not samples)."""
    reps = [r["report"] for r in rows if r.get("report")]

    def total(*path) -> int:
        return sum(int(_dig(rep, path, 0) or 0) for rep in reps)

    def p50s(*path) -> list[float]:
        return [v for rep in reps if (v := _dig(rep, path, None)) is not None]
    fo, fo_max = p50s("faults", "failover_ms", "p50"), p50s("faults", "failover_ms", "max")
    rs, rs_max = p50s("faults", "resume_ms", "p50"), p50s("faults", "resume_ms", "max")
    return {
        "runs": len(rows), "passed": sum(1 for r in rows if r["rc"] == 0),
        "lost": total("lost", "count"), "kills": total("faults", "master_kills"),
        "master_changes": total("master_changes", "total"),
        "master_changes_without_kill": total("master_changes", "without_kill"),
        "overlapping_ack_windows": total("ack_windows", "overlaps"),
        "received_after_cancel": total("received_after_cancel", "count"),
        "failover_ms_p50": statistics.median(fo) if fo else None, "failover_ms_max": max(fo_max, default=None),
        "resume_ms_p50": statistics.median(rs) if rs else None, "resume_ms_max": max(rs_max, default=None),
        "load1_p50": statistics.median(p50s("load1", "p50")) if p50s("load1", "p50") else None,
    }


def _dig(d, path, default):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--seeds", default="1-30")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-going", action="store_true")
    ap.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in parse_seeds(args.seeds):
        row = run_one(args.scenario, seed, out, extra, args.run_timeout_s)
        rows.append(row)
        with open(out / "series.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "report"} | {"summary": summarize([row])}) + "\n")
        print(json.dumps({"seed": seed, "rc": row["rc"], **summarize([row])}), flush=True)
        if row["rc"] != 0 and not args.keep_going:
            break
    total = summarize(rows)
    (out / "summary.json").write_text(json.dumps(total, indent=2))
    print(json.dumps({"scenario": args.scenario, **total}), flush=True)
    return 0 if total["passed"] == total["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
