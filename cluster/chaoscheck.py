"""Invariant checker for a chaos run (``tests/chaos/harness.py``, ``hourglass dev chaos``). Reads
the recorded files only (``run.json``, ``sends.jsonl``, ``cancels.jsonl``, ``receives.jsonl``,
``ack_answers.jsonl``, ``faults.jsonl`` and the process logs); imports nothing of the broker, so
a bug in the broker's code paths cannot hide a violation.

Invariants (violations fail the run):

* **lost**: every acknowledged, non-cancelled message due by the run's due limit was received at
  least once by every consumer group of its subject (a message whose cancel was answered with an
  error is left out: that cancel may have taken effect; such messages are counted apart);
* **received after cancel**: no receive of a message later than the acknowledgement of its cancel;
* **early**: no receive before the message's due time (``deliver_at`` of the received message;
  one machine, one clock: delay nodes fire ahead and real-time nodes hold until due);
* **restart**: every killed process came back on its files (no restart error), and no process log
  holds a ``CorruptRecord`` (or other ``StorageError``);
* **restored**: every fault was undone (a process thawed, a cgroup removed, helpers stopped);
* **acknowledgement windows**: no two members of a group acknowledged in overlapping windows,
  and no epoch was acknowledged by two members. The windows come from the delay nodes'
  journals (``node/replication/ackjournal.py``: ``*acks.jsonl`` beside the logs, or the files
  ``run.json`` lists): JSON lines ``{node, group, epoch, first_ms, last_ms}``, merged per
  (group, node, epoch) to min first / max last. A journal may miss the last
  < ``ACK_WINDOW_PAD_MS`` of a window (it writes at most that often, without fsync), so every
  window is extended by that much; a correct master stops acknowledging a lease margin
  (>= 400 ms) before the next one can start. Windows of one node in different epochs may touch.
  A run that expects journals (``run.json`` ``ack_journal_expected``) and acknowledged sends
  but holds no window fails: the check would otherwise pass unseen;
* **expectations** of the scenario (``run.json`` ``expect``): ``master_changes_without_kill_max``.

* **redelivered after an answered ack**: no message received again by a consumer group after
  the consumer's ack of it was answered OK (``ack_answers.jsonl``), unless a real-time master
  changed in between and the cluster runs ``async`` acks (``run.json`` ``ack_mode``; its slave
  may lack the master's last acks). Receives again after an ack that failed or was not yet
  answered are at-least-once delivery: reported, not failures (``classify_duplicates``);

Reported (not failures): duplicates (receives beyond the first per group), lateness percentiles
(all, and of messages due while a fault was in progress), failover and recovery times, resume
times (from a delay master's SIGKILL to the first receive of a message of that group due after
the kill), master changes ("became MASTER" in the node logs after the workload started; the first
one in a group after a SIGKILL of its master counts as "after a kill", the first after a SIGSTOP
of its master as "after a stop", the rest are "unprovoked"), the 1-minute load average during
the workload, cancelled messages received before the cancel answer, tracebacks in logs.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

FAULT_WINDOW_TAIL_MS = 5000   # a message due up to this long after a fault ended counts as "due during"
STORAGE_ERRORS = re.compile(r"\b(CorruptRecord|StorageError|OffsetOutOfRange)\b")
# "2026-11-26 10:08:47,531 WARNING hourglass.replication became MASTER group=delay-g1 epoch=93 ..."
BECAME_MASTER = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*\bbecame MASTER group=(\S+) epoch=(\d+)")
EXAMPLES_MAX = 10
ACK_WINDOW_PAD_MS = 20        # node/replication/ackjournal.py WRITE_INTERVAL_MS (tests/chaos check they agree)
KILL_ATTRIBUTION_MS = 60_000  # a master change this long after a kill is no longer the kill's
KILL_KINDS = ("delay_master_kill", "realtime_kill")


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


def _log_ms(stamp: str, millis: str) -> int:
    """A log line's local time (one machine) as wall-clock ms."""
    return int(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))) * 1000 + int(millis)


