"""Election on a real etcd: racing candidates, lease expiry, observe, and the meta server's RPCs."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from metaserver import keyspace as ks
from metaserver.election import Election
from metaserver.etcd import EtcdClient

RACE_BOUND_S = 420  # below pytest's 600 s timeout
TTL_S = 1  # the smallest lease etcd grants with the test cluster's 500 ms election timeout


async def _history(client: EtcdClient, key: bytes, from_revision: int, n_events: int) -> list:
    """The first ``n_events`` events of ``key`` after ``from_revision`` (bounded wait per event)."""
    watch = await client.call(lambda c: c.watch(key, start_revision=from_revision + 1))
    events = []
    it = watch.__aiter__()
    try:
        while len(events) < n_events:
            events.append(await asyncio.wait_for(it.__anext__(), 10))
    finally:
        await watch.cancel()
    return events


async def test_racing_candidates_one_master_epochs_increase(etcd, etcd_client):
    group = f"race-{random.randrange(1 << 30)}"
    key = ks.leader_key("delay", group)
    start = (await etcd_client.call(lambda c: c.get_prefix(b"/hourglass/"))).header.revision
    n_candidates, rounds = 6, 2
    clients = [EtcdClient(etcd.endpoints) for _ in range(n_candidates)]
    elections = [Election(c, "delay", group, ttl_s=TTL_S) for c in clients]
    tenures: list[tuple[str, int]] = []   # (node, epoch) in the order seats were won
    overlaps: list[str] = []
    rng = random.Random(4)

    async def candidate(i: int) -> None:
        me = elections[i]
        for r in range(rounds):
            epoch = await me.campaign(f"n{i}", f"127.0.0.1:{7000 + i}", timeout_s=60)
            others = [f"n{j}" for j, e in enumerate(elections) if e is not me and e.epoch]
            if others:
                overlaps.append(f"n{i} won epoch {epoch} while {others} still held the seat")
            tenures.append((f"n{i}", epoch))
            await asyncio.sleep(rng.uniform(0, 0.05))
            if (i + r) % 2:
                await me.resign()            # hand over at once
            else:
                await me.abandon()           # stop the keep-alive: the seat ends with the lease (TTL)

    try:
        # a bound against a hang, not a speed check: 12 seats in a row take seconds on a quiet
        # machine and took over 120 s beside a busy suite (two busy cores, load 20+)
        await asyncio.wait_for(asyncio.gather(*(candidate(i) for i in range(n_candidates))), RACE_BOUND_S)
    finally:
        for e in elections:
            await e.close()
        for c in clients:
            await c.close()
    assert not overlaps, overlaps
    assert len(tenures) == n_candidates * rounds
    epochs = [e for _, e in tenures]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), f"epochs not strictly increasing: {epochs}"
    # etcd's own history of the key: create, delete, create, delete ... never a second create while held
    events = await _history(etcd_client, key, start, 2 * len(tenures))
    kinds = [ev.kind for ev in events]
    assert kinds == ["PUT", "DELETE"] * len(tenures), kinds
    assert [ev.kv.create_revision for ev in events[0::2]] == epochs
    assert all(ev.kv.version == 1 for ev in events[0::2])


async def test_observe_reports_every_change_and_expiry(etcd, etcd_client):
    group = f"obs-{random.randrange(1 << 30)}"
    a, b = Election(etcd_client, "realtime", group, ttl_s=TTL_S), Election(EtcdClient(etcd.endpoints), "realtime",
                                                                             group, ttl_s=TTL_S)
    seen = []

    async def watch():
        async for leader in Election(etcd_client, "realtime", group).observe(changes_max=4):
            seen.append(leader)

    task = asyncio.create_task(watch())
    while not seen:  # the observer has read the empty seat
        await asyncio.sleep(0.01)
    ea = await a.campaign("a", "127.0.0.1:1", timeout_s=5)
    await a.abandon()                                     # lease expires -> seat empty
    eb = await b.campaign("b", "127.0.0.1:2", timeout_s=10)
    assert eb > ea
    assert await b.leader() == ks.LeaderInfo("b", "127.0.0.1:2", eb)
    await b.resign()
    await asyncio.wait_for(task, 10)
    # the empty seat first, then four changes: a, a's lease expired, b, b resigned
    assert seen == [None, ks.LeaderInfo("a", "127.0.0.1:1", ea), None, ks.LeaderInfo("b", "127.0.0.1:2", eb), None]
    await b.etcd.close()


async def test_campaign_times_out_with_leader_hint(etcd_client):
    from cluster.errors import NotLeader

    group = f"hint-{random.randrange(1 << 30)}"
    a, b = Election(etcd_client, "delay", group, ttl_s=2), Election(etcd_client, "delay", group, ttl_s=2)
    await a.campaign("a", "127.0.0.1:11", timeout_s=5)
    with pytest.raises(NotLeader) as err:
        await b.campaign("b", "127.0.0.1:12", timeout_s=0.3)
    assert err.value.leader_hint == "127.0.0.1:11"
    assert (await a.leader()).node_id == "a"
    await a.resign()
    await b.close()


async def _register(stub, node_id: str, group: str, port: int) -> int:
    resp = await stub.Register(mpb.RegisterRequest(node=mpb.NodeInfo(
        role="delay", group=group, node_id=node_id, address=f"127.0.0.1:{port}", master=False), ttl_ms=2000))
    return resp.lease_id


async def test_meta_server_campaign_resign_leader(meta_server):
    group = f"rpc-{random.randrange(1 << 30)}"
    async with grpc.aio.insecure_channel(meta_server.address) as ch:
        stub = mrpc.MetaStub(ch)
        l1 = await _register(stub, f"{group}-n1", group, 9001)
        l2 = await _register(stub, f"{group}-n2", group, 9002)
        r1 = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n1", lease_id=l1))
        assert r1.elected and r1.leader.address == "127.0.0.1:9001"
        r2 = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n2", lease_id=l2,
                                                     wait_ms=200))
        assert not r2.elected and r2.leader.node_id == f"{group}-n1"
        # a node cannot campaign with somebody else's lease
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n2", lease_id=l1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        servers = await stub.GetServers(mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER))
        g = next(g for g in servers.groups if g.name == group)
        assert g.master == "127.0.0.1:9001" and g.epoch == r1.leader.epoch
        # resigning with a wrong epoch does nothing; the right one hands over
        assert not (await stub.Resign(mpb.ResignRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                        epoch=r1.leader.epoch + 1))).resigned
        assert (await stub.Resign(mpb.ResignRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                    epoch=r1.leader.epoch))).resigned
        # n2 never joined the in-sync set (n1 did not add it): it may not be elected ...
        r3 = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n2", lease_id=l2))
        assert not r3.elected and "in-sync" in r3.refused
        assert list((await stub.Leader(mpb.LeaderRequest(role="delay", group=group))).in_sync) == [f"{group}-n1"]
        # ... until the master adds it (guarded by the master's epoch: a stale one changes nothing)
        r1b = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n1", lease_id=l1))
        assert r1b.elected and r1b.store_epoch > r1.store_epoch
        stale = await stub.UpdateInSync(mpb.UpdateInSyncRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                                epoch=r1.leader.epoch,
                                                                members=[f"{group}-n1", f"{group}-n2"]))
        assert not stale.updated
        up = await stub.UpdateInSync(mpb.UpdateInSyncRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                             epoch=r1b.leader.epoch,
                                                             members=[f"{group}-n1", f"{group}-n2"]))
        assert up.updated and sorted(up.members) == [f"{group}-n1", f"{group}-n2"]
        assert (await stub.Resign(mpb.ResignRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                    epoch=r1b.leader.epoch))).resigned
        r3 = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n2", lease_id=l2))
        assert r3.elected and r3.leader.epoch > r1b.leader.epoch and r3.store_epoch > r1b.store_epoch
        # the leadership dies with the node's registration
        await stub.Deregister(mpb.DeregisterRequest(lease_id=l2, node_id=f"{group}-n2"))
        assert not (await stub.Leader(mpb.LeaderRequest(role="delay", group=group))).present
        await stub.Deregister(mpb.DeregisterRequest(lease_id=l1, node_id=f"{group}-n1"))


async def test_leader_long_poll_answers_with_the_change_it_waited_for(meta_server):
    """A Leader call with the token of the caller's last answer waits for a change and answers
    with it: the seat taken, the in-sync set changed, the seat given up. A stale token is
    answered at once with the current state. Outcomes only: a poll that ends by its time
    limit answers the same token, and the caller asks again (bounded)."""
    group = f"lp-{random.randrange(1 << 30)}"
    async with grpc.aio.insecure_channel(meta_server.address) as ch:
        stub = mrpc.MetaStub(ch)
        first = await stub.Leader(mpb.LeaderRequest(role="delay", group=group))
        assert not first.present and first.token

        async def next_change(known: str, polls_max: int = 30) -> mpb.LeaderResponse:
            for _ in range(polls_max):
                r = await stub.Leader(mpb.LeaderRequest(role="delay", group=group, wait_ms=2000, known=known))
                if r.token != known:
                    return r
            raise AssertionError(f"no change seen in {polls_max} polls")

        lease = await _register(stub, f"{group}-n1", group, 9101)
        waiting = asyncio.ensure_future(next_change(first.token))
        won = await stub.Campaign(mpb.CampaignRequest(role="delay", group=group, node_id=f"{group}-n1", lease_id=lease))
        assert won.elected
        seen = await asyncio.wait_for(waiting, 120)
        assert seen.present and seen.leader.node_id == f"{group}-n1" and seen.leader.epoch == won.leader.epoch
        assert list(seen.in_sync) == [f"{group}-n1"]
        # nothing changes: a poll keeps the token
        same = await stub.Leader(mpb.LeaderRequest(role="delay", group=group, wait_ms=50, known=seen.token))
        assert same.token == seen.token and same.leader.epoch == won.leader.epoch
        # a stale token is answered at once with what holds now
        stale = await stub.Leader(mpb.LeaderRequest(role="delay", group=group, wait_ms=30_000, known=first.token))
        assert stale.token == seen.token
        # the in-sync set changes
        waiting = asyncio.ensure_future(next_change(seen.token))
        up = await stub.UpdateInSync(mpb.UpdateInSyncRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                             epoch=won.leader.epoch,
                                                             members=[f"{group}-n1", f"{group}-n2"]))
        assert up.updated
        isr = await asyncio.wait_for(waiting, 120)
        assert sorted(isr.in_sync) == [f"{group}-n1", f"{group}-n2"] and isr.present
        # the seat is given up
        waiting = asyncio.ensure_future(next_change(isr.token))
        assert (await stub.Resign(mpb.ResignRequest(role="delay", group=group, node_id=f"{group}-n1",
                                                    epoch=won.leader.epoch))).resigned
        gone = await asyncio.wait_for(waiting, 120)
        assert not gone.present
        await stub.Deregister(mpb.DeregisterRequest(lease_id=lease, node_id=f"{group}-n1"))
