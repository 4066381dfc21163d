"""The ``hourglass`` command line (typer).

    hourglass demo                      start a local cluster, schedule, show deliveries, stop
    hourglass dev up                    a local cluster that runs until Ctrl-C
    hourglass node --role delay ...     one node process (what containers run)
    hourglass send SUBJECT PAYLOAD --delay-ms 5000 [--count N]
    hourglass consume SUBJECT --group G [--count N]
    hourglass cancel ID | lookup ID | status

Client commands find the cluster through ``--meta``/``--delay``/``--realtime`` addresses,
an explicit ``--cluster-file``, the ``HOURGLASS_META_SERVERS``/``HOURGLASS_DELAY_NODES``/
``HOURGLASS_REALTIME_NODES`` variables, or the ``var/dev/cluster.json`` that ``hourglass dev up``
writes (in that order).

Errors (docs/cli.md): every failure leaves through one boundary (``HourglassApp.__call__``) as
one ``error:`` line and at most one ``hint:`` line on stderr, with an exit code from
``EXIT_CODES``; never a traceback unless ``HOURGLASS_DEBUG=1``. Arguments are checked before
any network call, and every command that talks to the cluster runs under ``--timeout-s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

import grpc
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cluster import errors as E
from cluster.status import from_rpc_error

# ---------------------------------------------------------------------- the error boundary

EXIT_FAILED = 1       # anything else: messages rejected, a handover refused, an unexpected error (a bug)
EXIT_USAGE = 2        # the command line is wrong (click's usage errors exit 2 too): fix it, do not retry
EXIT_UNAVAILABLE = 3  # the cluster cannot be reached or cannot serve now, or no answer in --timeout-s: retry later
EXIT_NOT_FOUND = 4    # no message with that id (cancel, lookup)
EXIT_CONFLICT = 5     # too late to cancel (already dispatched), or the id exists with other content

HINT_UNAVAILABLE = ("hint: check that the cluster is up and the addresses are right (--meta, --cluster-file, "
                    "HOURGLASS_META_SERVERS; `hourglass dev up` starts a local one), then retry")
HINT_BUG = "hint: this is a bug in hourglass; rerun with HOURGLASS_DEBUG=1 to see the traceback and report it"


class CliError(E.HourglassError):
    """A failure the CLI finds itself (no cluster given, an unreadable cluster file), with
    its exit code and hint line."""

    def __init__(self, message: str, *, code: int = EXIT_USAGE, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


# error class -> (exit code, hint line or ""); most specific first
EXIT_CODES: list[tuple[type[BaseException], int, str]] = [
    (E.UnknownSubject, EXIT_NOT_FOUND, ""),
    (E.InvalidArgument, EXIT_USAGE, ""),
    (E.NotFound, EXIT_NOT_FOUND, ""),
    (E.TooLate, EXIT_CONFLICT, ""),
    (E.AlreadyExists, EXIT_CONFLICT, "hint: give another --id, or send the same content again"),
    (E.Unavailable, EXIT_UNAVAILABLE, HINT_UNAVAILABLE),
    (E.StaleEpoch, EXIT_UNAVAILABLE, "hint: a new master was elected meanwhile; retry"),
    (E.StorageError, EXIT_FAILED, "hint: a node's files are damaged; see its log and docs/operations.md"),
    (E.HourglassError, EXIT_FAILED, ""),
]

MESSAGE_CHARS_MAX = 300  # an error line longer than this is cut in the middle (a 10 KB id is not echoed)
SHOWN_CHARS_MAX = 64     # user input quoted in a message (ids, subjects) is cut to this


def shorten(text: str, limit: int = MESSAGE_CHARS_MAX) -> str:
    """One line of at most about ``limit`` characters: newlines folded, the middle cut."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    keep = limit - 40
    return f"{text[:keep * 2 // 3]} ...[{len(text) - keep} characters cut]... {text[-(keep // 3):]}"


