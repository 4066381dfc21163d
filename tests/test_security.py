"""Issue 18 against a real ``LocalCluster(secure=True)`` (the same thing `hourglass dev up
--secure` starts): mutual TLS on every port, tokens, per-subject grants, node-only methods,
certificate rotation on disk, no token in any log."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cluster import certs
from cluster import errors as E
from cluster import status
from cluster.client import Consumer, Producer
from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from cluster.discovery import MetaResolver
from cluster.ports import free_port
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.security import Grant
from cluster.transport import Channels
from cluster.wire import BatchResult, make_request
from tests.helpers.flow import receive_ids, round_trip


GRANTS = {
    "producer": [Grant(action="produce", subjects=["orders.*"])],
    "orders-reader": [Grant(action="consume", subjects=["orders.*"], groups=["billing"])],
    "canceller": [Grant(action="cancel", subjects=["orders.*"])],
}


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("secure"), n_delay=2, n_realtime=1, meta=True, delay_replicas=2,
                     lease_ttl_ms=2000, secure=True)
    tokens = {}
    for name, grants in GRANTS.items():
        path = c.security.dir / f"{name}.token"
        tokens[name] = (certs.add_token(c.security.auth_file, name, grants, path), path)
    # a client known by its certificate alone (no token): produce orders.* only
    certs.issue(c.security.dir, c.security.dir, "orders", kind="client", hosts=(), stem="client-orders")
    certs.grant_certificate(c.security.auth_file, "orders-by-cert", "client:orders",
                            [Grant(action="produce", subjects=["orders.*"])])
    c.metrics_port = free_port()
    c.delay[0].env["HOURGLASS_METRICS_PORT"] = str(c.metrics_port)
    with c:
        c.wait_registered()
        c.tokens = tokens
        yield c


def _resolver(c: LocalCluster, token: str | None = None, **settings) -> MetaResolver:
    path = c.tokens[token][1] if token else None
    return MetaResolver(c.meta_addresses, security=c.client_security(path, **settings))


async def _produce(c: LocalCluster, subject: str, msg_id: str, *, delay_ms: int) -> None:
    """One message sent with the produce-only token."""
    r = _resolver(c, "producer")
    try:
        async with Producer(r) as p:
            await p.send_and_wait(subject, b"x", delay_ms=delay_ms, id=msg_id)
    finally:
        await r.close()


async def _health_plain(address: str) -> grpc.StatusCode:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


async def test_a_plaintext_client_is_refused_on_every_port(secure):
    addresses = secure.meta_addresses + [n.address for n in secure.nodes]
    assert len(addresses) == 4
    for a in addresses:
        assert await _health_plain(a) == grpc.StatusCode.UNAVAILABLE, a
    # etcd too: mutual TLS only (the meta servers reach it with the nodes' certificate)
    from cluster.etcdproc import healthy

    endpoint = secure.etcd_endpoints[0]
    assert healthy(endpoint, tls=secure.etcd.tls) and not healthy(endpoint)
    from metaserver.etcd import EtcdClient

    plain = EtcdClient([endpoint], timeout_s=1)
    try:
        with pytest.raises(E.Unavailable):
            await plain.status()
    finally:
        await plain.close()
    from cluster.security import ClientSecurity, SecuritySettings

    r = MetaResolver(secure.meta_addresses, security=ClientSecurity(SecuritySettings()))
    try:
        with pytest.raises(E.Unavailable, match="the server may require TLS"):  # said, not just "Socket closed"
            await r.load()
    finally:
        await r.close()


async def test_a_tls_client_of_a_plaintext_server_is_told_so(tmp_path, secure):
    with LocalCluster(tmp_path / "open", n_delay=1, n_realtime=0) as plain:
        ch = Channels(secure.client_security())
        try:
            with pytest.raises(grpc.RpcError) as err:
                await ch.admin(plain.delay[0].address).Status(pb.StatusRequest(), timeout=5)
        finally:
            await ch.close()
    from cluster import status

    assert "TLS handshake failed" in str(status.from_rpc_error(err.value)), err.value.details()


async def test_no_token_or_a_wrong_one_is_unauthenticated(secure, tmp_path):
    wrong = tmp_path / "wrong.token"
    wrong.write_text(certs.new_token())
    for sec in (secure.client_security(wrong), _no_token(secure)):
        r = MetaResolver(secure.meta_addresses, security=sec)
        try:
            with pytest.raises(E.Unauthenticated):
                await r.load()
        finally:
            await r.close()
        ch = Channels(sec)
        try:
            with pytest.raises(grpc.RpcError) as err:
                await ch.admin(secure.delay[0].address).Status(pb.StatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await ch.close()


def _no_token(c: LocalCluster):
    from cluster.security import ClientSecurity, SecuritySettings

    return ClientSecurity(SecuritySettings(tls_ca_file=c.security.ca, tls_cert_file=c.security.client_cert,
                                           tls_key_file=c.security.client_key))


async def test_a_produce_token_produces_its_subjects_only_and_cannot_consume_or_cancel(secure):
    r = _resolver(secure, "producer")
    async with Producer(r, call_timeout_s=10) as p:
        await p.send_and_wait("orders.created", b"x", delay_ms=100, id="sec-p1")
        with pytest.raises(E.PermissionDenied, match="may not produce subject 'payments.x'"):
            await p.send_and_wait("payments.x", b"x", delay_ms=100, id="sec-p2")
        with pytest.raises(E.PermissionDenied):
            await p.cancel("sec-p1")
    async with Consumer(r, "orders.created", group="billing", call_timeout_s=5) as cons:
        with pytest.raises(E.PermissionDenied, match="may not consume"):
            await cons.pull(wait_ms=100)
    await r.close()


async def test_a_consume_token_reads_its_subject_and_group_only(secure):
    await _produce(secure, "orders.paid", "sec-c1", delay_ms=50)
    r = _resolver(secure, "orders-reader")
    async with Consumer(r, "orders.paid", group="billing") as cons:
        assert "sec-c1" in await receive_ids(cons, {"sec-c1"})
    for subject, group in (("payments.x", "billing"), ("orders.paid", "other-group")):
        async with Consumer(r, subject, group=group, call_timeout_s=5) as cons:
            with pytest.raises(E.PermissionDenied):
                await cons.pull(wait_ms=100)
    await r.close()


async def test_a_cancel_token_cancels_its_subjects(secure):
    await _produce(secure, "orders.late", "sec-x1", delay_ms=600_000)
    r = _resolver(secure, "canceller")
    async with Producer(r) as p:
        assert (await p.lookup("sec-x1")).status == "pending"
        await p.cancel("sec-x1")
        assert (await p.lookup("sec-x1")).status == "cancelled"
    await r.close()


async def test_a_trace_needs_a_cancel_or_consume_grant_on_the_subject(secure):
    await _produce(secure, "orders.traced", "sec-t1", delay_ms=50)
    r = _resolver(secure, "orders-reader")
    async with Consumer(r, "orders.traced", group="billing") as cons:
        assert "sec-t1" in await receive_ids(cons, {"sec-t1"})
    await r.close()
    r = _resolver(secure, "canceller")  # a cancel grant: the delay Lookup and Consumer/Trace both answer
    async with Producer(r) as p:
        t = await p.trace("sec-t1")
    await r.close()
    assert t.realtime_error == "" and {g.group: g.state for g in t.realtime.groups} == {"billing": "acked"}
    r = _resolver(secure, "producer")
    async with Producer(r, call_timeout_s=10) as p:
        with pytest.raises(E.PermissionDenied):
            await p.trace("sec-t1")  # the delay Lookup refuses first
        with pytest.raises(grpc.RpcError) as ei:  # and the real-time node on its own
            await p.channels.consumer(t.lookup.realtime_address).Trace(
                pb.TraceRequest(subject="orders.traced", id="sec-t1"), timeout=10)
        assert isinstance(status.from_rpc_error(ei.value), E.PermissionDenied)
    await r.close()


async def test_without_a_node_certificate_no_replicate_no_dispatch_no_depose(secure):
    master_name = await secure.wait_master("delay")
    master = next(n for n in secure.delay if n.name == master_name)
    before = (await secure.statuses("delay"))[master_name]
    ch = Channels(secure.client_security())  # the admin token, a client certificate: still not a node
    try:
        call = rpc.ReplicationStub(ch.get(master.address)).Replicate()
        try:  # the server may end the stream before the request is even written
            await call.write(pb.FetchRequest(node_id="intruder", epoch=2 ** 63, log="messages", offset=0))
        except grpc.RpcError:
            pass
        assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.PERMISSION_DENIED
        assert "needs a node certificate" in await call.details()
        with pytest.raises(grpc.RpcError) as err:
            await rpc.ReplicationStub(ch.get(master.address)).ReadLog(pb.ReadLogRequest(log="messages"), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # a dispatch (a sender's epoch) into the real-time node
        req = make_request(Batch.build("orders.d", [b"p"], ["sec-d1"], [int(time.time() * 1000)]), immediate=True,
                           epoch=7)
        with pytest.raises(grpc.RpcError) as err:
            await ch.producer(secure.realtime[0].address).SendBatch(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            await mrpc.MetaStub(ch.get(secure.meta_addresses[0])).Register(
                mpb.RegisterRequest(node=mpb.NodeInfo(node_id="evil", role="delay", group="delay-g1",
                                                      address="127.0.0.1:1")), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await ch.close()
    await asyncio.sleep(0.5)
    after = (await secure.statuses("delay"))[master_name]
    assert after["master"] and after["epoch"] == before["epoch"]


async def test_handover_needs_admin(secure):
    master_name = await secure.wait_master("delay")
    master = next(n for n in secure.delay if n.name == master_name)
    ch = Channels(secure.client_security(secure.tokens["producer"][1]))
    try:
        with pytest.raises(grpc.RpcError) as err:
            await rpc.ReplicationStub(ch.get(master.address)).Handover(pb.HandoverRequest(wait_ms=100), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs admin" in err.value.details()
    finally:
        await ch.close()
    assert (await secure.wait_master("delay")) == master_name


async def test_a_client_certificate_listed_in_the_auth_file_needs_no_token(secure):
    from cluster.security import ClientSecurity, SecuritySettings

    d = secure.security.dir
    sec = ClientSecurity(SecuritySettings(tls_ca_file=d / "ca.crt", tls_cert_file=d / "client-orders.crt",
                                          tls_key_file=d / "client-orders.key"))
    r = MetaResolver(secure.meta_addresses, security=sec)
    async with Producer(r, call_timeout_s=10) as p:
        await p.send_and_wait("orders.bycert", b"x", delay_ms=100, id="sec-cert-1")
        with pytest.raises(E.PermissionDenied, match="'orders-by-cert' may not produce subject 'payments.x'"):
            await p.send_and_wait("payments.x", b"x", delay_ms=100, id="sec-cert-2")
    await r.close()


def _refusals(c: LocalCluster) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=5).read().decode()
    return {line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("hourglass_auth_refusals_total{")}


async def test_refusals_are_counted_in_the_metrics(secure):
    """delay-1 serves /metrics (master or slave: the interceptor refuses before any role logic)."""
    before = _refusals(secure)
    ch = Channels(secure.client_security())
    try:
        with pytest.raises(grpc.RpcError):
            await rpc.ReplicationStub(ch.get(secure.delay[0].address)).ReadLog(pb.ReadLogRequest(log="messages"),
                                                                              timeout=5)
    finally:
        await ch.close()
    after = _refusals(secure)
    key = 'action="node",reason="permission"'
    assert after.get(key, 0) == before.get(key, 0) + 1, (before, after)
    # an earlier test of this module sent this node a wrong token
    assert after.get('action="-",reason="bad_token"', 0) >= 1, after


def test_no_token_appears_in_any_log(secure):
    secrets_ = [t for t, _ in secure.tokens.values()] + [secure.security.admin_token_file.read_text().strip()]
    logs = list(secure.root.glob("*.log"))
    assert logs
    for log in logs:
        text = log.read_text(errors="replace")
        for s in secrets_:
            assert s not in text, log


async def test_certificates_rotated_on_disk_are_used_without_a_restart(tmp_path):
    """A new CA and new certificates written over the files: new connections use them (the old
    CA is refused from then on), the processes keep running, messages still flow."""
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=1, meta=True, secure=True,
                     env={"HOURGLASS_RELOAD_CHECK_MS": "200"})
    with c:
        c.wait_registered()
        pids = {n.name: n.proc.pid for n in c.meta + c.nodes}
        old = c.security.dir / "old"
        old.mkdir()
        (old / "ca.crt").write_bytes(c.security.ca.read_bytes())
        # the new material, written in place (as Kubernetes updates a mounted secret)
        certs.make_ca(c.security.dir)
        certs.issue(c.security.dir, c.security.dir, "dev", kind="node", stem="node")
        certs.issue(c.security.dir, c.security.dir, "dev", kind="client", hosts=(), stem="client")
        stale = c.client_security(tls_ca_file=old / "ca.crt")  # a client that still trusts the old CA
        servers = [("meta", a) for a in c.meta_addresses] + [("node", n.address) for n in c.nodes]
        deadline = time.monotonic() + 60  # bounded: each server picks the files up within reload_check_ms

        async def settle(security, handshake_ok: bool) -> None:
            """Every server, not one: each reloads on its own loop (a busy machine runs them apart)."""
            for kind, address in servers:
                while True:  # the files were written one by one; a server reads them until all are new
                    code = await _status_code(Channels(security), address, meta=kind == "meta")
                    if (code != grpc.StatusCode.UNAVAILABLE) == handshake_ok or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                assert (code != grpc.StatusCode.UNAVAILABLE) == handshake_ok, (kind, address, code)
                if kind == "node" and handshake_ok:
                    assert code == grpc.StatusCode.OK, (address, code)

        await settle(stale, False)  # every server now trusts only the new CA
        await settle(c.client_security(), True)  # and shows the new certificate
        r = MetaResolver(c.meta_addresses, security=c.client_security())
        try:
            assert "rot-1" in await round_trip(r, "rot.x", "rot-1")
        finally:
            await r.close()
        assert {n.name: n.proc.pid for n in c.meta + c.nodes} == pids and all(n.running for n in c.nodes)


async def _status_code(ch: Channels, address: str, *, meta: bool = False) -> grpc.StatusCode:
    """The code of one Status call (a node) or Route call (a meta server) on a new connection."""
    try:
        if meta:
            await mrpc.MetaStub(ch.get(address)).Route(mpb.RouteRequest(kind=mpb.CONSUMER, subject="rot.x"),
                                                       timeout=3)
        else:
            await ch.admin(address).Status(pb.StatusRequest(), timeout=3)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        await ch.close()


async def test_the_probe_port_answers_health_in_plaintext_and_nothing_else(tmp_path):
    """Kubernetes `grpc:` probes cannot speak TLS: HOURGLASS_HEALTH_PORT serves grpc.health.v1
    alone, in plaintext, beside the mutual-TLS port."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cluster.ports import free_port

    probe = free_port()
    with LocalCluster(tmp_path / "c", n_delay=1, n_realtime=0, secure=True,
                      env={"HOURGLASS_HEALTH_PORT": str(probe)}) as c:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{probe}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                await rpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await _health_plain(c.delay[0].address) == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ issue 27: authorization first


