"""The chaos checker's rules on synthetic files (no cluster): overlapping acknowledgement
windows, epochs acknowledged twice, master changes with and without a kill, resume times, a
scenario's expectation; and the fault plans as pure functions of the seed."""

from __future__ import annotations

import json
import time

import pytest

from cluster.chaoscheck import check, summarize
from cluster.chaosplan import (CLASSIC_KINDS, FAULT_KINDS, SCENARIOS, STARVATION_KINDS, Topology,
                               fault_schedule, lanes, scenario_schedule)

T0 = 1_800_000_000_000  # wall ms of the synthetic workload start


def write_run(tmp_path, *, sends=(), receives=(), faults=(), journals=None, logs=None, load=(), ack_answers=None,
              **run) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir(exist_ok=True)
    for name, text in (logs or {}).items():
        (log_dir / f"{name}.log").write_text(text)
    paths = []
    for name, rows in (journals or {}).items():
        p = log_dir / f"{name}.acks.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(p))
    (tmp_path / "run.json").write_text(json.dumps({
        "seed": 0, "duration_s": 60, "groups": {"s": ["g1"]}, "due_limit_ms": T0 + 60_000, "t0_ms": T0,
        "t_send_end": T0 + 60_000, "log_dir": str(log_dir), "ack_journals": paths, **run}))
    for name, rows in (("sends", sends), ("cancels", []), ("receives", receives), ("faults", faults),
                       ("load", load)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if ack_answers is not None:
        (tmp_path / "ack_answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ack_answers))


def send(mid: str, deliver_at: int, group: str = "delay-g1") -> dict:
    return {"id": mid, "subject": "s", "deliver_at": deliver_at, "t_req": T0, "t_ack": T0 + 5, "ok": True,
            "delay_group": group}


def recv(mid: str, t: int, deliver_at: int) -> dict:
    return {"id": mid, "subject": "s", "group": "g1", "t": t, "deliver_at": deliver_at}


def window(node: str, epoch: int, first: int, last: int, group: str = "delay-g1") -> dict:
    return {"node": node, "group": group, "epoch": epoch, "first_ms": T0 + first, "last_ms": T0 + last}


def log_line(t_ms: int, text: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_ms // 1000))
    return f"{stamp},{t_ms % 1000:03d} WARNING hourglass.replication {text}\n"


# ---------------------------------------------------------------------- acknowledgement windows

# delay-1 acks in epoch 5, then delay-2 (elected after delay-1's lease) in 6, then delay-1 in 8;
# the other group's master acks all along (other group: never compared)
GOOD = {
    "delay-1": [window("delay-1", 5, 1000, 1500), window("delay-1", 5, 1000, 2000),
                window("delay-1", 8, 9000, 9500)],
    "delay-2": [window("delay-2", 6, 4500, 6000)],
    "delay-3": [window("delay-3", 2, 0, 20_000, group="delay-g2")],
}


def test_windows_of_successive_masters_pass(tmp_path):
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], journals=GOOD,
              ack_journal_expected=True)
    r = check(tmp_path)
    assert r["passed"], r["violations"]
    assert r["ack_windows"] | {"overlap_examples": None} == {"journals": 3, "windows": 4, "overlaps": 0,
                                                             "overlap_examples": None, "shared_epochs": [],
                                                             "pad_ms": 20}


@pytest.mark.parametrize("b_first, overlap", [(1900, True), (2015, True), (2021, False)])
def test_a_new_master_acknowledging_before_the_old_one_stopped_fails(tmp_path, b_first, overlap):
    """delay-1 acknowledged until 2000 in epoch 5; delay-2 starts acknowledging in epoch 6 at
    1900: overlap; at 2015: within the journal's 20 ms pad, counted as overlapping (a journal may
    miss that much of a window's end); at 2021: apart."""
    journals = {"delay-1": [window("delay-1", 5, 1000, 2000)], "delay-2": [window("delay-2", 6, b_first, 6000)]}
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], journals=journals)
    r = check(tmp_path)
    assert r["passed"] is not overlap
    if overlap:
        assert r["violations"] == ["1 overlapping acknowledgement windows of two members of a group"]
        ex = r["ack_windows"]["overlap_examples"][0]
        assert (ex["a"]["node"], ex["b"]["node"], ex["group"]) == ("delay-1", "delay-2", "delay-g1")
        assert ex["overlap_ms"] == 2000 - b_first
        assert "overlapping pairs=1" in summarize(r)