def shown(value: str) -> str:
    """``value`` as quoted in a message: repr, cut to ``SHOWN_CHARS_MAX`` with its length said."""
    if len(value) <= SHOWN_CHARS_MAX:
        return repr(value)
    return f"{value[:SHOWN_CHARS_MAX - 16]!r}... ({len(value.encode())} bytes)"


def explain(exc: BaseException) -> tuple[int, list[str]]:
    """The exit code and the one or two lines the CLI prints for a failure."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # a TaskGroup's: its first error
        exc = exc.exceptions[0]
    if isinstance(exc, grpc.RpcError):  # a raw RPC the CLI made itself (status, handover)
        exc = from_rpc_error(exc)
    if isinstance(exc, CliError):
        return exc.code, [f"error: {shorten(str(exc))}"] + ([exc.hint] if exc.hint else [])
    for cls, code, hint in EXIT_CODES:
        if isinstance(exc, cls):
            return code, [f"error: {shorten(str(exc) or type(exc).__name__)}"] + ([hint] if hint else [])
    return EXIT_FAILED, [f"error: unexpected {type(exc).__name__}: {shorten(str(exc))}", HINT_BUG]


class HourglassApp(typer.Typer):
    """The typer app with the CLI's one error boundary. Click runs without its standalone
    mode, so its usage errors come here too (one line, exit 2, a pointer to --help);
    ``typer.Exit(code)`` exits with its code; any other exception is printed by ``explain``
    and exits with its code. ``HOURGLASS_DEBUG=1`` shows the traceback instead."""

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("standalone_mode", False)
        try:
            rv = super().__call__(*args, **kwargs)
        except typer.Abort:
            _print_error(["error: aborted"])
            sys.exit(EXIT_FAILED)
        except Exception as exc:
            if _is_click_error(exc):  # typer's (vendored) click: a usage error, exit 2
                if type(exc).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
                    ctx = getattr(exc, "ctx", None)
                    _print_error([f"error: {shorten(exc.format_message())}"]
                                 + ([f"hint: see `{ctx.command_path} --help`"] if ctx is not None else []))
                sys.exit(exc.exit_code)
            if os.environ.get("HOURGLASS_DEBUG", "") not in ("", "0"):
                raise
            code, lines = explain(exc)
            _print_error(lines)
            sys.exit(code)
        sys.exit(rv if isinstance(rv, int) else 0)  # an int is typer.Exit's code (non-standalone click)


def _is_click_error(exc: BaseException) -> bool:
    """Click's ``ClickException`` (typer vendors click, so it is told by its shape)."""
    return callable(getattr(exc, "format_message", None)) and isinstance(getattr(exc, "exit_code", None), int)


def _print_error(lines: list[str]) -> None:
    for line in lines:
        err_console.print(line, style="red" if line.startswith("error:") else None)


app = HourglassApp(add_completion=False, no_args_is_help=True, help="Hourglass: a broker for delayed messages.")
from cluster.cli_dev import dev  # noqa: E402  (dev up, dev chaos)
app.add_typer(dev, name="dev")
from cluster.spark.cli import app as spark_app  # noqa: E402  (imports pyspark only when a command runs)
app.add_typer(spark_app, name="spark")
console = Console(soft_wrap=True)  # a line is never cut or wrapped at the terminal's width
err_console = Console(stderr=True, soft_wrap=True, highlight=False, markup=False)

DEFAULT_CLUSTER_FILE = Path("var/dev/cluster.json")
TIMEOUT_S = 15.0           # default --timeout-s: the deadline of a whole command's network work
RPC_TIMEOUT_S_MAX = 10.0   # the deadline of one RPC (never more than --timeout-s)
DEADLINE_GRACE_S = 5.0     # the SDK answers within call_timeout_s (= --timeout-s); the backstop waits this much more
INT64_MAX = (1 << 63) - 1  # deliver_at_ms is an int64 on the wire
AT_PAST_SLACK_MS = 60_000  # --at may lie this far in the past (clock skew, a slow script); earlier is refused


def _split(v: str | None) -> list[str]:
    return [a.strip() for a in (v or "").split(",") if a.strip()]


