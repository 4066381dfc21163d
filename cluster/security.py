"""Transport security and access control (docs/security.md).

With TLS on, every gRPC port of a node or a meta server speaks **mutual TLS**: the server
shows a certificate signed by the cluster CA and asks every peer for one (grpc-python can
only *require* a client certificate or not ask for one, so one port cannot serve both).
Certificates tell *what* is calling: a certificate whose common name starts with ``node:``
is a node (replication, dispatch, registration, elections); any other one (``client:...``)
is a client, which must also present a **bearer token** (``authorization: Bearer ...``) that
says *who* it is and what it may do: ``produce`` / ``consume`` / ``cancel`` on subject
patterns (consume per group) and ``admin``. Tokens are stored as SHA-256 digests in the
auth file, compared in constant time, and never logged.

Clients may hold certificates of a **client CA** of their own (``HOURGLASS_TLS_CLIENT_CA_FILE``
on the servers, trusted beside the node CA for callers only): a certificate that CA signed is
a client whatever its common name, so whoever issues client certificates cannot make a node.

This module is pure policy plus the grpc glue of both ends:

* ``SecuritySettings``: file paths from ``HOURGLASS_TLS_*`` / ``HOURGLASS_AUTH_FILE`` /
  ``HOURGLASS_TOKEN[_FILE]``, read by every server, the SDK and the CLI;
* ``TlsFiles``: the CA, certificate and key (and a server's client CA), read again when they
  change on disk (checked at most every ``reload_check_ms``): new handshakes use the new files,
  nothing restarts;
* ``AuthTable``: tokens -> ``Principal`` with grants; ``Principal.may(action, subject, group)``;
* ``FailureThrottle`` (``cluster/auththrottle.py``): failed authentications per peer address;
  a peer over ``auth_failures_max`` within ``auth_failures_window_ms`` is refused unread;
* ``Authenticator``: the server interceptor, the first thing every call meets: throttle,
  who is calling, and may they call this method at all (``METHOD_ACTIONS``: a grant of one
  of its actions on some subject). Servicers then check the subjects and group of the
  request with ``check``/``require`` **before anything else** they do (before fencing,
  "not the master", or any answer that depends on stored state).

Subjects and group names in grants are matched only when they follow the one subject rule
(``codec.subject_problem``): ``fnmatch``'s ``*`` matches anything, newlines and '/'
included, so a grant for ``orders.*`` must never cover ``orders.a\n``.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import fnmatch
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from prometheus_client import Counter
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster import errors as E
from cluster import status
from cluster.auththrottle import (AUTH_FAILURES_MAX, AUTH_FAILURES_WINDOW_MS, AUTH_THROTTLE_PEERS_MAX, FailureThrottle,
                                  peer_key)
from cluster.codec import SUBJECT_WIRE_BYTES_MAX, subject_problem
from cluster.errors import InvalidArgument
from cluster.wire import grantable_subjects, request_batch

log = logging.getLogger("hourglass.security")

NODE_PREFIX = "node:"       # common name of a node certificate: "node:<name>"
CLIENT_PREFIX = "client:"   # common name of a client certificate: "client:<name>"
TOKEN_BYTES_MAX = 4096      # a longer authorization header is refused unread
REFUSED_STREAM_WAIT_S = 2.0  # a refused request stream waits this long at most for its first message (_checked)
DECISIONS_MAX = 4096        # cached (principal, action, subject, group) answers per principal


class Action(str, enum.Enum):
    PRODUCE = "produce"     # SendBatch / SendBatchStream of these subjects
    CONSUME = "consume"     # Pull / PullStream / Ack / Nack / Browse of these subjects, in these groups
    CANCEL = "cancel"       # Cancel / Lookup (and Consumer/Trace) of messages of these subjects
    ADMIN = "admin"         # Status details, Verify, Handover
    DISCOVER = "discover"   # GetServers, grpc.health.v1: every authenticated caller
    NODE = "node"           # Replicate, ReadLog, Register, Heartbeat, Campaign ...: node certificates only


class SecuritySettings(BaseSettings):
    """Where the credentials are. Servers: ``tls_*`` and ``auth_file``; clients: ``tls_*``
    (a client certificate) and ``token`` or ``token_file``. No TLS files: plaintext, no checks
    (the local dev cluster only; it says so when it starts)."""

    model_config = SettingsConfigDict(env_prefix="HOURGLASS_", extra="ignore")

    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_server_name: str | None = Field(default=None, description="name to check in server certificates "
                                                                  "(default: the host dialled)")
    tls_client_ca_file: Path | None = Field(default=None,
                                            description="servers: a CA whose certificates are accepted from callers "
                                                        "as clients only (never as nodes, whatever their name)")
    auth_file: Path | None = Field(default=None, description="servers: tokens (SHA-256) and their grants")
    token: SecretStr | None = None
    token_file: Path | None = None
    reload_check_ms: int = Field(default=1000, ge=10, le=600_000)
    auth_failures_max: int = Field(default=AUTH_FAILURES_MAX, ge=1, le=1_000_000,
                                   description="servers: failed authentications a peer may make within "
                                               "auth_failures_window_ms before it is refused unread")
    auth_failures_window_ms: int = Field(default=AUTH_FAILURES_WINDOW_MS, ge=1, le=86_400_000)
    auth_throttle_peers_max: int = Field(default=AUTH_THROTTLE_PEERS_MAX, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _all_or_none(self) -> "SecuritySettings":
        all_or_none(self, "HOURGLASS_", ("tls_ca_file", "tls_cert_file", "tls_key_file"),
                    "TLS needs all of {} (the cluster's CA, this process's certificate and key)")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_ca_file is not None

    def read_token(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is not None:
            try:
                return self.token_file.read_text().strip()
            except OSError as e:
                raise InvalidArgument("token_file", f"cannot read {self.token_file}: {e.strerror or e}") from None
        return None

    def files(self) -> "TlsFiles":
        return TlsFiles(self.tls_ca_file, self.tls_cert_file, self.tls_key_file,
                        check_every_s=self.reload_check_ms / 1000, client_ca=self.tls_client_ca_file)


def all_or_none(settings, prefix: str, fields: tuple[str, ...], message: str) -> None:
    """A set of TLS files is given whole or not at all: ``ValueError`` naming the variables."""
    given = [getattr(settings, f) is not None for f in fields]
    if any(given) and not all(given):
        raise ValueError(message.format(", ".join(f"{prefix}{f.upper()}" for f in fields)))


def load_settings(**overrides) -> SecuritySettings:
    """``SecuritySettings`` from the environment; bad settings are one ``InvalidArgument``."""
    try:
        return SecuritySettings(**overrides)
    except ValidationError as e:
        raise InvalidArgument("security", "; ".join(x["msg"] for x in e.errors())) from None


SECURITY_DEFAULTS = SecuritySettings.model_construct()  # the defaults alone: no environment, no validation
_RELOAD_CHECK_S = SECURITY_DEFAULTS.reload_check_ms / 1000


# ---------------------------------------------------------------------- TLS material


class TlsFiles:
    """The CA, certificate and key files of one process (and, for a server, the client CA),
    read again when one of them changes (mtime or size), at most every ``check_every_s``."""

    def __init__(self, ca: Path, cert: Path, key: Path, *, check_every_s: float = _RELOAD_CHECK_S,
                 client_ca: Path | None = None) -> None:
        self.paths = (Path(ca), Path(cert), Path(key)) + ((Path(client_ca),) if client_ca is not None else ())
        self.check_every_s = check_every_s
        self._stamp: tuple | None = None
        self._checked = 0.0
        self.generation = 0
        self.ca = self.cert = self.key = self.client_ca = b""
        self.client_cas: list[x509.Certificate] = []
        self.refresh(force=True)

    def _stamps(self) -> tuple:
        out = []
        for p in self.paths:
            st = p.stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def refresh(self, *, force: bool = False) -> bool:
        """Read the files again if they changed; True when they did. A half-written or
        unreadable set keeps the old material (logged) and is tried again later."""
        now = time.monotonic()
        if not force and now - self._checked < self.check_every_s:
            return False
        self._checked = now
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return False
            ca, cert, key, *client_ca = (p.read_bytes() for p in self.paths)
            if not all(b"-----BEGIN" in f for f in (ca, cert, key, *client_ca)):
                raise ValueError("not PEM")
            client_cas = x509.load_pem_x509_certificates(client_ca[0]) if client_ca else []
        except (OSError, ValueError) as e:
            if force:
                raise InvalidArgument("tls", f"cannot read TLS files {', '.join(map(str, self.paths))}: "
                                             f"{getattr(e, 'strerror', None) or e}") from None
            log.warning("TLS files changed but cannot be read (%s); keeping the ones loaded", e)
            return False
        self.ca, self.cert, self.key, self._stamp = ca, cert, key, stamp
        self.client_ca, self.client_cas = (client_ca[0] if client_ca else b""), client_cas
        self.generation += 1
        if not force:
            log.info("TLS files reloaded (generation %d)", self.generation)
        return True

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: the server's certificate, and a client certificate signed by the CA
        required of every caller. New handshakes pick up changed files."""
        def config():  # callers: nodes (the node CA) and clients (the node CA or the client CA)
            roots = self.ca if not self.client_ca else self.ca.rstrip(b"\n") + b"\n" + self.client_ca
            return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=roots)

        def fetch():
            return config() if self.refresh() else None
        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)

    def signed_by_client_ca(self, pem: bytes) -> bool:
        """True when the certificate ``pem`` was issued by a certificate of the client CA file
        (signature checked, not only the issuer's name)."""
        if not self.client_cas or not pem:
            return False
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            return False
        for ca in self.client_cas:
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except (ValueError, TypeError, InvalidSignature):
                continue
        return False

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


