"""A subject widened online from one real-time group to three, under load, on real processes
(etcd, a meta server, a delay node, three real-time groups): every acknowledged message,
delayed or immediate, is delivered exactly once to each consumer group and none before its
due time; after the change both the delay node and the immediate producer use every group,
and consumers pull from all of them. The same list is a no-op; an unknown group is refused."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster
from tests.helpers import admin
from cluster.discovery import MetaResolver
from cluster.proto import meta_pb2 as mpb

pytestmark = pytest.mark.integration

SUBJECT = "hot.orders"
GROUPS = ("billing", "audit")  # two consumer groups: each must see every message once
REFRESH_MS = 300               # clients and the delay node ask for routes this often
ENV = {"HOURGLASS_META_LEASE_TTL_MS": "2000", "HOURGLASS_META_REFRESH_MS": str(REFRESH_MS)}
ROUNDS_BEFORE = 10             # send rounds before the route is widened
ROUNDS_AFTER_MAX = 300         # send rounds after it, at most: until every group delivered both kinds
ROUNDS_TAIL = 10               # and this many more
PER_ROUND = 20                 # delayed messages a round (plus PER_ROUND // 2 immediate)
DRAIN_S_MAX = 120              # the consumers have everything within this (a bound, not a timing)
CLI_TIMEOUT_S = 60


def _cli(*args: str) -> subprocess.CompletedProcess:
    return admin.cli(*args, timeout_s=CLI_TIMEOUT_S)


async def _route(meta: str) -> mpb.RouteResponse:
    return await admin.route(meta, SUBJECT)


async def test_a_subject_widened_to_three_groups_under_load_delivers_each_message_once(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=3, meta=True, env=ENV)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        node_group = {n.address: c.group_of[n.name] for n in c.realtime}
        first = await _route(meta)  # first use: one group
        assert len(first.groups) == 1 and first.epoch == 1 and first.group.name == first.groups[0].name
        original = first.groups[0].name
        others = sorted(set(node_group.values()) - {original})

        sent: dict[str, int] = {}          # acknowledged id -> deliver_at_ms
        got: dict[str, dict[str, int]] = {g: {} for g in GROUPS}   # group -> id -> times received
        early: list[tuple[str, int]] = []
        seen_in: dict[str, set[tuple[str, str]]] = {g: set() for g in GROUPS}  # (real-time group, kind)
        stop = asyncio.Event()

        async def consume(group: str) -> None:
            r = MetaResolver([meta], refresh_ms=REFRESH_MS, realtime_kind=mpb.CONSUMER)
            try:
                async with Consumer(r, SUBJECT, group=group) as cons:
                    while not stop.is_set():
                        for rb in await cons.pull_batch(wait_ms=200):
                            for i, lateness in zip(rb.ids, rb.lateness_ms.tolist()):
                                got[group][i] = got[group].get(i, 0) + 1
                                seen_in[group].add((node_group[rb.node], i[0]))
                                if lateness < 0:
                                    early.append((i, lateness))
                            await rb.ack(wait=True)
            finally:
                await r.close()

        consumers = [asyncio.create_task(consume(g)) for g in GROUPS]
        resolver = MetaResolver([meta], refresh_ms=REFRESH_MS)
        try:
            async with Producer(resolver) as p:
                async def send_round(k: int) -> None:
                    await admin.send_round(p, SUBJECT, k, PER_ROUND, sent)

                for k in range(ROUNDS_BEFORE):
                    await send_round(k)
                # widen online, while messages are due and in flight; the list's order does not matter
                r = _cli("admin", "route", SUBJECT, "--groups", ",".join([*others, original]), "--meta", meta)
                assert r.returncode == 0, r.stderr
                assert "routed:" in r.stdout and "epoch 2" in r.stdout, r.stdout
                k = ROUNDS_BEFORE
                want = {(g, kind) for g in node_group.values() for kind in "di"}
                for k in range(ROUNDS_BEFORE, ROUNDS_BEFORE + ROUNDS_AFTER_MAX):
                    await send_round(k)
                    if all(want <= seen_in[g] for g in GROUPS):
                        break
                    await asyncio.sleep(0.02)
                for k in range(k + 1, k + 1 + ROUNDS_TAIL):
                    await send_round(k)
        finally:
            await resolver.close()

        deadline = time.monotonic() + DRAIN_S_MAX
        while time.monotonic() < deadline and not all(set(got[g]) >= set(sent) for g in GROUPS):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # a redelivery, if any, would show by now
        stop.set()
        await asyncio.gather(*consumers)

        after = await _route(meta)
        assert [g.name for g in after.groups] == sorted(node_group.values()) and after.epoch == 2
        assert len(sent) > (ROUNDS_BEFORE + ROUNDS_TAIL) * PER_ROUND
        for g in GROUPS:
            missing = set(sent) - set(got[g])
            assert not missing, f"{g}: {len(missing)} acknowledged messages never delivered, e.g. {sorted(missing)[:5]}"
            twice = {i: n for i, n in got[g].items() if n > 1}
            assert not twice, f"{g}: delivered more than once: {list(twice.items())[:5]}"
            assert set(got[g]) <= set(sent)
            # both the delay node's dispatch and the immediate producer used every group
            assert {(grp, kind) for grp in node_group.values() for kind in "di"} <= seen_in[g], seen_in[g]
        assert not early, f"delivered before due: {early[:5]}"

        # the same list is a no-op (narrowing drains first: tests/test_route_narrow.py)
        r = _cli("admin", "route", SUBJECT, "--groups", ",".join(sorted(node_group.values())), "--meta", meta)
        assert r.returncode == 0 and "unchanged" in r.stdout and "epoch 2" in r.stdout, (r.stdout, r.stderr)
        r = _cli("admin", "route", SUBJECT, "--groups", ",".join([*node_group.values(), "realtime-9"]), "--meta", meta)
        assert r.returncode == 2 and "realtime-9" in r.stderr and "registered" in r.stderr, (r.stdout, r.stderr)
        assert (await _route(meta)).epoch == 2


async def test_a_route_written_before_lists_still_routes_and_widens(tmp_path):
    """A key holding a bare group name (the old format) answers as a route of one at epoch 1,
    carries messages, and is rewritten in the new format only when widened."""
    from metaserver.etcd import EtcdClient
    from metaserver.keyspace import subject_key

    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=2, meta=True, env=ENV)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        etcd = EtcdClient(c.etcd_endpoints)
        key = subject_key(SUBJECT)
        try:
            await etcd.call(lambda cl: cl.put(key, b"realtime-2"))
            r = await _route(meta)
            assert [g.name for g in r.groups] == ["realtime-2"] and r.epoch == 1 and r.group.name == "realtime-2"
            resolver = MetaResolver([meta], refresh_ms=REFRESH_MS)
            try:
                async with Producer(resolver) as p, Consumer(resolver, SUBJECT, group="g") as cons:
                    await p.send_and_wait(SUBJECT, b"old", id="old-1", immediate=True)
                    got = []
                    for _ in range(20):  # bounded: 20 long polls
                        for rb in await cons.pull_batch(wait_ms=500):
                            got += [(i, rb.node) for i in rb.ids]
                            await rb.ack(wait=True)
                        if got:
                            break
                    assert got == [("old-1", c.realtime[1].address)]
            finally:
                await resolver.close()
            assert (await etcd.call(lambda cl: cl.get(key))).value == b"realtime-2"  # reading rewrote nothing
            done = _cli("admin", "route", SUBJECT, "--groups", "realtime-1,realtime-2", "--meta", meta)
            assert done.returncode == 0 and "epoch 2" in done.stdout, (done.stdout, done.stderr)
            raw = (await etcd.call(lambda cl: cl.get(key))).value
            assert raw == b'{"epoch": 2, "groups": ["realtime-1", "realtime-2"]}'
        finally:
            await etcd.close()
