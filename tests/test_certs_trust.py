"""The trusts of issue 27 without sockets: three CAs in ``dev_security``, the kinds of certificate
``certs.issue`` makes, and a server's verdict on a ``node:`` certificate of the client CA
(``Authenticator.identify`` on a stand-in gRPC context)."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cluster import certs
from cluster.errors import Unauthenticated
from cluster.security import AuthTable, Authenticator, TlsFiles


def _load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _issued_by(cert_path, ca_path) -> bool:
    try:
        _load(cert_path).verify_directly_issued_by(_load(ca_path))
        return True
    except Exception:
        return False


def test_dev_security_keeps_three_trusts_apart(tmp_path):
    s = certs.dev_security(tmp_path)
    assert len({_load(p).subject for p in (s.ca, s.client_ca, s.etcd_ca)}) == 3
    signed = {"node": s.node_cert, "client": s.client_cert, "member": s.etcd_member_cert, "meta": s.etcd_client_cert}
    by = {name: {ca for ca, path in (("node", s.ca), ("client", s.client_ca), ("etcd", s.etcd_ca))
                 if _issued_by(cert, path)} for name, cert in signed.items()}
    assert by == {"node": {"node"}, "client": {"client"}, "member": {"etcd"}, "meta": {"etcd"}}
    assert s.meta_etcd_env()["HOURGLASS_META_ETCD_CA_FILE"] == str(s.etcd_ca)
    assert s.node_env()["HOURGLASS_TLS_CLIENT_CA_FILE"] == str(s.client_ca)


@pytest.mark.parametrize("kind,server", [("node", True), ("client", False), ("etcd-member", True),
                                         ("etcd-client", False)])
def test_each_kind_names_its_role_and_its_uses(tmp_path, kind, server):
    certs.make_ca(tmp_path)
    crt, _ = certs.issue(tmp_path, tmp_path, "a", kind=kind)
    c = _load(crt)
    assert c.subject.rfc4514_string() == f"CN={kind}:a"
    usages = set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.CLIENT_AUTH} | ({ExtendedKeyUsageOID.SERVER_AUTH} if server else set())
    with pytest.raises(ValueError, match="kind must be one of"):
        certs.issue(tmp_path, tmp_path, "a", kind="admin")


class _Context:
    """What ``Authenticator.identify`` reads of a gRPC call: the peer's certificate and metadata."""

    def __init__(self, cert_path, token: str | None = None) -> None:
        pem = cert_path.read_bytes()
        self._auth = {"x509_common_name": [_load(cert_path).subject.rfc4514_string()[3:].encode()],
                      "x509_pem_cert": [pem]}
        self._metadata = [("authorization", f"Bearer {token}")] if token else []

    def auth_context(self):
        return self._auth

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return "ipv4:127.0.0.1:40000"


def test_a_node_name_from_the_client_ca_is_a_client(tmp_path):
    s = certs.dev_security(tmp_path)
    token = s.admin_token_file.read_text().strip()
    files = TlsFiles(s.ca, s.node_cert, s.node_key, check_every_s=0, client_ca=s.client_ca)
    auth = Authenticator(AuthTable(s.auth_file), files=files)
    evil, _ = certs.issue(s.client_ca.parent, tmp_path, "evil", kind="node", hosts=(), stem="evil")
    twin, _ = certs.issue(s.dir, tmp_path, "evil", kind="node", hosts=(), stem="twin")
    assert auth.identify(_Context(twin)).node  # the node CA's
    assert auth.identify(_Context(s.node_cert)).node
    with pytest.raises(Unauthenticated, match="no bearer token"):  # a client: a token is needed
        auth.identify(_Context(evil))
    p = auth.identify(_Context(evil, token))
    assert not p.node and p.name == "admin"
    # the verdict is the signature's, not the issuer's name: a CA named like the client CA signs nothing for it
    other = tmp_path / "other"
    certs.make_ca(other, name=certs.CLIENT_CA_NAME)
    forged, _ = certs.issue(other, tmp_path, "x", kind="node", hosts=(), stem="forged")
    assert _load(forged).issuer == _load(evil).issuer
    assert not files.signed_by_client_ca(forged.read_bytes()) and files.signed_by_client_ca(evil.read_bytes())
    # without a client CA (one CA for everyone, as before) the common name decides
    assert Authenticator(AuthTable(s.auth_file), files=TlsFiles(s.ca, s.node_cert, s.node_key)).identify(_Context(evil)).node
