"""What the cluster tests that change routes and drains share: the ``hourglass`` CLI run as an
operator would (a fresh process from the repository root, none of the test's ``HOURGLASS_*``
environment, no standard input) and a subject's route as the meta server answers it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc

ROOT = Path(__file__).resolve().parent.parent.parent
CLI_TIMEOUT_S = 60


def cli(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOURGLASS_")} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout_s, stdin=subprocess.DEVNULL)


async def route(meta: str, subject: str) -> mpb.RouteResponse:
    """``subject``'s route from the meta server at ``meta`` (open cluster), as a consumer asks."""
    async with grpc.aio.insecure_channel(meta) as ch:
        return await mrpc.MetaStub(ch).Route(mpb.RouteRequest(kind=mpb.CONSUMER, subject=subject), timeout=10)


async def send_round(producer, subject: str, k: int, per_round: int, sent: dict[str, int]) -> None:
    """Round ``k`` of a route test's load: ``per_round`` delayed messages (``d-k-j``, due 300 ms
    + 37 ms x j after sending) and ``per_round // 2`` immediate ones (``i-k-j``); every
    acknowledged id goes into ``sent`` with its due time."""
    d_ids = [f"d-{k}-{j}" for j in range(per_round)]
    i_ids = [f"i-{k}-{j}" for j in range(per_round // 2)]
    fd = await producer.send_many(subject, [b"x"] * len(d_ids), ids=d_ids,
                                  delay_ms=[300 + 37 * j for j in range(len(d_ids))])
    fi = await producer.send_many(subject, [b"y"] * len(i_ids), ids=i_ids, immediate=True)
    for res in (await fd, await fi):
        for j, msg_id in enumerate(res.ids):
            if j not in res.errors:
                sent[msg_id] = int(res.deliver_at_ms[j])