def _read_cluster_file(path: Path) -> tuple[list[str], list[str], list[str]]:
    """(delay, realtime, meta) addresses from a cluster.json; every failure names the file."""
    hint = "hint: `hourglass dev up` writes var/dev/cluster.json while it runs; or give --meta"
    try:
        info = json.loads(path.read_text())
    except OSError as e:
        raise CliError(f"cannot read cluster file {path}: {e.strerror or e}", hint=hint) from None
    except ValueError as e:
        raise CliError(f"cluster file {path} is not valid JSON: {e}", hint=hint) from None
    if not isinstance(info, dict):
        raise CliError(f"cluster file {path} is not a JSON object", hint=hint)
    lists = [info.get(k) or [] for k in ("delay", "realtime", "meta")]
    if not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in lists) or not any(lists):
        raise CliError(f"cluster file {path} lists no delay, realtime or meta addresses", hint=hint)
    return lists[0], lists[1], lists[2]


def _resolver(delay: str | None, realtime: str | None, cluster_file: Path | None, meta: str | None = None):
    """A resolver from, in this order: --meta/--delay/--realtime, --cluster-file, the
    HOURGLASS_* variables, var/dev/cluster.json. Meta servers win unless --delay/--realtime
    are given."""
    from cluster.client import StaticResolver

    env = os.environ.get
    if delay or realtime or meta:
        d = _split(delay or env("HOURGLASS_DELAY_NODES"))
        r = _split(realtime or env("HOURGLASS_REALTIME_NODES"))
        m = _split(meta)
    elif cluster_file is not None:
        d, r, m = _read_cluster_file(cluster_file)
    else:
        d, r, m = (_split(env(k)) for k in ("HOURGLASS_DELAY_NODES", "HOURGLASS_REALTIME_NODES",
                                           "HOURGLASS_META_SERVERS"))
        if not (d or r or m) and DEFAULT_CLUSTER_FILE.exists():
            d, r, m = _read_cluster_file(DEFAULT_CLUSTER_FILE)
    if m and not (delay or realtime):
        from cluster.discovery import MetaResolver
        return MetaResolver(m)  # each meta call has its own deadline (timeout_s)
    if not d and not r:
        raise CliError("no cluster given", hint="hint: give --meta (or --delay/--realtime, or --cluster-file), "
                       "set HOURGLASS_META_SERVERS, or run `hourglass dev up`")
    return StaticResolver(delay=d, realtime=r)


def _sdk_timeouts(timeout_s: float) -> dict:
    """Producer/Consumer deadlines from --timeout-s: one RPC, and one call with its retries."""
    return {"timeout_s": min(RPC_TIMEOUT_S_MAX, timeout_s), "call_timeout_s": timeout_s}


async def _check_reachable(resolver, *, delayed: bool, subject: str = "") -> None:
    """One discovery call before the SDK's retries, so that a cluster that cannot be reached,
    or has no group to serve the command, is said at once with its cause (not after
    --timeout-s of retrying)."""
    if not delayed:
        await resolver.realtime_for(subject)
    elif not await resolver.delay_groups():
        raise CliError("no delay group is registered with the meta servers", code=EXIT_UNAVAILABLE,
                       hint="hint: start a delay node (`hourglass dev up` starts one), then retry")


async def _within(timeout_s: float, what: str, coro, *, grace_s: float = 0.0):
    """Await ``coro`` under the deadline ``timeout_s`` (+ ``grace_s`` when the SDK keeps its own
    deadline of ``timeout_s``: this is the backstop); running out is ``Unavailable``."""
    try:
        async with asyncio.timeout(timeout_s + grace_s):
            return await coro
    except TimeoutError:
        raise E.Unavailable(f"{what}: no answer within {timeout_s:g} s (--timeout-s)") from None


DelayOpt = typer.Option(None, "--delay", help="delay node addresses, comma separated")
RealtimeOpt = typer.Option(None, "--realtime", help="real-time node addresses, comma separated")
ClusterFileOpt = typer.Option(None, "--cluster-file", help="cluster.json written by `hourglass dev up`")
MetaOpt = typer.Option(None, "--meta", help="meta server addresses, comma separated (discover through them)")
TimeoutOpt = typer.Option(TIMEOUT_S, "--timeout-s", min=0.1, help="give up after this many seconds (exit 3)")


