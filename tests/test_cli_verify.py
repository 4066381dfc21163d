"""``hourglass admin verify`` driven as a subprocess: online (a running node checks and heals
its files) and offline (``--data``, read-only); exit codes, one summary line, no traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cluster.client import Producer, StaticResolver
from cluster.devcluster import LocalCluster, free_port
from tests.test_healing import PAYLOAD_1K, _flip_in_place, _frames, bucket_dir, data_segment, flip

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


async def test_admin_verify_lists_the_ids_a_single_node_lost(tmp_path):
    """Issue 26: a single node (no replica) whose corrupt schedule frame held records the
    message log no longer has (retention deleted the segment) loses those records and only
    those, and says which: an ERROR line with their ids, Status, and ``admin verify`` (online,
    then offline on the stopped node's folder) lists them; it exits 1."""
    import asyncio

    env = {"HOURGLASS_MESSAGE_SEGMENT_BYTES": "65536", "HOURGLASS_SCRUB_RATE_MIB_S": "0",
           "HOURGLASS_RETENTION_INTERVAL_MS": "300", "HOURGLASS_CHECKPOINT_INTERVAL_MS": "200",
           # each call filed by itself, so the first frame holds the first call's records alone (those
           # whose message-log segment retention deletes); a lingering filer sorts several calls into one
           "HOURGLASS_FILE_LINGER_MS": "0"}
    with LocalCluster(tmp_path / "c", n_realtime=1, env=env) as c:
        node = c.delay[0]
        resolver = StaticResolver(delay=[node.address], realtime=[n.address for n in c.realtime])
        due = (int(time.time()) + 600) * 1000
        ids = [f"l{k}-{i}" for k in range(6) for i in range(40)]
        async with Producer(resolver) as p:
            for k in range(6):  # 240 KB: the 64 KiB message log rolls; retention deletes its first segments
                await asyncio.gather(*[p.send_and_wait("verify.lost", PAYLOAD_1K, deliver_at_ms=due + i, id=mid)
                                       for i, mid in enumerate(ids[k * 40:(k + 1) * 40])])
        first_seg = node.data_dir / "messages" / f"{0:020d}.log"
        for _ in range(200):  # bounded: 20 s
            if not first_seg.exists():
                break
            time.sleep(0.1)
        assert not first_seg.exists(), node.tail_log()
        (seg,) = sorted((node.data_dir / "schedule").glob("*/data/*.log"))
        lost = _frames(seg)[0][1].id_list()  # the first frame: its records' message-log segment is gone
        _flip_in_place(seg, seg.read_bytes().index(PAYLOAD_1K[:100]) + 50)

        online = run("admin", "verify", "--node", node.address)
        assert online.returncode == 1, online.stdout + online.stderr
        (line,) = [ln for ln in online.stdout.splitlines() if ln.startswith("lost: ")]
        assert f"{len(lost)} records lost" in line and f"messages {','.join(lost)}" in line, line
        assert "1 corrupt (1 repaired)" in summary(online) and f"{len(lost)} records lost and 0 being fetched" in summary(online)
        text = node.log_path.read_text()
        assert "acknowledged records LOST" in text and ",".join(lost[:3]) in text
        healing = (await c.statuses("delay"))[node.name]["healing"]
        assert healing["lost_records"] == len(lost) and healing["missing"][0]["messages"] == lost
        async with Producer(resolver) as p:  # the others are all there
            assert {(await p.lookup(mid)).status for mid in ids if mid not in lost} == {"pending"}

        node.stop()
        offline = run("admin", "verify", "--data", str(node.data_dir))
        assert offline.returncode == 1, offline.stdout + offline.stderr
        (line,) = [ln for ln in offline.stdout.splitlines() if ln.startswith("lost: ")]
        assert f"{len(lost)} records lost" in line and f"messages {','.join(lost)}" in line, line
