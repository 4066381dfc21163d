"""Issue 27, 3: a flood of new subjects does not stall the real-time node for everyone, and
each principal is held to its subject quotas (docs/security.md "Subject quotas").

A real cluster (etcd, a meta server, a real-time node and a delay node, open: one anonymous
tenant, its quotas raised for the flood). The attacker sends 1,500 new subjects in SendBatch
requests of 300 straight to the real-time node, as an attacker would, while the victim sends
one message at a time to a subject that exists. Before the change each batch of 300 held the
event loop for its whole creation (15 s measured), so no victim send could finish while a
flood batch was in flight. Asserted without a time: every victim send succeeds, and victim
sends start *and finish* while a flood batch that started before them is still in flight.
Then the owned quota (1,600 here) refuses what is past it, naming the setting, and still does
after the node restarts (the owners are in the subjects journal).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from cluster.proto import hourglass_pb2 as pb
from cluster.transport import Channels
from cluster.wire import BatchResult, make_request

FLOOD_SUBJECTS = 1500
FLOOD_BATCH = 300
OWNED_MAX = 1600
VICTIM_SENDS_MAX = 5000   # the victim stops once the flood is over, or at this many sends
SEND_TIMEOUT_S = 120


def _batch(subjects: list[str], tag: str) -> Batch:
    n = len(subjects)
    return Batch.build(subjects, [b"x"] * n, [f"{tag}-{i}" for i in range(n)], np.zeros(n, np.int64))


async def _send(ch: Channels, address: str, b: Batch) -> BatchResult:
    resp = await ch.producer(address).SendBatch(make_request(b, immediate=True), timeout=SEND_TIMEOUT_S)
    return BatchResult.from_pb(resp, b.n)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {"HOURGLASS_SUBJECTS_NEW_PER_MINUTE_MAX": "100000", "HOURGLASS_SUBJECTS_OWNED_MAX": str(OWNED_MAX)}
    with LocalCluster(tmp_path_factory.mktemp("flood"), n_delay=1, n_realtime=1, env=env) as c:
        c.wait_registered()
        yield c


async def test_a_flood_of_new_subjects_does_not_hold_back_other_sends(cluster):
    rt = cluster.realtime[0]
    ch = Channels()
    events: list[tuple[str, int]] = []  # in the order they happened on this loop
    try:
        assert (await _send(ch, rt.address, _batch(["victim"], "warm"))).codes.tolist() == [pb.OK]
        flood_done = asyncio.Event()

        async def flood() -> list[BatchResult]:
            out = []
            try:
                for k in range(FLOOD_SUBJECTS // FLOOD_BATCH):
                    subjects = [f"flood.{k}.{i}" for i in range(FLOOD_BATCH)]
                    events.append(("flood_start", k))
                    out.append(await _send(ch, rt.address, _batch(subjects, f"f{k}")))
                    events.append(("flood_end", k))
            finally:
                flood_done.set()
            return out

        async def victim() -> list[BatchResult]:
            out = []
            for j in range(VICTIM_SENDS_MAX):
                if flood_done.is_set():
                    break
                events.append(("victim_start", j))
                out.append(await _send(ch, rt.address, _batch(["victim"], f"v{j}")))
                events.append(("victim_end", j))
            return out

        floods, victims = await asyncio.gather(flood(), victim())
    finally:
        await ch.close()

    assert all((r.codes == pb.OK).all() for r in floods), [r.errors for r in floods if r.errors][:1]
    assert victims and all(r.codes.tolist() == [pb.OK] for r in victims)
    # victim sends that started and finished while one flood batch (started before them) was in flight
    pos = {e: i for i, e in enumerate(events)}
    inside = [j for j in range(len(victims)) for k in range(FLOOD_SUBJECTS // FLOOD_BATCH)
              if pos[("flood_start", k)] < pos[("victim_start", j)] < pos[("victim_end", j)] < pos[("flood_end", k)]]
    assert len(inside) >= 2, f"no victim send finished inside a flood batch: {events[:40]}"

    status = (await cluster.statuses("realtime"))[rt.name]
    assert status["subject_rounds"] >= 1 and status["subjects_created"] >= FLOOD_SUBJECTS + 1


async def test_the_owned_quota_refuses_past_it_and_survives_a_restart(cluster):
    rt = cluster.realtime[0]
    owned = 1 + FLOOD_SUBJECTS  # the victim's subject and the flood (one anonymous tenant); the DLQ has no owner
    ch = Channels()
    try:
        subjects = [f"more.{i}" for i in range(200)]
        res = await _send(ch, rt.address, _batch(["victim", *subjects], "more"))
        left = OWNED_MAX - owned
        assert res.codes[: 1 + left].tolist() == [pb.OK] * (1 + left)   # the existing subject and what fits
        refused = res.codes[1 + left:]
        assert len(refused) and (refused == pb.OVERLOADED).all()
        text = res.errors[1 + left]
        assert text.startswith("quota exceeded") and "subjects_owned_max=1600" in text and "'anonymous'" in text
    finally:
        await ch.close()
    await asyncio.to_thread(cluster.restart, rt)
    ch = Channels()
    try:
        res = await _send(ch, rt.address, _batch(["victim", "after.restart"], "after"))
        assert res.codes.tolist() == [pb.OK, pb.OVERLOADED] and "subjects_owned_max" in res.errors[1]
    finally:
        await ch.close()
