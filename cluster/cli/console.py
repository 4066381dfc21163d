"""``hourglass console`` (the web console, docs/console.md) and ``hourglass trace ID`` (the
message page's trace as text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cluster.cli.common import (
    DEFAULT_CLUSTER_FILE,
    ClusterFileOpt,
    CliError,
    DelayOpt,
    MetaOpt,
    RealtimeOpt,
    TimeoutOpt,
    _read_cluster_file,
    _split,
    app,
    console,
)
from cluster.cli.messages import _producer_call
from cluster.clock import wall_ms

CONSOLE_PORT = 8480


@app.command("console")
def console_cmd(
    meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt,
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 in a container)"),
    port: int = typer.Option(CONSOLE_PORT, min=1, max=65535, help="port to listen on"),
    https_cert: Optional[Path] = typer.Option(None, "--https-cert", envvar="HOURGLASS_CONSOLE_HTTPS_CERT",
                                              help="serve HTTPS with this certificate (PEM); needed on a secure "
                                                   "cluster"),
    https_key: Optional[Path] = typer.Option(None, "--https-key", envvar="HOURGLASS_CONSOLE_HTTPS_KEY",
                                             help="the key of --https-cert"),
) -> None:
    """Serve the web console: cluster, schedule, message trace and cancel, dead letters.

    The cluster is found through the meta servers (--meta, --cluster-file, HOURGLASS_META_SERVERS
    or var/dev/cluster.json). On a secure cluster (HOURGLASS_TLS_* or the cluster file's
    credentials) viewers log in with their own token and the console serves HTTPS only."""
    import uvicorn

    from cluster.console.app import create_app

    cluster = console_cluster(meta, cluster_file)
    if (https_cert is None) != (https_key is None):
        raise CliError("give both --https-cert and --https-key, or neither")
    if cluster.secure and https_cert is None:
        raise CliError("the cluster is secure: the console serves HTTPS only; give --https-cert and --https-key "
                       "(`hourglass dev up --secure` passes its node certificate)")
    scheme = "https" if https_cert else "http"
    app_ = create_app(cluster, https=https_cert is not None)
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    console.print(f"console: serving {scheme}://{shown_host}:{port}/ for the cluster at meta={','.join(cluster.meta)}"
                  + ("" if cluster.secure else " (OPEN: no TLS, no tokens)"), markup=False, highlight=False)
    uvicorn.run(app_, host=host, port=port, log_level="warning", access_log=False,
                ssl_certfile=str(https_cert) if https_cert else None,
                ssl_keyfile=str(https_key) if https_key else None)


def console_cluster(meta: str | None, cluster_file: Path | None):
    """Meta servers and the console's TLS files: --meta, else the cluster file, else
    HOURGLASS_META_SERVERS, else var/dev/cluster.json; HOURGLASS_TLS_* win over the file's."""
    import os

    from cluster.console.backend import ConsoleCluster
    from cluster.security import client_security_from

    sec = None
    metas = _split(meta)
    if not metas:
        path = cluster_file
        if path is None and not os.environ.get("HOURGLASS_META_SERVERS") and DEFAULT_CLUSTER_FILE.exists():
            path = DEFAULT_CLUSTER_FILE
        if path is not None:
            _, _, metas, sec = _read_cluster_file(path)
        else:
            metas = _split(os.environ.get("HOURGLASS_META_SERVERS"))
    if not metas:
        raise CliError("no meta servers given: the console discovers the cluster through them",
                       hint="hint: give --meta or --cluster-file, set HOURGLASS_META_SERVERS, or run "
                            "`hourglass dev up`")
    settings = client_security_from(sec).settings
    from cluster.console.backend import node_certificate

    try:
        node_cn = node_certificate(settings)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot read the client certificate {settings.tls_cert_file}: {e}") from None
    if node_cn is not None:
        raise CliError(f"the console's client certificate is a node certificate ({node_cn}): with it every viewer "
                       "could do everything, whatever their token",
                       hint="hint: give it a client certificate (HOURGLASS_TLS_CERT_FILE; `hourglass certs issue "
                            "client`), docs/console.md")
    # viewers log in with their own tokens; the console's (from the file or env) is used only on an open cluster
    if settings.tls:
        settings = settings.model_copy(update={"token": None, "token_file": None})
    return ConsoleCluster(tuple(metas), settings)


@app.command()
def trace(id: str, delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
          cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
          as_json: bool = typer.Option(False, "--json"), timeout_s: float = TimeoutOpt) -> None:
    """The hops of one message in order (accepted, filed, fired, stored, delivered to and acked
    or nacked by each consumer group, dead-lettered, cancelled), as the console's message page
    shows them (exit 4: no such id). A hop no node could say is marked [?] with the reason."""
    from dataclasses import asdict

    from cluster import trace as hops

    found = _producer_call("trace", id, (delay, realtime, cluster_file, meta), timeout_s).as_dict()
    if as_json:
        console.print(json.dumps(found | {"hops": [asdict(h) for h in hops.hops(found, wall_ms())]}),
                      markup=False, highlight=False)
        return
    for line in hops.lines(found, wall_ms()):
        console.print(line, markup=False, highlight=False)
