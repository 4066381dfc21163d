"""Certificates and tokens for a cluster: CAs, the certificates they sign, random tokens and
the auth file that holds their digests (docs/security.md).

Three trusts, kept apart (issue 27):

| CA | signs | trusted by |
|---|---|---|
| node CA (``ca.crt``) | node certificates (``node:<name>``, server and client) | nodes, meta servers, clients (to check servers) |
| client CA | client certificates (``client:<name>``) | nodes and meta servers (``HOURGLASS_TLS_CLIENT_CA_FILE``): a certificate it signed is a client whatever its name |
| etcd CA | etcd's member certificates (``etcd-member:<name>``) and the meta servers' etcd-client certificate (``etcd-client:<name>``) | etcd only: no client or node certificate opens etcd |

``hourglass certs ...`` and ``hourglass dev up --secure`` use this; a production cluster may
bring its own CAs (cert-manager, an internal PKI) as long as node certificates carry the
common name ``node:<name>`` and client certificates ``client:<name>``.

Every key, token and the auth file is written with ``cluster.files.write_secret`` (owner-only
from its first instant, on a fresh random temporary name: a file another user planted is never
reused); certificates with ``write_public``. New secret files must use it too.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cluster.files import DATA_DIR_MODE, write_public, write_secret
from cluster.security import CLIENT_PREFIX, NODE_PREFIX, AuthFile, Grant, TokenEntry, token_digest

DEFAULT_DAYS = 365
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
TOKEN_BYTES = 32
ETCD_MEMBER_PREFIX = "etcd-member:"   # etcd's serving and peer certificate
ETCD_CLIENT_PREFIX = "etcd-client:"   # the meta servers' certificate for etcd
# kind -> (common-name prefix, server auth too): what ``issue`` may make
KINDS = {"node": (NODE_PREFIX, True), "client": (CLIENT_PREFIX, False),
         "etcd-member": (ETCD_MEMBER_PREFIX, True), "etcd-client": (ETCD_CLIENT_PREFIX, False)}
# names of the CAs ``dev up --secure`` makes: distinct, so a certificate's issuer says which one signed it
NODE_CA_NAME, CLIENT_CA_NAME, ETCD_CA_NAME = "hourglass-node-ca", "hourglass-client-ca", "hourglass-etcd-ca"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(directory: Path, *, name: str = "hourglass-ca", days: int = DEFAULT_DAYS * 5) -> tuple[Path, Path]:
    """A self-signed CA: ``ca.crt`` and ``ca.key`` in ``directory``."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    crt, kp = directory / "ca.crt", directory / "ca.key"
    write_secret(kp, _pem_key(key))
    write_public(crt, cert.public_bytes(serialization.Encoding.PEM))
    return crt, kp


