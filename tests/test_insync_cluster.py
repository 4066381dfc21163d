"""The in-sync set on a real cluster (etcd, meta server, two delay nodes in sync mode):
a member outside the set is never elected, even when the master is gone, and an operator's
``hourglass admin force-in-sync`` (which first says what may be lost) elects it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from cluster.devcluster import LocalCluster, wait_until
from cluster.discovery import MetaClient
from cluster.proto import meta_pb2 as mpb

HOURGLASS = [sys.executable, "-m", "cluster.cli"]


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*HOURGLASS, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="200"))


async def test_only_in_sync_members_are_elected_and_force_in_sync_elects_one(tmp_path):
    with LocalCluster(tmp_path, n_delay=2, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000) as c:
        c.wait_registered()
        master = await c.wait_master("delay")
        slave = next(n.name for n in c.delay if n.name != master)
        meta = MetaClient(c.meta_addresses, timeout_s=5)
        try:
            async def both_in_sync():
                lr = await meta.call("Leader", mpb.LeaderRequest(role="delay", group="delay-g1"))
                return sorted(lr.in_sync) == sorted([master, slave])
            await wait_until(both_in_sync, 30, "the slave to join the in-sync set")
            # an operator takes the slave out (as a master does when a member falls behind)
            await meta.call("ForceInSync", mpb.ForceInSyncRequest(role="delay", group="delay-g1", node_id=master))
            slave_log = next(n for n in c.delay if n.name == slave).log_path
            # only what the slave says once the seat is empty: at start-up it may have said the
            # same already (a Leader answer read between the winner's key and its in-sync set)
            seen = len(slave_log.read_text())
            next(n for n in c.delay if n.name == master).kill()

            async def slave_refuses():
                return "not in the in-sync set" in slave_log.read_text()[seen:]
            await wait_until(slave_refuses, 30, "the slave to say it may not campaign")
            lr = await meta.call("Leader", mpb.LeaderRequest(role="delay", group="delay-g1"))
            assert not lr.present  # nobody serves: waiting for the member that holds everything
            # the command first says what may be lost, and changes nothing
            dry = await asyncio.to_thread(run_cli, "admin", "force-in-sync", "delay-g1", slave,
                                          "--meta", c.meta_addresses[0], cwd=tmp_path)
            assert dry.returncode == 1 and "may lose acknowledged records" in dry.stdout, dry.stdout + dry.stderr
            assert "Traceback" not in dry.stdout + dry.stderr
            lr = await meta.call("Leader", mpb.LeaderRequest(role="delay", group="delay-g1"))
            assert list(lr.in_sync) == [master]
            done = await asyncio.to_thread(run_cli, "admin", "force-in-sync", "delay-g1", slave, "--yes",
                                           "--meta", c.meta_addresses[0], cwd=tmp_path)
            assert done.returncode == 0 and "forced" in done.stdout, done.stdout + done.stderr

            async def slave_is_master():
                r = await meta.call("Leader", mpb.LeaderRequest(role="delay", group="delay-g1"))
                return r.present and r.leader.node_id == slave
            await wait_until(slave_is_master, 30, "the forced member to be elected")
        finally:
            await meta.close()