class ClientSecurity:
    """The client end: credentials for a channel (the certificate, and the token on every
    call), rebuilt when the files change (the certificate files, and the token file: a
    rotated token is sent from the next dial on). ``generation`` moves when they did, so a
    channel cache knows to dial again."""

    def __init__(self, settings: SecuritySettings | None = None) -> None:
        self.settings = settings if settings is not None else load_settings()
        self.files = self.settings.files() if self.settings.tls else None
        self._token = self.settings.read_token()
        self._token_stamp = self._stamp_token()
        self._token_checked = time.monotonic()
        self._files_generation = self.files.generation if self.files is not None else 0
        self._generation = 0

    @property
    def tls(self) -> bool:
        return self.files is not None

    def _stamp_token(self):
        try:
            st = self.settings.token_file.stat() if self.settings.token_file is not None else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino) if st is not None else None

    def _token_changed(self) -> bool:
        now = time.monotonic()
        if self.settings.token_file is None or now - self._token_checked < self.settings.reload_check_ms / 1000:
            return False
        self._token_checked = now
        stamp = self._stamp_token()
        if stamp is None or stamp == self._token_stamp:
            return False
        try:
            token = self.settings.read_token()
        except InvalidArgument as e:
            log.warning("token file changed but cannot be read (%s); keeping the token loaded", e)
            return False
        self._token_stamp = stamp
        if not token or token == self._token:
            return False
        self._token = token
        log.info("token file %s changed: new connections use the new token", self.settings.token_file)
        return True

    def generation(self) -> int:
        if self.files is None:
            return 0
        self.files.refresh()
        if self.files.generation != self._files_generation:
            self._files_generation = self.files.generation
            self._generation += 1
        if self._token_changed():
            self._generation += 1
        return self._generation

    def channel(self, address: str, options: list, *, blocking: bool = False) -> grpc.aio.Channel | grpc.Channel:
        """A channel to ``address``: ``grpc.aio``'s, or with ``blocking`` a plain one for a
        thread without an event loop (``cluster.discovery.BlockingMetaClient``)."""
        api = grpc if blocking else grpc.aio
        if self.files is None:
            return api.insecure_channel(address, options=options)
        creds = self.files.channel_credentials()
        if self._token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self._token))
        opts = list(options)
        if self.settings.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.settings.tls_server_name))
        return api.secure_channel(address, creds, options=opts)


