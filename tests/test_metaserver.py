"""Meta server with real etcd and real processes: registration, expiry, discovery, routing,
meta server failover, etcd loss, bad input, and a 3-member etcd cluster losing a member."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster, MetaProcess, NodeProcess, free_port
from cluster.discovery import MetaResolver
from cluster.errors import Unavailable
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from metaserver.etcd import EtcdClient

TTL_MS = 2000
FAST_NODES = {"HOURGLASS_META_LEASE_TTL_MS": str(TTL_MS)}


async def _listed(meta_address: str, kind: int) -> dict[str, list[str]]:
    """group -> member addresses as one meta server answers GetServers(kind)."""
    async with grpc.aio.insecure_channel(meta_address) as ch:
        resp = await mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=kind), timeout=5)
    return {g.name: [m.address for m in g.members] for g in resp.groups}


async def _wait_for(predicate, timeout_s: float, step_s: float = 0.05):
    """Poll an async predicate until it is truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(step_s)


async def _snapshot(endpoints: list[str]) -> list[tuple]:
    client = EtcdClient(endpoints)
    try:
        r = await client.call(lambda c: c.get_prefix(b"/hourglass/"))
        return [(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in r]
    finally:
        await client.close()


# ---------------------------------------------------------------------- registration and expiry


async def _ready(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="hourglass.v1.Node"),
                                                       timeout=5)
    return r.status


async def test_a_node_is_ready_only_once_registered(etcd_any, tmp_path):
    """The readiness service (the chart's readiness probe) waits for the registration: a rolling
    update must not take the next member while this one is not yet known to the meta servers."""
    from grpc_health.v1 import health_pb2

    meta = MetaProcess("meta-1", "meta", tmp_path / "meta-1", free_port(), etcd_endpoints=etcd_any.endpoints)
    node = NodeProcess("rt-r", "realtime", tmp_path / "rt-r", free_port(), dict(FAST_NODES),
                       ["--meta", meta.address, "--group", "rt-r"])
    try:
        node.start()  # its meta server is not up yet
        node.wait_ready()
        assert await _ready(node.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        meta.start()
        meta.wait_ready()
        async def serving() -> bool:
            return await _ready(node.address) == health_pb2.HealthCheckResponse.SERVING
        assert await _wait_for(serving, 15), "not ready after its registration"
    finally:
        node.stop()
        meta.stop()


async def test_node_registers_and_disappears_after_sigkill(etcd_any, tmp_path):
    meta = MetaProcess("meta-1", "meta", tmp_path / "meta-1", free_port(), etcd_endpoints=etcd_any.endpoints)
    node = NodeProcess("rt-a", "realtime", tmp_path / "rt-a", free_port(), dict(FAST_NODES),
                       ["--meta", meta.address, "--group", "rt-a"])
    meta.start()
    try:
        meta.wait_ready()
        node.start()
        node.wait_ready()
        listed = await _wait_for(lambda: _listed(meta.address, mpb.CONSUMER), 10)
        assert listed == {"rt-a": [node.address]}
        # the record carries role, group, master and offsets
        async with grpc.aio.insecure_channel(meta.address) as ch:
            g = (await mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=mpb.CONSUMER))).groups[0]
        assert g.master == node.address and g.members[0].role == "realtime" and g.members[0].master
        assert "message_log_end" in g.members[0].offsets
        node.kill()
        killed = time.monotonic()
        gone = await _wait_for(lambda: _empty(meta.address), TTL_MS / 1000 + 5)
        elapsed = time.monotonic() - killed
        assert gone, f"SIGKILLed node still registered {elapsed:.1f} s later (TTL {TTL_MS} ms)"
    finally:
        node.stop()
        meta.stop()


async def _empty(meta_address: str) -> bool:
    return await _listed(meta_address, mpb.CONSUMER) == {}


# ---------------------------------------------------------------------- discovery, routing, failover


@pytest.fixture(scope="module")
def meta_cluster(tmp_path_factory):
    """etcd + two meta servers + one delay node + two real-time nodes, discovering through the meta servers."""
    c = LocalCluster(tmp_path_factory.mktemp("metacluster"), n_delay=1, n_realtime=2, n_meta=2, env=FAST_NODES)
    with c:
        c.wait_registered()
        yield c


