"""What every ``hourglass`` command shares: the one error boundary (``HourglassApp``, exit
codes, ``explain``), the app, the consoles, finding the cluster (``_resolver``), deadlines
and the common options."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import typer
from rich.console import Console

from cluster import errors as E
from cluster.status import from_rpc_error

# ---------------------------------------------------------------------- the error boundary

EXIT_FAILED = 1       # anything else: messages rejected, a handover refused, an unexpected error (a bug)
EXIT_USAGE = 2        # the command line is wrong (click's usage errors exit 2 too): fix it, do not retry
EXIT_UNAVAILABLE = 3  # the cluster cannot be reached or cannot serve now, or no answer in --timeout-s: retry later
EXIT_NOT_FOUND = 4    # no message with that id (cancel, lookup)
EXIT_CONFLICT = 5     # too late to cancel (already dispatched), or the id exists with other content
EXIT_DISK_FULL = 6    # a node refused the write for lack of disk space (DiskFull): free space there, then retry

HINT_UNAVAILABLE = ("hint: check that the cluster is up and the addresses are right (--meta, --cluster-file, "
                    "HOURGLASS_META_SERVERS; `hourglass dev up` starts a local one), then retry")
HINT_BUG = "hint: this is a bug in hourglass; rerun with HOURGLASS_DEBUG=1 to see the traceback and report it"


def hint_disk_full(exc: BaseException) -> str:
    """The hint of a ``DiskFull``: the node and its free space (the server puts both in the error)."""
    node = getattr(exc, "node", "") or "the node named above"
    free = getattr(exc, "free_bytes", -1)
    has = f" ({free / (1 << 20):.2f} MiB free)" if isinstance(free, int) and free >= 0 else ""
    return (f"hint: free space on the data disk of {node}{has}, or wait for retention; it takes writes again by "
            "itself, then retry (docs/operations.md, \"When the disk fills\")")


class CliError(E.HourglassError):
    """A failure the CLI finds itself (no cluster given, an unreadable cluster file), with
    its exit code and hint line."""

    def __init__(self, message: str, *, code: int = EXIT_USAGE, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


# error class -> (exit code, hint line or "" or a function of the error); most specific first
EXIT_CODES: list[tuple[type[BaseException], int, str | Callable[[BaseException], str]]] = [
    (E.UnknownSubject, EXIT_NOT_FOUND, ""),
    (E.InvalidArgument, EXIT_USAGE, ""),
    (E.NotFound, EXIT_NOT_FOUND, ""),
    (E.TooLate, EXIT_CONFLICT, ""),
    (E.AlreadyExists, EXIT_CONFLICT, "hint: give another --id, or send the same content again"),
    (E.DiskFull, EXIT_DISK_FULL, hint_disk_full),
    (E.Unavailable, EXIT_UNAVAILABLE, HINT_UNAVAILABLE),
    (E.StaleEpoch, EXIT_UNAVAILABLE, "hint: a new master was elected meanwhile; retry"),
    (E.StorageError, EXIT_FAILED, "hint: a node's files are damaged; see its log and docs/operations.md"),
    (E.Unauthenticated, EXIT_FAILED, "hint: give a token (HOURGLASS_TOKEN or HOURGLASS_TOKEN_FILE) and a "
                                     "client certificate (HOURGLASS_TLS_*); docs/security.md"),
    (E.PermissionDenied, EXIT_FAILED, "hint: this token's grants do not cover it; docs/security.md"),
    (E.CannotListen, EXIT_FAILED, "hint: give another --port (HOURGLASS_PORT), or stop what holds this one"),
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
            hint = hint(exc) if callable(hint) else hint
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


def _read_cluster_file(path: Path) -> tuple[list[str], list[str], list[str], dict | None]:
    """(delay, realtime, meta) addresses and the client credentials (``security``: file paths,
    written by ``dev up --secure``) from a cluster.json; every failure names the file."""
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
    sec = info.get("security")
    if sec is not None and not (isinstance(sec, dict) and all(isinstance(v, str) for v in sec.values())):
        raise CliError(f"cluster file {path}: security is not an object of file paths", hint=hint)
    return lists[0], lists[1], lists[2], sec


def _resolver(delay: str | None, realtime: str | None, cluster_file: Path | None, meta: str | None = None):
    """A resolver from, in this order: --meta/--delay/--realtime, --cluster-file, the
    HOURGLASS_* variables, var/dev/cluster.json. Meta servers win unless --delay/--realtime
    are given."""
    from cluster.client import StaticResolver

    env = os.environ.get
    sec = None
    if delay or realtime or meta:
        d = _split(delay or env("HOURGLASS_DELAY_NODES"))
        r = _split(realtime or env("HOURGLASS_REALTIME_NODES"))
        m = _split(meta)
    elif cluster_file is not None:
        d, r, m, sec = _read_cluster_file(cluster_file)
    else:
        d, r, m = (_split(env(k)) for k in ("HOURGLASS_DELAY_NODES", "HOURGLASS_REALTIME_NODES",
                                           "HOURGLASS_META_SERVERS"))
        if not (d or r or m) and DEFAULT_CLUSTER_FILE.exists():
            d, r, m, sec = _read_cluster_file(DEFAULT_CLUSTER_FILE)
    from cluster.security import client_security_from

    security = client_security_from(sec)  # HOURGLASS_TLS_* / HOURGLASS_TOKEN win over the cluster file's
    if m and not (delay or realtime):
        from cluster.discovery import MetaResolver
        return MetaResolver(m, security=security)  # each meta call has its own deadline (timeout_s)
    if not d and not r:
        raise CliError("no cluster given", hint="hint: give --meta (or --delay/--realtime, or --cluster-file), "
                       "set HOURGLASS_META_SERVERS, or run `hourglass dev up`")
    return StaticResolver(delay=d, realtime=r, security=security)


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
