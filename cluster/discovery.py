"""Discovery through the meta servers: ``MetaResolver``, a drop-in for ``StaticResolver``.

    resolver = MetaResolver(["127.0.0.1:7100", "127.0.0.1:7101"])
    async with Producer(resolver) as p: ...
    async with Consumer(resolver, "orders.cancel", group="billing") as c: ...

It offers what ``cluster.client`` asks of a resolver: ``delay_nodes()`` (masters
of the delay groups, for producers of delayed messages), ``realtime_route(subject)``
(the subject's real-time groups and their masters, ``cluster/routes.py``: immediate
producers and delay nodes send each message to the group of its id's hash, consumers
pull from all), ``realtime_for(subject)`` (the first of them that has a master: tools
and the dead-letter subject), ``refresh()`` (called after a failed call), ``close()``;
and ``invalidate(subject)`` for the delay node's router.

Caching rules (all times monotonic, limits named):

* an answer is reused for ``refresh_ms``; after that the next call still gets it at
  once and a background task asks again (the "period": at most one per key and
  ``REFRESH_BEHIND_MAX`` at a time, so a lookup never waits for a routine refresh);
  ``refresh()`` marks everything stale so the next call asks again before it
  answers, but never more often than every ``refresh_min_ms`` (a dead node makes
  every client call refresh; the meta servers must not be hammered);
* meta servers are tried in order starting at the last one that answered; one
  that does not answer (connection refused, deadline, UNAVAILABLE) is skipped
  and the next is tried, so a dead meta server costs one timeout at most;
* if no meta server answers (all dead, or etcd down behind them) the cached
  answer is used as long as there is one: nodes keep serving with the routes
  they have. Only with nothing cached is ``Unavailable`` raised;
* subject routes are cached up to ``routes_max`` subjects (oldest dropped); an answer
  with a smaller route epoch than the cached one is ignored, so a widened route is never
  narrowed again by a late answer. A widening reaches a client within ``refresh_ms``.

Consumers never see delay nodes: ``realtime_for`` asks ``Route`` with kind
CONSUMER or IMMEDIATE_PRODUCER, which only ever answers real-time groups.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

import grpc

from cluster import errors as E
from cluster import status
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.clientsettings import CLIENT_DEFAULTS, ClientSettings
from cluster.routes import RouteView
from cluster.security import ClientSecurity
from cluster.transport import CHANNEL_OPTIONS, Channels

log = logging.getLogger("hourglass.discovery")

_DISCOVERY = CLIENT_DEFAULTS.discovery  # every default of discovery: cluster/clientsettings.py
REFRESH_BEHIND_MAX = 32  # background refreshes of aged answers in flight at once (MetaResolver._behind)

SKIP_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def _meta_servers(meta_servers: list[str]) -> list[str]:
    servers = [a.strip() for a in meta_servers if a.strip()]
    if not servers:
        raise E.InvalidArgument("meta_servers", "give at least one meta server address")
    return servers


def _passed_over(e: grpc.RpcError, address: str, method: str) -> None:
    """A meta server's error: raised as the domain error unless the next server is tried."""
    if e.code() not in SKIP_CODES:
        raise status.from_rpc_error(e) from None
    log.info("meta server %s did not answer %s (%s); trying the next", address, method, e.code().name)


def _none_answered(method: str, servers: list[str], last: BaseException | None) -> E.Unavailable:
    detail = last.details() if isinstance(last, grpc.RpcError) else str(last)
    return E.Unavailable(f"no meta server answered {method} ({', '.join(servers)}): {detail}{status.tls_note(detail)}")


