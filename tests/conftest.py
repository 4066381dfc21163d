"""Shared fixtures.

etcd (issue 4): a real etcd, never a fake.

* ``etcd`` - one single-member etcd process for the module (``cluster.etcdproc.EtcdCluster``);
* ``etcd_any`` - parametrised over the two ways Hourglass runs etcd: ``process`` (a local
  process) and ``container`` (testcontainers, image built locally from the same binary).
  The container case starts a Docker daemon with ``scripts/dockerd.sh start`` and is
  skipped, saying why, only when no daemon can be started;
* ``etcd_client`` - an ``EtcdClient`` on ``etcd``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


_DOCKER_WAS_RUNNING: bool | None = None


def pytest_sessionstart(session) -> None:
    global _DOCKER_WAS_RUNNING
    try:
        _DOCKER_WAS_RUNNING = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except Exception:
        _DOCKER_WAS_RUNNING = False


def pytest_sessionfinish(session, exitstatus) -> None:
    """Leave no process behind: stop a Docker daemon that this test session started."""
    if _DOCKER_WAS_RUNNING is False and Path("/tmp/hourglass-dockerd.pid").exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "dockerd.sh"), "stop"], capture_output=True, timeout=120)


def _docker_available() -> str | None:
    """None when a Docker daemon answers (started if needed), else the reason."""
    try:
        r = subprocess.run(["bash", str(ROOT / "scripts" / "dockerd.sh"), "start"], capture_output=True,
                           text=True, timeout=120)
    except Exception as e:  # no bash / timeout
        return f"dockerd.sh failed: {e}"
    return None if r.returncode == 0 else (r.stderr.strip() or "dockerd.sh start failed")[-300:]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    from cluster.etcdproc import EtcdCluster

    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), members=1)
    with cluster:
        yield cluster


@pytest.fixture(params=["process", "container"])
def etcd_any(request, tmp_path):
    if request.param == "process":
        from cluster.etcdproc import EtcdCluster

        with EtcdCluster(tmp_path / "etcd", members=1) as c:
            yield c
        return
    reason = _docker_available()
    if reason is not None:
        pytest.skip(f"no Docker daemon: {reason}")
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from cluster.etcdproc import EtcdContainer

    with EtcdContainer() as c:
        yield c


@pytest.fixture
async def etcd_client(etcd):
    from metaserver.etcd import EtcdClient

    client = EtcdClient(etcd.endpoints)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def meta_server(etcd, tmp_path_factory):
    """One meta server process on ``etcd``."""
    from cluster.devcluster import MetaProcess, free_port

    root = tmp_path_factory.mktemp("meta")
    m = MetaProcess("meta-1", "meta", root / "meta-1", free_port(), etcd_endpoints=etcd.endpoints)
    m.start()
    try:
        m.wait_ready()
        yield m
    finally:
        m.stop()