# ---------------------------------------------------------------------- node


def _serve(settings_cls, overrides: dict, serve) -> None:
    """Validate settings (a clear message and exit 2 when bad), then serve until SIGINT/SIGTERM.
    A server that fails logs its traceback (operators read the log) before the boundary
    prints its one line."""
    import logging

    from pydantic import ValidationError

    from node.server import configure_logging

    try:
        settings = settings_cls(**overrides)
    except ValidationError as e:
        raise CliError("bad settings: " + "; ".join(f"{'.'.join(map(str, x['loc'])) or 'settings'}: {x['msg']}"
                                                   for x in e.errors())) from None
    configure_logging(settings.log_level)
    profile_to = os.environ.get("HOURGLASS_PROFILE_TO")  # benchmarks: cProfile of the serving thread
    try:
        if not profile_to:
            asyncio.run(serve(settings))
            return
        import cProfile

        with cProfile.Profile() as prof:
            asyncio.run(serve(settings))
        prof.dump_stats(f"{profile_to}.{os.getpid()}")
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


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _check_subject(subject: str) -> None:
    """The subject rule of the wire format (``codec.SUBJECT_RE``), checked before any call."""
    from cluster.codec import SUBJECT_RE

    if not subject:
        raise E.InvalidArgument("subject", "it is empty; give one such as orders.cancel")
    if not SUBJECT_RE.match(subject):
        raise E.InvalidArgument("subject", f"{shown(subject)}: use letters, digits, '.', '_' and '-', "
                                           "starting with a letter or digit")


def _parse_at(at: str, now_ms: int) -> int:
    """``--at`` as epoch ms: digits are epoch milliseconds, anything else ISO 8601 (UTC unless it
    names a zone). Refused: what is no time, what does not fit the wire's int64, and a time more
    than ``AT_PAST_SLACK_MS`` ago (a mistake: a message due in the past is delivered at once, so
    say so). Times beyond the delay horizon are the server's to refuse (its horizon is a setting)."""
    text = at.strip()
    if re.fullmatch(r"-?[0-9]+", text):
        ms = int(text)
    else:
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise E.InvalidArgument("--at", f"{shown(at)} is neither epoch milliseconds nor an ISO 8601 time "
                                            "such as 2030-01-31T12:00:00Z") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        ms = (dt - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1)
    if not 0 <= ms <= INT64_MAX:
        raise E.InvalidArgument("--at", f"{shown(at)} is out of range: epoch milliseconds from 0 to 2^63-1")
    if ms < now_ms - AT_PAST_SLACK_MS:
        raise E.InvalidArgument("--at", f"{_iso(ms)} is in the past (--at takes milliseconds or ISO 8601); "
                                        "leave --at out to deliver now")
    return ms


@app.command()
def send(
    subject: str,
    payload: str = typer.Argument(""),
    delay_ms: int = typer.Option(0, help="deliver this many ms from now"),
    at: Optional[str] = typer.Option(None, help="deliver at this time: ISO 8601 (UTC unless given) or epoch ms"),
    id: str = typer.Option("", help="message id (idempotent); with --count, a prefix"),
    tag: list[str] = typer.Option([], help="tags (repeatable)"),
    count: int = typer.Option(1, min=1, help="send this many copies (ids get a -N suffix)"),
    delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
    cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
    timeout_s: float = TimeoutOpt,
) -> None:
    """Schedule a message (or --count of them, with a progress bar)."""
    _check_subject(subject)
    now = _now_ms()
    if delay_ms < 0:
        raise E.InvalidArgument("--delay-ms", f"{delay_ms} is negative; give 0 (deliver now) or more")
    if delay_ms > INT64_MAX - now:
        raise E.InvalidArgument("--delay-ms", f"{shown(str(delay_ms))} is out of range: the due time must fit "
                                              "epoch milliseconds (int64)")
    if at is not None and delay_ms:
        raise E.InvalidArgument("--at", "give --at or --delay-ms, not both")
    deliver_at = _parse_at(at, now) if at is not None else 0
    resolver = _resolver(delay, realtime, cluster_file, meta)
    asyncio.run(_within(timeout_s, "send", _send(resolver, subject, payload, delay_ms, deliver_at, id, tag, count,
                                                 timeout_s), grace_s=DEADLINE_GRACE_S))


