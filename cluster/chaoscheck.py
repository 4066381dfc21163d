"""Invariant checker for a chaos run (``tests/chaos/harness.py``, ``hourglass dev chaos``). Reads
the recorded files only (``run.json``, ``sends.jsonl``, ``cancels.jsonl``, ``receives.jsonl``,
``faults.jsonl`` and the process logs); imports nothing of the broker, so
a bug in the broker's code paths cannot hide a violation.

Invariants (violations fail the run):

* **lost**: every acknowledged, non-cancelled message due by the run's due limit was received at
  least once by every consumer group of its subject (a message whose cancel was answered with an
  error is left out: that cancel may have taken effect; such messages are counted apart);
* **received after cancel**: no receive of a message later than the acknowledgement of its cancel;
* **early**: no receive before the message's due time (``deliver_at`` of the received message;
  one machine, one clock: delay nodes fire ahead and real-time nodes hold until due);
* **restart**: every killed process came back on its files (no restart error), and no process log
  holds a ``CorruptRecord`` (or other ``StorageError``).

Reported (not failures): duplicates (receives beyond the first per group), lateness percentiles
(all, and of messages due while a fault was in progress), failover and recovery times, cancelled
messages received before the cancel answer, tracebacks in logs (with their exception lines).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

FAULT_WINDOW_TAIL_MS = 5000   # a message due up to this long after a fault ended counts as "due during"
STORAGE_ERRORS = re.compile(r"\b(CorruptRecord|StorageError|OffsetOutOfRange)\b")
EXAMPLES_MAX = 10


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line if the harness itself died
                pass
    return out


def percentiles(xs: list[int | float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)

    def p(q):
        return s[min(len(s) - 1, int(q * len(s)))]
    return {"n": len(s), "p50": p(0.50), "p99": p(0.99), "max": s[-1]}


def scan_logs(log_dir: Path) -> dict:
    storage, tracebacks = [], Counter()
    for f in sorted(Path(log_dir).glob("*.log")):
        lines = f.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if STORAGE_ERRORS.search(line):
                storage.append(f"{f.name}:{i + 1}: {line.strip()[:300]}")
            if line.startswith("Traceback"):
                # the exception line is the first unindented line after the traceback
                exc = next((x for x in lines[i + 1:i + 200] if x and not x.startswith((" ", "Traceback"))), "?")
                tracebacks[f"{f.name}: {exc.strip()[:160]}"] += 1
    return {"storage_errors": storage, "tracebacks": dict(tracebacks)}


def check(out_dir: str | Path) -> dict:
    out = Path(out_dir)
    run = json.loads((out / "run.json").read_text())
    sends = _lines(out / "sends.jsonl")
    cancels = _lines(out / "cancels.jsonl")
    receives = _lines(out / "receives.jsonl")
    faults = _lines(out / "faults.jsonl")
    groups_of = run["groups"]
    due_limit = run["due_limit_ms"]

    acked = {e["id"]: e for e in sends if e["ok"]}
    unacked = {e["id"] for e in sends if not e["ok"]}
    cancel_ok = {e["id"]: e for e in cancels if e["result"] == "ok"}
    # a cancel answered with an error (Unavailable/NotLeader during a failover) may still have taken
    # effect: its message may or may not arrive, so it is left out of the lost check and counted
    cancel_ambiguous = {e["id"] for e in cancels if e["result"].startswith("error")} - set(cancel_ok)
    cancel_results = Counter(e["result"] for e in cancels)

    by_group: dict[tuple[str, str], list[dict]] = defaultdict(list)   # (id, group) -> receives
    for r in receives:
        by_group[(r["id"], r["group"])].append(r)

    lost, not_checked = [], 0
    expected = 0
    ambiguous_received = ambiguous_not_received = 0
    for mid, s in acked.items():
        if mid in cancel_ok:
            continue
        if mid in cancel_ambiguous:
            if any((mid, g) in by_group for g in groups_of[s["subject"]]):
                ambiguous_received += 1
            else:
                ambiguous_not_received += 1
            continue
        if s["deliver_at"] > due_limit:
            not_checked += 1
            continue
        for g in groups_of[s["subject"]]:
            expected += 1
            if (mid, g) not in by_group:
                lost.append({"id": mid, "group": g, "subject": s["subject"], "deliver_at": s["deliver_at"],
                             "t_ack": s["t_ack"]})

    early = [{"id": r["id"], "group": r["group"], "received": r["t"], "deliver_at": r["deliver_at"]}
             for r in receives if r.get("deliver_at") is not None and r["t"] < r["deliver_at"]]

    after_cancel, before_cancel_answer = [], 0
    for mid, c in cancel_ok.items():
        for g in groups_of.get(acked.get(mid, {}).get("subject", ""), []):
            for r in by_group.get((mid, g), []):
                if r["t"] > c["t_ack"]:
                    after_cancel.append({"id": mid, "group": g, "received": r["t"], "cancel_ack": c["t_ack"]})
                else:
                    before_cancel_answer += 1

    dup_count = sum(len(v) - 1 for v in by_group.values() if len(v) > 1)
    dup_ids = sum(1 for v in by_group.values() if len(v) > 1)
    unacked_received = len({k[0] for k in by_group} & unacked)
    unknown_received = len({k[0] for k in by_group} - set(acked) - unacked)

    windows = [(f["t_start"], f["t_end"] + FAULT_WINDOW_TAIL_MS) for f in faults if "t_start" in f]
    late_all, late_fault = [], []
    for (mid, g), rs in by_group.items():
        s = acked.get(mid)
        if s is None:
            continue
        first = min(r["t"] for r in rs)
        lateness = first - max(s["deliver_at"], s["t_req"])
        late_all.append(lateness)
        if any(a <= s["deliver_at"] <= b for a, b in windows):
            late_fault.append(lateness)

    restart_errors = [f"fault {f['index']} {f['kind']} {f.get('process')}: {f['restart_error']}"
                      for f in faults if f.get("restart_error")]
    restart_errors += list(run.get("restore_errors", []))
    logs = scan_logs(Path(run["log_dir"]))
    fault_kinds = Counter(f["kind"] for f in faults if not f.get("skipped"))
    failovers = [f["failover_ms"] for f in faults if f.get("failover_ms") is not None
                 and f["kind"] == "delay_master_kill"]
    stop_failovers = [f["failover_ms"] for f in faults if f.get("failover_ms") is not None
                      and f["kind"] == "delay_master_stop"]
    recovered = [f["recovered_ms"] for f in faults if f.get("recovered_ms") is not None]
    not_recovered = [f["index"] for f in faults if f.get("recovered_ms") is None and not f.get("skipped")]

    violations = []
    if lost:
        violations.append(f"{len(lost)} acknowledged, non-cancelled messages never received")
    if after_cancel:
        violations.append(f"{len(after_cancel)} receives after the cancel was acknowledged")
    if early:
        violations.append(f"{len(early)} receives before the message's due time")
    if restart_errors:
        violations.append(f"{len(restart_errors)} processes did not restart on their files")
    if logs["storage_errors"]:
        violations.append(f"{len(logs['storage_errors'])} storage/corruption errors in process logs")
    if not sends:
        violations.append("no messages were sent")

    return {
        "seed": run["seed"], "duration_s": run["duration_s"], "passed": not violations, "violations": violations,
        "faults": {"injected": sum(fault_kinds.values()), "by_kind": dict(fault_kinds),
                   "skipped": [f for f in faults if f.get("skipped")],
                   "master_kills": fault_kinds.get("delay_master_kill", 0),
                   "failover_ms": percentiles(failovers), "frozen_master_failover_ms": percentiles(stop_failovers),
                   "recovery_ms": percentiles(recovered), "not_recovered": not_recovered},
        "messages": {"sent": len(sends), "acked": len(acked), "send_failed": len(unacked),
                     "cancel_results": dict(cancel_results), "expected_deliveries": expected,
                     "not_checked_due_after_run": not_checked, "receives": len(receives)},
        "lost": {"count": len(lost), "examples": lost[:EXAMPLES_MAX]},
        "received_after_cancel": {"count": len(after_cancel), "examples": after_cancel[:EXAMPLES_MAX]},
        "received_early": {"count": len(early), "examples": early[:EXAMPLES_MAX]},
        "cancelled_received_before_cancel_answer": before_cancel_answer,
        "ambiguous_cancels": {"received": ambiguous_received, "not_received": ambiguous_not_received},
        "duplicates": {"extra_receives": dup_count, "messages": dup_ids},
        "unacked_but_received": unacked_received, "unknown_received": unknown_received,
        "lateness_ms": {"all": percentiles(late_all), "due_during_faults": percentiles(late_fault)},
        "restart_errors": restart_errors[:EXAMPLES_MAX],
        "logs": {"storage_errors": logs["storage_errors"][:EXAMPLES_MAX], "tracebacks": logs["tracebacks"]},
        "cluster_start_s": run.get("cluster_start_s"),
    }


def summarize(r: dict) -> str:
    f, m, lat = r["faults"], r["messages"], r["lateness_ms"]

    def pct(d):
        return f"p50={d['p50']} p99={d['p99']} max={d['max']} (n={d['n']})"
    lines = [
        f"chaos seed={r['seed']} duration={r['duration_s']}s: {'PASSED' if r['passed'] else 'FAILED'}",
        f"faults: {f['injected']} injected {f['by_kind']}; master kills={f['master_kills']}",
        f"failover ms (master SIGKILL -> slave promoted): {pct(f['failover_ms'])}",
        f"failover ms (master SIGSTOP -> slave promoted within hold): {pct(f['frozen_master_failover_ms'])}",
        f"recovery ms (fault start -> all groups healthy): {pct(f['recovery_ms'])}",
        f"messages: sent={m['sent']} acked={m['acked']} send_failed={m['send_failed']} cancels={m['cancel_results']}",
        f"expected deliveries={m['expected_deliveries']} receives={m['receives']} lost={r['lost']['count']} "
        f"received_after_cancel={r['received_after_cancel']['count']} early={r['received_early']['count']} "
        f"duplicates={r['duplicates']['extra_receives']} (messages {r['duplicates']['messages']}) "
        f"ambiguous cancels (error answer) received/not={r['ambiguous_cancels']['received']}/"
        f"{r['ambiguous_cancels']['not_received']}",
        f"lateness ms all: {pct(lat['all'])}",
        f"lateness ms due during faults: {pct(lat['due_during_faults'])}",
        f"restart errors={len(r['restart_errors'])} storage errors in logs={len(r['logs']['storage_errors'])} "
        f"tracebacks in logs={sum(r['logs']['tracebacks'].values())}",
    ]
    for v in r["violations"]:
        lines.append(f"VIOLATION: {v}")
    if not r["passed"]:
        lines.append(f"seed={r['seed']} reproduces this fault schedule")
    return "\n".join(lines)


def main() -> None:
    rep = check(sys.argv[1])
    print(json.dumps(rep, indent=2) if "--json" in sys.argv else summarize(rep))
    sys.exit(0 if rep["passed"] else 1)


if __name__ == "__main__":
    main()
