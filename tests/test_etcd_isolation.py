"""Issue 27, "etcd is the meta servers' alone", against a real ``LocalCluster(secure=True)``
(what ``hourglass dev up --secure`` starts): etcd trusts only its own CA, so the client
certificate, the node certificate and any token are refused by etcd itself, while the meta
servers (their etcd-client certificate) keep working. A certificate of the client CA that
calls itself ``node:`` is a client. Every refusal is checked beside a control that passes
with the meta servers' own credentials, so the refusals are etcd's trust, not a broken dial.
"""

from __future__ import annotations

import grpc
import pytest
from aetcd import rpc as etcdrpc
from cryptography import x509

from cluster import certs
from cluster import errors as E
from cluster.devcluster import LocalCluster
from cluster.discovery import MetaResolver
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.security import ClientSecurity, SecuritySettings, TlsFiles
from metaserver.etcd import EtcdClient
from tests.helpers.flow import round_trip

CALL_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("etcd-iso"), n_delay=1, n_realtime=1, meta=True, secure=True)
    with c:
        c.wait_registered()
        yield c


def _read(path) -> bytes:
    return path.read_bytes()


async def _range(endpoint: str, creds: grpc.ChannelCredentials | None, metadata=()) -> list[bytes]:
    """Read the whole /hourglass/ prefix straight from etcd (the KV API, no Hourglass code in between)."""
    ch = grpc.aio.secure_channel(endpoint, creds) if creds is not None else grpc.aio.insecure_channel(endpoint)
    try:
        reply = await etcdrpc.KVStub(ch).Range(etcdrpc.RangeRequest(key=b"/hourglass/", range_end=b"/hourglass0"),
                                               timeout=CALL_TIMEOUT_S, metadata=metadata)
        return [kv.key for kv in reply.kvs]
    finally:
        await ch.close()


def _creds(sec, cert, key) -> grpc.ChannelCredentials:
    """TLS to etcd: its CA as the root (so the client side of the handshake is satisfied), and
    the certificate given (or none)."""
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=_read(sec.etcd_ca))
    return grpc.ssl_channel_credentials(root_certificates=_read(sec.etcd_ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


async def test_only_the_meta_servers_certificate_opens_etcd(secure):
    sec, endpoint = secure.security, secure.etcd_endpoints[0]
    # control: the meta servers' etcd-client certificate reads the keyspace (registrations are there)
    keys = await _range(endpoint, _creds(sec, sec.etcd_client_cert, sec.etcd_client_key))
    assert any(k.startswith(b"/hourglass/nodes/") for k in keys), keys
    token = sec.admin_token_file.read_text().strip()
    attempts = {
        "client certificate": (_creds(sec, sec.client_cert, sec.client_key), ()),
        "client certificate + admin token": (_creds(sec, sec.client_cert, sec.client_key), (("token", token),)),
        "node certificate": (_creds(sec, sec.node_cert, sec.node_key), ()),
        "no certificate + admin token": (_creds(sec, None, None), (("token", token),)),
        "plaintext + admin token": (None, (("token", token),)),
    }
    for what, (creds, metadata) in attempts.items():
        with pytest.raises(grpc.RpcError) as err:
            await _range(endpoint, creds, metadata)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (what, err.value)  # the handshake, not a reply


async def test_a_token_as_an_etcd_password_is_refused(secure):
    sec, endpoint = secure.security, secure.etcd_endpoints[0]
    token = sec.admin_token_file.read_text().strip()
    for creds in (_creds(sec, sec.client_cert, sec.client_key), _creds(sec, None, None)):
        async with grpc.aio.secure_channel(endpoint, creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                await etcdrpc.AuthStub(ch).Authenticate(etcdrpc.AuthenticateRequest(name="root", password=token),
                                                        timeout=CALL_TIMEOUT_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


async def test_the_projects_etcd_client_refuses_foreign_certificates(secure):
    """The same through ``EtcdClient`` (what a meta server would do if handed the wrong files)."""
    sec, endpoints = secure.security, secure.etcd_endpoints
    for cert, key in ((sec.client_cert, sec.client_key), (sec.node_cert, sec.node_key)):
        client = EtcdClient(endpoints, timeout_s=2, tls=TlsFiles(sec.etcd_ca, cert, key, check_every_s=0))
        try:
            with pytest.raises(E.Unavailable):
                await client.status()
        finally:
            await client.close()
    good = EtcdClient(endpoints, timeout_s=2, tls=TlsFiles(sec.etcd_ca, sec.etcd_client_cert, sec.etcd_client_key,
                                                           check_every_s=0))
    try:
        assert (await good.status()).version
    finally:
        await good.close()


async def test_the_meta_servers_keep_working(secure):
    r = MetaResolver(secure.meta_addresses, security=secure.client_security())
    try:
        assert "iso-1" in await round_trip(r, "iso.x", "iso-1")
    finally:
        await r.close()


def test_no_client_or_node_certificate_verifies_against_etcds_ca(secure):
    sec = secure.security
    etcd_ca = x509.load_pem_x509_certificate(_read(sec.etcd_ca))
    for path in (sec.client_cert, sec.node_cert):
        with pytest.raises(Exception):
            x509.load_pem_x509_certificate(_read(path)).verify_directly_issued_by(etcd_ca)
    for path in (sec.etcd_client_cert, sec.etcd_member_cert):  # control
        x509.load_pem_x509_certificate(_read(path)).verify_directly_issued_by(etcd_ca)


async def test_a_client_ca_certificate_named_node_is_a_client(secure, tmp_path):
    """Whoever holds the client CA's key can issue ``node:`` names; the servers still see a client."""
    sec = secure.security
    cert, key = certs.issue(sec.client_ca.parent, tmp_path, "evil", kind="node", hosts=(), stem="evil")
    settings = SecuritySettings(tls_ca_file=sec.ca, tls_cert_file=cert, tls_key_file=key,
                                token_file=sec.admin_token_file)
    ch = ClientSecurity(settings).channel(secure.meta_addresses[0], [])
    try:
        stub = mrpc.MetaStub(ch)
        await stub.GetServers(mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER), timeout=CALL_TIMEOUT_S)  # a client
        with pytest.raises(grpc.RpcError) as err:
            await stub.Register(mpb.RegisterRequest(node=mpb.NodeInfo(role="delay", group="g", node_id="evil",
                                                                      address="127.0.0.1:1")),
                                timeout=CALL_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    finally:
        await ch.close()
    # control: the same name from the node CA is a node (Register passes authorization)
    ncert, nkey = certs.issue(sec.dir, tmp_path, "evil", kind="node", hosts=(), stem="node-evil")
    ch = ClientSecurity(SecuritySettings(tls_ca_file=sec.ca, tls_cert_file=ncert, tls_key_file=nkey)).channel(
        secure.meta_addresses[0], [])
    try:
        reply = await mrpc.MetaStub(ch).Register(mpb.RegisterRequest(node=mpb.NodeInfo(
            role="delay", group="evil-g", node_id="evil", address="127.0.0.1:1"), ttl_ms=2000),
            timeout=CALL_TIMEOUT_S)
        assert reply.lease_id
    finally:
        await ch.close()
