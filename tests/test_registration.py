"""node.registration.Registrar against a real meta server and etcd: the lease is renewed on
the heartbeat thread while the node's event loop is blocked; a loop wedged past
``loop_stall_max_ms`` gives the lease up; ``on_lost`` is told before the node registers
again; and no thread outlives ``close()`` or a cancelled ``run()``.

Every check is an outcome (the lease still held or gone, the order of callbacks, threads
alive or not); the loop is blocked "until something has happened", bounded, never for a
time that a test then compares against."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import grpc
import pytest

from cluster import errors as E
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from node.aio import wait_event
from node.config import NodeSettings
from node.metrics import NodeMetrics
from node.registration import Registrar, takes_lease_id

TTL_MS = 2000           # the shortest lease the meta server grants
WAIT_S = 30             # bound on every wait for something to happen
_ids = itertools.count(1)


def _settings(meta_server, **kw) -> NodeSettings:
    return NodeSettings(role="delay", node_id=f"reg-{next(_ids)}", group="reg", meta_servers=[meta_server.address],
                        meta_lease_ttl_ms=TTL_MS, meta_heartbeat_ms=200, **kw)


def _listed(meta_address: str, node_id: str) -> bool:
    """Is ``node_id`` registered (a live lease)? A blocking call: usable while the loop is held."""
    with grpc.insecure_channel(meta_address) as ch:
        resp = mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER), timeout=5)
    return any(m.node_id == node_id for g in resp.groups for m in g.members)


def _hold_the_loop_until(done, timeout_s: float = WAIT_S) -> None:
    """Block the event loop thread (as a long synchronous call would) until ``done()``, bounded."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _count(histogram) -> float:
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))


def _heartbeat_threads(node_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"heartbeat-{node_id}" and t.is_alive()]


async def _started(r: Registrar) -> asyncio.Task:
    task = asyncio.create_task(r.run())
    assert await wait_event(r.registered, WAIT_S), "never registered"
    return task


async def _stop(r: Registrar, task: asyncio.Task) -> None:
    await r.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_the_callback_form_decides_the_thread():
    assert takes_lease_id(lambda lease_id, sent_ms: None)
    assert takes_lease_id(lambda *a: None)
    assert not takes_lease_id(lambda sent_ms: None)

    class Roles:
        def _on_beat(self, sent_at_ms): ...

    assert not takes_lease_id(Roles()._on_beat)  # roles.py's hook: called on the main loop, as before


async def test_the_lease_is_renewed_while_the_loop_is_blocked_past_the_ttl(meta_server):
    """The loop is held until more than 1.5 TTL has passed and the thread confirmed renewals
    meanwhile: the node is still registered under the same lease, never lost."""
    settings = _settings(meta_server)
    metrics = NodeMetrics("delay", settings.server.node_id)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {"master": False}, metrics=metrics)
    lost, beats = [], []
    r.on_lost = lost.append
    r.on_beat = lambda lease_id, sent_ms: beats.append((lease_id, threading.get_ident()))
    task = await _started(r)
    try:
        lease = r.lease_id
        before = r.heartbeats
        t0 = time.monotonic()
        _hold_the_loop_until(lambda: time.monotonic() - t0 > 1.5 * TTL_MS / 1000 and r.heartbeats >= before + 3)
        renewed_while_held = r.heartbeats - before
        still_listed = _listed(meta_server.address, settings.server.node_id)  # asked while the loop is still held
        await asyncio.sleep(0)
        assert renewed_while_held >= 3 and still_listed
        # and the same lease is still good: a renewal by hand is accepted, nothing was lost
        await r.meta.call("Heartbeat", mpb.HeartbeatRequest(lease_id=lease, node=r._info.node))
        assert not lost and r.lease_id == lease
        assert {t for _, t in beats} == {_heartbeat_threads(settings.server.node_id)[0].ident}  # on_beat: the thread's
        # every confirmed call is in the round-trip histogram, every one after the Register in the gap one
        assert _count(metrics.heartbeat_rtt) >= renewed_while_held
        assert _count(metrics.heartbeat_gap) >= renewed_while_held - 1
    finally:
        await _stop(r, task)


async def test_a_loop_wedged_past_loop_stall_max_gives_the_lease_up(meta_server):
    """Past ``loop_stall_max_ms`` the thread withholds renewals: the lease runs out while the
    loop is held, ``on_lost`` names it, and the node registers again once the loop turns."""
    settings = _settings(meta_server, loop_stall_max_ms=500)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {"master": False})
    lost = []
    r.on_lost = lost.append
    task = await _started(r)
    try:
        lease = r.lease_id
        gone = []

        def expired() -> bool:
            gone.append(not _listed(meta_server.address, settings.server.node_id))
            return gone[-1]

        _hold_the_loop_until(expired)
        assert gone[-1], "the registration outlived a wedged loop"
        for _ in range(WAIT_S * 20):  # bounded: the thread finds it lost and registers again
            if lost and r.lease_id not in (None, lease):
                break
            await asyncio.sleep(0.05)
        assert lost == [lease]
        assert r.lease_id not in (None, lease) and r.registered.is_set()
        assert _listed(meta_server.address, settings.server.node_id)
    finally:
        await _stop(r, task)


