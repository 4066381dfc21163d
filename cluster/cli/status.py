"""``hourglass status``: role, group, master/slave, epoch and replication lag of every node, then
one line per route drain in progress (a narrowing's dropped group, docs/design.md "Narrowing
drains first")::

    route: orders draining: realtime-3 (12 left), waiting for audit

The ``draining: GROUP (N left)`` part is ``draining_text``, shared with ``hourglass admin route``;
N is what the draining group's master counts (``drain_left``, node/realtime/fence.py): entries of
the subject there that a consumer group the drain waits for has not acknowledged, summed over
those consumer groups. Being the masters' own report, a drain the meta server has just finished
(``hourglass admin route`` no longer lists it) shows here until its master has loaded the new
route."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import grpc
import typer

from cluster import errors as E
from cluster.cli.common import (
    EXIT_UNAVAILABLE,
    RPC_TIMEOUT_S_MAX,
    ClusterFileOpt,
    DelayOpt,
    MetaOpt,
    RealtimeOpt,
    TimeoutOpt,
    _resolver,
    _within,
    app,
    console,
    err_console,
    shorten,
)

STATUS_COLUMNS = ("node", "role", "group", "mode", "address", "epoch", "repl lag", "error")


@app.command()
def status(delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
           as_json: bool = typer.Option(False, "--json"), timeout_s: float = TimeoutOpt) -> None:
    """Role, group, master/slave, epoch and replication lag of every node (--json: every counter).

    Exit 3 when a listed node does not answer (it is shown with its error)."""
    resolver = _resolver(delay, realtime, cluster_file, meta)
    rows = asyncio.run(_within(timeout_s, "status", _status_rows(resolver, min(RPC_TIMEOUT_S_MAX, timeout_s))))
    if not rows:
        raise E.Unavailable("no node is registered with the meta servers")
    if as_json:
        console.print_json(json.dumps(rows))
    else:
        for line in status_table(rows) + drain_lines(rows):
            console.print(line, markup=False, highlight=False)
    down = [r["address"] for r in rows if "error" in r]
    if down:
        err_console.print(f"error: {len(down)} of {len(rows)} nodes did not answer: {shorten(', '.join(down))}",
                          style="red")
        raise typer.Exit(EXIT_UNAVAILABLE)


async def _status_rows(resolver, rpc_timeout_s: float) -> list[dict]:
    """Every node the resolver knows (meta: every registered member), asked at once; a node
    that does not answer is a row with ``error``."""
    from cluster.proto import hourglass_pb2 as pb
    from cluster.transport import Channels

    try:
        if hasattr(resolver, "load"):  # MetaResolver: every registered node, with its group
            listed = [{"address": a, "role": role, "group": g["group"]}
                      for role, groups in (await resolver.load()).items() for g in groups for a in g["members"]]
        else:
            listed = [{"address": a, "role": role, "group": ""}
                      for role, addrs in (("delay", resolver.delay), ("realtime", resolver.realtime)) for a in addrs]
    finally:
        await resolver.close()
    ch = Channels(getattr(resolver, "security", None))

    async def ask(node: dict) -> dict:
        try:
            r = await ch.admin(node["address"]).Status(pb.StatusRequest(), timeout=rpc_timeout_s)
            return node | json.loads(r.json)
        except grpc.RpcError as e:  # a dead node is reported, not fatal
            return node | {"error": shorten(f"{e.code().name}: {e.details()}", 120)}
        except ValueError as e:
            return node | {"error": shorten(f"unreadable status: {e}", 120)}
    try:
        return list(await asyncio.gather(*(ask(n) for n in listed)))
    finally:
        await ch.close()


def status_table(rows: list[dict]) -> list[str]:
    """Plain text columns as wide as their widest cell: an address is never cut, whatever the
    terminal's width (a line may be longer than the terminal)."""
    cells = []
    for r in rows:
        lag = (f"{r.get('replication_lag_bytes', 0)} B / {r.get('replication_lag_ms', 0)} ms"
               if r.get("mode") == "slave" else "")
        mode = "unreachable" if "error" in r else r.get("mode", "master")
        drain = r.get("drain") or {}
        if drain.get("state") in ("draining", "empty"):  # hourglass admin drain: a master says how far
            mode += f" ({drain['state']}, {drain.get('pending', 0)} pending)"
        cells.append([str(r.get("node_id", "?")), str(r.get("role", "?")), str(r.get("group", "")), mode,
                      str(r.get("address", "?")), str(r.get("election_epoch", r.get("epoch", ""))), lag,
                      r.get("error", "")])
    keep = [i for i in range(len(STATUS_COLUMNS)) if i < 7 or any(c[i] for c in cells)]  # "error" only if any
    table = [[STATUS_COLUMNS[i] for i in keep]] + [[c[i] for i in keep] for c in cells]
    widths = [max(len(line[j]) for line in table) for j in range(len(keep))]
    return ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in table]


def draining_text(group: str, left: str) -> str:
    """``draining: GROUP (N left)``: a route's draining group and what its master still holds
    for a consumer group (``hourglass status``, ``hourglass admin route``)."""
    return f"draining: {group} ({left} left)"


def drain_of(st: dict, subject: str) -> dict | None:
    """A real-time master's Status (its JSON) on its drain of ``subject``: ``{"subject",
    "left", "waiting_for"}``, None when it does not drain it (or has not loaded the fence yet)."""
    return next((d for d in st.get("route_drains") or [] if d.get("subject") == subject), None)


def drain_lines(rows: list[dict]) -> list[str]:
    """One line per drain in progress, from the status rows of real-time masters, sorted by
    subject then group."""
    found = []
    for r in rows:
        if r.get("role") != "realtime" or "error" in r or r.get("mode", "master") != "master":
            continue
        for d in r.get("route_drains") or []:
            found.append((str(d.get("subject", "?")), str(r.get("group", "?")), str(d.get("left", "?")),
                          list(d.get("waiting_for") or []), list(d.get("released") or [])))
    return [f"route: {s} {draining_text(g, left)}" + (f", waiting for {','.join(waiting)}" if waiting else "")
            + (f", released {','.join(released)}" if released else "")
            for s, g, left, waiting, released in sorted(found)]