async def test_kinds_see_only_their_groups_and_routes_are_stable(meta_cluster):
    c = meta_cluster
    m1, m2 = c.meta_addresses
    delay = await _listed(m1, mpb.DELAYED_PRODUCER)
    consumer = await _listed(m1, mpb.CONSUMER)
    assert delay == {"delay-1": [c.delay[0].address]}
    assert consumer == {"realtime-1": [c.realtime[0].address], "realtime-2": [c.realtime[1].address]}
    assert await _listed(m2, mpb.IMMEDIATE_PRODUCER) == consumer
    rt_addresses = {n.address for n in c.realtime}
    routes = {}
    for i in range(12):
        subject = f"orders.{i}"
        r1, r2 = MetaResolver([m1]), MetaResolver([m2], realtime_kind=mpb.CONSUMER)
        try:
            a, b = await r1.realtime_for(subject), await r2.realtime_for(subject)
        finally:
            await r1.close()
            await r2.close()
        assert a == b and a in rt_addresses   # consumers and producers agree; never a delay node
        routes[subject] = a
    assert len(set(routes.values())) == 2     # subjects spread over both groups
    again = MetaResolver([m2, m1])
    try:
        assert {s: await again.realtime_for(s) for s in routes} == routes   # stored in etcd, stable
    finally:
        await again.close()


async def test_two_meta_servers_one_killed_clients_carry_on(meta_cluster, tmp_path):
    c = meta_cluster
    resolver = MetaResolver(c.meta_addresses, refresh_ms=200)
    subject = "failover.orders"
    got: set[str] = set()

    async def send(p: Producer, ids: list[str]) -> None:
        futs = [await p.send(subject, f"m {i}", delay_ms=300, id=i) for i in ids]
        await asyncio.gather(*futs)

    async def receive(cons: Consumer, want: set[str]) -> None:
        for _ in range(60):  # bounded: 60 long polls of 0.5 s
            if want <= got:
                return
            batch = await cons.pull(wait_ms=500)
            got.update(m.id for m in batch)
            await cons.ack(batch)

    try:
        async with Producer(resolver) as p, Consumer(MetaResolver(c.meta_addresses, refresh_ms=200), subject,
                                                     group="g") as cons:
            first = [f"a{i}" for i in range(20)]
            await send(p, first)
            await receive(cons, set(first))
            c.meta[0].kill()
            # past the node TTL: heartbeats must have moved to the second meta server
            await asyncio.sleep(TTL_MS / 1000 + 0.5)
            assert set(await _listed(c.meta[1].address, mpb.CONSUMER)) == {"realtime-1", "realtime-2"}
            second = [f"b{i}" for i in range(20)]
            await send(p, second)
            await receive(cons, set(second))
        assert set(first + second) <= got
    finally:
        await resolver.close()
        c.meta[0].start()
        c.meta[0].wait_ready()


async def test_consumer_never_sees_delay_nodes(meta_cluster):
    c = meta_cluster
    r = MetaResolver(c.meta_addresses, realtime_kind=mpb.CONSUMER)
    try:
        for s in ("x", "y.z", "hourglass.dlq"):
            assert await r.realtime_for(s) not in {n.address for n in c.delay}
    finally:
        await r.close()
    async with grpc.aio.insecure_channel(c.meta_addresses[0]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await mrpc.MetaStub(ch).Route(mpb.RouteRequest(kind=mpb.DELAYED_PRODUCER, subject="x"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------- bad input


async def test_bad_input_clear_errors_and_etcd_unchanged(meta_cluster):
    c = meta_cluster
    before = await _snapshot(c.etcd_endpoints)
    taken = c.realtime[0]
    good = dict(role="realtime", group="g-bad", node_id="n-bad", address="127.0.0.1:9", master=True)
    cases = [
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, role="archive"))), "unknown role"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, node_id=""))), "node.node_id"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, group="a/b"))), "node.group"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, address="nowhere"))), "host:port"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, lag_ms=-5))), "lag_ms"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**good), ttl_ms=10_000_000), "ttl_ms"),
        (mpb.RegisterRequest(node=mpb.NodeInfo(**dict(good, offsets={"x": -1}))), "offset"),
    ]
    async with grpc.aio.insecure_channel(c.meta_addresses[0]) as ch:
        stub = mrpc.MetaStub(ch)
        for req, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert words in err.value.details(), err.value.details()
        # a node claiming a live node's id (different address): refused, the owner is untouched
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(mpb.RegisterRequest(node=mpb.NodeInfo(
                role="realtime", group=taken.name, node_id=taken.name, address="127.0.0.1:1")), timeout=5)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert taken.name in err.value.details() and "held by a live registration" in err.value.details()
        # heartbeat for another node's id with a made-up lease
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Heartbeat(mpb.HeartbeatRequest(lease_id=12345, node=mpb.NodeInfo(
                role="realtime", group=taken.name, node_id=taken.name, address=taken.address)), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for kind in (mpb.KIND_UNSPECIFIED, 42):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetServers(mpb.GetServersRequest(kind=kind), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown kind" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(mpb.RouteRequest(kind=mpb.CONSUMER, subject=""), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = await _snapshot(c.etcd_endpoints)
    # heartbeats of the live nodes rewrite their own records meanwhile; everything else is identical
    strip = lambda snap: [(k, v if b"/nodes/" not in k else b"", lease) for k, v, _, lease in snap]  # noqa: E731
    assert strip(after) == strip(before)
    assert not [k for k, *_ in after if b"bad" in k or b"archive" in k]


# ---------------------------------------------------------------------- etcd loss


async def test_etcd_down_meta_unhealthy_nodes_keep_serving(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=1, meta=True, env=FAST_NODES)
    with c:
        c.wait_registered()
        resolver = MetaResolver(c.meta_addresses)
        subject = "etcd.down"
        try:
            async with Producer(resolver) as p, Consumer(resolver, subject, group="g") as cons:
                got = set()

                async def receive(want: str) -> None:
                    for _ in range(20):  # bounded: 20 long polls of 0.5 s
                        batch = await cons.pull(wait_ms=500)
                        got.update(m.id for m in batch)
                        await cons.ack(batch)
                        if want in got:
                            return

                # routes are learned while etcd is up (producer, consumer and the delay node)
                await p.send_and_wait(subject, b"before", delay_ms=100, id="before")
                await receive("before")
                assert "before" in got
                c.etcd.stop()
                async with grpc.aio.insecure_channel(c.meta_addresses[0]) as ch:
                    health = await mrpc.MetaStub(ch).Health(mpb.HealthRequest(), timeout=10)
                    assert not health.healthy and health.error
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=mpb.CONSUMER), timeout=10)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                await resolver.refresh()   # force the resolver to ask: it must fall back to its cache
                await p.send_and_wait(subject, b"during", delay_ms=100, id="during")
                await receive("during")
                assert "during" in got
                assert all(n.running for n in c.nodes)
        finally:
            await resolver.close()


