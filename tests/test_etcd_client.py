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
