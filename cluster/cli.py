"""The ``hourglass`` command line (typer).

    hourglass demo                      start a local cluster, schedule, show deliveries, stop
    hourglass dev up                    a local cluster that runs until Ctrl-C
    hourglass node --role delay ...     one node process (what containers run)
    hourglass send SUBJECT PAYLOAD --delay-ms 5000 [--count N]
    hourglass consume SUBJECT --group G [--count N]
    hourglass cancel ID | lookup ID | status

Client commands find the cluster through ``--delay``/``--realtime`` addresses, the
``HOURGLASS_DELAY_NODES``/``HOURGLASS_REALTIME_NODES`` variables, or the
``cluster.json`` that ``hourglass dev up`` writes (``--cluster-file``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Hourglass: a broker for delayed messages.")
from cluster.cli_dev import dev  # noqa: E402  (dev up, dev chaos)
app.add_typer(dev, name="dev")
from cluster.spark.cli import app as spark_app  # noqa: E402  (imports pyspark only when a command runs)
app.add_typer(spark_app, name="spark")
console = Console()

DEFAULT_CLUSTER_FILE = Path("var/dev/cluster.json")


def _split(v: str | None) -> list[str]:
    return [a.strip() for a in (v or "").split(",") if a.strip()]


def _resolver(delay: str | None, realtime: str | None, cluster_file: Path | None, meta: str | None = None):
    from cluster.client import StaticResolver

    d = _split(delay or os.environ.get("HOURGLASS_DELAY_NODES"))
    r = _split(realtime or os.environ.get("HOURGLASS_REALTIME_NODES"))
    m = _split(meta or os.environ.get("HOURGLASS_META_SERVERS"))
    cf = cluster_file or DEFAULT_CLUSTER_FILE
    if not d and not r and not m and cf.exists():
        info = json.loads(cf.read_text())
        m = info.get("meta", [])
        d = d or info["delay"]
        r = r or info["realtime"]
    if m and not (delay or realtime):
        from cluster.discovery import MetaResolver
        return MetaResolver(m)
    if not d and not r:
        console.print("[red]no cluster: give --delay/--realtime, set HOURGLASS_DELAY_NODES/REALTIME_NODES, "
                      "or run `hourglass dev up`[/red]")
        raise typer.Exit(2)
    return StaticResolver(delay=d, realtime=r)


DelayOpt = typer.Option(None, "--delay", help="delay node addresses, comma separated")
RealtimeOpt = typer.Option(None, "--realtime", help="real-time node addresses, comma separated")
ClusterFileOpt = typer.Option(None, "--cluster-file", help="cluster.json written by `hourglass dev up`")
MetaOpt = typer.Option(None, "--meta", help="meta server addresses, comma separated (discover through them)")


# ---------------------------------------------------------------------- node


def _serve(settings_cls, overrides: dict, serve) -> None:
    """Validate settings (a clear message and exit 2 when bad), then serve until SIGINT/SIGTERM."""
    from pydantic import ValidationError

    from node.server import configure_logging

    try:
        settings = settings_cls(**overrides)
    except ValidationError as e:
        console.print(f"[red]bad settings:[/red] {e}")
        raise typer.Exit(2)
    configure_logging(settings.log_level)
    profile_to = os.environ.get("HOURGLASS_PROFILE_TO")  # benchmarks: cProfile of the serving thread
    if not profile_to:
        asyncio.run(serve(settings))
        return
    import cProfile

    with cProfile.Profile() as prof:
        asyncio.run(serve(settings))
    prof.dump_stats(f"{profile_to}.{os.getpid()}")


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
    _serve(NodeSettings, overrides, serve)


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


# ---------------------------------------------------------------------- dev cluster


@app.command()
def demo(
    messages: int = typer.Option(20, help="how many messages to schedule"),
    spread_s: float = typer.Option(5.0, help="due times spread over this many seconds"),
    data: Optional[Path] = typer.Option(None, help="data folder (default: a temporary one, removed after)"),
    meta: bool = typer.Option(True, "--meta/--static", help="discover everything through etcd + a meta server"),
) -> None:
    """Start a local cluster, schedule messages a few seconds ahead, show them delivered, stop."""
    from cluster.devcluster import LocalCluster

    tmp = None
    if data is None:
        tmp = tempfile.TemporaryDirectory(prefix="hourglass-demo-")
        data = Path(tmp.name)
    cluster = LocalCluster(data, meta=meta)
    console.print("[bold]Hourglass demo[/bold]: starting "
                  + ("etcd, a meta server, " if meta else "") + "a delay node and a real-time node ...")
    try:
        cluster.start()
        cluster.wait_registered()
        info = cluster.describe()
        console.print(f"  delay node {info['delay'][0]}, real-time node {info['realtime'][0]}"
                      + (f", meta server {info['meta'][0]} (the client knows only this address)" if meta else ""))
        ok = asyncio.run(_demo(info, messages, spread_s))
    finally:
        cluster.stop()
        console.print("cluster stopped")
        if tmp is not None:
            tmp.cleanup()
    if not ok:
        raise typer.Exit(1)


async def _demo(info: dict, n: int, spread_s: float) -> bool:
    from cluster.client import Consumer, Producer, StaticResolver

    if info.get("meta"):
        from cluster.discovery import MetaResolver
        resolver = MetaResolver(info["meta"])
    else:
        resolver = StaticResolver(delay=info["delay"], realtime=info["realtime"])
    subject = "demo.orders"
    now = time.time_ns() // 1_000_000
    due = {f"order-{i:03d}": now + 1000 + int(i * spread_s * 1000 / max(1, n - 1)) for i in range(n)}
    async with Producer(resolver) as p:
        futs = [await p.send(subject, f"cancel unpaid order {mid}", deliver_at_ms=at, id=mid, tags=["demo"])
                for mid, at in due.items()]
        await asyncio.gather(*futs)
        cancelled = "order-005" if n > 5 else None
        if cancelled:
            await p.cancel(cancelled)
            due.pop(cancelled)
    console.print(f"scheduled {n} messages due in 1..{1 + spread_s:.0f} s"
                  + (f"; cancelled {cancelled}" if cancelled else ""))
    table = Table("id", "due (UTC)", "received", "lateness ms")
    got: dict[str, int] = {}
    deadline = time.monotonic() + spread_s + 15
    async with Consumer(resolver, subject, group="demo", wait_ms=500) as c:
        while len(got) < len(due) and time.monotonic() < deadline:
            for m in await c.pull():
                if m.id not in got:
                    got[m.id] = m.lateness_ms
                    table.add_row(m.id, time.strftime("%H:%M:%S", time.gmtime(m.deliver_at_ms / 1000))
                                  + f".{m.deliver_at_ms % 1000:03d}",
                                  time.strftime("%H:%M:%S", time.gmtime(m.received_ms / 1000))
                                  + f".{m.received_ms % 1000:03d}", str(m.lateness_ms))
                    console.print(f"  delivered {m.id}  lateness {m.lateness_ms} ms")
                await m.ack()
    console.print(table)
    missing = sorted(set(due) - set(got))
    if missing:
        console.print(f"[red]{len(missing)} messages not delivered: {missing[:10]}[/red]")
        return False
    late = sorted(got.values())
    console.print(f"[green]all {len(got)} messages delivered[/green]; lateness median {late[len(late) // 2]} ms, "
                  f"max {late[-1]} ms")
    return True


# ---------------------------------------------------------------------- client commands


@app.command()
def send(
    subject: str,
    payload: str = typer.Argument(""),
    delay_ms: int = typer.Option(0, help="deliver this many ms from now"),
    at: Optional[str] = typer.Option(None, help="deliver at this UTC time (ISO 8601) or epoch ms"),
    id: str = typer.Option("", help="message id (idempotent); with --count, a prefix"),
    tag: list[str] = typer.Option([], help="tags (repeatable)"),
    count: int = typer.Option(1, help="send this many copies (ids get a -N suffix)"),
    delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
    cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
) -> None:
    """Schedule a message (or --count of them, with a progress bar)."""
    deliver_at = _parse_at(at) if at else 0
    resolver = _resolver(delay, realtime, cluster_file, meta)
    asyncio.run(_send(resolver, subject, payload, delay_ms, deliver_at, id, tag, count))


def _parse_at(at: str) -> int:
    from datetime import datetime, timezone

    if at.isdigit():
        return int(at)
    dt = datetime.fromisoformat(at.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


SEND_CALL_MAX = 1000  # messages per send_many call of ``hourglass send --count`` (the progress step)


async def _send(resolver, subject, payload, delay_ms, deliver_at, id, tags, count) -> None:
    from cluster.client import Producer

    immediate = not delay_ms and not deliver_at
    ids = [f"{id}-{i}" for i in range(count)] if id and count > 1 else [id] * count if id else None
    data = payload.encode()
    accepted: list = []
    errors: dict[int, Exception] = {}
    async with Producer(resolver) as p:
        with Progress(console=console, transient=True, disable=count < 1000) as prog:
            task = prog.add_task("sending", total=count)
            futs = []
            for lo in range(0, count, SEND_CALL_MAX):
                hi = min(count, lo + SEND_CALL_MAX)
                futs.append((lo, await p.send_many(subject, [data] * (hi - lo), ids=ids[lo:hi] if ids else None,
                                                   delay_ms=delay_ms or None, deliver_at_ms=deliver_at or None,
                                                   tags=tag_list(tags), immediate=immediate)))
            for lo, f in futs:
                res = await f
                errors.update({lo + i: e for i, e in res.errors.items()})
                accepted += [res.result(i) for i in range(len(res)) if i not in res.errors][:10 - len(accepted)]
                prog.update(task, completed=lo + len(res))
    for i, e in sorted(errors.items())[:10]:
        console.print(f"[red]rejected:[/red] message {i}: {e}")
    for r in accepted:
        console.print(f"accepted id={r.id} seq={r.seq} deliver_at_ms={r.deliver_at_ms}"
                      + (" (duplicate)" if r.duplicate else ""))
    if count > 10:
        console.print(f"{count - len(errors)} accepted, {len(errors)} rejected")
    if errors:
        raise typer.Exit(1)


def tag_list(tags) -> list[str]:
    return [t for t in tags if t]


@app.command()
def consume(
    subject: str,
    group: str = typer.Option(..., help="consumer group"),
    count: int = typer.Option(0, help="stop after this many messages (0 = until Ctrl-C or --idle-s)"),
    idle_s: float = typer.Option(0, help="stop after this many seconds without a message (0 = never)"),
    tag: list[str] = typer.Option([], help="only messages with one of these tags"),
    delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
    cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
) -> None:
    """Pull messages, print them and ack them."""
    resolver = _resolver(delay, realtime, cluster_file, meta)
    asyncio.run(_consume(resolver, subject, group, count, idle_s, tag_list(tag)))


async def _consume(resolver, subject, group, count, idle_s, tags) -> None:
    from cluster.client import Consumer

    n = 0
    last = time.monotonic()
    async with Consumer(resolver, subject, group=group, tags=tags, wait_ms=500) as c:
        while not count or n < count:
            batch = await c.pull()
            for m in batch:
                console.print(f"{m.id}  subject={m.subject}  lateness={m.lateness_ms}ms  "
                              f"payload={m.payload[:80]!r}")
            await c.ack(batch)
            n += len(batch)
            if batch:
                last = time.monotonic()
            elif idle_s and time.monotonic() - last > idle_s:
                break


def _producer_call(method: str, id: str, resolver_args: tuple):
    """Run ``Producer.<method>(id)`` once; a domain error is printed and exits 1."""
    from cluster.client import Producer
    from cluster.errors import HourglassError

    async def _run():
        async with Producer(_resolver(*resolver_args)) as p:
            return await getattr(p, method)(id)
    try:
        return asyncio.run(_run())
    except HourglassError as e:
        console.print(f"[red]{type(e).__name__}:[/red] {e}")
        raise typer.Exit(1)


@app.command()
def cancel(id: str, delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt) -> None:
    """Cancel a scheduled message by id."""
    r = _producer_call("cancel", id, (delay, realtime, cluster_file, meta))
    console.print(f"cancelled id={r.id} seq={r.seq}")


@app.command()
def lookup(id: str, delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt) -> None:
    """Show the state of a scheduled message."""
    r = _producer_call("lookup", id, (delay, realtime, cluster_file, meta))
    console.print(json.dumps(r.model_dump()))


@app.command()
def status(delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Role, group, master/slave, epoch and replication lag of every node (--json: every counter)."""
    resolver = _resolver(delay, realtime, cluster_file, meta)

    async def _run():
        from cluster.proto import hourglass_pb2 as pb
        from cluster.transport import Channels
        ch = Channels()
        out = []
        try:
            if hasattr(resolver, "load"):  # MetaResolver: every registered node
                await resolver.load()
            for address in resolver.delay + resolver.realtime:
                try:
                    r = await ch.admin(address).Status(pb.StatusRequest(), timeout=5)
                    out.append(json.loads(r.json))
                except Exception as e:  # a dead node is reported, not fatal
                    out.append({"address": address, "error": str(e)[:200]})
        finally:
            await ch.close()
        return out
    rows = asyncio.run(_run())
    if as_json:
        console.print_json(json.dumps(rows))
        return
    t = Table("node", "role", "group", "mode", "address", "epoch", "repl lag")
    for r in rows:
        lag = "" if r.get("mode") != "slave" else f"{r.get('replication_lag_bytes', 0)} B / {r.get('replication_lag_ms', 0)} ms"
        t.add_row(r.get("node_id", "?"), r.get("role", "?"), str(r.get("group", "")), r.get("mode", "master"),
                  r.get("address", "?"), str(r.get("election_epoch", r.get("epoch", ""))), lag)
    console.print(t)