async def test_on_lost_is_told_before_the_node_registers_again(meta_server):
    """The lease is revoked behind the node's back (as an expiry would): the next heartbeat
    finds it gone, ``on_lost(old lease)`` runs while nothing is registered, and only then is
    a new lease taken; the main loop's view follows in that order."""
    settings = _settings(meta_server)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {"master": False})
    events: list[tuple] = []

    def on_lost(lease_id: int) -> None:
        events.append(("lost", lease_id, _listed(meta_server.address, settings.server.node_id)))

    r.on_lost = on_lost
    r.on_beat = lambda lease_id, sent_ms: events.append(("beat", lease_id))
    views: list[int | None] = []
    task = await _started(r)
    try:
        old = r.lease_id
        await r.meta.call("Deregister", mpb.DeregisterRequest(lease_id=old, node_id=settings.server.node_id))
        for _ in range(WAIT_S * 20):
            views.append(r.lease_id)
            if r.lease_id not in (None, old):
                break
            await asyncio.sleep(0.05)
        lost_at = events.index(("lost", old, False))  # told while nothing was registered
        new = r.lease_id
        assert new not in (None, old)
        assert all(e[1] == old for e in events[:lost_at])
        assert events[lost_at + 1:] and all(e == ("beat", new) for e in events[lost_at + 1:])
        assert views[-1] == new and all(v in (old, None) for v in views[:-1])
    finally:
        await _stop(r, task)


async def test_the_one_argument_on_beat_runs_on_the_main_loop(meta_server):
    """roles.py's ``on_beat(sent_ms)`` keeps working: called on the loop's thread."""
    r = Registrar(_settings(meta_server), "127.0.0.1:1", describe=lambda: {})
    called = asyncio.Event()
    threads = set()

    def on_beat(sent_ms: int) -> None:
        threads.add(threading.get_ident())
        called.set()

    r.on_beat = on_beat
    task = await _started(r)
    try:
        assert await wait_event(called, WAIT_S)
        assert threads == {threading.get_ident()}
    finally:
        await _stop(r, task)


async def test_close_stops_the_thread_and_revokes_the_lease(meta_server):
    settings = _settings(meta_server)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {})
    task = await _started(r)
    assert _heartbeat_threads(settings.server.node_id)
    await r.close()
    assert not _heartbeat_threads(settings.server.node_id)
    assert not _listed(meta_server.address, settings.server.node_id)  # gone at once, not after the TTL
    await asyncio.wait_for(task, WAIT_S)  # run() ends by itself once the thread stopped


async def test_a_cancelled_run_leaves_no_thread(meta_server):
    settings = _settings(meta_server)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {})
    task = await _started(r)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert not _heartbeat_threads(settings.server.node_id)
    await r.close()


async def test_bad_settings_stop_run_with_invalid_argument(meta_server):
    """A node that cannot describe itself must not run unregistered: run() raises, no thread stays."""
    settings = _settings(meta_server).replace(group="")
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {})
    with pytest.raises(E.InvalidArgument):
        await asyncio.wait_for(r.run(), WAIT_S)
    assert not _heartbeat_threads(settings.server.node_id)
    await r.close()


async def test_the_heartbeat_thread_runs_no_event_loop(meta_server):
    """The thread's calls are blocking ones on plain gRPC channels: no asyncio loop of its
    own, which the process's one grpc.aio poller would wake on every gRPC event of the node
    (it used to: half of the main loop's events were handed over through it)."""
    settings = _settings(meta_server)
    r = Registrar(settings, "127.0.0.1:1", describe=lambda: {"master": False})
    loops = []
    r.on_beat = lambda lease_id, sent_ms: loops.append(asyncio._get_running_loop())
    task = await _started(r)
    try:
        before = r.heartbeats
        for _ in range(WAIT_S * 20):  # bounded: a renewal or two after the Register
            if r.heartbeats >= before + 2:
                break
            await asyncio.sleep(0.05)
        assert len(loops) >= 2 and loops == [None] * len(loops)
    finally:
        await _stop(r, task)


def test_a_blocking_meta_call_in_flight_ends_when_cancelled():
    """``BlockingMetaClient.cancel()`` (the heartbeat thread's stop) ends a call to a meta
    server that never answers, well inside the call's own deadline, and every later call."""
    import socket

    from cluster.discovery import BlockingMetaClient

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never speaks HTTP/2: a call waits for its deadline
    client = BlockingMetaClient([f"127.0.0.1:{silent.getsockname()[1]}"], timeout_s=3600)
    errors = []

    def call():
        try:
            client.call("Heartbeat", mpb.HeartbeatRequest(lease_id=1))
        except E.HourglassError as e:
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    try:
        t.start()
        for _ in range(WAIT_S * 20):  # until the call is in flight
            if client._in_flight is not None:
                break
            time.sleep(0.05)
        client.cancel()
        t.join(WAIT_S)
        assert not t.is_alive() and isinstance(errors[0], E.Unavailable) and "cancelled" in str(errors[0])
        with pytest.raises(E.Unavailable, match="cancelled"):
            client.call("Heartbeat", mpb.HeartbeatRequest(lease_id=1))
    finally:
        client.close()
        silent.close()