def test_an_epoch_acknowledged_by_two_members_fails(tmp_path):
    journals = {"delay-1": [window("delay-1", 5, 1000, 2000)], "delay-2": [window("delay-2", 5, 7000, 8000)]}
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], journals=journals)
    r = check(tmp_path)
    assert r["violations"] == ["1 epochs acknowledged by two members"]
    assert r["ack_windows"]["shared_epochs"] == [{"group": "delay-g1", "epoch": 5, "nodes": ["delay-1", "delay-2"]}]


def test_windows_of_an_earlier_run_on_the_same_cluster_are_left_out(tmp_path):
    journals = {"delay-1": [window("delay-1", 1, -90_000, -80_000)], "delay-2": [window("delay-2", 2, -85_000, -1)]}
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], journals=journals)
    r = check(tmp_path)
    assert r["passed"] and r["ack_windows"]["windows"] == 0


def test_a_run_that_expects_journals_fails_without_them(tmp_path):
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)],
              ack_journal_expected=True)
    r = check(tmp_path)
    assert r["violations"] == ["no acknowledgement window journaled although sends were acknowledged "
                               "(HOURGLASS_ACK_JOURNAL not in effect?)"]
    assert "ack windows: no journal" in summarize(r)


# ---------------------------------------------------------------------- master changes, resume

def kill(index: int, t: int, group: str = "delay-g1", kind: str = "delay_master_kill") -> dict:
    return {"index": index, "kind": kind, "target": 0, "hold_s": 1, "group": group, "process": "delay-1",
            "t_start": T0 + t, "t_end": T0 + t + 3000, "failover_ms": 2100, "restart_error": None,
            "restored": True, "recovered_ms": 4000}


def test_master_changes_with_and_without_a_kill_and_resume_times(tmp_path):
    logs = {
        "delay-1": (log_line(T0 - 5000, "became MASTER group=delay-g1 epoch=3 store_epoch=1")  # before the run
                    + log_line(T0 + 12_100, "became MASTER group=delay-g1 epoch=9 store_epoch=3")    # kill 2's
                    + log_line(T0 + 30_000, "became MASTER group=delay-g1 epoch=12 store_epoch=4")),  # no kill
        "delay-2": (log_line(T0 + 2_200, "became MASTER group=delay-g1 epoch=7 store_epoch=2")      # kill 1's
                    + log_line(T0 + 3_000, "became SLAVE group=delay-g1 epoch=7 leader=")
                    + log_line(T0 + 31_500, "became MASTER group=delay-g1 epoch=14 store_epoch=5")),  # no kill
        "delay-3": log_line(T0 + 2_500, "became MASTER group=delay-g2 epoch=4 store_epoch=2"),      # other group
    }
    sends = [send("a", T0 + 500), send("b", T0 + 1200, "delay-g2"), send("c", T0 + 1500), send("d", T0 + 11_000)]
    receives = [recv("a", T0 + 600, T0 + 500),     # before kill 1
                recv("b", T0 + 1300, T0 + 1200),   # the other group: does not end kill 1's gap
                recv("c", T0 + 3300, T0 + 1500),   # kill 1 at 1000 -> 2300 ms
                recv("d", T0 + 13_000, T0 + 11_000)]  # kill 2 at 10_000 -> 3000 ms
    write_run(tmp_path, sends=sends, receives=receives, faults=[kill(0, 1000), kill(1, 10_000)], logs=logs,
              load=[{"t": T0 + 1000, "load1": 11.5}, {"t": T0 + 2000, "load1": 12.5}, {"t": T0 - 1, "load1": 1}])
    r = check(tmp_path)
    mc = r["master_changes"]
    assert (mc["total"], mc["after_kill"], mc["without_kill"], mc["unprovoked"]) == (5, 2, 3, 3)
    assert mc["to_another_node"] == 3  # delay-1 -> delay-2 -> delay-1 -> delay-2; delay-g2's first master
    assert mc["by_group"] == {"delay-g1": 4, "delay-g2": 1}
    assert r["faults"]["resume_ms"] | {"p99": None} == {"n": 2, "p50": 3000, "p99": None, "max": 3000}
    assert r["load1"] == {"n": 2, "min": 11.5, "p50": 12.5, "max": 12.5}
    assert "master changes: 5 (after a kill 2, without a kill 3" in summarize(r)


