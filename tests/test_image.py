"""The container image, built here without pulling anything, runs the demo and answers health probes.

scripts/image.sh starts Docker (scripts/dockerd.sh), makes a Debian bookworm base image with
debootstrap + ``docker import`` (cached: the daemon's image, else .cache/image/*.tar.gz), builds
the Dockerfile on it and runs ``hourglass demo`` with host networking and a read-only root. When
no Docker daemon can be started the tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.devcluster import free_port

ROOT = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("HOURGLASS_IMAGE", "hourglass:dev")
UID = 10001  # the Dockerfile's user; the chart's podSecurityContext.runAsUser
READY_WAIT_S_MAX = 60


def _image_sh(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOURGLASS_IMAGE=IMAGE)
    return subprocess.run(["bash", str(ROOT / "scripts/image.sh"), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def image():
    # a daemon this session started is stopped once, at the session's end (conftest.py): a stop
    # here took it from under the next module's image build ("Cannot connect to the Docker daemon")
    r = _image_sh("build", timeout_s=1200)
    if "image.sh: SKIP:" in r.stdout:
        reason = r.stdout.split("image.sh: SKIP:", 1)[1].strip()
        print(f"skipping image tests: {reason}")
        pytest.skip(reason)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return IMAGE


def test_image_config(image):
    r = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (cfg,) = json.loads(r.stdout)
    assert cfg["Config"]["User"] == f"{UID}:{UID}"
    assert cfg["Config"]["Entrypoint"] == ["/opt/hourglass/bin/hourglass"]
    whoami = subprocess.run(["docker", "run", "--rm", "--network", "host", "--entrypoint", "id", image, "-u"],
                            capture_output=True, text=True, timeout=60)
    assert whoami.stdout.strip() == str(UID), whoami.stderr


def test_demo_runs_inside_the_image(image):
    r = _image_sh("demo", "--", "--messages", "10", "--spread-s", "2", timeout_s=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "all 9 messages delivered" in out, out[-4000:]  # 10 scheduled, one cancelled
    assert "cluster stopped" in out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s; nothing is left running."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


def _wait_serving(address: str, alive) -> int:
    deadline = time.monotonic() + READY_WAIT_S_MAX
    while time.monotonic() < deadline and alive():
        try:
            return _health(address)
        except grpc.RpcError:
            time.sleep(0.2)
    raise AssertionError(f"no grpc.health.v1 answer from {address}")


def test_node_in_the_image_answers_kubernetes_grpc_probe(image):
    """What the chart's `grpc:` probes call, against a node started as the chart starts it."""
    port = free_port()
    name = f"hourglass-probe-{os.getpid()}-{port}"
    cid = subprocess.run(
        ["docker", "run", "-d", "--rm", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
         "--tmpfs", f"/var/lib/hourglass:uid={UID},gid={UID}",
         "-e", f"HOURGLASS_NODE_ID={name}", "-e", "HOURGLASS_ACK_MODE=async",
         image, "node", "--role=delay", f"--node-id={name}", "--group=d1", "--data-dir=/var/lib/hourglass",
         "--host=127.0.0.1", f"--port={port}"],
        capture_output=True, text=True, timeout=60)
    assert cid.returncode == 0, cid.stderr
    container_id = cid.stdout.strip()

    def alive() -> bool:
        r = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", container_id],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip() == "true"
    try:
        assert _wait_serving(f"127.0.0.1:{port}", alive) == health_pb2.HealthCheckResponse.SERVING
    finally:
        logs = subprocess.run(["docker", "logs", container_id], capture_output=True, text=True, timeout=30)
        subprocess.run(["docker", "stop", "-t", "10", container_id], capture_output=True, timeout=60)
    assert "Traceback" not in logs.stdout + logs.stderr, logs.stderr[-3000:]


def test_node_process_answers_grpc_health(tmp_path):
    """The same probe against a node process on this machine (runs without Docker too)."""
    port = free_port()
    log = open(tmp_path / "node.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "node", "--role=realtime", "--node-id=probe-1", "--group=r1",
         f"--data-dir={tmp_path / 'data'}", "--host=127.0.0.1", f"--port={port}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert _wait_serving(f"127.0.0.1:{port}", lambda: proc.poll() is None) == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        _stop(proc)
        log.close()


@pytest.mark.skipif(not Path("/usr/bin/etcd").exists(), reason="no /usr/bin/etcd (Debian: etcd-server)")
def test_metaserver_health_follows_etcd(tmp_path):
    """The chart's meta server probes: "" (liveness) answers while the process runs; the Meta
    service (readiness) is SERVING with etcd reachable and NOT_SERVING once etcd is gone."""
    client, peer, port = free_port(), free_port(), free_port()
    etcd_log, meta_log = open(tmp_path / "etcd.log", "wb"), open(tmp_path / "meta.log", "wb")
    etcd = subprocess.Popen(
        ["/usr/bin/etcd", "--name=m0", f"--data-dir={tmp_path / 'etcd'}",
         f"--listen-client-urls=http://127.0.0.1:{client}", f"--advertise-client-urls=http://127.0.0.1:{client}",
         f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
         f"--initial-cluster=m0=http://127.0.0.1:{peer}"],
        stdout=etcd_log, stderr=subprocess.STDOUT, start_new_session=True)
    meta = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "metaserver", "--host=127.0.0.1", f"--port={port}",
         f"--etcd-endpoints=127.0.0.1:{client}"],
        cwd=ROOT, stdout=meta_log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"

    def meta_status() -> int:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="hourglass.meta.v1.Meta"), timeout=2).status

    def wait_for(status: int) -> None:
        deadline = time.monotonic() + READY_WAIT_S_MAX
        last = None
        while time.monotonic() < deadline and meta.poll() is None:
            try:
                last = meta_status()
                if last == status:
                    return
            except grpc.RpcError as e:
                last = e.code()
            time.sleep(0.2)
        raise AssertionError(f"Meta health stayed {last}, wanted {status}; log:\n"
                             + (tmp_path / "meta.log").read_text()[-2000:])
    try:
        assert _wait_serving(address, lambda: meta.poll() is None) == health_pb2.HealthCheckResponse.SERVING
        wait_for(health_pb2.HealthCheckResponse.SERVING)
        etcd.terminate()
        etcd.wait(timeout=30)
        wait_for(health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING  # alive: no restart for etcd's outage
    finally:
        for proc in (meta, etcd):
            _stop(proc)
        etcd_log.close()
        meta_log.close()
