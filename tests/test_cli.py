"""The ``hourglass`` CLI as a user types it (issue 13): every failure is one ``error:`` line and
at most one ``hint:`` line on stderr, a documented exit code, and never a traceback.

Each case runs the real ``hourglass`` script in a subprocess, in an empty working folder (no
``var/dev/cluster.json`` to find) with no ``HOURGLASS_*`` variables, and a 80-column terminal.
Where a cluster is needed it is a real one (``LocalCluster``: etcd, a meta server, nodes):

* ``cluster`` (module): etcd, a meta server, one delay and one real-time node;
* ``bare`` (module): etcd and a meta server, no node registered (no delay group);
* ``etcd_down``: etcd and a meta server, then etcd stopped.

"Nothing listening" is a free 127.0.0.1 port (the issue typed ``127.0.0.1:1``; the rule is the same).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cli
from cluster.cli import common
from cluster.devcluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parent.parent
HOURGLASS = shutil.which("hourglass", path=str(Path(sys.executable).parent)) or shutil.which("hourglass")
RUN_TIMEOUT_S = 60  # a command that has not ended by then hangs: the test fails


class Run:
    def __init__(self, p: subprocess.CompletedProcess, took_s: float) -> None:
        self.code, self.out, self.err, self.took_s = p.returncode, p.stdout, p.stderr, took_s

    def __repr__(self) -> str:
        return f"exit {self.code} in {self.took_s:.1f} s\nstdout: {self.out[-2000:]}\nstderr: {self.err[-2000:]}"


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="module")
def hg(cwd):
    assert HOURGLASS, "the hourglass script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")} | {"COLUMNS": "80"}

    def run(*args: str, extra_env: dict | None = None) -> Run:
        t0 = time.monotonic()
        p = subprocess.run([HOURGLASS, *args], capture_output=True, text=True, cwd=cwd, timeout=RUN_TIMEOUT_S,
                           env=env | (extra_env or {}), stdin=subprocess.DEVNULL)
        return Run(p, time.monotonic() - t0)
    return run


def fails(r: Run, code: int, *words: str) -> None:
    """Exit ``code``; stderr is one ``error:`` line holding ``words`` and at most one ``hint:``."""
    assert r.code == code, r
    assert "Traceback" not in r.out + r.err, r
    lines = r.err.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), r
    assert len(lines) == 1 or lines[1].startswith("hint: "), r
    for w in words:
        assert w in lines[0], (w, r)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster"), meta=True) as c:
        c.wait_registered()
        yield c


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("bare"), meta=True, n_delay=0, n_realtime=0) as c:
        yield c


@pytest.fixture
def etcd_down(tmp_path):
    with LocalCluster(tmp_path / "c", meta=True, n_delay=0, n_realtime=0) as c:
        c.etcd.stop()
        yield c


def meta(c: LocalCluster) -> str:
    return ",".join(c.meta_addresses)


# ------------------------------------------------------------------ cannot reach the cluster (exit 3)


def test_status_nothing_listening(hg):
    fails(hg("status", "--meta", f"127.0.0.1:{free_port()}"), 3, "no meta server answered", "Connection refused")


def test_status_while_etcd_is_down(hg, etcd_down):
    fails(hg("status", "--meta", meta(etcd_down)), 3, "etcd unavailable")


def test_consume_nothing_listening(hg):
    r = hg("consume", "demo.a", "--group", "g", "--count", "1", "--meta", f"127.0.0.1:{free_port()}")
    fails(r, 3, "no meta server answered")


@pytest.mark.parametrize("command", ["lookup", "cancel"])
def test_lookup_cancel_without_delay_group(hg, bare, command):
    r = hg(command, "x1", "--meta", meta(bare))
    fails(r, 3, "no delay group is registered")
    assert "start a delay node" in r.err


# ------------------------------------------------------------------ bad arguments: refused before any call (exit 2)


@pytest.mark.parametrize("args, words", [
    (["send", "demo.a", "hi", "--at", "notadate"], ["invalid --at", "'notadate'", "ISO 8601"]),
    (["send", "", "x", "--delay-ms", "100"], ["invalid subject", "empty"]),
    (["send", "demo.a", "x", "--delay-ms", "-1000"], ["invalid --delay-ms", "-1000", "negative"]),
    (["send", "a.due", "x", "--at", "99999999999999999999"], ["invalid --at", "out of range"]),
    (["send", "a.due", "x", "--at", "1700000000"], ["invalid --at", "1970-01-20T16:13:20Z is in the past"]),
    (["send", "a b", "x"], ["invalid subject", "'a b'"]),
    (["send", "demo.a", "x", "--at", "2030-01-01T00:00:00Z", "--delay-ms", "5"], ["not both"]),
])
def test_bad_send_arguments_are_refused_before_any_call(hg, args, words):
    # no cluster is given at all: these must be refused before one is even looked for
    fails(hg(*args), 2, *words)


@pytest.mark.parametrize("args, words", [
    (["send"], ["Missing argument 'subject'"]),
    (["send", "a.b", "--count", "0"], ["--count"]),
    (["nosuch"], ["No such command 'nosuch'"]),
])
def test_usage_errors_are_one_line_too(hg, args, words):
    r = hg(*args)
    fails(r, 2, *words)
    assert "--help" in r.err


def test_at_beyond_int64_does_not_hang_with_a_cluster(hg, cluster):
    r = hg("send", "a.due", "x", "--at", "99999999999999999999", "--meta", meta(cluster))
    fails(r, 2, "invalid --at", "out of range")


def test_at_beyond_the_delay_horizon_is_one_line(hg, cluster):
    fails(hg("send", "a.due", "x", "--at", "2100-01-01", "--meta", meta(cluster)), 2, "horizon")


def test_cluster_file_that_cannot_be_read_is_named(hg, cwd):
    fails(hg("status", "--cluster-file", "/nonexistent.json"), 2, "/nonexistent.json", "cannot read")
    (cwd / "broken.json").write_text("{not json")
    fails(hg("send", "a.b", "x", "--cluster-file", str(cwd / "broken.json")), 2, "broken.json", "not valid JSON")


def test_no_cluster_given(hg):
    r = hg("lookup", "x1")
    fails(r, 2, "no cluster given")
    assert "hourglass dev up" in r.err


@pytest.mark.parametrize("role", ["delay", "realtime"])
def test_a_server_whose_port_is_taken_says_so_without_a_traceback(hg, cwd, role):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = hg("node", "--role", role, "--data-dir", str(cwd / role), "--port", str(port))
    assert r.code == 1, r
    assert "Traceback" not in r.out + r.err, r
    lines = r.err.splitlines()
    assert lines[-2] == f"error: cannot listen on 127.0.0.1:{port}: the port is in use, or 127.0.0.1 is not an " \
                        "address of this machine", r
    assert lines[-1].startswith("hint: give another --port"), r


# ------------------------------------------------------------------ against a running cluster


def test_status_table_is_not_cut_at_80_columns(hg, cluster):
    r = hg("status", "--meta", meta(cluster))
    assert r.code == 0 and not r.err, r
    for n in cluster.nodes:
        line = next((ln for ln in r.out.splitlines() if ln.startswith(n.name + " ")), None)
        assert line is not None and n.address in line.split(), r
    assert "…" not in r.out, r


def test_status_names_a_node_that_does_not_answer(hg, cluster, cwd):
    dead = f"127.0.0.1:{free_port()}"
    r = hg("status", "--delay", dead, "--realtime", cluster.realtime[0].address)
    assert r.code == 3 and "Traceback" not in r.out + r.err, r
    assert re.search(rf"unreachable\s+{re.escape(dead)}", r.out) and cluster.realtime[0].address in r.out, r
    assert r.err.startswith("error: 1 of 2 nodes did not answer") and dead in r.err, r


def test_cancel_of_a_10kb_id_does_not_echo_it(hg, cluster):
    long_id = "x" * 10_240
    r = hg("cancel", long_id, "--meta", meta(cluster))
    fails(r, 4, "no message with id", "(10240 bytes)")
    assert long_id not in r.out + r.err and len(r.err) < 500, r


def test_send_lookup_cancel_consume(hg, cluster):
    m = meta(cluster)
    r = hg("send", "cli.later", "hi", "--delay-ms", "600000", "--id", "cli-1", "--meta", m)
    assert r.code == 0 and "accepted id=cli-1" in r.out, r
    r = hg("lookup", "cli-1", "--meta", m)
    assert r.code == 0, r
    got = json.loads(r.out)
    # the trace fields: accepted now, by a term of the group, filed under its due time (0: not filed yet)
    assert got["accepted_ms"] > 0 and got["effective_ms"] in (0, got["deliver_at_ms"]) and got["store_epoch"] >= 1, r
    varying = {"seq": 0, "deliver_at_ms": 0, "accepted_ms": 0, "effective_ms": 0, "store_epoch": 0,
               "realtime_address": ""}
    # not dispatched yet; the real-time group its route and id name, the delay group and member that
    # answered, and the node that accepted it (the term table, node/delay/terms.py)
    assert got | varying == {"id": "cli-1", "status": "pending", "subject": "cli.later", "cancelled_ms": 0,
                             "dispatched_ms": 0, "dead_lettered": False, "realtime_group": "realtime-1",
                             "group": "delay-1", "node_id": "delay-1", "accepted_node_id": "delay-1",
                             **varying}, r
    r = hg("cancel", "cli-1", "--meta", m)
    assert r.code == 0 and r.out.startswith("cancelled id=cli-1"), r
    fails(hg("lookup", "no-such-id", "--meta", m), 4, "no-such-id")
    r = hg("send", "cli.now", "[b]payload[/b]", "--meta", m)  # no delay: straight to the real-time node
    assert r.code == 0, r
    r = hg("consume", "cli.now", "--group", "g", "--count", "1", "--meta", m)
    assert r.code == 0 and "payload=b'[b]payload[/b]'" in r.out, r  # printed as data, not as markup


# ------------------------------------------------------------------ the boundary itself


def test_an_unexpected_error_is_one_line_unless_debugging(cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")}
    code = ("import sys, cluster.cli as c, cluster.cli.messages as m\n"
            "m._now_ms = lambda: 1 // 0\n"
            "sys.argv = ['hourglass', 'send', 'a.b', 'x']\n"
            "c.app()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                       timeout=RUN_TIMEOUT_S)
    fails(Run(r, 0), 1, "unexpected ZeroDivisionError")
    assert "HOURGLASS_DEBUG=1" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                       env=env | {"HOURGLASS_DEBUG": "1"}, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 1 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr


def test_shorten_keeps_one_line_and_both_ends():
    s = common.shorten("a" * 1000 + "\nEND")
    assert "\n" not in s and len(s) < common.MESSAGE_CHARS_MAX + 40 and s.startswith("aaa") and s.endswith("END")


@pytest.mark.unit
def test_disk_full_has_its_own_exit_code_and_a_hint_naming_the_node_and_its_free_space():
    from cluster import errors as E
    from cluster import status

    text = ("disk full: node 10.0.0.7:7001 has 999424 bytes (0.95 MiB) free on its data disk; it keeps 1258291 "
            "bytes (1.20 MiB) free; writes resume at 1761607 bytes (1.68 MiB) free")
    for err in (E.DiskFull(text, "10.0.0.7:7001", 999424), status.from_code(status.to_code(E.DiskFull(text)), text)):
        code, lines = common.explain(err)
        assert code == common.EXIT_DISK_FULL == 6 and len(lines) == 2
        assert lines[0] == f"error: {text}"
        assert lines[1].startswith("hint: free space on the data disk of 10.0.0.7:7001 (0.95 MiB free)")
    code, lines = common.explain(E.DiskFull("no space left on device while writing x"))  # nothing known: still 2
    assert code == 6 and len(lines) == 2 and "the node named above" in lines[1]
    assert common.explain(E.Overloaded("queue full"))[0] == common.EXIT_UNAVAILABLE


def test_docs_list_every_command_and_exit_code():
    import typer.main

    doc = (ROOT / "docs" / "cli.md").read_text()
    group = typer.main.get_command(cli.app)
    for name, cmd in group.commands.items():
        assert f"`hourglass {name}" in doc, name
    for name in ("EXIT_FAILED", "EXIT_USAGE", "EXIT_UNAVAILABLE", "EXIT_NOT_FOUND", "EXIT_CONFLICT",
                 "EXIT_DISK_FULL"):
        assert f"| {getattr(common, name)} |" in doc, name
    assert "HOURGLASS_DEBUG=1" in doc and "--timeout-s" in doc


def test_the_spark_submit_entry_runs_the_cli_boundary(cwd):
    """``spark-submit cluster/spark_submit.py ...`` (docs/spark.md) runs ``hourglass spark``:
    its help, and a usage error as one line with exit 2."""
    entry = ROOT / "cluster" / "spark_submit.py"
    r = subprocess.run([sys.executable, str(entry), "audit", "--help"], capture_output=True, text=True, cwd=cwd,
                       timeout=RUN_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "audit" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, str(entry), "no-such-job"], capture_output=True, text=True, cwd=cwd,
                       timeout=RUN_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
