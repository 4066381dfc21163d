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
from cluster.wire import make_request
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
        deadline = time.monotonic() + 20
        while True:  # bounded: the servers pick the files up within reload_check_ms
            code = await _status_code(Channels(stale), c.delay[0].address)
            if code == grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert code == grpc.StatusCode.UNAVAILABLE  # the server now trusts only the new CA
        while True:  # bounded: the files were written one by one; the server reads them until all are new
            code = await _status_code(Channels(c.client_security()), c.delay[0].address)
            if code == grpc.StatusCode.OK or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert code == grpc.StatusCode.OK
        r = MetaResolver(c.meta_addresses, security=c.client_security())
        try:
            assert "rot-1" in await round_trip(r, "rot.x", "rot-1")
        finally:
            await r.close()
        assert {n.name: n.proc.pid for n in c.meta + c.nodes} == pids and all(n.running for n in c.nodes)


async def _status_code(ch: Channels, address: str) -> grpc.StatusCode:
    try:
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