def client_security_from(cluster_file_entry: dict | None) -> ClientSecurity:
    """Credentials: ``HOURGLASS_TLS_*`` / ``HOURGLASS_TOKEN[_FILE]`` when set, else the
    ``security`` entry of a cluster file (``dev up --secure`` writes it), else none."""
    settings = load_settings()
    if not settings.tls and cluster_file_entry:
        fields = {k: v for k, v in cluster_file_entry.items() if k in SecuritySettings.model_fields}
        if settings.token is not None or settings.token_file is not None:
            fields.pop("token_file", None)  # a token of the caller's own wins over the cluster file's
        settings = load_settings(**fields)
    return ClientSecurity(settings)


# ---------------------------------------------------------------------- who may do what


class Grant(BaseModel):
    action: Action
    subjects: list[str] = ["*"]    # fnmatch patterns: "orders.*", "*"
    groups: list[str] = ["*"]      # consume only: consumer groups


class TokenEntry(BaseModel):
    """A token (its ``sha256``) or a client certificate (its common name, ``certificate``:
    ``client:orders``) and what it may do."""

    name: str = Field(min_length=1, max_length=200)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    certificate: str | None = Field(default=None, min_length=1, max_length=200)
    allow: list[Grant] = []

    @model_validator(mode="after")
    def _one_credential(self) -> "TokenEntry":
        if (self.sha256 is None) == (self.certificate is None):
            raise ValueError(f"entry {self.name!r}: give exactly one of sha256 (a token) or certificate "
                             "(a client certificate's common name)")
        if self.certificate is not None and self.certificate.startswith(NODE_PREFIX):
            raise ValueError(f"entry {self.name!r}: node certificates need no entry (they may do everything)")
        return self


