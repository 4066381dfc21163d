"""Network partitions between network namespaces this test creates (root only).

``tests/chaos/netns.py`` builds a hub namespace with a bridge and three members: ``core``
(etcd, meta server, real-time node, the driver), ``delay-1`` and ``delay-2`` (one delay node
each; one replicated group, ``sync`` acks, 2 s leases). The scenario runs inside ``core``
(``tests/chaos/partition_driver.py``); this test reads its JSON record and checks:

* master cut off: no send the partitioned master answers after the cut is OK (fencing: no
  slave can ack, and after its lease it reports slave and answers NOT_LEADER); the slave
  becomes master and delivers acknowledged messages that fall due during the partition;
  after the heal the old master is a caught-up slave whose logs are a byte prefix of the
  master's (the suffix it stored while cut off is gone, lookups do not find it);
* slave cut off: every send to the master answered during the partition is an error
  (REPLICATION_TIMEOUT), never an OK; sends succeed again after the heal;
* zero acknowledged messages lost; duplicates counted (reported, not failed).

Skipped, with the reason, when not root or when namespaces cannot be made here.
About 45 s on a 2-core machine.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos import netns

DRIVER_TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[2]


def summarize(r: dict) -> dict:
    """Numbers of one driver record (pure)."""
    a, b = r["phase_a"], r["phase_b"]
    sends, receives = r["sends"], r["receives"]
    acked = {s["id"] for s in sends if s["result"] == "OK"}
    got = [x["id"] for x in receives]
    ev = {e["what"]: e for e in r["events"] if e["what"] != "rejoined"}
    rejoin = [e["rejoin_ms"] for e in r["events"] if e["what"] == "rejoined"]

    def answers(lo: int, hi: int) -> dict:
        """Results of sends issued at/after lo and answered before hi."""
        return dict(collections.Counter(s["result"] for s in sends if s["t"] >= lo and s["answered"] < hi))

    probe = a["probe"] or {"sends": [], "status": []}
    after_cut = [s for s in probe["sends"] if s["t"] >= a["t_cut"]]
    not_master = [s["t"] - a["t_cut"] for s in probe["status"] if s["t"] >= a["t_cut"] and s.get("master") is False]
    acked_before_cut = {s["id"]: s["deliver_at"] for s in sends if s["result"] == "OK" and s["answered"] < a["t_cut"]}
    first_rx = {}
    for x in receives:
        first_rx.setdefault(x["id"], x["t"])
    due_in_partition = [i for i, d in acked_before_cut.items() if a["t_cut"] + 500 < d < a["t_heal"] - 2000]
    return {
        "sends": len(sends), "acked": len(acked), "received": len(set(got)),
        "lost": sorted(acked - set(got)), "duplicates": len(got) - len(set(got)),
        "failover_ms": ev["failover"]["failover_ms"], "rejoin_ms": rejoin,
        "a_answers_during": answers(a["t_cut"], a["t_heal"]),
        "a_probe_answers_after_cut": dict(collections.Counter(s["result"] for s in after_cut)),
        "a_probe_first_not_master_ms": min(not_master) if not_master else None,
        "a_probe_lookups_after_cut": dict(collections.Counter(a["probe_lookups"].get(s["id"]) for s in after_cut)),
        "a_probe_lookups_acked": dict(collections.Counter(
            a["probe_lookups"].get(s["id"]) for s in probe["sends"] if s["result"] == "OK")),
        "a_due_in_partition": len(due_in_partition),
        "a_delivered_before_heal": sum(1 for i in due_in_partition if first_rx.get(i, 1 << 62) < a["t_heal"]),
        "a_truncated": a["old_master_truncated"],
        "b_answers_during": answers(b["t_cut"], b["t_heal"]),
        "b_answers_after_heal": answers(b["t_heal"] + 1000, 1 << 62),
        "replica_logs": r["replica_logs"],
    }


def _kill_leftovers(driver: subprocess.Popen, cluster_root: Path) -> None:
    """After a driver that timed out or crashed: SIGKILL it and every process it started that is
    still alive, by PID (listed in pids.json), only if its command line names this run's files."""
    import os
    import signal

    if driver.poll() is None:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    pids = cluster_root / "pids.json"
    if not pids.exists():
        return
    for pid in json.loads(pids.read_text()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone
        if str(cluster_root) in cmd:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def partition_run(tmp_path_factory) -> dict:
    if not shutil.which("etcd"):
        pytest.skip("etcd binary not installed")
    ok, why = netns.available()
    if not ok:
        print(f"network partition test skipped: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("partition")
    with netns.Netns(["core", "delay-1", "delay-2"]) as net:
        (root / "net.json").write_text(json.dumps(net.describe()))
        out, log = root / "out.json", root / "driver.log"
        with open(log, "wb") as logf:
            driver = subprocess.Popen(
                [*net.exec_prefix("core"), sys.executable, "-m", "tests.chaos.partition_driver", "run",
                 "--net", str(root / "net.json"), "--root", str(root / "cluster"), "--out", str(out)],
                cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = driver.wait(timeout=DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_leftovers(driver, root / "cluster")
        tail = log.read_text(errors="replace")[-4000:]
        assert rc == 0 and out.exists(), f"driver failed (exit {rc}):\n{tail}"
    result = json.loads(out.read_text())
    summary = summarize(result)
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print("partition summary:", json.dumps(summary, indent=1))
    return summary


def test_master_partition_fails_over_and_the_old_master_is_fenced(partition_run):
    s = partition_run
    # fencing: nothing the cut-off master answered after the cut is acknowledged
    assert s["a_probe_answers_after_cut"], "the probe inside the partitioned namespace sent nothing"
    assert "OK" not in s["a_probe_answers_after_cut"], s["a_probe_answers_after_cut"]
    assert s["a_probe_first_not_master_ms"] is not None, "the partitioned master never reported slave"
    # the slave took over: acknowledged messages due during the partition were delivered during it
    assert s["a_due_in_partition"] > 0
    assert s["a_delivered_before_heal"] > 0, "no delivery resumed while the master was cut off"
    # what the old master stored while cut off (never acknowledged) did not survive its rejoin
    assert set(s["a_probe_lookups_after_cut"]) <= {"error:NotFound"}, s["a_probe_lookups_after_cut"]
    assert set(s["a_probe_lookups_acked"]) <= {"pending"}, s["a_probe_lookups_acked"]
    # back as a caught-up slave with the master's bytes
    assert len(s["rejoin_ms"]) == 2
    for lg, v in s["replica_logs"].items():
        assert v["identical_prefix"], f"{lg} logs of the two replicas diverge: {v}"


def test_slave_partition_gets_replication_timeouts_never_silent_acks(partition_run):
    s = partition_run
    during = s["b_answers_during"]
    assert during, "no send answered while the slave was cut off"
    assert "OK" not in during, f"a send was acknowledged without the slave: {during}"
    assert "REPLICATION_TIMEOUT" in during, during
    assert s["b_answers_after_heal"].get("OK", 0) > 0, f"sends did not recover after the heal: {s['b_answers_after_heal']}"


def test_no_acknowledged_message_lost_across_partitions(partition_run):
    s = partition_run
    assert s["acked"] > 100
    assert not s["lost"], f"{len(s['lost'])} acknowledged messages lost, e.g. {s['lost'][:5]}"
