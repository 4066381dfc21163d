"""The Prometheus ``/metrics`` endpoint of a node or a meta server: an address that is a setting,
optionally TLS and a bearer token (docs/operations.md "Metrics endpoint").

    server = MetricsServer.start(registry, MetricsEndpoint(host="10.0.0.5", port=9100,
                                                           token_file=Path("/etc/hourglass/metrics/token")))
    server.port            # the port bound (0 asks for a free one)
    server.stop()

Served by a thread of its own (``wsgiref`` with one thread per scrape, as prometheus_client's
``start_http_server``), never the event loop. Without ``token_file`` anyone who reaches the
address may scrape; with it a scrape must send ``Authorization: Bearer <token>`` (compared in
constant time; the file is read again when it changes, so a rotated token needs no restart) and
gets 401 otherwise. With ``tls_cert_file``/``tls_key_file`` the endpoint speaks HTTPS only.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from cluster.errors import InvalidArgument

log = logging.getLogger("hourglass.metrics")

TOKEN_BYTES_MAX = 4096  # a longer Authorization header is refused unread


@dataclass(frozen=True)
class MetricsEndpoint:
    host: str = "127.0.0.1"
    port: int | None = None          # None: no endpoint
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    token_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise InvalidArgument("metrics_tls", "the metrics endpoint's TLS needs both a certificate and a key file")


class _Threading(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes are not worth a log line each
        pass


class _BearerToken:
    """The expected token, read from its file again when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = None
        self._token = b""
        self._lock = threading.Lock()
        self._load(force=True)

    def _load(self, force: bool = False) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            token = self.path.read_bytes().strip()
            if not token:
                raise ValueError("empty")
        except (OSError, ValueError) as e:
            if force:
                raise InvalidArgument("metrics_token_file", f"cannot read {self.path}: "
                                                            f"{getattr(e, 'strerror', None) or e}") from None
            log.warning("metrics token file %s changed but cannot be read (%s); keeping the token loaded", self.path, e)
            return
        self._token, self._stamp = token, stamp

    def ok(self, header: str | None) -> bool:
        if not header or len(header) > TOKEN_BYTES_MAX or not header.startswith("Bearer "):
            return False
        with self._lock:
            self._load()
            want = self._token
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), want)


def _guarded(app, token: _BearerToken):
    def guarded(environ, start_response):
        if not token.ok(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"unauthorized: send Authorization: Bearer <the metrics token>\n"]
        return app(environ, start_response)
    return guarded


class MetricsServer:
    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, endpoint: MetricsEndpoint) -> "MetricsServer | None":
        """Serve ``registry`` at ``endpoint`` (None when it has no port)."""
        if endpoint.port is None:
            return None
        app = make_wsgi_app(registry)
        if endpoint.token_file is not None:
            app = _guarded(app, _BearerToken(endpoint.token_file))
        try:
            server = make_server(endpoint.host, endpoint.port, app, _Threading, handler_class=_Quiet)
        except OSError as e:
            raise InvalidArgument("metrics", f"cannot listen on {endpoint.host}:{endpoint.port}: "
                                             f"{e.strerror or e}") from None
        if endpoint.tls_cert_file is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(str(endpoint.tls_cert_file), str(endpoint.tls_key_file))
            except (OSError, ssl.SSLError) as e:
                server.server_close()
                raise InvalidArgument("metrics_tls", f"cannot load {endpoint.tls_cert_file}: {e}") from None
            # the handshake happens in the scrape's own thread (first read), not in the accept loop
            server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
        thread.start()
        log.info("metrics endpoint address=%s:%d tls=%s token=%s", endpoint.host, server.server_port,
                 endpoint.tls_cert_file is not None, endpoint.token_file is not None)
        return cls(server, thread)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ServesMetrics:
    """What a process's metrics object shares: serve its ``registry`` at an endpoint, stop."""

    registry: CollectorRegistry
    _server: "MetricsServer | None" = None
    port: int | None = None

    def start(self, endpoint: MetricsEndpoint) -> None:
        """Serve /metrics at ``endpoint`` (nothing when it has no port)."""
        self._server = MetricsServer.start(self.registry, endpoint)
        self.port = self._server.port if self._server is not None else None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