class AuthFile(BaseModel):
    """The auth file (JSON): ``{"tokens": [{"name", "sha256" | "certificate", "allow":
    [{"action", "subjects", "groups"}]}]}``."""

    tokens: list[TokenEntry] = []


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Principal:
    name: str
    node: bool = False
    grants: list[Grant] = field(default_factory=list)
    _decisions: dict = field(default_factory=dict, repr=False)

    def may(self, action: Action, subject: str | None = None, group: str | None = None) -> bool:
        """Whether this principal may ``action`` on ``subject`` in ``group``; None stands for
        "some": ``may(CONSUME, None, "billing")`` is a consume grant for group billing on any
        subject. A subject or group outside the subject rule is never granted."""
        if self.node:
            return True  # node certificates: the cluster's own processes
        if action is Action.DISCOVER:
            return True
        if action is Action.NODE:
            return False  # a "node" grant in the auth file makes no token a node
        if (subject is not None and subject_problem(subject, SUBJECT_WIRE_BYTES_MAX) is not None
                or group is not None and subject_problem(group, SUBJECT_WIRE_BYTES_MAX) is not None):
            return False
        key = (action, subject, group)
        hit = self._decisions.get(key)
        if hit is not None:
            return hit
        ok = any(g.action is action
                 and (subject is None or any(fnmatch.fnmatchcase(subject, p) for p in g.subjects))
                 and (group is None or any(fnmatch.fnmatchcase(group, p) for p in g.groups))
                 for g in self.grants)
        if len(self._decisions) >= DECISIONS_MAX:
            self._decisions.clear()
        self._decisions[key] = ok
        return ok