def scan_logs(log_dir: Path) -> dict:
    storage, tracebacks, became_master = [], Counter(), []
    for f in sorted(Path(log_dir).glob("*.log")):
        lines = f.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "became MASTER" in line and (m := BECAME_MASTER.match(line)):
                became_master.append({"t": _log_ms(m[1], m[2]), "node": f.stem, "group": m[3], "epoch": int(m[4])})
            if STORAGE_ERRORS.search(line):
                storage.append(f"{f.name}:{i + 1}: {line.strip()[:300]}")
            if line.startswith("Traceback"):
                # the exception line is the first unindented line after the traceback
                exc = next((x for x in lines[i + 1:i + 200] if x and not x.startswith((" ", "Traceback"))), "?")
                tracebacks[f"{f.name}: {exc.strip()[:160]}"] += 1
    return {"storage_errors": storage, "tracebacks": dict(tracebacks),
            "became_master": sorted(became_master, key=lambda c: c["t"])}


# ---------------------------------------------------------------------- acknowledgement windows


def ack_windows(paths: list[Path], since_ms: int = 0) -> list[dict]:
    """Journal lines merged per (group, node, epoch); windows ending before ``since_ms`` (an
    earlier run on the same cluster) are left out."""
    merged: dict[tuple, dict] = {}
    for p in paths:
        for e in _lines(Path(p)):
            key = (e.get("group", ""), e["node"], e["epoch"])
            w = merged.setdefault(key, {"group": key[0], "node": key[1], "epoch": key[2],
                                        "first_ms": e["first_ms"], "last_ms": e["last_ms"]})
            w["first_ms"] = min(w["first_ms"], e["first_ms"])
            w["last_ms"] = max(w["last_ms"], e["last_ms"])
    return sorted((w for w in merged.values() if w["last_ms"] >= since_ms),
                  key=lambda w: (w["group"], w["first_ms"], w["node"]))


def ack_overlaps(windows: list[dict], pad_ms: int = ACK_WINDOW_PAD_MS) -> list[dict]:
    """Pairs of windows of two different nodes of one group that overlap once each is extended
    by ``pad_ms`` at its end. ``overlap_ms`` < 0 means they came within the pad of each other."""
    out = []
    by_group: dict[str, list[dict]] = defaultdict(list)
    for w in windows:
        by_group[w["group"]].append(w)
    for ws in by_group.values():
        ws = sorted(ws, key=lambda w: w["first_ms"])
        for i, a in enumerate(ws):
            for b in ws[i + 1:]:
                if b["first_ms"] > a["last_ms"] + pad_ms:
                    break
                if b["node"] != a["node"]:
                    out.append({"group": a["group"], "a": a, "b": b,
                                "overlap_ms": min(a["last_ms"], b["last_ms"]) - b["first_ms"]})
    return out


def shared_epochs(windows: list[dict]) -> list[dict]:
    """(group, epoch) acknowledged by more than one node: two masters of one term."""
    nodes: dict[tuple, set] = defaultdict(set)
    for w in windows:
        nodes[(w["group"], w["epoch"])].add(w["node"])
    return [{"group": g, "epoch": e, "nodes": sorted(n)} for (g, e), n in sorted(nodes.items()) if len(n) > 1]


def _journal_paths(run: dict) -> list[Path]:
    found = {Path(p) for p in run.get("ack_journals", []) if Path(p).exists()}
    found |= set(Path(run["log_dir"]).glob("*acks.jsonl"))  # <node>.acks.jsonl, or one shared acks.jsonl
    return sorted(found)


# ---------------------------------------------------------------------- master changes, resumes


def master_changes(changes: list[dict], faults: list[dict], since_ms: int, until_ms: int | None = None) -> dict:
    """Changes of master ("became MASTER" lines) after ``since_ms`` and, when given, before
    ``until_ms`` (the end of the drain: the clean stop that follows hands every master over,
    counted apart as ``at_stop``), each kill (then each SIGSTOP
    of a master) claiming the first change of its group after it (within KILL_ATTRIBUTION_MS,
    before the group's next such fault). A node that demotes itself and takes the seat back
    counts too (it stopped serving meanwhile); ``to_another_node`` counts the changes where the
    seat went to another member."""
    before: dict[str, str] = {}  # group -> its master before the change
    moved = 0
    for c in changes:
        if c["t"] >= since_ms and (until_ms is None or c["t"] < until_ms) \
                and before.get(c["group"]) not in (None, c["node"]):
            moved += 1
        before[c["group"]] = c["node"]
    at_stop = sum(1 for c in changes if until_ms is not None and c["t"] >= until_ms)
    changes = [c for c in changes if c["t"] >= since_ms and (until_ms is None or c["t"] < until_ms)]
    claimed: set[int] = set()

    def claim(kinds) -> int:
        fs = sorted((f for f in faults if f.get("kind") in kinds and not f.get("skipped") and f.get("group")
                     and "t_start" in f and f.get("role", "master") == "master"), key=lambda f: f["t_start"])
        n = 0
        for k, f in enumerate(fs):
            nxt = next((g["t_start"] for g in fs[k + 1:] if g["group"] == f["group"]), None)
            until = min(f["t_start"] + KILL_ATTRIBUTION_MS, nxt if nxt is not None else 1 << 62)
            for i, c in enumerate(changes):
                if i not in claimed and c["group"] == f["group"] and f["t_start"] < c["t"] < until:
                    claimed.add(i)
                    n += 1
                    break
        return n
    after_kill = claim(KILL_KINDS)
    after_stop = claim(("delay_master_stop", "node_stall"))
    by_group = Counter(c["group"] for c in changes)
    return {"total": len(changes), "to_another_node": moved, "after_kill": after_kill,
            "without_kill": len(changes) - after_kill,
            "after_master_stop": after_stop, "unprovoked": len(changes) - after_kill - after_stop,
            "by_group": dict(by_group), "at_stop": at_stop,
            "unprovoked_examples": [c for i, c in enumerate(changes) if i not in claimed][:EXAMPLES_MAX]}


