"""``hourglass admin``: operations on a cluster's nodes and their files.

    hourglass admin verify [--node ADDR,...]     every node's files, checked online (Admin.Verify)
    hourglass admin verify --data DIR            a stopped node's data folder, offline, read-only
    hourglass admin handover GROUP               graceful handover of a delay group's master
    hourglass admin force-in-sync GROUP NODE     unclean election: NODE may become master (may lose acks)
    hourglass admin route SUBJECT [--groups r1,r2] show SUBJECT's route, or set it (online; dropped groups drain)
    hourglass admin drain GROUP [--wait-s S]     move a delay group's pending messages away; 'empty' when done

Part of the ``hourglass`` app (``cluster/cli/__init__.py`` adds this sub-app). It uses the
helpers of ``cluster/cli/common.py``: the resolver, the option types, the error boundary's
``CliError`` and exit codes (docs/cli.md). Failures leave through that boundary as one ``error:`` line.

``admin verify`` prints one line per corrupt record (``corrupt: PATH at offset N: reason``,
``repaired`` when the node healed it: derived data is rebuilt), one line per rebuilt bucket
that lacks records (``lost: PATH: N records lost: messages ID,ID,...; cancels ...``, or
``missing`` while a replicated node is still fetching them from a member), ``note:`` lines for
what is normal (a torn tail the node drops at open), and ends with one summary line per node
(``ADDRESS: OK, ...`` / ``ADDRESS: N corrupt (M repaired), ...``) or for the folder.
Exit codes: 0 nothing corrupt is left (all OK, or every corrupt record repaired) and no record
is missing; 1 a corrupt record is left, or records are lost or missing; 2 the command line is
wrong (no such folder, --node with --data); 3 a node did not answer within --timeout-s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import grpc
import typer

from cluster import errors as E
from cluster.cli.common import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    RPC_TIMEOUT_S_MAX,
    CliError,
    ClusterFileOpt,
    DelayOpt,
    MetaOpt,
    RealtimeOpt,
    _resolver,
    _split,
    _within,
    console,
    err_console,
    shorten,
    shown,
)
from cluster.cli.status import _status_rows, drain_of, draining_text

admin = typer.Typer(help="Operations on a running cluster (verify, handover).", no_args_is_help=True)

VERIFY_TIMEOUT_S = 600.0  # default --timeout-s of `admin verify`: nodes read every file at verify_rate_mib_s
FINDINGS_SHOWN_MAX = 50   # corrupt records printed per node or folder (the summary counts them all)
IDS_SHOWN_MAX = 1000      # ids printed per bucket with lost records (the node's lost.json has them all)


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


def _print_report(where: str, report) -> None:
    for f in report.corrupt[:FINDINGS_SHOWN_MAX]:
        _say(f"corrupt: {f.path} at offset {f.offset}: {f.reason}" + (" (repaired)" if f.repaired else ""))
    if report.corrupt_count > FINDINGS_SHOWN_MAX:
        _say(f"corrupt: ... {report.corrupt_count - FINDINGS_SHOWN_MAX} more")
    for b in report.lost[:FINDINGS_SHOWN_MAX]:
        parts = [f"{b['records']} records {b['state']}"]
        for name in ("messages", "cancels"):
            ids = b[name]
            if ids:
                more = f",... (+{len(ids) - IDS_SHOWN_MAX})" if len(ids) > IDS_SHOWN_MAX else ""
                parts.append(f"{name} {','.join(ids[:IDS_SHOWN_MAX])}{more}")
        if b["seq_ranges"]:
            parts.append("seq ranges (first, last, records) " + " ".join(f"{lo}-{hi}:{n}" for lo, hi, n in b["seq_ranges"]))
        if b["unreadable_bytes"]:
            parts.append(f"{b['unreadable_bytes']} unreadable bytes")
        _say(f"lost: {b['path']}: " + "; ".join(parts))
    for n in report.notes[:FINDINGS_SHOWN_MAX]:
        _say(f"note: {n}")


@admin.command("verify")
def admin_verify(
    node: Optional[str] = typer.Option(None, "--node", help="node addresses, comma separated (default: every node)"),
    data: Optional[Path] = typer.Option(None, "--data", help="check this data folder offline (the node stopped)"),
    delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
    cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
    timeout_s: float = typer.Option(VERIFY_TIMEOUT_S, "--timeout-s", min=0.1,
                                    help="give up on a node after this many seconds (exit 3)"),
) -> None:
    """Check a node's files: every segment's CRCs, schedule indexes, checkpoints.

    Online (default, or --node): each node checks its own files at verify_rate_mib_s and heals
    derived data (schedule buckets are rebuilt from the message log). Offline (--data DIR):
    read-only check of a stopped node's folder. Records a rebuilt bucket lacks are listed by id
    ("lost:" lines). Exit 0 nothing corrupt left, 1 corruption left or records lost, 3 a node
    did not answer."""
    from node.store.verify import VerifyReport, verify_dir

    if data is not None:
        if node:
            raise CliError("give --node or --data, not both")
        if not data.is_dir():
            raise CliError(f"no data folder at {data}", hint="hint: --data takes a node's data folder (its --data-dir)")
        report = verify_dir(data, online=False)
        _print_report(str(data), report)
        _say(f"verify {report.summary()}")
        raise typer.Exit(EXIT_FAILED if report.corrupt_count or report.lost else 0)

    async def _run() -> list[tuple[str, VerifyReport | None, str]]:
        from cluster.proto import hourglass_pb2 as pb
        from cluster.transport import Channels

        resolver = _resolver(delay, realtime, cluster_file, meta) if not node else None
        if node:
            addresses = _split(node)
        else:
            rows = await _within(min(RPC_TIMEOUT_S_MAX, timeout_s), "admin verify: listing nodes",
                                 _status_rows(resolver, min(RPC_TIMEOUT_S_MAX, timeout_s)))
            addresses = [r["address"] for r in rows]
            if not addresses:
                raise E.Unavailable("no node is registered with the meta servers")
        ch = Channels(getattr(resolver, "security", None))

        async def ask(address: str) -> tuple[str, VerifyReport | None, str]:
            try:
                r = await ch.admin(address).Verify(pb.VerifyRequest(), timeout=timeout_s)
                return address, VerifyReport.from_json(r.json), ""
            except grpc.RpcError as e:
                return address, None, shorten(f"{e.code().name}: {e.details()}", 200)
            except (ValueError, TypeError) as e:
                return address, None, shorten(f"unreadable answer: {e}", 200)
        try:
            return list(await asyncio.gather(*(ask(a) for a in addresses)))
        finally:
            await ch.close()

    results = asyncio.run(_within(timeout_s, "admin verify", _run(), grace_s=5.0))
    left = down = 0
    for address, report, error in results:
        if report is None:
            err_console.print(f"error: {address}: {error}", style="red")
            down += 1
            continue
        _print_report(address, report)
        _say(f"verify {address} {report.summary()}")
        left += report.unrepaired + len(report.lost)
    if down:
        raise typer.Exit(EXIT_UNAVAILABLE)
    raise typer.Exit(EXIT_FAILED if left else 0)


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
            raise CliError("handover needs the meta servers", hint="hint: give --meta, or a --cluster-file with meta")
        resp = await resolver.meta.call("GetServers", mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER,
                                                                             include_draining=True))
        groups = {g.name: g for g in resp.groups}
        if group not in groups or not groups[group].master:
            raise E.NotFound(f"no delay group {shown(group)} with a live master (known: {sorted(groups)})")
        ch = Channels(getattr(resolver, "security", None))
        try:
            return groups[group].master, await rpc.ReplicationStub(ch.get(groups[group].master)).Handover(
                pb.HandoverRequest(wait_ms=wait_ms), timeout=wait_ms / 1000 + 10)
        finally:
            await ch.close()
            await resolver.close()
    old, r = asyncio.run(_run())
    if not r.done:
        err_console.print(f"error: handover refused by {old}: {shorten(r.error)}", style="red")
        raise typer.Exit(EXIT_FAILED)
    console.print(f"[green]handed over[/green]: {old} is now a slave of group {group}")


@admin.command("force-in-sync")
def admin_force_in_sync(group: str = typer.Argument(..., help="the group with no electable member"),
                        node: str = typer.Argument(..., help="node id to make electable"),
                        role: str = typer.Option("delay", help="delay or realtime"),
                        yes: bool = typer.Option(False, "--yes", help="do it (without it: only say what may be lost)"),
                        meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt) -> None:
    """Unclean election: make NODE the only member of GROUP's in-sync set, so it may be elected
    although it may lack acknowledged records (docs/replication.md, The in-sync set). Prints what
    may be lost (how far each member's message log reaches beyond NODE's) and does nothing
    without --yes."""
    if role not in ("delay", "realtime"):
        raise CliError(f"--role must be delay or realtime, not {shown(role)}")
    resolver = _resolver(None, None, cluster_file, meta)

    async def _run():
        from cluster.proto import meta_pb2 as mpb
        if not hasattr(resolver, "meta"):
            raise CliError("force-in-sync needs the meta servers", hint="hint: give --meta, or a --cluster-file")
        try:
            kind = mpb.DELAYED_PRODUCER if role == "delay" else mpb.CONSUMER
            servers = await resolver.meta.call("GetServers", mpb.GetServersRequest(kind=kind, include_draining=True))
            lr = await resolver.meta.call("Leader", mpb.LeaderRequest(role=role, group=group))
            g = next((x for x in servers.groups if x.name == group), None)
            ends = {m.node_id: int(m.offsets.get("message_log_end", 0)) for m in (g.members if g else [])}
            if node not in ends:
                raise E.NotFound(f"{shown(node)} is not a registered member of {role} group {shown(group)} "
                                 f"(members: {sorted(ends)})")
            behind = {k: v - ends[node] for k, v in ends.items() if k != node and v > ends[node]}
            r = None
            if yes:
                r = await resolver.meta.call("ForceInSync", mpb.ForceInSyncRequest(role=role, group=group,
                                                                                   node_id=node))
            return lr, behind, r
        finally:
            await resolver.close()
    lr, behind, r = asyncio.run(_run())
    loss = ", ".join(f"{k} holds {v} more bytes of message log" for k, v in sorted(behind.items())) or \
        "no registered member holds more of the message log (unregistered members may)"
    now = list(lr.in_sync) or ["(none recorded)"]
    if not yes:
        console.print(f"in-sync set of {role}/{group}: {', '.join(now)}; forcing {node} may lose acknowledged "
                      f"records: {loss}. Run again with --yes to do it.")
        raise typer.Exit(EXIT_FAILED)
    console.print(f"[yellow]forced[/yellow]: in-sync set of {role}/{group} is now [{node}] (was "
                  f"{', '.join(r.previous) or 'none'}); possibly lost: {loss}")


@admin.command("route")
def admin_route(subject: str = typer.Argument(..., help="the subject whose route is shown or changed"),
                groups: Optional[str] = typer.Option(None, "--groups", help="every real-time group the subject is "
                                                     "written to, comma separated; left out: show the route"),
                meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt) -> None:
    """Show SUBJECT's route, or set it to real-time GROUPS online (docs/design.md, "A subject over
    several real-time groups"): new messages of the subject spread over every listed group by id
    hash and consumers pull from all of them; nothing stored moves. A group left out drains
    first: it takes no new messages of the subject, consumers keep pulling what it holds, and it
    leaves the route by itself once every consumer group acked it all ("draining: GROUP (N
    left)" meanwhile). A list equal to the route is a no-op."""
    resolver = _resolver(None, None, cluster_file, meta)

    async def _run():
        from cluster.proto import meta_pb2 as mpb
        if not hasattr(resolver, "meta"):
            raise CliError("route needs the meta servers", hint="hint: give --meta, or a --cluster-file")
        try:
            r = await resolver.meta.call("SetRoute", mpb.SetRouteRequest(subject=subject,
                                                                          groups=_split(groups or "")))
            try:  # progress of a drain, best effort: the route is what was asked for
                left = await _left(resolver, subject, list(r.draining)) if r.draining else {}
            except E.HourglassError:
                left = {}
            return r, left
        finally:
            await resolver.close()
    r, left = asyncio.run(_run())
    now = ",".join(r.groups)
    draining = "; ".join(draining_text(g, left.get(g, "?")) for g in r.draining)
    if not r.changed:
        _say(f"{'route' if not groups else 'unchanged'}: {subject} routes to {now} (epoch {r.epoch})"
             + (f"; {draining}" if draining else ""))
        return
    newly = [g for g in r.draining if g in r.previous]
    if newly:
        _say(f"narrowing: {subject} -> {now} (epoch {r.epoch}); draining {','.join(newly)}: its stored messages "
             f"stay readable until every consumer group acked them")
        return
    _say(f"routed: {subject} -> {now} (epoch {r.epoch}; was {','.join(r.previous) or 'none'})"
         + (f"; {draining}" if draining else ""))