def test_a_scenario_that_allows_no_master_change_fails_on_one(tmp_path):
    logs = {"delay-2": log_line(T0 + 40_000, "became MASTER group=delay-g1 epoch=7 store_epoch=2")}
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], logs=logs,
              expect={"master_changes_without_kill_max": 0}, scenario="starved")
    r = check(tmp_path)
    assert r["violations"] == ["1 master changes without a kill (at most 0 expected)"]
    assert summarize(r).startswith("chaos scenario=starved seed=0")


def test_a_fault_left_in_force_fails_and_a_skipped_one_says_why(tmp_path):
    faults = [{"index": 0, "kind": "node_throttle", "target": 0, "hold_s": 2, "t_start": T0, "t_end": T0 + 2000,
               "restored": False, "restore_error": "OSError: busy", "process": "delay-1"},
              {"index": 1, "kind": "node_throttle", "target": 0, "hold_s": 2, "t_start": T0, "t_end": T0,
               "skipped": "no cgroup v1 cpu controller at /sys/fs/cgroup/cpu (cpu.cfs_quota_us missing)"}]
    write_run(tmp_path, sends=[send("m", T0 + 100)], receives=[recv("m", T0 + 100, T0 + 100)], faults=faults)
    r = check(tmp_path)
    assert r["violations"] == ["1 faults not restored"]
    assert "skipped: fault 1 node_throttle: no cgroup v1 cpu controller" in summarize(r)


# ---------------------------------------------------------------------- duplicates by the consumer's ack

def answer(ids, t_req: int, ok: bool = True) -> dict:
    return {"ids": list(ids), "subject": "s", "group": "g1", "t_req": T0 + t_req, "t_ans": T0 + t_req + 5,
            "ok": ok, "error": None if ok else "Unavailable: not the master"}


RT_KILL = kill(0, 5_000, group="realtime-g1", kind="realtime_kill")
# a: ack failed at the kill, came again (at-least-once); b: acked OK at 4_000, came again after the
# real-time kill at 5_000 (the async slave lacked the ack); c: acked OK at 6_000 after the kill and
# came again at 9_000 with no master change since (nothing may undo that ack)
REDELIVERIES = dict(
    sends=[send("a", T0 + 100), send("b", T0 + 100), send("c", T0 + 100)],
    receives=[recv("a", T0 + 4_990, T0 + 100), recv("a", T0 + 7_000, T0 + 100),
              recv("b", T0 + 3_990, T0 + 100), recv("b", T0 + 7_000, T0 + 100),
              recv("c", T0 + 5_990, T0 + 100), recv("c", T0 + 9_000, T0 + 100)],
    ack_answers=[answer(["a"], 4_995, ok=False), answer(["b"], 4_000), answer(["a", "b"], 7_005),
                 answer(["c"], 6_000), answer(["c"], 9_005)],
    faults=[RT_KILL],
    logs={"realtime-2": log_line(T0 + 5_800, "became MASTER group=realtime-g1 epoch=4 store_epoch=2 log_end=9")})


@pytest.mark.parametrize("ack_mode, violating", [("async", 1), ("sync", 2)])
def test_a_receive_after_an_answered_ack_fails_unless_an_async_failover_explains_it(tmp_path, ack_mode, violating):
    write_run(tmp_path, ack_mode=ack_mode, **REDELIVERIES)
    r = check(tmp_path)
    d = r["duplicates"]
    assert (d["extra_receives"], d["messages"]) == (3, 3)
    assert d["by_ack"] | {"answered_ack_examples": None} == {
        "after_no_answered_ack": 1, "after_answered_ack_across_failover": 1, "after_answered_ack": 1,
        "violating": violating, "ack_mode": ack_mode, "answered_ack_examples": None}
    assert {(e["id"], e["kind"]) for e in d["by_ack"]["answered_ack_examples"]} == {
        ("b", "after_answered_ack_across_failover"), ("c", "after_answered_ack")}
    assert r["violations"] == [f"{violating} receives of a message after its ack was answered OK "
                               f"(ack_mode={ack_mode}; 1 without a real-time master change)"]
    assert "after an answered ack across a real-time failover 1, after an answered ack 1" in summarize(r)


def test_receives_again_after_failed_acks_only_pass_and_old_runs_are_not_checked(tmp_path):
    only_failed = {k: v for k, v in REDELIVERIES.items()}
    only_failed["ack_answers"] = [answer(["a"], 4_995, ok=False), answer(["b"], 3_995, ok=False),
                                  answer(["c"], 5_995, ok=False), answer(["a", "b", "c"], 9_005)]
    write_run(tmp_path, ack_mode="sync", **only_failed)
    r = check(tmp_path)
    assert r["passed"], r["violations"]
    assert r["duplicates"]["by_ack"]["after_no_answered_ack"] == 3
    (tmp_path / "ack_answers.jsonl").unlink()  # recorded before the answers were: reported as not recorded
    r = check(tmp_path)
    assert r["passed"] and r["duplicates"]["by_ack"] is None
    assert "duplicates by the consumer's ack: not recorded" in summarize(r)