class AuthTable:
    """The tokens a server knows, read from its auth file (again when it changes)."""

    def __init__(self, path: Path | None, *, check_every_s: float = _RELOAD_CHECK_S) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self._stamp = None
        self._checked = 0.0
        self._entries: list[tuple[bytes, Principal]] = []
        self._certificates: dict[str, Principal] = {}
        if path is not None:
            self._load(force=True)

    def _load(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.check_every_s:
            return
        self._checked = now
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            parsed = AuthFile.model_validate(json.loads(self.path.read_text()))
        except (OSError, ValueError) as e:
            msg = f"auth file {self.path}: {getattr(e, 'strerror', None) or e}"
            if force:
                raise InvalidArgument("auth_file", msg[:500]) from None
            log.warning("%s; keeping the tokens loaded", msg[:500])
            return
        self._entries = [(bytes.fromhex(t.sha256), Principal(t.name, grants=t.allow))
                         for t in parsed.tokens if t.sha256 is not None]
        self._certificates = {t.certificate: Principal(t.name, grants=t.allow)
                              for t in parsed.tokens if t.certificate is not None}
        self._stamp = stamp
        if not force:
            log.info("auth file %s reloaded: %d tokens", self.path, len(self._entries))

    def by_certificate(self, common_name: str) -> Principal | None:
        """The principal of a client certificate listed in the auth file (no token needed)."""
        if self.path is not None:
            self._load()
        return self._certificates.get(common_name)

    def principal(self, token: str) -> Principal | None:
        if self.path is not None:
            self._load()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for want, p in self._entries:  # every entry, compared in constant time
            if hmac.compare_digest(digest, want):
                found = p
        return found


# ---------------------------------------------------------------------- the server end

_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("hourglass_caller", default=None)

# registered by each process's own metrics registry (node/metrics.py)
REFUSALS = Counter("hourglass_auth_refusals", "Calls refused by authentication or permissions",
                   ["reason", "action"], registry=None)
THROTTLED_PEERS = Counter("hourglass_auth_throttled_peers", "Times a peer reached auth_failures_max failed "
                          "authentications within the window (refused unread until it passes)", registry=None)

_ADMIN = (Action.ADMIN,)
_NODE = (Action.NODE,)
# method -> the actions of which the caller needs a grant (on some subject, in some group) to
# call it at all: the interceptor's check, before the servicer runs. The servicers then check
# the subjects and group of the request itself (``check``/``require``), first thing.
METHOD_ACTIONS: dict[str, tuple[Action, ...]] = {
    "/hourglass.v1.Producer/SendBatch": (Action.PRODUCE,),
    "/hourglass.v1.Producer/SendBatchStream": (Action.PRODUCE,),
    "/hourglass.v1.Producer/Cancel": (Action.CANCEL,),
    "/hourglass.v1.Producer/Lookup": (Action.CANCEL,),
    "/hourglass.v1.Consumer/Pull": (Action.CONSUME,),
    "/hourglass.v1.Consumer/PullStream": (Action.CONSUME,),
    "/hourglass.v1.Consumer/Ack": (Action.CONSUME,),
    "/hourglass.v1.Consumer/Nack": (Action.CONSUME,),
    "/hourglass.v1.Consumer/Browse": (Action.CONSUME,),
    "/hourglass.v1.Consumer/Trace": (Action.CANCEL, Action.CONSUME),  # a grant on the subject: the servicer
    "/hourglass.v1.Admin/Status": _ADMIN,
    "/hourglass.v1.Admin/Verify": _ADMIN,
    "/hourglass.v1.Replication/Handover": _ADMIN,
    "/hourglass.v1.Replication/Replicate": _NODE,
    "/hourglass.v1.Replication/ReadLog": _NODE,
    "/hourglass.meta.v1.Meta/Register": _NODE,
    "/hourglass.meta.v1.Meta/Heartbeat": _NODE,
    "/hourglass.meta.v1.Meta/Deregister": _NODE,
    "/hourglass.meta.v1.Meta/Campaign": _NODE,
    "/hourglass.meta.v1.Meta/Resign": _NODE,
    "/hourglass.meta.v1.Meta/UpdateInSync": _NODE,
    "/hourglass.meta.v1.Meta/ReportDead": _NODE,
    "/hourglass.meta.v1.Meta/ForceInSync": _ADMIN,
    "/hourglass.meta.v1.Meta/SetRoute": _ADMIN,  # where every tenant's messages of a subject go: operators
    "/hourglass.meta.v1.Meta/Drain": _ADMIN,     # moves every tenant's pending messages of a delay group: operators
    "/hourglass.meta.v1.Meta/ReleaseConsumerGroup": _ADMIN,  # gives up a consumer group's messages on a drain
    "/hourglass.meta.v1.Meta/Leader": _ADMIN,   # a group's master, epoch and in-sync set: nodes and operators
    "/hourglass.meta.v1.Meta/Health": _ADMIN,   # the etcd endpoint and its error text: operators
    "/hourglass.meta.v1.Meta/Route": (Action.PRODUCE, Action.CONSUME),  # and on that very subject (the servicer)
    "/hourglass.meta.v1.Meta/GetServers": (Action.DISCOVER,),
    "/grpc.health.v1.Health/Check": (Action.DISCOVER,),
    "/grpc.health.v1.Health/Watch": (Action.DISCOVER,),
}
# a method not listed needs a node certificate: a new RPC is closed until someone opens it


def refuse(reason: str, action: Action | str, error: E.HourglassError) -> E.HourglassError:
    """Count a refusal (``hourglass_auth_refusals_total{reason, action}``) and return its error."""
    REFUSALS.labels(reason=reason, action=getattr(action, "value", action)).inc()
    return error


def caller() -> Principal | None:
    """The principal of the call being served (None: security is off)."""
    return _CALLER.get()


def _what(action: Action | tuple[Action, ...]) -> str:
    actions = action if isinstance(action, tuple) else (action,)
    return " or ".join(a.value for a in actions)


def check(action: Action | tuple[Action, ...], subjects: Iterable[str | None] = (None,),
          group: str | None = None) -> None:
    """Raise ``PermissionDenied`` unless the caller may ``action`` (or one of a tuple of
    actions) on every one of ``subjects`` (in ``group``). No subject named (an empty list,
    as an empty Ack) means "some subject": the caller needs such a grant all the same.
    Security off: always allowed."""
    p = _CALLER.get()
    if p is None:
        return
    actions = action if isinstance(action, tuple) else (action,)
    for s in list(subjects) or [None]:
        if not any(p.may(a, s, group) for a in actions):
            what = f" subject {s[:200]!r}" if s is not None else ""
            what += f" in group {group[:200]!r}" if group is not None else ""
            log.info("refused: %s may not %s%s", p.name, _what(action), what)
            raise refuse("permission", actions[0], E.PermissionDenied(
                f"permission denied: {p.name!r} may not {_what(action)}{what}"))


async def require(context, action: Action | tuple[Action, ...], subjects: Iterable[str | None] = (None,),
                  group: str | None = None) -> None:
    """``check`` for a servicer: a refusal ends the call with its status (``cluster.status``)."""
    try:
        check(action, subjects, group)
    except E.PermissionDenied as e:
        await status.abort(context, e)


async def authorized_batch(context, request, clock) -> tuple:
    """What every node's SendBatch does first: ``require_send`` at ``clock``'s now; returns
    ``(batch, now_ms)`` (the time its delays were resolved at)."""
    now = clock.now_ms()
    return await require_send(context, request, now_ms=now), now


async def require_send(context, request, *, now_ms: int):
    """The first step of a SendBatch: decode its batch (malformed: INVALID_ARGUMENT, nothing
    about the server's state said) and check the caller may produce each of its subjects
    (``grantable_subjects``) and, when the request claims a term (``epoch``: fencing), is a
    node. Returns the batch, its delays resolved at ``now_ms``."""
    try:
        batch = request_batch(request, now_ms=now_ms)
    except E.HourglassError as e:
        await status.abort(context, e)
    await require(context, Action.PRODUCE, grantable_subjects(batch))
    if request.epoch:  # a sender's term is believed only from a node certificate
        await require(context, Action.NODE)
    return batch


def _bearer(metadata) -> str | None:
    for k, v in metadata or ():
        if k == "authorization":
            if isinstance(v, bytes):
                v = v.decode(errors="replace")
            if len(v) > TOKEN_BYTES_MAX or not v.startswith("Bearer "):
                return ""
            return v[len("Bearer "):].strip()
    return None


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class Authenticator(grpc.aio.ServerInterceptor):
    """Who is calling (a node certificate, or a client certificate with a token) and may
    they call this method at all. Subject checks happen in the servicers (``require``).
    With ``files`` holding a client CA, a ``node:`` certificate that CA signed is a client.

    Failed authentications count per peer address (``FailureThrottle``); a peer over the
    limit is refused (UNAUTHENTICATED, saying when to try again) before its token is read.
    Node certificates are exempt: the TLS handshake proved them, and a client that shares an
    address with a node (a host, a NAT) must not cut the cluster's own calls."""

    def __init__(self, table: AuthTable, throttle: FailureThrottle | None = None, *, files: TlsFiles | None = None,
                 clock=_now_ms) -> None:
        self.table = table
        self.files = files
        self._client_ca_verdicts: dict[tuple[int, bytes], bool] = {}  # (CA generation, PEM) -> signed by it
        self.throttle = throttle if throttle is not None else FailureThrottle()
        self.clock = clock

    def _claims_node_falsely(self, auth) -> bool:
        """A ``node:`` certificate issued by the client CA (cached per certificate and CA generation)."""
        if self.files is None or not self.files.client_cas:
            return False
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        key = (self.files.generation, pem)
        verdict = self._client_ca_verdicts.get(key)
        if verdict is None:
            verdict = self.files.signed_by_client_ca(pem)
            if len(self._client_ca_verdicts) >= DECISIONS_MAX:
                self._client_ca_verdicts.clear()
            self._client_ca_verdicts[key] = verdict
        return verdict

    def identify(self, context) -> Principal:
        auth = context.auth_context()
        names = [n.decode(errors="replace") for n in auth.get("x509_common_name", ())]
        if names and names[0].startswith(NODE_PREFIX):
            if not self._claims_node_falsely(auth):
                return Principal(names[0], node=True)
            log.warning("a certificate of the client CA claims to be a node (%s): treated as a client", names[0][:200])
        peer = peer_key(context.peer())
        now = self.clock()
        wait_ms = self.throttle.retry_after_ms(peer, now)
        if wait_ms:
            raise refuse("throttled", "-", E.Unauthenticated(
                f"unauthenticated: too many failed authentications from {peer} ({self.throttle.failures_max} "
                f"within {self.throttle.window_ms} ms); refused unread, try again in {-(-wait_ms // 1000)} s"))
        try:
            return self._identify(context, names)
        except E.Unauthenticated:
            if self.throttle.failed(peer, now):
                THROTTLED_PEERS.inc()
                log.warning("peer=%s reached %d failed authentications within %d ms: refused until the window "
                            "passes", peer, self.throttle.failures_max, self.throttle.window_ms)
            raise

    def _identify(self, context, names: list[str]) -> Principal:
        if not names:  # mutual TLS should make this impossible: refuse rather than trust
            raise refuse("no_certificate", "-", E.Unauthenticated("unauthenticated: no client certificate"))
        token = _bearer(context.invocation_metadata())
        if token is None:
            p = self.table.by_certificate(names[0])  # a client certificate the auth file lists: its own identity
            if p is not None:
                return p
            raise refuse("no_token", "-", E.Unauthenticated(
                "unauthenticated: no bearer token (HOURGLASS_TOKEN or HOURGLASS_TOKEN_FILE), and the client "
                "certificate is not listed in the auth file"))
        p = self.table.principal(token) if token else None
        if p is None:
            raise refuse("bad_token", "-", E.Unauthenticated("unauthenticated: unknown token"))
        return p

    def authorize(self, method: str, context) -> Principal:
        p = self.identify(context)
        need = METHOD_ACTIONS.get(method, _NODE)
        if any(p.may(a) for a in need):
            return p
        name = method.rsplit("/", 1)[-1]
        if need == _NODE:
            log.info("refused: %s called %s, which needs a node certificate", p.name, method)
            raise refuse("permission", Action.NODE, E.PermissionDenied(
                f"permission denied: {method} needs a node certificate"))
        log.info("refused: %s called %s without a %s grant", p.name, method, _what(need))
        raise refuse("permission", need[0], E.PermissionDenied(
            f"permission denied: {p.name!r} may not {_what(need)} ({name} needs {_what(need)})"))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _checked(self, details.method, handler)


async def _first_request(requests) -> None:
    """Wait (at most ``REFUSED_STREAM_WAIT_S``) for a request stream's first message or its
    end. A stream refused before the client's first write went out ends, for the client,
    with INTERNAL "Internal error from Core" (grpc turns the failed send into the call's
    status) instead of the refusal; once that write is through, the refusal is what it reads."""
    try:
        async with asyncio.timeout(REFUSED_STREAM_WAIT_S):
            async for _ in requests:
                return
    except (TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
        return


def _checked(auth: Authenticator, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` behind ``auth.authorize``: a refusal ends the call before the servicer
    is touched (a request stream's first message is waited for, not handled: ``_first_request``)."""
    streamed_requests = bool(handler.stream_unary or handler.stream_stream)

    async def enter(request, context) -> E.HourglassError | None:
        try:
            _CALLER.set(auth.authorize(method, context))
            return None
        except (E.Unauthenticated, E.PermissionDenied) as e:
            if streamed_requests:
                await _first_request(request)
            return e

    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request, context):
            refused = await enter(request, context)
            if refused is not None:
                await status.abort(context, refused)
            return await inner(request, context)
        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    inner = handler.unary_stream or handler.stream_stream

    async def streaming(request, context):
        refused = await enter(request, context)
        if refused is not None:
            await status.abort(context, refused)
        async for item in inner(request, context):
            yield item
    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streaming, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


@dataclass
class ServerSecurity:
    """A server's end: credentials for its port and the interceptor, or plaintext."""

    settings: SecuritySettings
    files: TlsFiles | None = None
    table: AuthTable | None = None

    @classmethod
    def from_settings(cls, settings: SecuritySettings | None = None) -> "ServerSecurity":
        settings = settings if settings is not None else load_settings()
        if not settings.tls:
            return cls(settings)
        if settings.auth_file is None:
            raise InvalidArgument("auth_file", "TLS is on but HOURGLASS_AUTH_FILE is not set: a server with "
                                               "TLS needs the tokens clients may use (docs/security.md)")
        return cls(settings, settings.files(), AuthTable(settings.auth_file,
                                                         check_every_s=settings.reload_check_ms / 1000))

    @property
    def tls(self) -> bool:
        return self.files is not None

    def interceptors(self) -> list:
        if self.table is None:
            return []
        s = self.settings
        return [Authenticator(self.table, FailureThrottle(s.auth_failures_max, s.auth_failures_window_ms,
                                                          s.auth_throttle_peers_max), files=self.files)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.files is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.files.server_credentials())


def open_warning(what: str) -> str:
    return (f"{what} is OPEN: plaintext gRPC, no authentication (local development only; "
            f"set HOURGLASS_TLS_* and HOURGLASS_AUTH_FILE, or `hourglass dev up --secure`)")