@admin.command("release")
def admin_release(subject: str = typer.Argument(..., help="the subject whose narrowing waits"),
                  consumer_group: str = typer.Argument(..., help="the consumer group that stopped for good"),
                  yes: bool = typer.Option(False, "--yes", help="do it (without it: only say what is given up)"),
                  meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt) -> None:
    """Release CONSUMER_GROUP from SUBJECT's drains (docs/design.md, "Releasing a consumer
    group"): a narrowing waits until every consumer group of the subject acked what the dropped
    group holds, so one that stopped for good holds it back for ever. Released, it holds nothing
    back: its unacked messages of SUBJECT on the draining groups are given up (never delivered to
    it; every other consumer group still gets them). Says what it would give up and does nothing
    without --yes."""
    resolver = _resolver(None, None, cluster_file, meta)

    async def _run():
        from cluster.proto import meta_pb2 as mpb
        if not hasattr(resolver, "meta"):
            raise CliError("release needs the meta servers", hint="hint: give --meta, or a --cluster-file")
        try:
            route = await resolver.meta.call("SetRoute", mpb.SetRouteRequest(subject=subject))  # no groups: show
            draining = list(route.draining)
            if not draining:
                raise E.NotFound(f"subject {shown(subject)} drains in no real-time group: nothing to release "
                                 f"{shown(consumer_group)} from")
            if not yes:
                try:  # best effort: what the drains hold back in all
                    left = await _left(resolver, subject, draining)
                except E.HourglassError:
                    left = {}
                return draining, left, None
            r = await resolver.meta.call("ReleaseConsumerGroup", mpb.ReleaseRequest(subject=subject,
                                                                                  consumer_group=consumer_group))
            return draining, {}, r
        finally:
            await resolver.close()
    draining, left, r = asyncio.run(_run())
    if r is None:
        held = "; ".join(draining_text(g, left.get(g, "?")) for g in draining)
        console.print(f"{subject} {held}; releasing {consumer_group} gives up its unacked messages of {subject} "
                      f"on {','.join(draining)} (the other consumer groups still get them). Run again with --yes "
                      f"to do it.")
        raise typer.Exit(EXIT_FAILED)
    word = "released" if r.changed else "unchanged"
    _say(f"{word}: the drains of {subject} on {','.join(r.groups)} no longer wait for {consumer_group}"
         + ("; its unacked messages there are given up" if r.changed else " (released before)"))