def classify_duplicates(by_group: dict[tuple[str, str], list[dict]], ack_answers: list[dict],
                        realtime_changes: list[int], ack_mode: str) -> dict:
    """Every receive of a message in a consumer group after its first, by what the consumer's
    ack had been told before it (``ack_answers``: one line per acked batch, its ``ids``,
    ``group``, ``t_req``, ``t_ans``, ``ok``):

    * ``after_no_answered_ack``: no ack of it had been answered OK yet (the ack failed in a
      failover, or was not answered): at-least-once, allowed;
    * ``after_answered_ack_across_failover``: an ack answered OK, then a real-time master change
      (``realtime_changes``: wall ms of real-time master kills and "became MASTER" lines of
      real-time groups) after that ack was asked and by this receive. Allowed in ``async`` ack
      mode only (an ack is answered after the master's fsync; its slave may lack the last
      acks when it takes over, docs/replication.md); in ``sync`` mode an answered ack is held
      by every slave, so it is a violation;
    * ``after_answered_ack``: an ack answered OK and no real-time master change since: a
      violation in either mode (nothing may undo an answered ack).
    """
    answered: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)  # -> [(t_ans, t_req)] ok
    for a in ack_answers:
        if a.get("ok"):
            for mid in a["ids"]:
                answered[(mid, a["group"])].append((a["t_ans"], a["t_req"]))
    changes = sorted(realtime_changes)
    counts = Counter()
    examples: list[dict] = []
    for key, rs in by_group.items():
        if len(rs) < 2:
            continue
        oks = sorted(answered.get(key, ()))
        for t in sorted(r["t"] for r in rs)[1:]:
            done = [req for ans, req in oks if ans <= t]  # the consumer records, then acks, then pulls
            if not done:
                counts["after_no_answered_ack"] += 1
                continue
            i = bisect.bisect_right(changes, done[0])
            if i < len(changes) and changes[i] <= t:
                counts["after_answered_ack_across_failover"] += 1
                kind = "after_answered_ack_across_failover"
            else:
                counts["after_answered_ack"] += 1
                kind = "after_answered_ack"
            if len(examples) < EXAMPLES_MAX:
                examples.append({"id": key[0], "group": key[1], "kind": kind, "ack_asked": done[0], "received": t})
    bad = counts["after_answered_ack"] + (counts["after_answered_ack_across_failover"] if ack_mode == "sync" else 0)
    return {"after_no_answered_ack": counts["after_no_answered_ack"],
            "after_answered_ack_across_failover": counts["after_answered_ack_across_failover"],
            "after_answered_ack": counts["after_answered_ack"], "violating": bad,
            "ack_mode": ack_mode, "answered_ack_examples": examples}


def resume_times(faults: list[dict], sends: dict[str, dict], receives: list[dict]) -> list[int | None]:
    """Per delay master SIGKILL: ms until the first receive of a message of that delay group due
    after the kill (None: none came). A send record without ``delay_group`` matches any group."""
    recv = sorted((r["t"], r.get("deliver_at") or 0, r["id"]) for r in receives)
    times = [t for t, _, _ in recv]
    out = []
    for f in sorted((f for f in faults if f.get("kind") == "delay_master_kill" and not f.get("skipped")
                     and "t_start" in f), key=lambda f: f["t_start"]):
        at = f["t_start"]
        got = None
        for t, due, mid in recv[bisect.bisect_right(times, at):]:
            group = sends.get(mid, {}).get("delay_group")
            if due > at and (group is None or f.get("group") is None or group == f["group"]):
                got = t - at
                break
        out.append(got)
    return out


