"""``hourglass send | consume | cancel | lookup``: the client commands on messages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress

from cluster import errors as E
from cluster.cli.common import (
    AT_PAST_SLACK_MS,
    DEADLINE_GRACE_S,
    INT64_MAX,
    SHOWN_CHARS_MAX,
    ClusterFileOpt,
    DelayOpt,
    MetaOpt,
    RealtimeOpt,
    TimeoutOpt,
    _check_reachable,
    _resolver,
    _sdk_timeouts,
    _within,
    app,
    console,
    err_console,
    explain,
    shorten,
    shown,
)
from cluster.clock import wall_ms as _now_ms

# ---------------------------------------------------------------------- client commands


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _check_subject(subject: str) -> None:
    """The subject rule of the wire format (``codec.subject_problem``), checked before any call."""
    from cluster.codec import SUBJECT_BYTES_MAX, subject_problem

    if not subject:
        raise E.InvalidArgument("subject", "it is empty; give one such as orders.cancel")
    if subject_problem(subject) is not None:
        raise E.InvalidArgument("subject", f"{shown(subject)}: use letters, digits, '.', '_' and '-', "
                                           f"starting with a letter or digit, at most {SUBJECT_BYTES_MAX} bytes")


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
