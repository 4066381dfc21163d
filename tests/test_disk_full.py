"""Disk full (issue 14 A): a delay node on a small tmpfs the test mounts (root only).

Writes are refused with the documented code (gRPC RESOURCE_EXHAUSTED, "disk full: ...";
per-message code OVERLOADED), the node stays up (no SIGBUS), nothing acknowledged is lost,
and writes are taken again by themselves once space is freed. Two runs: with the
free-space watermark, and with the watermark at 0 (every write runs into ENOSPC itself).
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.wire import make_request

TMPFS_BYTES = 24 << 20
BALLAST_BYTES = 6 << 20
SENDS_MAX = 400


@pytest.mark.parametrize("watermark_bytes", [4 << 20, 0], ids=["watermark", "enospc"])
def test_disk_full_refuses_writes_keeps_serving_and_recovers(tmpfs, watermark_bytes):
    disk = tmpfs(TMPFS_BYTES)
    cluster = None
    try:
        ballast = disk / "ballast"
        ballast.write_bytes(b"\1" * BALLAST_BYTES)
        env = {"HOURGLASS_DISK_FREE_MIN_BYTES": str(watermark_bytes), "HOURGLASS_DISK_FREE_MIN_RATIO": "0.5",
               "HOURGLASS_DISK_RESUME_MARGIN_BYTES": str(256 << 10), "HOURGLASS_DISK_CHECK_INTERVAL_MS": "100",
               "HOURGLASS_MESSAGE_SEGMENT_BYTES": str(1 << 20), "HOURGLASS_DISPATCH_SEGMENT_BYTES": str(1 << 16),
               "HOURGLASS_SCHEDULE_SEGMENT_BYTES": str(1 << 20), "HOURGLASS_ID_SLOTS": "4096",
               "HOURGLASS_ID_ENTRIES_MAX": "65536", "HOURGLASS_RETENTION_INTERVAL_MS": "200"}
        cluster = LocalCluster(disk / "c", env=env).start()
        node = cluster.nodes[-1] if cluster.nodes[-1].role == "delay" else cluster.nodes[0]
        assert node.role == "delay"
        stub = rpc.ProducerStub(grpc.insecure_channel(node.address))
        acked: list[str] = []
        refusals = 0
        consecutive = 0
        due = int(time.time() * 1000) + 3_600_000  # pending for the whole test: nothing may be deleted
        for k in range(SENDS_MAX):  # fill until writes stay refused (retention frees the WAL copy first)
            ids = [f"k{k}-{j}" for j in range(200)]
            b = Batch.build("orders", [os.urandom(1000)] * 200, ids, [due] * 200)
            try:
                resp = stub.SendBatch(make_request(b), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert e.details().startswith("disk full"), e.details()
                refusals += 1
                consecutive += 1
                assert node.running
                if consecutive >= 5:
                    break
                time.sleep(0.3)
                continue
            consecutive = 0
            assert set(resp.codes) <= {pb.OK, pb.ALREADY_EXISTS}, set(resp.codes)
            acked += [i for i, c in zip(ids, resp.codes) if c == pb.OK]
        assert consecutive >= 5, f"the disk never filled ({refusals} refusals, {len(acked)} acked)"
        assert stub.Lookup(pb.LookupRequest(id=acked[0]), timeout=10).status == "pending"
        # space comes back: writes are taken again, by themselves
        ballast.unlink()
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = stub.SendBatch(make_request(Batch.build("orders", [b"y"], ["after"], [due])), timeout=10)
                if resp.codes[0] == pb.OK:
                    break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert time.monotonic() < deadline, "writes not taken again after space was freed"
            time.sleep(0.2)
        assert node.running
        # nothing acknowledged was lost (a restart replays from disk)
        node.stop()
        node.start()
        node.wait_ready()
        stub = rpc.ProducerStub(grpc.insecure_channel(node.address))
        for mid in acked[:: max(1, len(acked) // 50)] + [acked[-1], "after"]:
            assert stub.Lookup(pb.LookupRequest(id=mid), timeout=10).status == "pending", mid
        log = node.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
    finally:
        if cluster is not None:
            cluster.stop()