def check(out_dir: str | Path) -> dict:
    out = Path(out_dir)
    run = json.loads((out / "run.json").read_text())
    sends = _lines(out / "sends.jsonl")
    cancels = _lines(out / "cancels.jsonl")
    receives = _lines(out / "receives.jsonl")
    ack_answers = _lines(out / "ack_answers.jsonl")
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
    not_recovered = [f["index"] for f in faults if f.get("recovered_ms") is None and not f.get("skipped")
                     and f.get("recovery_measured", True)]
    not_restored = [f"fault {f['index']} {f['kind']} {f.get('process', '')}: {f.get('restore_error', '')}".strip()
                    for f in faults if f.get("restored") is False]
    t0 = run.get("t0_ms", 0)
    changes = master_changes(logs.get("became_master", []), faults, t0, run.get("t_drain_end"))
    resumes = resume_times(faults, acked, receives)
    journals = _journal_paths(run)
    windows = ack_windows(journals, t0)
    overlaps = ack_overlaps(windows)
    two_masters = shared_epochs(windows)
    load = [e["load1"] for e in _lines(out / "load.jsonl")
            if t0 <= e["t"] <= run.get("t_send_end", 1 << 62)]
    expect = run.get("expect") or {}

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
    if not_restored:
        violations.append(f"{len(not_restored)} faults not restored")
    if run.get("teardown_errors"):
        violations.append(f"{len(run['teardown_errors'])} errors undoing faults at teardown")
    if overlaps:
        violations.append(f"{len(overlaps)} overlapping acknowledgement windows of two members of a group")
    if two_masters:
        violations.append(f"{len(two_masters)} epochs acknowledged by two members")
    redelivered = None
    if (out / "ack_answers.jsonl").exists():  # runs recorded before the ack answers were: not checked
        rt_changes = [c["t"] for c in logs["became_master"] if c["group"].startswith("realtime")]
        rt_changes += [f["t_start"] for f in faults if f.get("kind") == "realtime_kill" and not f.get("skipped")
                       and "t_start" in f]
        redelivered = classify_duplicates(by_group, ack_answers, rt_changes, run.get("ack_mode", "async"))
        if redelivered["violating"]:
            violations.append(f"{redelivered['violating']} receives of a message after its ack was answered OK "
                              f"(ack_mode={redelivered['ack_mode']}; "
                              f"{redelivered['after_answered_ack']} without a real-time master change)")
    if run.get("ack_journal_expected") and acked and not windows:
        violations.append("no acknowledgement window journaled although sends were acknowledged "
                          "(HOURGLASS_ACK_JOURNAL not in effect?)")
    limit = expect.get("master_changes_without_kill_max")
    if limit is not None and changes["without_kill"] > limit:
        violations.append(f"{changes['without_kill']} master changes without a kill (at most {limit} expected)")

    return {
        "seed": run["seed"], "duration_s": run["duration_s"], "passed": not violations, "violations": violations,
        "faults": {"injected": sum(fault_kinds.values()), "by_kind": dict(fault_kinds),
                   "skipped": [f for f in faults if f.get("skipped")],
                   "master_kills": fault_kinds.get("delay_master_kill", 0),
                   "failover_ms": percentiles(failovers), "frozen_master_failover_ms": percentiles(stop_failovers),
                   "recovery_ms": percentiles(recovered), "not_recovered": not_recovered,
                   "not_restored": not_restored[:EXAMPLES_MAX],
                   "resume_ms": percentiles([r for r in resumes if r is not None]),
                   "not_resumed": sum(1 for r in resumes if r is None)},
        "master_changes": changes,
        "ack_windows": {"journals": len(journals), "windows": len(windows), "overlaps": len(overlaps),
                        "overlap_examples": overlaps[:EXAMPLES_MAX], "shared_epochs": two_masters[:EXAMPLES_MAX],
                        "pad_ms": ACK_WINDOW_PAD_MS},
        "load1": {"n": len(load), "min": min(load) if load else None,
                  "p50": percentiles(load)["p50"], "max": max(load) if load else None},
        "scenario": run.get("scenario"), "expect": expect,
        "messages": {"sent": len(sends), "acked": len(acked), "send_failed": len(unacked),
                     "cancel_results": dict(cancel_results), "expected_deliveries": expected,
                     "not_checked_due_after_run": not_checked, "receives": len(receives)},
        "lost": {"count": len(lost), "examples": lost[:EXAMPLES_MAX]},
        "received_after_cancel": {"count": len(after_cancel), "examples": after_cancel[:EXAMPLES_MAX]},
        "received_early": {"count": len(early), "examples": early[:EXAMPLES_MAX]},
        "cancelled_received_before_cancel_answer": before_cancel_answer,
        "ambiguous_cancels": {"received": ambiguous_received, "not_received": ambiguous_not_received},
        "duplicates": {"extra_receives": dup_count, "messages": dup_ids, "by_ack": redelivered},
        "unacked_but_received": unacked_received, "unknown_received": unknown_received,
        "lateness_ms": {"all": percentiles(late_all), "due_during_faults": percentiles(late_fault)},
        "restart_errors": restart_errors[:EXAMPLES_MAX],
        "logs": {"storage_errors": logs["storage_errors"][:EXAMPLES_MAX], "tracebacks": logs["tracebacks"]},
        "cluster_start_s": run.get("cluster_start_s"),
    }


