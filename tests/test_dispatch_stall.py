"""A real-time node whose fsync stalls does not hold the delay node's next dispatch rounds.

A real ``DelayNode`` and a real ``RealtimeNode`` in-process on real ports. The real-time
node's message-log fsync is held on a gate: its appends stay in the page cache, visible to
pulls (they are handed out before the fsync), but no dispatch round is answered. Messages
due at several times far enough apart to fire in rounds of their own must all reach the
consumer while the gate is held: with two rounds in flight at most (the default before
2026-12-02) the third round waited for the first one's fsync, and a slow fsync at the
real-time node (tens to hundreds of ms on this VM's disk) became every later message's
lateness (docs/benchmarks.md, "A slow fsync at the real-time node").
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from cluster.codec import Batch
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.wire import BatchResult, make_request
from node.config import NodeSettings
from node.delay.service import DelayNode
from node.realtime.service import RealtimeNode
from tests.helpers.fsync import held_fsync
from tests.helpers.inprocess import serving

ROUNDS = 6              # messages due this many distinct times, one dispatch round each
SPACING_MS = 150        # apart: more than the round spacing (40 ms), so no two share a round
FIRST_DUE_MS = 800      # after the send: filed and in the wheel before the first is due
SEEN_WAIT_S = 20.0      # bound on the wait for every message while the fsync is held
GATE_WAIT_S = 60.0      # bound on the held fsync: longer than SEEN_WAIT_S, so it cannot free the rounds first


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_rounds_keep_going_out_while_the_realtime_nodes_fsync_is_held(tmp_path):
    rt = RealtimeNode(NodeSettings(role="realtime", node_id="rt-stall", data_dir=tmp_path / "rt", port=0,
                                   pull_wait_ms_max=2_000))
    async with serving(rt) as rt_channel:
        consumer = rpc.ConsumerStub(rt_channel)
        # a warm append, so the subject exists and the log has had its first fsync
        warm = await rpc.ProducerStub(rt_channel).SendBatch(
            make_request(Batch.build("stall.s", [b"w"], ["warm"], 0), immediate=True))
        assert BatchResult.from_pb(warm, 1).codes.tolist() == [pb.OK]
        delay = DelayNode(NodeSettings(role="delay", node_id="d-stall", data_dir=tmp_path / "d", port=0,
                                       realtime_nodes=[rt.address]))
        async with serving(delay) as d_channel:
            gate, in_fsync = held_fsync(rt.committer.log, guard_s=GATE_WAIT_S)
            try:
                t0 = now_ms()
                ids = [f"m{i}" for i in range(ROUNDS)]
                due = [t0 + FIRST_DUE_MS + i * SPACING_MS for i in range(ROUNDS)]
                resp = await rpc.ProducerStub(d_channel).SendBatch(
                    make_request(Batch.build("stall.s", [b"x"] * ROUNDS, ids, np.array(due, np.int64))))
                assert BatchResult.from_pb(resp, ROUNDS).codes.tolist() == [pb.OK] * ROUNDS
                seen: list[str] = []
                deadline = time.monotonic() + SEEN_WAIT_S
                while len(set(seen) - {"warm"}) < ROUNDS and time.monotonic() < deadline:
                    r = await consumer.Pull(pb.PullRequest(subjects=["stall.s"], group="g", consumer_id="c",
                                                           max_messages=100, wait_ms=1_000))
                    seen += Batch.decode(r.batch).id_list()
                assert in_fsync.is_set() and not gate.is_set()  # every message below came while it was held
                assert sorted(set(seen) - {"warm"}) == ids, f"seen while the fsync was held: {seen}"
            finally:
                gate.set()
                del rt.committer.log.flush
            # once the fsync returns, every round is answered and recorded as dispatched
            deadline = time.monotonic() + SEEN_WAIT_S
            while delay.store.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert delay.store.inflight == 0
