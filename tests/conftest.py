"""Shared fixtures.

etcd (issue 4): a real etcd, never a fake.

* ``etcd`` - one single-member etcd process for the module (``cluster.etcdproc.EtcdCluster``);
* ``etcd_any`` - parametrised over the two ways Hourglass runs etcd: ``process`` (a local
  process) and ``container`` (testcontainers, image built locally from the same binary).
  The container case starts a Docker daemon with ``scripts/dockerd.sh start`` and is
  skipped, saying why, only when no daemon can be started;
* ``etcd_client`` - an ``EtcdClient`` on ``etcd``.

Other shared fixtures: ``meta_server`` (one meta server process on ``etcd``), ``resolver``
(a ``StaticResolver`` on the module's own ``cluster`` fixture) and ``tmpfs`` (mounts a small
file system that a test fills on purpose; root only, else skipped).

Tiers (docs/testing.md): every test is exactly one of ``unit`` (pure, in-process, no
subprocess, socket, etcd, Docker or Spark; the whole tier runs in under a minute),
``integration`` (real processes, ports, etcd) or ``slow`` (over ~30 s: crash loops, large
backlogs, image builds, Spark jobs). A module's tier is its row in ``MODULE_TIERS``; a test
or class that differs says so with its own marker (``@pytest.mark.integration``). A test
module missing from the table, or a test with two tiers, stops the collection.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

TIERS = ("unit", "integration", "slow")

# module (relative to tests/) -> tier of its tests, unless a test or class carries its own tier marker
MODULE_TIERS = {
    "chaos/test_chaos.py": "slow",
    "chaos/test_chaosrun.py": "unit",
    "chaos/test_checker.py": "unit",
    "chaos/test_partition.py": "slow",
    "chaos/test_starvation.py": "slow",
    "test_ackjournal.py": "unit",
    "test_ports.py": "integration",  # binds sockets
    "test_cli.py": "integration",
    "test_cli_dev.py": "integration",
    "test_cli_verify.py": "integration",
    "test_certs_trust.py": "unit",
    "test_aio.py": "unit",
    "test_client.py": "integration",
    "test_consumer_health.py": "integration",
    "test_codec.py": "unit",
    "test_config.py": "unit",
    "test_settings_tree.py": "unit",
    "test_console_browser.py": "integration",
    "test_console_secure.py": "integration",
    "test_console_views.py": "unit",
    "test_crash.py": "slow",
    "test_delay_store.py": "unit",
    "test_drain.py": "unit",
    "test_delay_deadletter.py": "unit",
    "test_delay_store_machine.py": "unit",
    "test_disk_full.py": "integration",
    "test_dispatch_stall.py": "integration",
    "test_diskspace.py": "unit",
    "test_bench_e2e_user.py": "unit",
    "test_bench_cgroupquota.py": "unit",
    "test_docs.py": "unit",
    "test_e2e.py": "integration",
    "test_election.py": "integration",
    "test_etcd_client.py": "unit",
    "test_etcd_isolation.py": "integration",
    "test_failover_store.py": "integration",  # seeded runs: minutes
    "test_file_modes.py": "unit",
    "test_healing.py": "integration",
    "test_heal_missing.py": "unit",
    "test_helm.py": "integration",
    "test_idindex.py": "unit",
    "test_layers.py": "unit",
    "test_image.py": "slow",
    "test_log.py": "unit",
    "test_metaserver.py": "integration",
    "test_metrics_endpoint.py": "integration",
    "test_observability.py": "unit",
    "test_realtime_inflight.py": "unit",
    "test_realtime_offsets.py": "unit",
    "test_realtime_replication.py": "unit",
    "test_realtime_rules.py": "unit",
    "test_realtime_service.py": "integration",
    "test_realtime_store.py": "unit",
    "test_subject_quota.py": "unit",
    "test_subject_flood.py": "integration",
    "test_records.py": "unit",
    "test_replication.py": "integration",
    "test_replication_realtime.py": "integration",
    "test_registration.py": "integration",
    "test_replication_sim.py": "unit",
    "test_leader_wait.py": "unit",
    "test_insync.py": "unit",
    "test_insync_cluster.py": "integration",
    "test_restart_large.py": "slow",
    "test_retention.py": "unit",
    "test_role.py": "unit",
    "test_retention_realtime.py": "unit",
    "test_schedule.py": "unit",
    "test_scrub.py": "integration",
    "test_security.py": "integration",
    "test_security_unit.py": "unit",
    "test_sdk_errors.py": "integration",
    "test_server_edges.py": "integration",
    "test_spark.py": "slow",
    "test_spark_cli.py": "slow",
    "test_status.py": "unit",
    "test_status_counts.py": "unit",
    "test_subject_counts.py": "unit",
    "test_streams.py": "integration",
    "test_trace.py": "integration",
    "test_trace_rules.py": "unit",
    "test_wheel.py": "unit",
}


def pytest_configure(config) -> None:
    missing = sorted(m for m in MODULE_TIERS if not (TESTS / m).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py MODULE_TIERS names modules that do not exist: {missing}")
    worker = getattr(config, "workerinput", None)
    if worker is not None:  # a pytest-xdist worker (scripts/test.sh runs two): a port range of its own
        from cluster.ports import PORT_RANGE_ENV, port_range, split_range

        index = int(worker["workerid"].removeprefix("gw"))
        lo, hi = split_range(*port_range(), index, int(worker["workercount"]))
        os.environ[PORT_RANGE_ENV] = f"{lo}-{hi}"  # free_port here and in every child process


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    """Give every test its module's tier unless it has its own; refuse a test with none or two."""
    wrong = []
    for item in items:
        module = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else str(item.path)
        own = {m.name for m in item.iter_markers() if m.name in TIERS}
        if not own and module in MODULE_TIERS:
            item.add_marker(MODULE_TIERS[module])
            own = {MODULE_TIERS[module]}
        if len(own) != 1:
            wrong.append(f"{item.nodeid}: {sorted(own) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier (unit, integration or slow; docs/testing.md): add the "
            "module to MODULE_TIERS in tests/conftest.py, or mark the test\n  " + "\n  ".join(wrong[:20]))


_DOCKER_WAS_RUNNING: bool | None = None


def _is_worker(session) -> bool:
    return hasattr(session.config, "workerinput")


def pytest_sessionstart(session) -> None:
    """The Docker daemon is the machine's: the main process (not an xdist worker) notes whether
    one ran before the session and stops it after every worker has ended."""
    global _DOCKER_WAS_RUNNING
    if _is_worker(session):
        return
    try:
        _DOCKER_WAS_RUNNING = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except Exception:
        _DOCKER_WAS_RUNNING = False


def pytest_sessionfinish(session, exitstatus) -> None:
    """Leave no process behind: stop a Docker daemon that this test session started."""
    if _is_worker(session):
        return
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


@pytest.fixture
def resolver(cluster):
    """A ``StaticResolver`` on the nodes of the module's own ``cluster`` fixture (a ``LocalCluster``)."""
    from cluster.client import StaticResolver

    return StaticResolver(delay=[n.address for n in cluster.delay], realtime=[n.address for n in cluster.realtime])


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size_bytes)`` mounts a small file system for a test that fills a disk on purpose and
    returns its path; unmounted at teardown. Skipped, saying why, when not root or mount refuses."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (this test fills a small file system on purpose)")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


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