async def test_resolver_without_meta_or_cache_is_unavailable():
    r = MetaResolver([f"127.0.0.1:{free_port()}"], timeout_s=0.5)
    try:
        with pytest.raises(Unavailable):
            await r.delay_nodes()
    finally:
        await r.close()


# ---------------------------------------------------------------------- 3-member etcd


async def test_three_member_etcd_loses_a_member(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=1, meta=True, etcd_members=3, env=FAST_NODES)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        c.etcd.kill(0)   # the member the meta server talks to first
        await asyncio.sleep(TTL_MS / 1000 + 0.5)   # past a node TTL: heartbeats went through the others
        assert await _listed(meta, mpb.CONSUMER) == {"realtime-1": [c.realtime[0].address]}
        assert await _listed(meta, mpb.DELAYED_PRODUCER) == {"delay-1": [c.delay[0].address]}
        async with grpc.aio.insecure_channel(meta) as ch:
            assert (await mrpc.MetaStub(ch).Health(mpb.HealthRequest(), timeout=10)).healthy
        resolver = MetaResolver([meta])
        try:
            async with Producer(resolver) as p, Consumer(resolver, "three", group="g") as cons:
                await p.send_and_wait("three", b"x", delay_ms=100, id="three-1")
                got = []
                for _ in range(20):
                    got += await cons.pull(wait_ms=500)
                    if got:
                        break
                assert [m.id for m in got] == ["three-1"]
        finally:
            await resolver.close()


# ---------------------------------------------------------------------- pure keyspace rules, docs


def test_groups_prefer_the_leader_key_and_routes_skip_dead_groups():
    from metaserver import keyspace as ks

    rec = lambda nid, group, port, master: ks.NodeRecord(role="realtime", group=group, node_id=nid,  # noqa: E731
                                                         address=f"127.0.0.1:{port}", master=master)
    records = [rec("b", "g1", 2, True), rec("a", "g1", 1, True), rec("c", "g2", 3, False)]
    groups = ks.build_groups("realtime", records, {})
    assert [(g.name, g.master) for g in groups] == [("g1", "127.0.0.1:1"), ("g2", "")]
    groups = ks.build_groups("realtime", records, {"g1": ks.LeaderInfo("b", "127.0.0.1:2", 77)})
    assert (groups[0].master, groups[0].epoch) == ("127.0.0.1:2", 77)
    assert ks.build_groups("delay", records, {}) == []
    # g2 has no master: every subject routes to g1
    assert {ks.choose_group(f"s{i}", groups).name for i in range(50)} == {"g1"}
    assert ks.choose_group("s", [groups[1]]) is None


def test_operations_doc_names_every_key_and_kind():
    from pathlib import Path

    from metaserver import keyspace as ks

    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    for key in (ks.id_key("{node_id}"), ks.node_key("{role}", "{group}", "{node_id}"),
                ks.leader_key("{role}", "{group}"), ks.subject_key("{subject}")):
        assert f"`{key.decode()}`" in doc
    for kind in ("DELAYED_PRODUCER", "IMMEDIATE_PRODUCER", "CONSUMER", "KIND_UNSPECIFIED"):
        assert kind in doc