SEND_CALL_MAX = 1000  # messages per send_many call of ``hourglass send --count`` (the progress step)
REJECTIONS_SHOWN_MAX = 10  # rejected messages listed one a line; the rest are counted


async def _send(resolver, subject, payload, delay_ms, deliver_at, id, tags, count, timeout_s) -> None:
    """One message: its error leaves through the boundary. ``--count`` messages: up to
    ``REJECTIONS_SHOWN_MAX`` rejections listed, the exit code that of the first."""
    from cluster.client import Producer

    immediate = not delay_ms and not deliver_at
    ids = [f"{id}-{i}" for i in range(count)] if id and count > 1 else [id] * count if id else None
    data = payload.encode()
    accepted: list = []
    errors: dict[int, Exception] = {}
    try:
        await _check_reachable(resolver, delayed=not immediate, subject=subject)
        async with Producer(resolver, **_sdk_timeouts(timeout_s)) as p:
            with Progress(console=console, transient=True, disable=count < 1000) as prog:
                task = prog.add_task("sending", total=count)
                futs = []
                for lo in range(0, count, SEND_CALL_MAX):
                    hi = min(count, lo + SEND_CALL_MAX)
                    futs.append((lo, await p.send_many(subject, [data] * (hi - lo),
                                                       ids=ids[lo:hi] if ids else None, delay_ms=delay_ms or None,
                                                       deliver_at_ms=deliver_at or None, tags=tag_list(tags),
                                                       immediate=immediate)))
                for lo, f in futs:
                    res = await f
                    errors.update({lo + i: e for i, e in res.errors.items()})
                    accepted += [res.result(i) for i in range(len(res)) if i not in res.errors][:10 - len(accepted)]
                    prog.update(task, completed=lo + len(res))
    finally:
        await resolver.close()
    if count == 1 and errors:
        raise errors[0]
    for r in accepted:
        console.print(f"accepted id={r.id} seq={r.seq} deliver_at_ms={r.deliver_at_ms}"
                      + (" (duplicate)" if r.duplicate else ""), markup=False, highlight=False)
    for i, e in sorted(errors.items())[:REJECTIONS_SHOWN_MAX]:
        err_console.print(f"rejected: message {i}: {shorten(str(e))}")
    if count > 10:
        console.print(f"{count - len(errors)} accepted, {len(errors)} rejected")
    if errors:
        raise typer.Exit(explain(errors[min(errors)])[0])


def tag_list(tags) -> list[str]:
    return [t for t in tags if t]


@app.command()
def consume(
    subject: str,
    group: str = typer.Option(..., help="consumer group"),
    count: int = typer.Option(0, min=0, help="stop after this many messages (0 = until Ctrl-C or --idle-s)"),
    idle_s: float = typer.Option(0, min=0, help="stop after this many seconds without a message (0 = never)"),
    tag: list[str] = typer.Option([], help="only messages with one of these tags"),
    delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
    cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
    timeout_s: float = TimeoutOpt,
) -> None:
    """Pull messages, print them and ack them.

    Fails at once if the cluster cannot be reached at the start; once it was reached, rides out
    failures (a failover) for up to --timeout-s."""
    _check_subject(subject)
    if not group:
        raise E.InvalidArgument("--group", "it is empty; give a consumer group name")
    resolver = _resolver(delay, realtime, cluster_file, meta)
    asyncio.run(_consume(resolver, subject, group, count, idle_s, tag_list(tag), timeout_s))


CONSUME_PAUSE_S_MAX = 1.0  # the pause between pulls while the cluster does not answer


