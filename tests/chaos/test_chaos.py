"""Chaos: a real cluster under load, masters killed and frozen, an independent check of the records.

The default run is short (about 60 s of workload; cluster start and drain included it stays
under ~3 minutes). Long runs: ``bash scripts/chaos.sh SEED DURATION_S`` (or ``HOURGLASS_CHAOS=1``
with ``HOURGLASS_CHAOS_DURATION_S`` for ``test_chaos_long``). A failing run names its seed; the
same seed gives the same fault schedule (``python -m tests.chaos.harness --schedule-only --seed N``).

Any violation (a lost message, a receive after an acknowledged cancel, restart or corruption
errors, overlapping acknowledgement windows, no traffic, no master fault) fails the run and names
its seed. The bugs this suite found are in docs/reliability.md with the regression tests that now
guard them. Named scenarios (issue 26: ``meta-pause``, ``starved-kills``, ``starved``) run long
with ``HOURGLASS_CHAOS=1 HOURGLASS_CHAOS_SCENARIO=meta-pause`` (``test_chaos_scenario``); the
starvation fault kinds run once each, briefly, in ``tests/chaos/test_starvation.py``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.chaos.checker import summarize
from tests.chaos.harness import CLASSIC_KINDS, FAULT_KINDS, SCENARIOS, ChaosConfig, fault_schedule, run_chaos, \
    scenario_config

pytestmark = pytest.mark.skipif(not shutil.which("etcd"), reason="etcd binary not installed")

# the default CI run plays every classic fault kind (findings 1 and 2 of docs/reliability.md are
# fixed, with regression tests in tests/test_replication.py and tests/test_e2e.py); the starvation
# kinds (issue 26) have their own short run in test_starvation.py
CI_KINDS = CLASSIC_KINDS


@pytest.mark.unit
def test_schedule_is_a_pure_function_of_the_seed():
    a = fault_schedule(123, 600)
    assert a == fault_schedule(123, 600)
    assert a != fault_schedule(124, 600)
    assert {f.kind for f in a} == set(CLASSIC_KINDS)
    assert {f.kind for f in fault_schedule(5, 60, kinds=CI_KINDS)} <= set(CI_KINDS)


def test_checker_counts_a_receive_before_its_due_time_as_a_violation(tmp_path):
    """The checker's own invariants on recorded files: one message received on time, one
    received a millisecond before its due time (a delay node fires ahead; the real-time
    node must hold it until due)."""
    import json

    from tests.chaos.checker import check

    (tmp_path / "logs").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"seed": 0, "duration_s": 1, "groups": {"s": ["g1"]},
                                                   "due_limit_ms": 10_000, "log_dir": str(tmp_path / "logs")}))
    sends = [{"id": m, "subject": "s", "deliver_at": 5_000, "t_req": 1_000, "t_ack": 1_001, "ok": True}
             for m in ("ontime", "early")]
    receives = [{"id": "ontime", "subject": "s", "group": "g1", "t": 5_000, "deliver_at": 5_000},
                {"id": "early", "subject": "s", "group": "g1", "t": 4_999, "deliver_at": 5_000}]
    for name, rows in (("sends", sends), ("cancels", []), ("receives", receives), ("faults", [])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = check(tmp_path)
    assert not r["passed"] and r["violations"] == ["1 receives before the message's due time"]
    assert r["received_early"]["examples"] == [{"id": "early", "group": "g1", "received": 4_999,
                                                "deliver_at": 5_000}]
    assert "early=1" in summarize(r)


def _run(tmp_path, seed: int, duration_s: float, kinds) -> dict:
    report = run_chaos(ChaosConfig(seed=seed, duration_s=duration_s, out_dir=tmp_path / f"chaos-{seed}",
                                   kinds=tuple(kinds)))
    print(summarize(report))
    print(f"files: {tmp_path / f'chaos-{seed}'}")
    return report


def _judge(report: dict) -> None:
    seed = report["seed"]
    assert report["messages"]["acked"] > 0, f"seed={seed}: nothing acknowledged"
    assert report["faults"]["master_kills"] + report["faults"]["by_kind"].get("delay_master_stop", 0) > 0, \
        f"seed={seed}: no master fault injected"
    assert not report["violations"], f"seed={seed} (rerun: bash scripts/chaos.sh {seed}): " \
        + "; ".join(report["violations"]) + "\n" + summarize(report)


@pytest.mark.timeout(420)
def test_chaos_short(tmp_path):
    seed = int(os.environ.get("HOURGLASS_CHAOS_SEED", "11"))
    _judge(_run(tmp_path, seed, float(os.environ.get("HOURGLASS_CHAOS_SHORT_S", "40")), CI_KINDS))


@pytest.mark.chaos
@pytest.mark.skipif(os.environ.get("HOURGLASS_CHAOS") != "1", reason="long chaos run: set HOURGLASS_CHAOS=1")
@pytest.mark.timeout(0)
def test_chaos_long(tmp_path):
    seed = int(os.environ.get("HOURGLASS_CHAOS_SEED", "1"))
    kinds = os.environ.get("HOURGLASS_CHAOS_KINDS", ",".join(CLASSIC_KINDS))
    kinds = FAULT_KINDS if kinds == "all" else kinds.split(",")
    _judge(_run(tmp_path, seed, float(os.environ.get("HOURGLASS_CHAOS_DURATION_S", "1200")), kinds))


@pytest.mark.chaos
@pytest.mark.skipif(os.environ.get("HOURGLASS_CHAOS") != "1" or not os.environ.get("HOURGLASS_CHAOS_SCENARIO"),
                    reason="a named scenario: set HOURGLASS_CHAOS=1 and HOURGLASS_CHAOS_SCENARIO")
@pytest.mark.timeout(0)
def test_chaos_scenario(tmp_path):
    """``HOURGLASS_CHAOS_SCENARIO`` (meta-pause, starved-kills, starved) with its own load and
    length, or ``HOURGLASS_CHAOS_DURATION_S`` / ``HOURGLASS_CHAOS_RATE``."""
    name = os.environ["HOURGLASS_CHAOS_SCENARIO"]
    assert name in SCENARIOS, f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}"
    seed = int(os.environ.get("HOURGLASS_CHAOS_SEED", "1"))
    env = os.environ.get
    report = run_chaos(scenario_config(name, seed=seed, out_dir=tmp_path / f"{name}-{seed}",
                                       duration_s=float(env("HOURGLASS_CHAOS_DURATION_S") or 0) or None,
                                       rate_per_s=float(env("HOURGLASS_CHAOS_RATE") or 0) or None))
    print(summarize(report))
    assert report["messages"]["acked"] > 0, f"seed={seed}: nothing acknowledged"
    assert not report["violations"], f"scenario {name} seed={seed}: " + "; ".join(report["violations"])