async def _subject_keys(c: LocalCluster) -> set[bytes]:
    """Every key under etcd's ``/hourglass/subjects/`` (read with the meta servers' credentials)."""
    from cluster.security import TlsFiles
    from metaserver.etcd import EtcdClient

    env = c.meta[0].env
    tls = TlsFiles(env["HOURGLASS_META_ETCD_CA_FILE"], env["HOURGLASS_META_ETCD_CERT_FILE"],
                   env["HOURGLASS_META_ETCD_KEY_FILE"], check_every_s=0)
    etcd = EtcdClient(c.etcd_endpoints, timeout_s=5, tls=tls)
    try:
        return {kv.key for kv in await etcd.call(lambda cl: cl.get_prefix(b"/hourglass/subjects/"))}
    finally:
        await etcd.close()


async def _meta_code(c: LocalCluster, token: str | None, method: str, request) -> grpc.StatusCode:
    ch = Channels(c.client_security(c.tokens[token][1] if token else None))
    try:
        await getattr(mrpc.MetaStub(ch.get(c.meta_addresses[0])), method)(request, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        await ch.close()


async def test_route_needs_a_grant_on_its_subject_and_a_valid_subject_and_writes_nothing_else(secure):
    before = await _subject_keys(secure)
    route = lambda kind, subject: mpb.RouteRequest(kind=kind, subject=subject)  # noqa: E731
    refused = [
        ("producer", route(mpb.IMMEDIATE_PRODUCER, "payments.x"), grpc.StatusCode.PERMISSION_DENIED),
        ("producer", route(mpb.CONSUMER, "payments.y"), grpc.StatusCode.PERMISSION_DENIED),
        ("orders-reader", route(mpb.CONSUMER, "payments.z"), grpc.StatusCode.PERMISSION_DENIED),
        ("canceller", route(mpb.CONSUMER, "orders.c"), grpc.StatusCode.PERMISSION_DENIED),  # cancel: no route
        ("producer", route(mpb.IMMEDIATE_PRODUCER, "orders.a\n"), grpc.StatusCode.INVALID_ARGUMENT),
        ("producer", route(mpb.IMMEDIATE_PRODUCER, "not a subject/\n../x"), grpc.StatusCode.INVALID_ARGUMENT),
        (None, route(mpb.IMMEDIATE_PRODUCER, "orders.a\n"), grpc.StatusCode.INVALID_ARGUMENT),  # admin too
        (None, route(mpb.IMMEDIATE_PRODUCER, "orders." + "x" * 200), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for token, req, want in refused:
        assert await _meta_code(secure, token, "Route", req) == want, (token, req)
    assert await _subject_keys(secure) == before  # nothing written
    # the other Meta RPCs: Leader and Health are for operators (and nodes); GetServers for any caller
    assert await _meta_code(secure, "producer", "Leader",
                            mpb.LeaderRequest(role="delay", group="delay-g1")) == grpc.StatusCode.PERMISSION_DENIED
    assert await _meta_code(secure, "producer", "Health", mpb.HealthRequest()) == grpc.StatusCode.PERMISSION_DENIED
    assert await _meta_code(secure, None, "Leader", mpb.LeaderRequest(role="delay", group="delay-g1")) == \
        grpc.StatusCode.OK
    assert await _meta_code(secure, "producer", "GetServers",
                            mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER)) == grpc.StatusCode.OK
    # and a route inside the grants is made (this test sees writes)
    assert await _meta_code(secure, "orders-reader", "Route",
                            route(mpb.CONSUMER, "orders.routed")) == grpc.StatusCode.OK
    assert await _subject_keys(secure) == before | {b"/hourglass/subjects/orders.routed"}
    # a route change is an admin write: a tenant with grants on the subject may not widen it
    groups = [g.name for g in (await _route_groups(secure, "orders.routed"))]
    widen = mpb.SetRouteRequest(subject="orders.routed", groups=groups + ["realtime-x"])
    for token in ("producer", "orders-reader", "canceller"):
        assert await _meta_code(secure, token, "SetRoute", widen) == grpc.StatusCode.PERMISSION_DENIED, token
    assert [g.name for g in (await _route_groups(secure, "orders.routed"))] == groups
    same = mpb.SetRouteRequest(subject="orders.routed", groups=groups)  # the admin token: a no-op answers OK
    assert await _meta_code(secure, None, "SetRoute", same) == grpc.StatusCode.OK
    # draining a delay group moves every tenant's messages: admin only (the admin token's own
    # attempt is refused as the last delay group: INVALID_ARGUMENT, nothing written)
    drain = mpb.DrainRequest(group="delay-g1")
    for token in ("producer", "orders-reader", "canceller"):
        assert await _meta_code(secure, token, "Drain", drain) == grpc.StatusCode.PERMISSION_DENIED, token
    assert await _meta_code(secure, None, "Drain", drain) == grpc.StatusCode.INVALID_ARGUMENT
    # releasing a consumer group from a drain gives up its messages: admin only (the admin token's
    # own attempt finds no drain of the subject: NOT_FOUND, nothing written)
    release = mpb.ReleaseRequest(subject="orders.routed", consumer_group="audit")
    for token in ("producer", "orders-reader", "canceller"):
        assert await _meta_code(secure, token, "ReleaseConsumerGroup", release) == \
            grpc.StatusCode.PERMISSION_DENIED, token
    assert await _meta_code(secure, None, "ReleaseConsumerGroup", release) == grpc.StatusCode.NOT_FOUND


async def _route_groups(c: LocalCluster, subject: str):
    ch = Channels(c.client_security())
    try:
        resp = await mrpc.MetaStub(ch.get(c.meta_addresses[0])).Route(
            mpb.RouteRequest(kind=mpb.CONSUMER, subject=subject), timeout=10)
        return list(resp.groups)
    finally:
        await ch.close()


async def test_a_subject_with_a_trailing_newline_is_invalid_from_a_send_and_a_consume(secure):
    master_name = await secure.wait_master("delay")
    master = next(n for n in secure.delay if n.name == master_name)
    now = int(time.time() * 1000)
    r = _resolver(secure, "producer")
    try:
        async with Producer(r, call_timeout_s=10) as p:
            with pytest.raises(E.InvalidArgument, match="does not match"):  # the SDK's own check
                await p.send_and_wait("orders.a\n", b"x", delay_ms=100, id="sec-nl-1")
    finally:
        await r.close()
    ch = Channels(secure.client_security(secure.tokens["producer"][1]))
    try:  # the nodes' check (a client without the SDK's)
        for address, immediate in ((master.address, False), (secure.realtime[0].address, True)):
            batch = Batch.build(["orders.a\n", "orders.ok"], [b"x", b"y"], ["sec-nl-2", "sec-nl-3"], [now, now])
            resp = await ch.producer(address).SendBatch(make_request(batch, immediate=immediate), timeout=10)
            res = BatchResult.from_pb(resp, 2)
            assert res.codes.tolist() == [pb.INVALID_ARGUMENT, pb.OK], (address, res.errors)
            assert "does not match" in res.errors[0]
    finally:
        await ch.close()
    ch = Channels(secure.client_security(secure.tokens["orders-reader"][1]))
    try:
        rt = ch.consumer(secure.realtime[0].address)
        calls = [rt.Pull(pb.PullRequest(subject="orders.a\n", group="billing", wait_ms=0), timeout=10),
                 rt.Pull(pb.PullRequest(subject="orders.ok", group="billing\n", wait_ms=0), timeout=10),
                 rt.Ack(pb.AckRequest(group="billing", acks=[pb.SubjectHandles(subject="orders.a\n")]), timeout=10),
                 rt.Nack(pb.NackRequest(group="billing", nacks=[pb.SubjectHandles(subject="orders.a\n")]), timeout=10)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    finally:
        await ch.close()
    statuses = await secure.statuses("realtime")
    assert not [s for st in statuses.values() for s in st["subjects"] if "\n" in s]  # no such subject made


async def test_an_empty_ack_or_nack_needs_a_consume_grant(secure):
    async def code(token: str, call) -> grpc.StatusCode:
        ch = Channels(secure.client_security(secure.tokens[token][1]))
        try:
            await call(ch.consumer(secure.realtime[0].address))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()
        finally:
            await ch.close()

    def ack(group):
        return lambda stub: stub.Ack(pb.AckRequest(group=group), timeout=10)

    def nack(group):
        return lambda stub: stub.Nack(pb.NackRequest(group=group), timeout=10)

    assert await code("producer", ack("billing")) == grpc.StatusCode.PERMISSION_DENIED
    assert await code("producer", nack("billing")) == grpc.StatusCode.PERMISSION_DENIED
    assert await code("orders-reader", ack("shipping")) == grpc.StatusCode.PERMISSION_DENIED  # not its group
    assert await code("orders-reader", ack("billing")) == grpc.StatusCode.OK  # its own group: nothing to ack


async def test_a_claimed_epoch_from_a_client_is_permission_denied_before_any_master_check(secure):
    """The check order: who may (a client may not claim a term) before who is master. A slave
    used to answer "not the master" to a client's epoch, telling it where the master is."""
    master_name = await secure.wait_master("delay")
    slave = next(n for n in secure.delay if n.name != master_name and n.name.startswith("delay-"))
    master = next(n for n in secure.delay if n.name == master_name)
    groups = {n.name: (await secure.statuses("delay"))[n.name].get("group") for n in (slave, master)}
    assert groups[slave.name] == groups[master.name]  # a master and its slave
    before = (await secure.statuses("delay"))[master_name]
    now = int(time.time() * 1000)
    batch = Batch.build("orders.e", [b"x"], ["sec-ep-1"], [now + 60_000])
    ch = Channels(secure.client_security(secure.tokens["producer"][1]))
    try:
        for address, epoch in ((slave.address, 7), (master.address, 2 ** 63), (secure.realtime[0].address, 7)):
            with pytest.raises(grpc.RpcError) as err:
                await ch.producer(address).SendBatch(make_request(batch, epoch=epoch), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (address, err.value.details())
            assert "may not node" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # the same send without an epoch: the slave says so
            await ch.producer(slave.address).SendBatch(make_request(batch), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not the master" in err.value.details()
    finally:
        await ch.close()
    after = (await secure.statuses("delay"))[master_name]
    assert after["master"] and after["epoch"] == before["epoch"]


def _metric(port: int, prefix: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


async def test_a_peer_with_too_many_failed_authentications_is_refused_unread(tmp_path):
    """A real secure node with auth_failures_max=5: five wrong tokens from 127.0.0.1, then even
    the right token is refused (throttled) while the nodes' own certificate is still served.
    The window is long (10 min): the test asserts the refusal, not a time."""
    metrics = free_port()
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=0, secure=True,
                     env={"HOURGLASS_AUTH_FAILURES_MAX": "5", "HOURGLASS_AUTH_FAILURES_WINDOW_MS": "600000",
                          "HOURGLASS_METRICS_PORT": str(metrics)})
    with c:
        wrong = tmp_path / "wrong.token"
        wrong.write_text(certs.new_token())
        address = c.delay[0].address
        assert await _status_code(Channels(c.client_security()), address) == grpc.StatusCode.OK
        for _ in range(5):
            assert await _status_details(c.client_security(wrong), address) == \
                (grpc.StatusCode.UNAUTHENTICATED, "unauthenticated: unknown token")
        code, details = await _status_details(c.client_security(), address)  # the admin token
        assert code == grpc.StatusCode.UNAUTHENTICATED and "too many failed authentications from 127.0.0.1" in details
        assert "try again in" in details
        code, details = await _status_details(c.client_security(wrong), address)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "too many" in details  # refused unread, not "unknown"
        assert await _status_code(Channels(c.node_security()), address) == grpc.StatusCode.OK  # a node: exempt
        refusals = _metric(metrics, "hourglass_auth_refusals_total{")
        assert refusals['hourglass_auth_refusals_total{action="-",reason="bad_token"}'] == 5
        assert refusals['hourglass_auth_refusals_total{action="-",reason="throttled"}'] == 2
        assert _metric(metrics, "hourglass_auth_throttled_peers_total") == {"hourglass_auth_throttled_peers_total": 1}
    from cluster.cli.common import explain

    assert len(explain(E.Unauthenticated(details))[1]) <= 2  # the CLI says it in a line or two


async def _status_details(sec, address: str) -> tuple[grpc.StatusCode, str]:
    ch = Channels(sec)
    try:
        await ch.admin(address).Status(pb.StatusRequest(), timeout=5)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()
    finally:
        await ch.close()


async def test_a_refused_stream_says_why_every_time(secure):
    """The interceptor refuses a PullStream of a token without consume before the servicer
    runs. Refused before the client's first write went out, the client read INTERNAL "Internal
    error from Core" (grpc makes the failed send the call's status) about one time in ten: the
    refusal now waits for that first request. Fresh streams, each refused."""
    r = _resolver(secure, "producer")
    try:
        for i in range(20):
            async with Consumer(r, "orders.created", group="billing", call_timeout_s=10) as cons:
                with pytest.raises(E.PermissionDenied, match="may not consume"):
                    await cons.pull(wait_ms=0)
    finally:
        await r.close()