async def _consume(resolver, subject, group, count, idle_s, tags, timeout_s) -> None:
    from cluster.client import Consumer

    n = 0
    last = time.monotonic()
    failing_since: float | None = None
    reached = False
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(resolver.close)
        c = await stack.enter_async_context(Consumer(resolver, subject, group=group, tags=tags, wait_ms=500,
                                                     **_sdk_timeouts(timeout_s)))
        while not count or n < count:
            try:
                batch = await c.pull(max_messages=count - n if count else None)
                for m in batch:
                    console.print(f"{m.id}  subject={m.subject}  lateness={m.lateness_ms}ms  "
                                  f"payload={m.payload[:80]!r}", markup=False, highlight=False)
                await c.ack(batch)
            except E.Unavailable:
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if not reached or now - failing_since >= timeout_s:
                    raise
                await asyncio.sleep(min(CONSUME_PAUSE_S_MAX, timeout_s - (now - failing_since)))
                continue
            reached, failing_since = True, None
            n += len(batch)
            if batch:
                last = time.monotonic()
            elif idle_s and time.monotonic() - last > idle_s:
                break


def _producer_call(method: str, id: str, resolver_args: tuple, timeout_s: float):
    """Run ``Producer.<method>(id)`` under the deadline; errors leave through the boundary,
    a long id cut down in their message."""
    from cluster.client import Producer

    if not id:
        raise E.InvalidArgument("id", "it is empty")
    resolver = _resolver(*resolver_args)

    async def _run():
        try:
            await _check_reachable(resolver, delayed=True)
            async with Producer(resolver, **_sdk_timeouts(timeout_s)) as p:
                return await getattr(p, method)(id)
        finally:
            await resolver.close()
    try:
        return asyncio.run(_within(timeout_s, method, _run(), grace_s=DEADLINE_GRACE_S))
    except E.HourglassError as e:
        if len(id) > SHOWN_CHARS_MAX:
            e.args = (str(e).replace(repr(id), shown(id)).replace(id, shown(id)),)
        raise


@app.command()
def cancel(id: str, delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
           timeout_s: float = TimeoutOpt) -> None:
    """Cancel a scheduled message by id (exit 4: no such id; 5: already dispatched)."""
    r = _producer_call("cancel", id, (delay, realtime, cluster_file, meta), timeout_s)
    console.print(f"cancelled id={r.id} seq={r.seq}", markup=False, highlight=False)


@app.command()
def lookup(id: str, delay: Optional[str] = DelayOpt, realtime: Optional[str] = RealtimeOpt,
           cluster_file: Optional[Path] = ClusterFileOpt, meta: Optional[str] = MetaOpt,
           timeout_s: float = TimeoutOpt) -> None:
    """Show the state of a scheduled message as JSON (exit 4: no such id)."""
    from dataclasses import asdict

    r = _producer_call("lookup", id, (delay, realtime, cluster_file, meta), timeout_s)
    console.print(json.dumps(asdict(r)), markup=False, highlight=False)


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
        for line in status_table(rows):
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
    ch = Channels()

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
        cells.append([str(r.get("node_id", "?")), str(r.get("role", "?")), str(r.get("group", "")), mode,
                      str(r.get("address", "?")), str(r.get("election_epoch", r.get("epoch", ""))), lag,
                      r.get("error", "")])
    keep = [i for i in range(len(STATUS_COLUMNS)) if i < 7 or any(c[i] for c in cells)]  # "error" only if any
    table = [[STATUS_COLUMNS[i] for i in keep]] + [[c[i] for i in keep] for c in cells]
    widths = [max(len(line[j]) for line in table) for j in range(len(keep))]
    return ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in table]


# admin verify, admin handover (cluster/cli_admin.py uses the helpers above); under `python -m
# cluster.cli` this module is __main__: cli_admin must find it as cluster.cli, not load a second copy
sys.modules.setdefault("cluster.cli", sys.modules[__name__])
from cluster.cli_admin import admin  # noqa: E402
app.add_typer(admin, name="admin")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":
    sys.exit(app())
