"""``EtcdClient.call`` answers within its budget: a meta server RPC with a client deadline
must hear ``Unavailable`` before that deadline runs out, however etcd hangs."""

from __future__ import annotations

import asyncio

import pytest

from cluster.errors import Unavailable
from metaserver.etcd import EtcdClient


class _Hang:
    """Stands in for ``aetcd.Client``: every call hangs, as a stopped member's channel can."""

    calls = 0

    async def get(self, key):
        _Hang.calls += 1
        await asyncio.sleep(3600)

    async def close(self):
        pass


def _client(monkeypatch, endpoints, **kw) -> EtcdClient:
    c = EtcdClient(endpoints, **kw)
    monkeypatch.setattr(c, "client", lambda: _Hang())
    _Hang.calls = 0
    return c


async def test_a_hanging_etcd_is_unavailable_within_the_budget(monkeypatch):
    c = _client(monkeypatch, ["127.0.0.1:1"], timeout_s=0.1)
    assert c.budget_s == pytest.approx(0.2)  # one endpoint: its timeout, plus one more try
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(Unavailable, match="etcd unavailable"):
        await c.call(lambda cl: cl.get(b"k"))
    took = loop.time() - t0
    # the old rule (three attempts of twice the timeout) took 0.6 s here and longer than
    # a client's 5 s deadline with the default 2 s timeout
    assert took < 0.2 + 0.15, took
    assert 1 <= _Hang.calls <= c.attempts_max


async def test_every_endpoint_is_tried_once_at_full_timeout(monkeypatch):
    c = _client(monkeypatch, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], timeout_s=0.5)
    with pytest.raises(Unavailable):
        await c.call(lambda cl: cl.get(b"k"))
    assert _Hang.calls >= 3  # a dead first member does not use up the budget meant for the others


async def test_a_watch_gets_its_own_wait_on_top(monkeypatch):
    c = _client(monkeypatch, ["127.0.0.1:1"], timeout_s=0.05)

    async def slow_answer(cl):
        await asyncio.sleep(0.15)  # longer than timeout_s, shorter than timeout_s + wait_s
        return "answer"

    assert await c.call(slow_answer, wait_s=0.2) == "answer"
    with pytest.raises(Unavailable):
        await c.call(slow_answer)


class _Stubborn:
    """Stands in for an ``aetcd.Client`` whose call does not unwind when cancelled: aetcd's
    ``watch_once`` cancels its watch in a ``finally`` that waits on the watcher's lock, which a
    stuck stream handler can hold. ``asyncio.wait_for`` would wait for it with no end."""

    made = 0

    def __init__(self):
        _Stubborn.made += 1
        self.release = asyncio.Event()
        self.channel = None

    async def get(self, key):
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.wait_for(self.release.wait(), 3600)  # the first cancel is spent here

    async def close(self):
        raise AssertionError("a stuck client is dropped, not closed: close() takes the stuck lock")


async def _ends(aw, bound_s: float = 60):
    """Run ``aw``; True if it ended within ``bound_s`` (a bound against a hang, not a speed check)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    if not done:
        task.cancel()
        return False, None
    return True, task


async def test_a_call_that_does_not_unwind_is_abandoned_and_its_client_dropped(monkeypatch):
    c = EtcdClient(["127.0.0.1:1"], timeout_s=0.1, budget_s=3)  # room for a second attempt
    clients = []

    def make():
        if c._client is None:
            c._client = _Stubborn()
            clients.append(c._client)
        return c._client

    monkeypatch.setattr(c, "client", make)
    _Stubborn.made = 0
    ended, task = await _ends(c.call(lambda cl: cl.get(b"k")))
    assert ended, "the call waited for an attempt that does not unwind"
    assert isinstance(task.exception(), Unavailable)
    assert _Stubborn.made >= 2  # the retry opened a fresh client instead of reusing the stuck one
    assert c._stuck  # the abandoned attempts are held until they end ...
    for cl in clients:
        cl.release.set()
    for _ in range(100):
        if not c._stuck:
            break
        await asyncio.sleep(0.01)
    assert not c._stuck  # ... and forgotten once they do


async def test_a_cancelled_caller_does_not_wait_for_the_attempt(monkeypatch):
    c = EtcdClient(["127.0.0.1:1"], timeout_s=3600)
    stubborn = _Stubborn()
    monkeypatch.setattr(c, "client", lambda: stubborn)
    caller = asyncio.ensure_future(c.call(lambda cl: cl.get(b"k")))
    await asyncio.sleep(0.05)
    caller.cancel()
    ended, _ = await _ends(asyncio.wait({caller}))
    assert ended and caller.cancelled()
    stubborn.release.set()