def summarize(r: dict) -> str:
    f, m, lat = r["faults"], r["messages"], r["lateness_ms"]
    mc, aw, ld = r["master_changes"], r["ack_windows"], r["load1"]

    def pct(d):
        return f"p50={d['p50']} p99={d['p99']} max={d['max']} (n={d['n']})"
    lines = [
        f"chaos {('scenario=' + r['scenario'] + ' ') if r.get('scenario') else ''}seed={r['seed']} "
        f"duration={r['duration_s']}s: {'PASSED' if r['passed'] else 'FAILED'}",
        f"faults: {f['injected']} injected {f['by_kind']}; master kills={f['master_kills']}",
        f"failover ms (master SIGKILL -> slave promoted): {pct(f['failover_ms'])}",
        f"failover ms (master SIGSTOP -> slave promoted within hold): {pct(f['frozen_master_failover_ms'])}",
        f"recovery ms (fault start -> all groups healthy): {pct(f['recovery_ms'])}",
        f"resume ms (delay master SIGKILL -> first receive of that group due after it): {pct(f['resume_ms'])}"
        f" not resumed={f['not_resumed']}",
        f"master changes: {mc['total']} (after a kill {mc['after_kill']}, without a kill {mc['without_kill']}: "
        f"after a master stop {mc['after_master_stop']}, unprovoked {mc['unprovoked']}; to another node "
        f"{mc['to_another_node']}) {mc['by_group']}",
        (f"ack windows: {aw['windows']} in {aw['journals']} journals, overlapping pairs={aw['overlaps']}, "
         f"epochs with two members={len(aw['shared_epochs'])}" if aw["journals"]
         else "ack windows: no journal (overlaps not checked; HOURGLASS_ACK_JOURNAL)"),
        f"load avg (1 min) during the workload: min={ld['min']} p50={ld['p50']} max={ld['max']} (n={ld['n']})",
        f"messages: sent={m['sent']} acked={m['acked']} send_failed={m['send_failed']} cancels={m['cancel_results']}",
        f"expected deliveries={m['expected_deliveries']} receives={m['receives']} lost={r['lost']['count']} "
        f"received_after_cancel={r['received_after_cancel']['count']} early={r['received_early']['count']} "
        f"duplicates={r['duplicates']['extra_receives']} (messages {r['duplicates']['messages']}) "
        f"ambiguous cancels (error answer) received/not={r['ambiguous_cancels']['received']}/"
        f"{r['ambiguous_cancels']['not_received']}",
        (f"duplicates by the consumer's ack (ack_mode={d['ack_mode']}): after no answered ack "
         f"{d['after_no_answered_ack']}, after an answered ack across a real-time failover "
         f"{d['after_answered_ack_across_failover']}, after an answered ack {d['after_answered_ack']}"
         if (d := r["duplicates"]["by_ack"]) else "duplicates by the consumer's ack: not recorded"),
        f"lateness ms all: {pct(lat['all'])}",
        f"lateness ms due during faults: {pct(lat['due_during_faults'])}",
        f"restart errors={len(r['restart_errors'])} storage errors in logs={len(r['logs']['storage_errors'])} "
        f"tracebacks in logs={sum(r['logs']['tracebacks'].values())}",
    ]
    for sk in f["skipped"]:
        lines.append(f"skipped: fault {sk.get('index')} {sk.get('kind')}: {sk.get('skipped')}")
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