def issue(ca_dir: Path, out_dir: Path, name: str, *, kind: str, hosts=DEFAULT_HOSTS,
          days: int = DEFAULT_DAYS, stem: str | None = None) -> tuple[Path, Path]:
    """A certificate for ``kind`` (``KINDS``: ``node`` -> common name ``node:<name>``,
    ``client``, ``etcd-member``, ``etcd-client``), signed by the CA in ``ca_dir``, valid for
    ``hosts`` (IP addresses and DNS names: node and etcd-member certificates are also server
    certificates). Writes ``<stem>.crt`` and ``<stem>.key``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    prefix, server = KINDS[kind]
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    key = _key()
    cn = prefix + name
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    stem = stem or f"{kind}-{name}"
    crt, kp = out_dir / f"{stem}.crt", out_dir / f"{stem}.key"
    write_secret(kp, _pem_key(key))
    write_public(crt, cert.public_bytes(serialization.Encoding.PEM))
    return crt, kp


def new_token() -> str:
    return "hgt_" + secrets.token_urlsafe(TOKEN_BYTES)


def _put_entry(auth_file: Path, entry: TokenEntry) -> None:
    """Add ``entry`` to ``auth_file`` (created if missing); an entry of the same name is replaced."""
    current = AuthFile.model_validate(json.loads(auth_file.read_text())) if auth_file.exists() else AuthFile()
    entries = [t for t in current.tokens if t.name != entry.name] + [entry]
    write_secret(auth_file, (AuthFile(tokens=entries).model_dump_json(indent=2, exclude_none=True) + "\n").encode())


def add_token(auth_file: Path, name: str, grants: list[Grant], token_path: Path | None = None) -> str:
    """A new token for ``name`` with ``grants``, its digest added to ``auth_file``. The token
    itself is returned and, with ``token_path``, written there (owner-only); it is stored
    nowhere else."""
    token = new_token()
    _put_entry(auth_file, TokenEntry(name=name, sha256=token_digest(token), allow=grants))
    if token_path is not None:
        write_secret(token_path, (token + "\n").encode())
    return token


def grant_certificate(auth_file: Path, name: str, common_name: str, grants: list[Grant]) -> None:
    """Let the client certificate with ``common_name`` (``client:orders``) do ``grants`` without a token."""
    _put_entry(auth_file, TokenEntry(name=name, certificate=common_name, allow=grants))


@dataclass
class DevSecurity:
    """What ``dev up --secure`` and ``LocalCluster(secure=True)`` make in ``<root>/security``:
    ``ca.crt`` (the node CA: what clients check servers with), ``node.*``, ``client.*`` (signed
    by ``client-ca/``), ``auth.json``, ``admin.token``, and ``etcd/`` (etcd's own CA, the
    members' certificate and the meta servers' etcd-client certificate)."""

    dir: Path
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    auth_file: Path
    admin_token_file: Path
    client_ca: Path
    etcd_ca: Path
    etcd_member_cert: Path
    etcd_member_key: Path
    etcd_client_cert: Path
    etcd_client_key: Path

    def node_env(self) -> dict[str, str]:
        return {"HOURGLASS_TLS_CA_FILE": str(self.ca), "HOURGLASS_TLS_CERT_FILE": str(self.node_cert),
                "HOURGLASS_TLS_KEY_FILE": str(self.node_key), "HOURGLASS_TLS_CLIENT_CA_FILE": str(self.client_ca),
                "HOURGLASS_AUTH_FILE": str(self.auth_file)}

    def meta_etcd_env(self) -> dict[str, str]:
        """The meta servers' credentials for etcd: etcd's CA and the etcd-client certificate."""
        return {"HOURGLASS_META_ETCD_CA_FILE": str(self.etcd_ca),
                "HOURGLASS_META_ETCD_CERT_FILE": str(self.etcd_client_cert),
                "HOURGLASS_META_ETCD_KEY_FILE": str(self.etcd_client_key)}

    def client_env(self, token_file: Path | None = None) -> dict[str, str]:
        return {"HOURGLASS_TLS_CA_FILE": str(self.ca), "HOURGLASS_TLS_CERT_FILE": str(self.client_cert),
                "HOURGLASS_TLS_KEY_FILE": str(self.client_key),
                "HOURGLASS_TOKEN_FILE": str(token_file or self.admin_token_file)}

    def cluster_file_entry(self) -> dict[str, str]:
        """The ``security`` entry of cluster.json: the CLI and SDK read their credentials there."""
        return {"tls_ca_file": str(self.ca), "tls_cert_file": str(self.client_cert),
                "tls_key_file": str(self.client_key), "token_file": str(self.admin_token_file)}


def dev_security(root: Path, *, hosts=DEFAULT_HOSTS) -> DevSecurity:
    """Three CAs (node, client, etcd: module docstring), one node certificate shared by the
    local cluster's processes, one client certificate, an ``admin`` token allowed everything
    (``admin.token``), etcd's member certificate and the meta servers' etcd-client one."""
    d = root / "security"
    d.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    make_ca(d, name=NODE_CA_NAME)
    client_ca_dir, etcd_dir = d / "client-ca", d / "etcd"
    make_ca(client_ca_dir, name=CLIENT_CA_NAME)
    make_ca(etcd_dir, name=ETCD_CA_NAME)
    node_cert, node_key = issue(d, d, "dev", kind="node", hosts=hosts, stem="node")
    client_cert, client_key = issue(client_ca_dir, d, "dev", kind="client", hosts=(), stem="client")
    member_cert, member_key = issue(etcd_dir, etcd_dir, "dev", kind="etcd-member", hosts=hosts, stem="member")
    etcd_client_cert, etcd_client_key = issue(etcd_dir, etcd_dir, "meta", kind="etcd-client", hosts=(), stem="meta")
    auth = d / "auth.json"
    admin = d / "admin.token"
    add_token(auth, "admin", [Grant(action=a) for a in ("produce", "consume", "cancel", "admin")], admin)
    return DevSecurity(d, d / "ca.crt", node_cert, node_key, client_cert, client_key, auth, admin,
                       client_ca_dir / "ca.crt", etcd_dir / "ca.crt", member_cert, member_key,
                       etcd_client_cert, etcd_client_key)
