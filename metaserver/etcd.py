"""A thin shell over ``aetcd``: several endpoints, bounded retries, one error type.

``aetcd.Client`` talks to one endpoint. ``EtcdClient`` holds the list and, when a
call fails with a connection error or timeout, closes the client, moves to the
next endpoint and tries again, at most ``attempts_max`` times with a short
backoff (tenacity), and within ``budget_s`` in all: each attempt gets at most
``timeout_s`` and never more than what is left of the budget, so a caller with a
deadline (a meta server RPC answering a client) hears ``Unavailable`` in time
rather than its own deadline running out. What still fails is
``cluster.errors.Unavailable`` naming the endpoint, so callers see one error type
for "etcd cannot be reached".

Errors that are answers (a lease that is gone, a compacted revision) are not
retried: they come back as the aetcd exception for the caller to translate.

TLS (docs/security.md "etcd"): ``EtcdClient(..., tls=TlsFiles(ca, cert, key))`` talks mutual
TLS to etcd. aetcd 1.0 opens only plaintext channels (``Client.connect`` calls
``aetcd.rpc.insecure_channel``), so this module gives ``aetcd.client`` a ``rpc`` that opens a
secure channel for the endpoints registered with credentials and delegates everything else;
``tests/test_metaserver.py`` runs a meta server against an etcd that refuses plaintext.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd
import aetcd.client
import aetcd.rpc
import grpc
from aetcd import exceptions as aex
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_exponential

from cluster.errors import Unavailable
from cluster.security import TlsFiles
from metaserver.config import META_DEFAULTS

log = logging.getLogger("hourglass.etcd")
T = TypeVar("T")

RETRYABLE = (aex.ConnectionFailedError, aex.ConnectionTimeoutError, asyncio.TimeoutError)
UNWIND_S = 1.0  # how long an attempt cancelled at its timeout may take to unwind before its client is dropped
UNWIND_MIN_S = 0.05  # ... when the call's budget is spent already


_SECURE_TARGETS: dict[str, grpc.ChannelCredentials] = {}


class _Rpc:
    """``aetcd.rpc`` as ``aetcd.client`` sees it: the same, except that ``insecure_channel``
    opens a TLS channel to a target registered in ``_SECURE_TARGETS``."""

    def __getattr__(self, name: str):
        return getattr(aetcd.rpc, name)

    @staticmethod
    def insecure_channel(target: str, options=None, **kw):
        creds = _SECURE_TARGETS.get(target)
        if creds is None:
            return aetcd.rpc.insecure_channel(target, options=options, **kw)
        return aetcd.rpc.secure_channel(target, creds, options=options, **kw)


if not isinstance(getattr(aetcd.client, "rpc", None), _Rpc):
    aetcd.client.rpc = _Rpc()


class EtcdClient:
    def __init__(self, endpoints: list[str], *, timeout_s: float = META_DEFAULTS.etcd_timeout_ms / 1000, attempts_max: int | None = None,
                 budget_s: float | None = None, tls: TlsFiles | None = None):
        if not endpoints:
            raise ValueError("at least one etcd endpoint")
        self.endpoints = list(endpoints)
        self.tls = tls
        self._secure_targets()
        self.timeout_s = timeout_s
        self.attempts_max = attempts_max or 2 * len(self.endpoints) + 1
        # every endpoint once at full timeout, plus one more try: a dead member costs one
        # timeout, and all of etcd down is reported within budget_s
        self.budget_s = budget_s if budget_s is not None else timeout_s * (len(self.endpoints) + 1)
        self._index = 0
        self._client: aetcd.Client | None = None
        self._stuck: set[asyncio.Future] = set()  # abandoned attempts and closes, until they end

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._index]

    def client(self) -> aetcd.Client:
        if self._client is None:
            host, _, port = self.endpoint.rpartition(":")
            self._client = aetcd.Client(host=host, port=int(port), timeout=self.timeout_s)
        return self._client

    def _secure_targets(self) -> None:
        """Register this client's endpoints with the TLS files as they are now (checked again
        on every rotation: a renewed client certificate is used from the next connection on;
        a half-written one is ignored, ``TlsFiles.refresh``)."""
        if self.tls is None:
            return
        self.tls.refresh()
        creds = self.tls.channel_credentials()
        for e in self.endpoints:
            _SECURE_TARGETS[e] = creds

    async def rotate(self) -> None:
        """Drop the current connection and use the next endpoint."""
        self._secure_targets()
        old, self._client = self._client, None
        self._index = (self._index + 1) % len(self.endpoints)
        if old is not None:
            await self._close(old)

    async def call(self, fn: Callable[[aetcd.Client], Awaitable[T]], *, wait_s: float = 0.0) -> T:
        """Run ``fn(client)``; on connection errors rotate and retry, then raise Unavailable.
        ``wait_s`` is how long ``fn`` itself may wait by design (a watch with a timeout); it is
        added to each attempt's timeout and to the budget."""
        loop = asyncio.get_running_loop()
        budget_s = self.budget_s + wait_s
        deadline = loop.time() + budget_s
        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception_type(RETRYABLE),
                                               stop=stop_after_attempt(self.attempts_max) | stop_after_delay(budget_s),
                                               wait=wait_exponential(multiplier=0.05, max=0.5), reraise=True):
                with attempt:
                    try:
                        left = deadline - loop.time()
                        if left <= 0:
                            raise asyncio.TimeoutError(f"no time left of the {budget_s:g} s budget")
                        return await self._attempt(fn, min(self.timeout_s + wait_s, left), deadline)
                    except RETRYABLE:
                        log.info("etcd endpoint=%s failed; trying the next one", self.endpoint)
                        await self.rotate()
                        raise
        except RETRYABLE as e:
            raise Unavailable(f"etcd unavailable (last endpoint {self.endpoint}): {e}") from None
        except aex.ClientError as e:
            if "leader" in str(e) or "timed out" in str(e) or "too many requests" in str(e):
                raise Unavailable(f"etcd unavailable: {e}") from None
            raise
        raise AssertionError("unreachable")

    async def _attempt(self, fn: Callable[[aetcd.Client], Awaitable[T]], timeout_s: float, deadline: float) -> T:
        """One attempt, in its own task, bounded even if it does not unwind when cancelled.

        ``asyncio.wait_for`` waits for a cancelled awaitable to finish, and an aetcd call need
        not: ``watch_once`` cancels its watch in a ``finally`` that awaits the watcher's lock and
        request queue (maxsize 10), which a stuck stream handler can hold or fill. The likely
        cause of a CI run where the election race test waited 420 s with no campaign ending.
        Here an attempt that has not unwound ``UNWIND_S`` after its cancel (or by the call's
        deadline, when that comes first) is left behind with its connection, which is dropped:
        the next attempt opens a fresh one."""
        task = asyncio.ensure_future(fn(self.client()))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        task.cancel()
        loop = asyncio.get_running_loop()
        done, _ = await asyncio.wait({task}, timeout=min(UNWIND_S, max(UNWIND_MIN_S, deadline - loop.time())))
        if not done:
            log.warning("etcd endpoint=%s: a call did not unwind after its timeout; dropping the connection",
                        self.endpoint)
            old, self._client = self._client, None  # rotate() must not close it: close() takes the stuck lock
            channel = getattr(old, "channel", None)
            if channel is not None:  # closing the channel ends the stuck stream; no lock involved
                self._keep(asyncio.ensure_future(channel.close()))
            self._keep(task)
        elif not task.cancelled():
            return task.result()  # it finished (an answer or an error) as it was cancelled
        raise asyncio.TimeoutError(f"no answer within {timeout_s:g} s")

    def _keep(self, task: asyncio.Future) -> None:
        self._stuck.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future) -> None:
        self._stuck.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late error of an abandoned call is not an unhandled one

    async def status(self):
        return await self.call(lambda c: c.status())

    async def _close(self, client: aetcd.Client) -> None:
        """Close a client, bounded: aetcd's close takes the watcher's lock, which a stuck call may
        hold; then only its channel is closed."""
        task = asyncio.ensure_future(client.close())
        done, _ = await asyncio.wait({task}, timeout=UNWIND_S)
        if not done:
            task.cancel()
            self._keep(task)
            if getattr(client, "channel", None) is not None:
                self._keep(asyncio.ensure_future(client.channel.close()))
        elif not task.cancelled() and task.exception() is not None:
            log.debug("closing etcd client: %s", task.exception())  # a broken channel is gone either way

    async def close(self) -> None:
        if self._client is not None:
            c, self._client = self._client, None
            await self._close(c)
