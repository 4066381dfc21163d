"""``hourglass node`` and ``hourglass metaserver``: run one server process until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Optional

import typer

from cluster import errors as E
from cluster.cli.common import CliError, _split, app

# ---------------------------------------------------------------------- node


def _serve(settings_cls, overrides: dict, serve, log_level=lambda s: s.log_level) -> None:
    """Validate settings (a clear message and exit 2 when bad), then serve until SIGINT/SIGTERM.
    ``log_level`` reads the level from the settings. A server that fails logs its traceback
    (operators read the log) before the boundary prints its one line."""
    import logging

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from cluster.process import configure_logging, restrict_umask

    restrict_umask()  # before anything is written: data, checkpoints, ready file are owner-only
    try:
        settings = settings_cls(**overrides)
    except ValidationError as e:
        raise CliError("bad settings: " + "; ".join(f"{'.'.join(map(str, x['loc'])) or 'settings'}: {x['msg']}"
                                                   for x in e.errors())) from None
    except SettingsError as e:  # an environment value pydantic-settings cannot parse (nested JSON)
        raise CliError(f"bad settings: {e}") from None
    configure_logging(log_level(settings))
    profile_to = os.environ.get("HOURGLASS_PROFILE_TO")  # benchmarks: cProfile of the serving thread
    try:
        if not profile_to:
            asyncio.run(serve(settings))
            return
        import cProfile

        with cProfile.Profile() as prof:
            asyncio.run(serve(settings))
        prof.dump_stats(f"{profile_to}.{os.getpid()}")
    except E.HourglassError as e:  # a known refusal (a port in use): one log line, no traceback
        logging.getLogger("hourglass").error("%s stopped: %s", settings_cls.__name__, e)
        raise
    except Exception:
        logging.getLogger("hourglass").exception("%s stopped by an error", settings_cls.__name__)
        raise


@app.command()
def node(
    role: str = typer.Option(..., help="delay | realtime"),
    node_id: str = typer.Option("node-1"),
    group: str = typer.Option("g1"),
    data_dir: Path = typer.Option(..., help="where this node keeps its files"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(0),
    metrics_port: Optional[int] = typer.Option(None),
    realtime_nodes: str = typer.Option("", help="(delay) real-time node addresses"),
    delay_nodes: str = typer.Option("", help="(realtime) delay node addresses for retries"),
    meta: str = typer.Option("", help="meta server addresses: register there and discover through them"),
    ready_file: Optional[Path] = typer.Option(None),
) -> None:
    """Run one node until SIGINT/SIGTERM. Other settings come from HOURGLASS_* variables."""
    from node.config import NodeSettings
    from node.server import serve

    overrides = dict(role=role, node_id=node_id, group=group, data_dir=data_dir, host=host, port=port,
                     ready_file=ready_file)
    if metrics_port is not None:
        overrides["metrics_port"] = metrics_port
    if realtime_nodes:
        overrides["realtime_nodes"] = _split(realtime_nodes)
    if delay_nodes:
        overrides["delay_nodes"] = _split(delay_nodes)
    if meta:
        overrides["meta_servers"] = _split(meta)
    _serve(NodeSettings, overrides, serve, log_level=lambda s: s.server.log_level)


# ---------------------------------------------------------------------- meta server


@app.command()
def metaserver(
    port: int = typer.Option(0, help="gRPC port (0 = a free one)"),
    host: str = typer.Option("127.0.0.1"),
    etcd_endpoints: str = typer.Option("127.0.0.1:2379", help="etcd client endpoints host:port, comma separated"),
    node_ttl_ms: Optional[int] = typer.Option(None, help="default lease TTL of node registrations"),
    ready_file: Optional[Path] = typer.Option(None),
) -> None:
    """Run one meta server (stateless; all state in etcd) until SIGINT/SIGTERM."""
    from metaserver.config import MetaSettings
    from metaserver.server import serve

    overrides = dict(host=host, port=port, etcd_endpoints=_split(etcd_endpoints), ready_file=ready_file)
    if node_ttl_ms is not None:
        overrides["node_ttl_ms"] = node_ttl_ms
    _serve(MetaSettings, overrides, serve)
