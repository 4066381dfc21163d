"""MetaResolver's cache policy (cluster/discovery.py): an aged answer is served at once and
refreshed behind the caller; one a failure made stale is asked again before it is used."""

from __future__ import annotations

import asyncio
import types

import pytest

import cluster.discovery as D
from cluster import errors as E
from cluster.proto import meta_pb2 as mpb

pytestmark = pytest.mark.unit
GUARD_S = 10  # a lookup that waits for a hung refresh fails instead of blocking the suite


class FakeMeta:
    """Answers Route with the current ``master``; a call waits until ``gate`` is set."""

    def __init__(self) -> None:
        self.master = "n1:1"
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.servers = ["meta:1"]

    async def call(self, name, req, **_):
        assert name == "Route"
        self.calls += 1
        await self.gate.wait()
        if self.master is None:
            raise E.Unavailable("meta down")
        return mpb.RouteResponse(group=mpb.Group(name="r1", master=self.master))

    async def close(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    # discovery's clock only (patching time.monotonic itself would stop the event loop's)
    monkeypatch.setattr(D, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_an_aged_route_is_served_at_once_and_refreshed_behind(clock):
    r = D.MetaResolver(["meta:1"], refresh_ms=5000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = meta = FakeMeta()
    assert await r.realtime_for("s") == "n1:1" and meta.calls == 1
    clock[0] += 6  # past refresh_ms; the meta server is slow and has a new answer
    meta.master, meta.gate = "n2:1", asyncio.Event()
    assert await asyncio.wait_for(r.realtime_for("s"), GUARD_S) == "n1:1"  # not waiting for the refresh
    await settle()
    assert await r.realtime_for("s") == "n1:1" and meta.calls == 2  # one refresh per key in flight
    meta.gate.set()
    await settle()
    assert await r.realtime_for("s") == "n2:1" and meta.calls == 2  # the refresh landed
    await r.close()


async def test_a_failed_call_makes_the_next_lookup_ask_before_answering(clock):
    r = D.MetaResolver(["meta:1"], refresh_ms=5000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = meta = FakeMeta()
    assert await r.realtime_for("s") == "n1:1"
    meta.master = "n2:1"
    await r.refresh()  # a call to n1 failed
    assert await r.realtime_for("s") == "n1:1"  # within refresh_min_ms of the last fetch: cached
    clock[0] += 0.3
    assert await r.realtime_for("s") == "n2:1" and meta.calls == 2  # asked inline
    meta.master = None  # meta servers down: a stale route is kept, aged ones too
    await r.refresh()
    clock[0] += 10
    assert await r.realtime_for("s") == "n2:1"
    await settle()
    assert await r.realtime_for("s") == "n2:1"
    await r.close()


async def test_background_refreshes_are_bounded_and_cancelled_at_close(clock, monkeypatch):
    monkeypatch.setattr(D, "REFRESH_BEHIND_MAX", 3)
    r = D.MetaResolver(["meta:1"], refresh_ms=5000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = meta = FakeMeta()
    for i in range(5):
        await r.realtime_for(f"s{i}")
    clock[0] += 6
    meta.gate = asyncio.Event()  # every refresh hangs
    for i in range(5):
        assert await asyncio.wait_for(r.realtime_for(f"s{i}"), GUARD_S) == "n1:1"
    await settle()
    assert len(r._refreshing) == 3 and meta.calls == 5 + 3
    await r.close()
    assert not r._refreshing


class ListMeta(FakeMeta):
    """Answers Route with a list of groups and an epoch (``answers`` in turn, the last repeated)."""

    def __init__(self, answers) -> None:
        super().__init__()
        self.answers = list(answers)

    async def call(self, name, req, **_):
        assert name == "Route"
        self.calls += 1
        groups, epoch = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        pb = [mpb.Group(name=g, master=m) for g, m in groups]
        return mpb.RouteResponse(group=pb[0], groups=pb, epoch=epoch)


async def test_a_route_of_several_groups_is_cached_and_never_steps_back_to_an_older_epoch(clock):
    wide = ([("r1", "n1:1"), ("r2", "n2:1"), ("r3", "")], 2)
    old = ([("r1", "n1:1")], 1)
    r = D.MetaResolver(["meta:1"], refresh_ms=5000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = ListMeta([wide, old])
    view = await r.realtime_route("s")
    assert view.groups == ("r1", "r2", "r3") and view.masters == ("n1:1", "n2:1", "") and view.epoch == 2
    assert view.live() == ["n1:1", "n2:1"] and await r.realtime_for("s") == "n1:1"
    await r.refresh()
    clock[0] += 1  # past refresh_min_ms: asked again, and a late answer of epoch 1 arrives
    assert (await r.realtime_route("s")).epoch == 2  # kept: a widened route is not narrowed by it
    await r.close()


async def test_an_old_meta_servers_answer_without_a_list_is_a_route_of_one(clock):
    r = D.MetaResolver(["meta:1"], refresh_ms=5000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = FakeMeta()  # answers only ``group``
    view = await r.realtime_route("s")
    assert view.groups == ("r1",) and view.masters == ("n1:1",) and view.epoch == 1
    await r.close()


class DrainingMeta(ListMeta):
    """ListMeta whose answers may carry draining groups: ``(groups, epoch, draining)``."""

    async def call(self, name, req, **_):
        assert name == "Route"
        self.calls += 1
        groups, epoch, draining = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        pb = [mpb.Group(name=g, master=m) for g, m in groups]
        return mpb.RouteResponse(group=pb[0], groups=pb, epoch=epoch,
                                 draining=[mpb.Group(name=g, master=m) for g, m in draining])


async def test_a_route_moved_refusal_makes_the_next_lookup_ask_at_once_but_not_more_often_than_refresh_min(clock):
    """A node said "route moved" (a narrowing drains its group): the subject's route is asked
    again before the retry although it is fresh; a narrowed route is read with its draining
    groups (consumers pull them, writers hash over the written groups only)."""
    wide = ([("r1", "n1:1"), ("r2", "n2:1"), ("r3", "n3:1")], 2, [])
    narrowed = ([("r1", "n1:1"), ("r2", "n2:1")], 3, [("r3", "n3:1")])
    r = D.MetaResolver(["meta:1"], refresh_ms=3_600_000, refresh_min_ms=200)
    await r.meta.close()
    r.meta = meta = DrainingMeta([wide, narrowed])
    assert (await r.realtime_route("s")).epoch == 2
    r.route_moved("s")
    view = await r.realtime_route("s")
    assert meta.calls == 2 and view.epoch == 3 and view.groups == ("r1", "r2") and view.draining == ("r3",)
    assert view.live() == ["n1:1", "n2:1", "n3:1"] and view.writable_live() == ["n1:1", "n2:1"]
    r.route_moved("s")  # again at once: within refresh_min_ms the cached route answers
    assert (await r.realtime_route("s")).epoch == 3 and meta.calls == 2
    clock[0] += 0.3
    r.route_moved("s")
    await r.realtime_route("s")
    assert meta.calls == 3
    await r.close()