async def _left(resolver, subject: str, groups: list[str]) -> dict[str, str]:
    """Draining group -> entries of ``subject`` its master holds that a consumer group the drain
    waits for has not acked (``drain_of``; "?" when its master cannot be asked or has not
    loaded the fence yet)."""
    import json

    from cluster.proto import hourglass_pb2 as pb
    from cluster.transport import Channels
    out: dict[str, str] = {}
    ch = Channels(getattr(resolver, "security", None))
    try:
        masters = {g["group"]: g["master"] for g in (await resolver.load())["realtime"]}
        for g in groups:
            if not masters.get(g):
                out[g] = "no master now: ?"
                continue
            try:
                st = json.loads((await ch.admin(masters[g]).Status(pb.StatusRequest(),
                                                                    timeout=RPC_TIMEOUT_S_MAX)).json)
            except grpc.RpcError as e:
                out[g] = f"master did not answer ({e.code().name}): ?"
                continue
            d = drain_of(st, subject)
            out[g] = "?" if d is None else str(d["left"])
    finally:
        await ch.close()
    return out


DRAIN_POLL_S = 1.0  # `admin drain --wait-s`: the master's status is asked this often


@admin.command("drain")
def admin_drain(group: str = typer.Argument(..., help="the delay group to empty"),
                wait_s: float = typer.Option(0.0, "--wait-s", min=0, max=86_400,
                                             help="wait up to this long for the group to be empty"),
                meta: Optional[str] = MetaOpt, cluster_file: Optional[Path] = ClusterFileOpt) -> None:
    """Drain delay GROUP (docs/operations.md, "Removing a delay group"): producers stop being given
    it, its master moves its pending messages to the other delay groups (same ids, due times
    unchanged, cancels honoured) and fires those due within a few seconds itself. Running it again
    reports progress; 'empty: GROUP' once it holds nothing (exit 0), else exit 1 after --wait-s."""
    resolver = _resolver(None, None, cluster_file, meta)

    async def _run():
        import json

        from cluster.proto import hourglass_pb2 as pb
        from cluster.proto import meta_pb2 as mpb
        from cluster.transport import Channels
        if not hasattr(resolver, "meta"):
            raise CliError("drain needs the meta servers", hint="hint: give --meta, or a --cluster-file")
        ch = Channels(getattr(resolver, "security", None))
        try:
            r = await resolver.meta.call("Drain", mpb.DrainRequest(group=group))
            _say(("draining: " if r.changed else "already draining: ") + f"{group} -> {','.join(r.others)}")
            loop = asyncio.get_running_loop()
            end = loop.time() + wait_s
            for _ in range(int(wait_s / DRAIN_POLL_S) + 2):
                servers = await resolver.meta.call("GetServers", mpb.GetServersRequest(
                    kind=mpb.DELAYED_PRODUCER, include_draining=True))
                g = next((x for x in servers.groups if x.name == group), None)
                d = None
                if g is not None and g.master:
                    try:
                        st = await ch.admin(g.master).Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S_MAX)
                        d = json.loads(st.json).get("drain")
                    except grpc.RpcError as e:
                        _say(f"{group}: master {g.master} did not answer: {e.code().name}")
                if d is not None and d.get("state") == "empty":
                    _say(f"empty: {group} holds nothing (moved {d.get('moved', 0)}); it can be removed")
                    return True
                if d is not None:
                    _say(f"{d.get('state', '?')}: {group}: {d.get('pending', 0)} pending, {d.get('in_flight', 0)} "
                         f"in flight, {d.get('near', 0)} due soon (fired here), moved {d.get('moved', 0)}")
                elif g is None or not g.master:
                    _say(f"{group}: no master now (a failover?); the next master carries on")
                if loop.time() + DRAIN_POLL_S > end:
                    return False
                await asyncio.sleep(DRAIN_POLL_S)
            return False
        finally:
            await ch.close()
            await resolver.close()
    if not asyncio.run(_run()):
        raise typer.Exit(EXIT_FAILED)
