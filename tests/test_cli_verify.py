"""``hourglass admin verify`` driven as a subprocess: online (a running node checks and heals
its files) and offline (``--data``, read-only); exit codes, one summary line, no traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cluster.client import Producer, StaticResolver
from cluster.devcluster import LocalCluster, free_port
from tests.test_healing import bucket_dir, data_segment, flip

HOURGLASS = [sys.executable, "-m", "cluster.cli"]
REPO = Path(__file__).resolve().parent.parent


def run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run([*HOURGLASS, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


def summary(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("verify ")]
    assert len(lines) == 1, p.stdout
    return lines[0]


async def test_admin_verify_online_heals_and_offline_finds(tmp_path):
    bucket_ms = 60_000
    # no background scrub here: it would find and heal the flipped byte before the command does
    with LocalCluster(tmp_path / "c", n_realtime=1, env={"HOURGLASS_BUCKET_MS": str(bucket_ms),
                                                          "HOURGLASS_SCRUB_RATE_MIB_S": "0"}) as c:
        node = c.delay[0]
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        later = int(time.time() * 1000) + 10 * bucket_ms
        later -= later % bucket_ms
        async with Producer(resolver) as p:
            for i in range(20):
                await p.send_and_wait("verify.cli", f"p{i}", deliver_at_ms=later + 1000 * i, id=f"v{i}")
        time.sleep(0.5)  # filed

        ok = run("admin", "verify", "--node", node.address)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"verify {node.address} " in summary(ok) and ": OK," in summary(ok)

        # a flipped byte in schedule data under the running node: found and rebuilt online
        # (inside a frame's payload: a flipped length field of the segment being appended to
        # would read as a torn tail still being written, which online verify leaves alone)
        seg = data_segment(node.data_dir, later)
        flip(seg, seg.read_bytes().index(b"p5"))
        healed = run("admin", "verify", "--node", node.address)
        assert healed.returncode == 0, healed.stdout + healed.stderr
        assert "1 corrupt (1 repaired)" in summary(healed)
        assert any(ln.startswith("corrupt: ") and ln.endswith("(repaired)") for ln in healed.stdout.splitlines())
        again = run("admin", "verify", "--node", node.address)
        assert again.returncode == 0 and ": OK," in summary(again)

        # every node of the cluster, found through the resolver (--delay/--realtime)
        every = run("admin", "verify", "--delay", node.address, "--realtime", c.realtime[0].address)
        assert every.returncode == 0, every.stdout + every.stderr
        assert len([ln for ln in every.stdout.splitlines() if ln.startswith("verify ")]) == 2

        node.stop()
        clean = run("admin", "verify", "--data", str(node.data_dir))
        assert clean.returncode == 0 and ": OK," in summary(clean), clean.stdout

        # offline: a flipped byte in the message log is reported, nothing is written
        seg = sorted((node.data_dir / "messages").glob("*.log"))[0]
        flip(seg)
        before = seg.read_bytes()
        bad = run("admin", "verify", "--data", str(node.data_dir))
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert "1 corrupt (0 repaired)" in summary(bad) and str(seg) in bad.stdout
        assert seg.read_bytes() == before
        assert (bucket_dir(node.data_dir, later) / "rebuilt").exists()


def test_admin_verify_errors_are_one_line():
    down = run("admin", "verify", "--node", f"127.0.0.1:{free_port()}", "--timeout-s", "3")
    assert down.returncode == 3
    assert down.stderr.startswith("error: ") and len(down.stderr.strip().splitlines()) == 1
    missing = run("admin", "verify", "--data", "/nonexistent/hourglass")
    assert missing.returncode == 2 and missing.stderr.startswith("error: no data folder at /nonexistent/hourglass")
    both = run("admin", "verify", "--data", "/tmp", "--node", "127.0.0.1:1")
    assert both.returncode == 2 and "not both" in both.stderr