# ---------------------------------------------------------------------- plans

def test_the_random_plan_is_a_pure_function_of_the_seed_with_every_new_kind():
    a = fault_schedule(123, 600, kinds=FAULT_KINDS)
    assert a == fault_schedule(123, 600, kinds=FAULT_KINDS)
    assert a != fault_schedule(124, 600, kinds=FAULT_KINDS)
    assert {f.kind for f in a[:len(FAULT_KINDS)]} == set(FAULT_KINDS)  # every kind once, first
    topo = Topology()
    for f in a:
        assert 0 <= f.target < topo.targets(f.kind)
        if f.kind in ("node_stall", "meta_stall", "etcd_stall"):
            assert 0.2 <= f.hold_s <= 3.0
    capped = fault_schedule(123, 600, kinds=FAULT_KINDS, hold_max_s=1.5)
    assert [(f.kind, f.target) for f in capped[:len(a)]] == [(f.kind, f.target) for f in a]
    assert max(f.hold_s for f in capped) == 1.5
    short = fault_schedule(9, 24, kinds=STARVATION_KINDS, hold_max_s=1.5, gap_s=0.3, first_s=2, tail_free_s=2)
    assert {f.kind for f in short} == set(STARVATION_KINDS)
    with pytest.raises(ValueError, match="unknown fault kinds"):
        fault_schedule(1, 60, kinds=("gc_pause",))


def test_the_classic_plans_did_not_change():
    """Seeds quoted in docs/reliability.md replay the same faults (seed 7: etcd_kill of etcd-3 at 5 s)."""
    first = fault_schedule(7, 45)[0]
    assert (first.kind, first.target, first.at_s) == ("etcd_kill", 2, 5.0)
    assert {f.kind for f in fault_schedule(123, 600)} == set(CLASSIC_KINDS)


def test_the_meta_pause_scenario_is_issue_26s_reproduction():
    sc = SCENARIOS["meta-pause"]
    plan = scenario_schedule(sc, 3)
    assert plan == scenario_schedule(sc, 3) and plan != scenario_schedule(sc, 4)
    by_lane = lanes(plan)
    kills = by_lane["kills"]
    assert [f.kind for f in kills] == ["delay_master_kill"] * 5
    assert [round(b.at_s - a.at_s, 2) for a, b in zip(kills, kills[1:])] == [10.0] * 4
    stalls = by_lane["meta"]
    assert {(f.kind, f.hold_s) for f in stalls} == {("meta_stall", 1.8)}
    assert [round(b.at_s - a.at_s, 2) for a, b in zip(stalls, stalls[1:])] == [5.3] * (len(stalls) - 1)
    assert (sc.rate_per_s, sc.due_ms, sc.groups_every_subject) == (2000, (1000, 15_000), ("g1", "g2"))
    assert len(scenario_schedule(sc, 3, duration_s=20)) < len(plan)  # a short run keeps what fits


def test_the_starved_scenarios_starve_the_whole_run():
    kills = lanes(scenario_schedule(SCENARIOS["starved-kills"], 1))
    assert len(kills["kills"]) == 5 and "meta" not in kills
    assert [(f.kind, f.at_s, f.hold_s) for f in kills["cpu"] + kills["disk"]] == [("cpu_starve", 0.0, 60.0),
                                                                               ("disk_saturate", 0.0, 60.0)]
    alone = scenario_schedule(SCENARIOS["starved"], 1, duration_s=30)
    assert sorted(f.kind for f in alone) == ["cpu_starve", "disk_saturate"]
    assert SCENARIOS["starved"].master_changes_without_kill_max == 0


def test_master_changes_of_the_clean_stop_are_counted_apart():
    from cluster.chaoscheck import master_changes
    changes = [{"t": 100, "node": "a", "group": "g"}, {"t": 5000, "node": "b", "group": "g"},
               {"t": 9000, "node": "a", "group": "g"}]
    mc = master_changes(changes, [], since_ms=1000, until_ms=8000)
    assert mc["total"] == 1 and mc["unprovoked"] == 1 and mc["at_stop"] == 1 and mc["to_another_node"] == 1
    assert master_changes(changes, [], since_ms=1000)["total"] == 2