admin = typer.Typer(help="Operations on a running cluster (handover).", no_args_is_help=True)
app.add_typer(admin, name="admin")


@admin.command("handover")
def admin_handover(group: str = typer.Argument(..., help="delay group whose master hands over"),
                   meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt,
                   wait_ms: int = typer.Option(5000, help="how long the master waits for a slave to catch up")) -> None:
    """Graceful handover: the master of GROUP stops dispatching, lets a slave take the final bytes and
    tick state, and resigns; the slave becomes master with no duplicates."""
    resolver = _resolver(None, None, cluster_file, meta)

    async def _run():
        from cluster.proto import hourglass_pb2 as pb
        from cluster.proto import hourglass_pb2_grpc as rpc
        from cluster.proto import meta_pb2 as mpb
        from cluster.transport import Channels
        if not hasattr(resolver, "meta"):
            raise typer.BadParameter("handover needs the meta servers (--meta or a cluster file with meta)")
        resp = await resolver.meta.call("GetServers", mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER))
        groups = {g.name: g for g in resp.groups}
        if group not in groups or not groups[group].master:
            raise typer.BadParameter(f"no delay group {group!r} with a live master (known: {sorted(groups)})")
        ch = Channels()
        try:
            return groups[group].master, await rpc.ReplicationStub(ch.get(groups[group].master)).Handover(
                pb.HandoverRequest(wait_ms=wait_ms), timeout=wait_ms / 1000 + 10)
        finally:
            await ch.close()
            await resolver.close()
    old, r = asyncio.run(_run())
    if not r.done:
        console.print(f"[red]handover refused[/red] by {old}: {r.error}")
        raise typer.Exit(1)
    console.print(f"[green]handed over[/green]: {old} is now a slave of group {group}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":
    sys.exit(app())