class MetaClient:
    """Calls one RPC on the first meta server that answers, remembering which one did."""

    def __init__(self, meta_servers: list[str], *, timeout_s: float = _DISCOVERY.meta_timeout_ms / 1000,
                 security: ClientSecurity | None = None) -> None:
        self.servers = _meta_servers(meta_servers)
        self.timeout_s = timeout_s
        self._current = 0
        self._channels = Channels(security)

    def stub(self, address: str) -> mrpc.MetaStub:
        return mrpc.MetaStub(self._channels.get(address))

    @property
    def current(self) -> str:
        return self.servers[self._current]

    async def call(self, method: str, request, *, timeout_s: float | None = None):
        last: BaseException | None = None
        for i in range(len(self.servers)):
            index = (self._current + i) % len(self.servers)
            address = self.servers[index]
            try:
                resp = await getattr(self.stub(address), method)(request, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                _passed_over(e, address, method)
                last = e
                continue
            self._current = index
            return resp
        raise _none_answered(method, self.servers, last)

    async def close(self) -> None:
        await self._channels.close()


class BlockingMetaClient:
    """``MetaClient`` for a thread without an event loop: blocking calls on plain gRPC
    channels, one call at a time; ``cancel()`` (from any thread) ends the call in flight and
    every later one. A node's heartbeat thread uses it (node/registration.py): every asyncio
    loop that makes a ``grpc.aio`` channel is bound to the process's one aio poller, and each
    gRPC event of the process wakes every loop bound to it, so a second loop for heartbeats
    woke on each of the main loop's calls (docs/benchmarks.md, "Heartbeats off grpc.aio")."""

    def __init__(self, meta_servers: list[str], *, timeout_s: float = _DISCOVERY.meta_timeout_ms / 1000,
                 security: ClientSecurity | None = None) -> None:
        self.servers = _meta_servers(meta_servers)
        self.timeout_s = timeout_s
        self._current = 0
        self.security = security if security is not None else ClientSecurity()
        self._generation = self.security.generation()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # guards the two below (cancel() comes from another thread)
        self._in_flight: grpc.Future | None = None
        self._cancelled = False

    @property
    def current(self) -> str:
        return self.servers[self._current]

    def _stub(self, address: str) -> mrpc.MetaStub:
        gen = self.security.generation()
        if gen != self._generation:  # new certificate files or token: dial again (as ``Channels``)
            self._generation = gen
            self.close()
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.security.channel(address, CHANNEL_OPTIONS, blocking=True)
        return mrpc.MetaStub(ch)

    def call(self, method: str, request, *, timeout_s: float | None = None):
        last: BaseException | None = None
        for i in range(len(self.servers)):
            index = (self._current + i) % len(self.servers)
            address = self.servers[index]
            fut = getattr(self._stub(address), method).future(request, timeout=timeout_s or self.timeout_s)
            with self._lock:
                self._in_flight = fut
                if self._cancelled:
                    fut.cancel()
            try:
                resp = fut.result()
            except grpc.FutureCancelledError:
                raise E.Unavailable(f"{method} to {address} cancelled: the client is closing") from None
            except grpc.RpcError as e:
                _passed_over(e, address, method)
                last = e
                continue
            finally:
                with self._lock:
                    self._in_flight = None
            self._current = index
            return resp
        raise _none_answered(method, self.servers, last)

    def cancel(self) -> None:
        """End the call in flight, if any, and every later one (any thread)."""
        with self._lock:
            self._cancelled = True
            fut = self._in_flight
        if fut is not None:
            fut.cancel()

    def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            ch.close()


class MetaResolver:
    def __init__(self, meta_servers: list[str] | str, *, refresh_ms: int = _DISCOVERY.refresh_ms,
                 refresh_min_ms: int = _DISCOVERY.refresh_min_ms, timeout_s: float = _DISCOVERY.meta_timeout_ms / 1000,
                 routes_max: int = _DISCOVERY.routes_max,
                 realtime_kind: int = mpb.IMMEDIATE_PRODUCER, security: ClientSecurity | None = None) -> None:
        if isinstance(meta_servers, str):
            meta_servers = meta_servers.split(",")
        # how to talk to this cluster (TLS, token): the SDK's channels use it too
        self.security = security if security is not None else ClientSecurity()
        self.meta = MetaClient(list(meta_servers), timeout_s=timeout_s, security=self.security)
        self.refresh_ms = refresh_ms
        self.refresh_min_ms = refresh_min_ms
        self.routes_max = routes_max
        self.realtime_kind = realtime_kind
        self._delay: list[str] = []
        self._delay_groups: list[tuple[str, str]] = []
        self._draining_groups: list[tuple[str, str]] = []
        self._delay_at = float("-inf")
        self._routes: OrderedDict[str, tuple[RouteView, float]] = OrderedDict()  # subject -> (route, fetched_at)
        self._stale_since: float | None = None
        self._last_fetch = float("-inf")
        self._refreshing: dict[str, asyncio.Task] = {}  # key -> its background refresh (``_behind``)
        self._moved: dict[str, float] = {}  # subject -> when a node said "route moved" (``route_moved``)
        self._moved_fetch: dict[str, float] = {}  # subject -> when its route was last asked for that
        self.delay: list[str] = []     # every delay node seen by the last load() (status, tools)
        self.realtime: list[str] = []  # every real-time node seen by the last load()
        # grows whenever a cached route may have changed or must be asked again: a consumer
        # keeps its node -> subjects map while this stays (``Consumer._routes``)
        self.routes_version = 0

    @classmethod
    def from_settings(cls, meta_servers: list[str] | str, settings: ClientSettings, *,
                      realtime_kind: int = mpb.IMMEDIATE_PRODUCER,
                      security: ClientSecurity | None = None) -> "MetaResolver":
        """A resolver with every value from ``settings.discovery``."""
        d = settings.discovery
        return cls(meta_servers, refresh_ms=d.refresh_ms, refresh_min_ms=d.refresh_min_ms,
                   timeout_s=d.meta_timeout_ms / 1000, routes_max=d.routes_max, realtime_kind=realtime_kind,
                   security=security)

    # ------------------------------------------------------------------ cache policy

    def _due(self, fetched_at: float) -> bool:
        return self._aged(fetched_at) or self._stale(fetched_at)

    def _aged(self, fetched_at: float) -> bool:
        """Older than ``refresh_ms``: the periodic refresh, answered from the cache while it
        runs behind (``_behind``)."""
        return time.monotonic() - fetched_at >= self.refresh_ms / 1000

    def _stale(self, fetched_at: float) -> bool:
        """Fetched before a call failed (``refresh()``): asked again before it is used."""
        stale = self._stale_since is not None and fetched_at <= self._stale_since
        return stale and time.monotonic() - self._last_fetch >= self.refresh_min_ms / 1000

    def _behind(self, key: str, fetch) -> None:
        """Run ``fetch()`` as a background refresh of ``key`` (at most one per key and
        ``REFRESH_BEHIND_MAX`` in all; beyond that the next lookup tries again). Issue 28: the
        periodic refresh ran inline, one meta-server call per subject in turn, so every
        ``refresh_ms`` a consumer of 16 subjects, and a delay node's firing round, waited
        50-100 ms for it: the p99 at 2,000 msgs/s."""
        if key in self._refreshing or len(self._refreshing) >= REFRESH_BEHIND_MAX:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        async def run() -> None:
            try:
                await fetch()
            except E.HourglassError as e:  # the cached answer stands; the next lookup tries again
                log.info("background refresh of %s failed: %s", key, e)
            finally:
                self._refreshing.pop(key, None)
        self._refreshing[key] = loop.create_task(run(), name=f"resolver-refresh-{key[:64]}")

    # ------------------------------------------------------------------ resolver interface

    async def delay_groups(self) -> list[tuple[str, str]]:
        """Every delay group as ``(name, master address or "")``, sorted by name. Producers pin
        a message id to one group by hash (``cluster.client.group_for``), so a retry never
        lands in a second group; a group without a live master makes its ids wait."""
        if self._delay_groups and self._cached_delay_usable():
            return self._delay_groups
        try:
            await self._fetch_delay()
        except E.Unavailable:
            if self._delay_groups:
                return self._delay_groups
            raise
        return self._delay_groups

    def _cached_delay_usable(self) -> bool:
        """The cached delay groups may answer (not made stale by a failure); an aged answer
        is refreshed behind the caller."""
        if self._stale(self._delay_at):
            return False
        if self._aged(self._delay_at):
            self._behind(" delay", self._fetch_delay)
        return True

    async def _fetch_delay(self) -> None:
        self._last_fetch = time.monotonic()
        resp = await self.meta.call("GetServers", mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER,
                                                                         include_draining=True))
        # a draining group takes nothing new (it refuses SendBatch), but may still hold an id
        # not moved yet: cancel and lookup ask it last (``draining_groups``)
        self._delay_groups = sorted((g.name, g.master) for g in resp.groups if not g.draining)
        self._draining_groups = sorted((g.name, g.master) for g in resp.groups if g.draining)
        self._delay = [m for _, m in self._delay_groups if m]
        self._delay_at = time.monotonic()

    def draining_groups(self) -> list[tuple[str, str]]:
        """The delay groups being drained, as of the last ``delay_groups`` answer."""
        return self._draining_groups

    async def delay_nodes(self) -> list[str]:
        if self._delay and self._cached_delay_usable():
            return self._delay
        try:
            await self._fetch_delay()
        except E.Unavailable as e:
            if self._delay:
                log.warning("keeping cached delay groups: %s", e)
                return self._delay
            raise
        if not self._delay:
            raise E.Unavailable("no delay group has a live master")
        return self._delay

    async def realtime_for(self, subject: str) -> str:
        """The master of the subject's first group that has one (tools, the dead-letter
        subject); senders and consumers of a subject use ``realtime_route``."""
        return (await self.realtime_route(subject)).first_master()

    async def realtime_route(self, subject: str) -> RouteView:
        """The subject's real-time groups with their masters (``cluster/routes.py``). At
        least one group has a master, else ``Unavailable``."""
        cached = self._routes.get(subject)
        moved = subject in self._moved and self._ask_moved(subject)
        if cached is not None and not moved and not self._stale(cached[1]):
            if self._aged(cached[1]):
                self._behind(subject, lambda: self._fetch_route(subject))
            return cached[0]
        try:
            return await self._fetch_route(subject)
        except E.Unavailable as e:
            if cached is not None and cached[0].live():
                log.warning("keeping cached route subject=%s: %s", subject, e)
                return cached[0]
            raise

    async def _fetch_route(self, subject: str) -> RouteView:
        self._last_fetch = time.monotonic()
        resp = await self.meta.call("Route", mpb.RouteRequest(kind=self.realtime_kind, subject=subject))
        groups = list(resp.groups) or [resp.group]  # a meta server from before routes were lists
        view = RouteView(tuple(g.name for g in groups), tuple(g.master for g in groups), max(1, resp.epoch),
                         tuple(g.name for g in resp.draining), tuple(g.master for g in resp.draining))
        cached = self._routes.get(subject)
        if cached is not None and cached[0].epoch > view.epoch:  # never step back to an older route
            log.info("ignoring route subject=%s epoch=%d older than cached epoch %d", subject, view.epoch,
                     cached[0].epoch)
            return cached[0]
        if cached is None or cached[0] != view:
            self.routes_version += 1
        if not view.live():
            self._routes.pop(subject, None)
            raise E.Unavailable(f"no real-time group of subject {subject!r} ({', '.join(view.groups)}) "
                                f"has a live master")
        self._routes[subject] = (view, time.monotonic())
        self._routes.move_to_end(subject)
        while len(self._routes) > self.routes_max:
            self._routes.popitem(last=False)
        return view

    def route_moved(self, subject: str) -> None:
        """A real-time node refused messages of ``subject``: the route moved (a narrowing,
        docs/design.md "Narrowing drains first"). The next lookup of the subject asks a meta
        server before it answers (once per ``refresh_min_ms`` at most)."""
        if len(self._moved) < self.routes_max:
            self._moved[subject] = time.monotonic()
        self.routes_version += 1

    def _ask_moved(self, subject: str) -> bool:
        """A node said the subject's route moved: ask a meta server now, unless it was asked
        for that within ``refresh_min_ms`` (the cached route answers; the sender retries)."""
        now = time.monotonic()
        self._moved.pop(subject, None)
        if now - self._moved_fetch.get(subject, float("-inf")) < self.refresh_min_ms / 1000:
            return False
        self._moved_fetch[subject] = now
        while len(self._moved_fetch) > self.routes_max:
            self._moved_fetch.pop(next(iter(self._moved_fetch)))
        return True

    async def refresh(self) -> None:
        """A call failed: the next lookup asks a meta server again (rate limited)."""
        self._stale_since = time.monotonic()
        self.routes_version += 1

    def invalidate(self, subject: str) -> None:
        self._stale_since = time.monotonic()
        self.routes_version += 1

    def describe(self) -> str:
        """Where this resolver looks (for errors that say what was tried)."""
        return f"meta servers {','.join(self.meta.servers)}"

    async def load(self) -> dict:
        """Fetch every group of both roles (for status pages); fills ``delay``/``realtime``."""
        out = {}
        for kind, role in ((mpb.DELAYED_PRODUCER, "delay"), (mpb.CONSUMER, "realtime")):
            resp = await self.meta.call("GetServers", mpb.GetServersRequest(kind=kind, include_draining=True))
            out[role] = [{"group": g.name, "master": g.master, "epoch": g.epoch, "draining": g.draining,
                          "members": [m.address for m in g.members]} for g in resp.groups]
        self.delay = [a for g in out["delay"] for a in g["members"]]
        self.realtime = [a for g in out["realtime"] for a in g["members"]]
        return out

    async def close(self) -> None:
        tasks = list(self._refreshing.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.meta.close()
