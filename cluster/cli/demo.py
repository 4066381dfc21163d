"""``hourglass demo``: start a local cluster, schedule messages, show them delivered, stop."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cluster.cli.common import app, console

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
    console.print("  OPEN: plaintext and no authentication on 127.0.0.1, for this demo only "
                  "(`hourglass dev up --secure` and the Helm chart run mutual TLS and tokens; docs/security.md)",
                  markup=False)
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
