"""Narrowing drains first, on real processes (etcd, a meta server, a delay node, three real-time
groups; docs/design.md "Narrowing drains first"): a subject over three groups is narrowed to two
under load (delayed and immediate messages, two consumer groups pulling and acking). Every
acknowledged message is delivered to each consumer group, exactly once (the bound on
duplicates in a run without failures is zero: a refused message was stored nowhere, and the
retry of an id goes to one group under one route), none before its due time; a producer
and a delay node whose route is cached from before the narrowing are refused by the dropped
group and their messages land in the remaining ones; the route ends without the dropped group, by itself,
once the consumers acked everything there (not before: while one consumer group holds back,
`hourglass admin route SUBJECT` says how many of its messages are left there). Then: a consumer
group that pulled only from the kept group before the narrowing is waited for by name and gets
every message the dropped group held (`hourglass status` shows the drain and who it waits
for); and a drain whose group is a master and a slave survives a SIGKILL of that master."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest

from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster, wait_until
from tests.helpers import admin
from tests.helpers.flow import send_all
from cluster.discovery import MetaResolver
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.routes import FENCE_REVISION_KEY, group_of

pytestmark = pytest.mark.slow  # real processes, over 20 s

SUBJECT = "hot.narrowed"
GROUPS = ("billing", "audit")   # two consumer groups: each must see every message once
REFRESH_MS = 300                # the test's clients ask for routes this often
# the delay node keeps a route an hour: after the narrowing it learns the new one only from the
# dropped group's "route moved" refusal of its dispatch
ENV = {"HOURGLASS_META_LEASE_TTL_MS": "2000", "HOURGLASS_META_REFRESH_MS": "3600000"}
ALL = ("realtime-1", "realtime-2", "realtime-3")
KEPT = ("realtime-1", "realtime-2")
DROPPED = "realtime-3"
ROUNDS_BEFORE = 10              # send rounds on three groups
ROUNDS_AFTER = 20               # and after the narrowing
PER_ROUND = 20                  # delayed messages a round (plus PER_ROUND // 2 immediate)
STALE_MESSAGES = 10             # immediate messages of the stale producer, each hashed to DROPPED by its old route
WAIT_S_MAX = 120                # bounds of the waits below (outcomes, not timings)
CLI_TIMEOUT_S = 60


def _cli(*args: str) -> subprocess.CompletedProcess:
    return admin.cli(*args, timeout_s=CLI_TIMEOUT_S)


async def _route(meta: str) -> mpb.RouteResponse:
    return await admin.route(meta, SUBJECT)


async def _fence_revisions(meta: str, group: str) -> list[int]:
    async with grpc.aio.insecure_channel(meta) as ch:
        r = await mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=mpb.CONSUMER), timeout=10)
    return [m.offsets.get(FENCE_REVISION_KEY, 0) for g in r.groups if g.name == group for m in g.members]


async def _until(pred, what: str) -> None:
    """Wait for an outcome (``LocalCluster``'s ``wait_until``), bounded by ``WAIT_S_MAX``."""
    await wait_until(pred, WAIT_S_MAX, what)


async def test_a_subject_narrowed_under_load_loses_nothing_and_the_dropped_group_leaves_the_route(tmp_path):
    from metaserver.etcd import EtcdClient
    from metaserver.fences import fence_key

    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=3, meta=True, env=ENV)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        node_group = {n.address: c.group_of[n.name] for n in c.realtime}
        assert sorted(node_group.values()) == list(ALL)
        await _route(meta)  # first use: one group
        r = _cli("admin", "route", SUBJECT, "--groups", ",".join(ALL), "--meta", meta)
        assert r.returncode == 0 and "epoch 2" in r.stdout, (r.stdout, r.stderr)

        sent: dict[str, int] = {}          # acknowledged id -> deliver_at_ms
        got: dict[str, dict[str, int]] = {g: {} for g in GROUPS}   # consumer group -> id -> times received
        where: dict[str, str] = {}         # id -> real-time group it was received from
        early: list[tuple[str, int]] = []
        stop = asyncio.Event()
        held = asyncio.Event()  # set: the "audit" consumer group pulls nothing (the drain must wait for it)

        async def consume(group: str) -> None:
            res = MetaResolver([meta], refresh_ms=REFRESH_MS, realtime_kind=mpb.CONSUMER)
            try:
                async with Consumer(res, SUBJECT, group=group) as cons:
                    while not stop.is_set():
                        if group == "audit" and held.is_set():
                            await asyncio.sleep(0.05)
                            continue
                        for rb in await cons.pull_batch(wait_ms=200):
                            for i, lateness in zip(rb.ids, rb.lateness_ms.tolist()):
                                got[group][i] = got[group].get(i, 0) + 1
                                where[i] = node_group[rb.node]
                                if lateness < 0:
                                    early.append((i, lateness))
                            await rb.ack(wait=True)
            finally:
                await res.close()

        consumers = [asyncio.create_task(consume(g)) for g in GROUPS]
        resolver = MetaResolver([meta], refresh_ms=REFRESH_MS)
        stale = MetaResolver([meta], refresh_ms=3_600_000)  # a route cached for an hour: older than the narrowing
        etcd = EtcdClient(c.etcd_endpoints)
        try:
            old = await stale.realtime_route(SUBJECT)
            assert old.groups == ALL and old.epoch == 2
            async with Producer(resolver) as p, Producer(stale) as sp:
                async def send_round(k: int) -> None:
                    await admin.send_round(p, SUBJECT, k, PER_ROUND, sent)

                for k in range(ROUNDS_BEFORE):
                    if k == ROUNDS_BEFORE - 1:
                        held.set()  # audit stops before the last round: the dropped group holds its share
                        await asyncio.sleep(0.5)  # a pull in flight ends (wait_ms=200)
                    await send_round(k)
                assert any(group_of(f"i-{ROUNDS_BEFORE - 1}-{j}", ALL) == DROPPED for j in range(PER_ROUND // 2))
                # narrow online, while messages are due, in flight and unacked in the dropped group
                r = _cli("admin", "route", SUBJECT, "--groups", ",".join(KEPT), "--meta", meta)
                assert r.returncode == 0, r.stderr
                assert r.stdout.startswith("narrowing: ") and "epoch 3" in r.stdout and f"draining {DROPPED}" \
                    in r.stdout, r.stdout
                narrowed = await _route(meta)
                assert [g.name for g in narrowed.groups] == list(KEPT) and narrowed.epoch >= 3
                for k in range(ROUNDS_BEFORE, ROUNDS_BEFORE + ROUNDS_AFTER):
                    await send_round(k)

                # the stale producer, once the dropped group enforces its fence: refused there,
                # it asks for the route again and its messages land in the kept groups
                fence = await etcd.call(lambda cl: cl.get(fence_key(DROPPED, SUBJECT)))
                assert fence is not None

                async def fenced() -> bool:
                    revs = await _fence_revisions(meta, DROPPED)
                    return bool(revs) and min(revs) >= fence.mod_revision
                await _until(fenced, f"{DROPPED} enforces its fence")
                assert stale._routes[SUBJECT][0].epoch == 2  # still the old route
                ids = [i for i in (f"s-{n}" for n in range(1000)) if group_of(i, ALL) == DROPPED][:STALE_MESSAGES]
                res = await (await sp.send_many(SUBJECT, [b"z"] * len(ids), ids=ids, immediate=True))
                assert not res.errors, res.errors
                sent.update({i: int(res.deliver_at_ms[j]) for j, i in enumerate(res.ids)})
                assert stale._routes[SUBJECT][0].epoch >= 3  # the refusal made it ask again
                # delayed ones the delay node dispatches with its hour-old route: refused there too
                d_ids = [i for i in (f"ds-{n}" for n in range(1000)) if group_of(i, ALL) == DROPPED][:STALE_MESSAGES]
                res = await (await p.send_many(SUBJECT, [b"w"] * len(d_ids), ids=d_ids, delay_ms=300))
                assert not res.errors, res.errors
                sent.update({i: int(res.deliver_at_ms[j]) for j, i in enumerate(res.ids)})
                ids += d_ids
                # audit has not acked the dropped group's messages: it drains, and says how many are left
                r = _cli("admin", "route", SUBJECT, "--meta", meta)
                assert r.returncode == 0 and r.stdout.startswith(f"route: {SUBJECT} routes to {','.join(KEPT)}") \
                    and f"draining: {DROPPED} (" in r.stdout, (r.stdout, r.stderr)
                left = int(r.stdout.split(f"draining: {DROPPED} (")[1].split(" left)")[0])
                assert left > 0, r.stdout
                assert [g.name for g in (await _route(meta)).draining] == [DROPPED]
                held.clear()
        finally:
            await resolver.close()
            await stale.close()
            await etcd.close()

        async def delivered() -> bool:
            return all(set(got[g]) >= set(sent) for g in GROUPS)
        await _until(delivered, "every acknowledged message delivered to both consumer groups")

        async def finished() -> bool:
            now = await _route(meta)
            return not now.draining and [g.name for g in now.groups] == list(KEPT)
        await _until(finished, f"{DROPPED} leaves the route once drained")
        await asyncio.sleep(1.0)  # a redelivery, if any, would show by now
        stop.set()
        await asyncio.gather(*consumers)

        after = await _route(meta)
        assert after.epoch == 4 and not after.draining  # widened 2, narrowed 3, finished 4
        assert len(sent) >= (ROUNDS_BEFORE + ROUNDS_AFTER) * PER_ROUND
        for g in GROUPS:
            missing = set(sent) - set(got[g])
            assert not missing, f"{g}: {len(missing)} acknowledged messages never delivered, e.g. {sorted(missing)[:5]}"
            twice = {i: n for i, n in got[g].items() if n > 1}
            assert not twice, f"{g}: delivered more than once: {list(twice.items())[:5]}"
            assert set(got[g]) <= set(sent)
        assert not early, f"delivered before due: {early[:5]}"
        assert {where[i] for i in ids} <= set(KEPT), {i: where[i] for i in ids}
        assert any(where[i] == DROPPED for i in sent), "the dropped group held messages before the narrowing"

        r = _cli("admin", "route", SUBJECT, "--meta", meta)
        assert r.returncode == 0 and r.stdout.startswith("route: ") and ",".join(KEPT) in r.stdout \
            and "epoch 4" in r.stdout and "draining" not in r.stdout, (r.stdout, r.stderr)
        # listing the dropped group again takes it back: no fence left, it is written to again
        r = _cli("admin", "route", SUBJECT, "--groups", ",".join(ALL), "--meta", meta)
        assert r.returncode == 0 and r.stdout.startswith("routed: ") and "epoch 5" in r.stdout, (r.stdout, r.stderr)
        etcd = EtcdClient(c.etcd_endpoints)
        try:
            assert await etcd.call(lambda cl: cl.get(fence_key(DROPPED, SUBJECT))) is None
        finally:
            await etcd.close()
        r = _cli("admin", "route", "no.such.subject", "--meta", meta)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr


async def _drain_of(address: str, subject: str) -> dict | None:
    """A real-time master's drain of ``subject`` as its Status says (``route_drains``)."""
    import json

    from cluster.cli.status import drain_of
    from cluster.proto import hourglass_pb2 as pb
    from cluster.proto import hourglass_pb2_grpc as rpc
    async with grpc.aio.insecure_channel(address) as ch:
        st = json.loads((await rpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=10)).json)
    return drain_of(st, subject)


async def _consume(meta: str, subject: str, group: str, stop: asyncio.Event, got: dict[str, int],
                   where: dict[str, str] | None = None, node_group: dict[str, str] | None = None) -> None:
    """One consumer of ``group`` until ``stop``: counts each id it gets in ``got`` (and the
    real-time group it came from in ``where``), acks each batch and waits for the answer."""
    res = MetaResolver([meta], refresh_ms=REFRESH_MS, realtime_kind=mpb.CONSUMER)
    try:
        async with Consumer(res, subject, group=group) as cons:
            while not stop.is_set():
                for rb in await cons.pull_batch(wait_ms=200):
                    for i in rb.ids:
                        got[i] = got.get(i, 0) + 1
                        if where is not None:
                            where[i] = node_group[rb.node]
                    await rb.ack(wait=True)
    finally:
        await res.close()


async def _send_now(meta: str, subject: str, ids: list[str], sent: list[str]) -> None:
    """Immediate messages ``ids`` from a new producer (the route as it is now), all accepted."""
    res = MetaResolver([meta], refresh_ms=REFRESH_MS)
    try:
        async with Producer(res) as p:
            out = await (await p.send_many(subject, [b"x"] * len(ids), ids=ids, immediate=True))
    finally:
        await res.close()
    assert not out.errors, out.errors
    sent.extend(ids)


async def test_a_consumer_group_that_never_pulled_from_the_dropped_group_still_gets_every_message_it_held(tmp_path):
    """``audit`` consumes the subject on its first group only, then stops; the subject is widened
    to a second group, which ``billing`` drains to the last message, and narrowed back. The
    dropped group has no state of ``audit``, yet its drain waits for it by name (``N left``,
    ``waiting for audit`` in ``hourglass status``) and ends only once ``audit``, back, got every
    message the dropped group held, exactly once like every other."""
    subject = "hot.narrowed.late"
    c = LocalCluster(tmp_path / "c", n_delay=1, n_realtime=2, meta=True, env=ENV)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        first = (await admin.route(meta, subject)).groups[0].name  # first use: one group
        masters = {c.group_of[n.name]: n.address for n in c.realtime}
        other = next(g for g in masters if g != first)
        node_group = {a: g for g, a in masters.items()}
        got: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
        where: dict[str, str] = {}
        sent: list[str] = []
        stop = {g: asyncio.Event() for g in GROUPS}

        def consume(group: str):
            return _consume(meta, subject, group, stop[group], got[group], where, node_group)

        async def send(ids: list[str]) -> None:
            await _send_now(meta, subject, ids, sent)

        async def both_have(ids) -> bool:
            return all(set(got[g]) >= set(ids) for g in GROUPS)

        tasks = {g: asyncio.create_task(consume(g)) for g in GROUPS}
        try:
            await send([f"a-{j}" for j in range(10)])  # one group: both consumer groups get them there
            await _until(lambda: both_have(sent), "both consumer groups got the first messages")
            stop["audit"].set()
            await tasks.pop("audit")  # audit has state on `first` only, and stops
            r = _cli("admin", "route", subject, "--groups", f"{first},{other}", "--meta", meta)
            assert r.returncode == 0 and "epoch 2" in r.stdout, (r.stdout, r.stderr)
            ids = [f"b-{j}" for j in range(60)]
            await send(ids)
            dropped = [i for i in ids if group_of(i, tuple(sorted((first, other)))) == other]
            assert dropped

            async def billing_has_all() -> bool:
                return set(got["billing"]) >= set(sent)
            await _until(billing_has_all, "billing got every message, from both groups")
            assert {where[i] for i in dropped} == {other}
            r = _cli("admin", "route", subject, "--groups", first, "--meta", meta)
            assert r.returncode == 0 and r.stdout.startswith("narrowing: "), (r.stdout, r.stderr)

            # billing acked all of `other`; audit never pulled there: the drain waits for it by name
            async def waits_for_audit():
                d = await _drain_of(masters[other], subject)
                return d if d and d["left"] == len(dropped) and d["waiting_for"] == ["audit"] else None
            await _until_value(waits_for_audit, f"{other}'s drain waits for audit")
            assert [g.name for g in (await admin.route(meta, subject)).draining] == [other]
            st = _cli("status", "--meta", meta)
            assert st.returncode == 0, (st.stdout, st.stderr)
            line = f"route: {subject} draining: {other} ({len(dropped)} left), waiting for audit"
            assert line in st.stdout.splitlines(), st.stdout
            r = _cli("admin", "route", subject, "--meta", meta)
            assert f"draining: {other} ({len(dropped)} left)" in r.stdout, r.stdout

            stop["audit"].clear()
            tasks["audit"] = asyncio.create_task(consume("audit"))  # audit is back: it reads both groups

            async def finished() -> bool:
                now = await admin.route(meta, subject)
                return not now.draining and [g.name for g in now.groups] == [first]
            await _until(lambda: both_have(sent), "audit got every message, the dropped group's too")
            await _until(finished, f"{other} leaves the route once audit acked it all")
            await send([f"c-{j}" for j in range(10)])  # after the drain: the kept group only
            await _until(lambda: both_have(sent), "the last messages")
        finally:
            for g in GROUPS:
                stop[g].set()
            await asyncio.gather(*tasks.values())
        await _status_shows_no_drain(meta)
        for g in GROUPS:
            assert set(got[g]) == set(sent), g
            twice = {i: n for i, n in got[g].items() if n > 1}
            assert not twice, f"{g}: delivered more than once: {list(twice.items())[:5]}"
        assert {where[i] for i in dropped} == {other} and {where[i] for i in sent if i.startswith("c-")} == {first}


async def test_an_operator_releases_a_consumer_group_that_stopped_for_good_and_the_drain_ends(tmp_path):
    """``audit`` consumes the subject on its first group, then stops for good; the subject is
    widened, ``billing`` reads both groups to the end, and it is narrowed back: the drain waits
    for ``audit`` by name. ``hourglass admin release SUBJECT audit`` says what it gives up and does
    nothing without ``--yes``; with it the drain ends (the dropped group leaves the route) and
    ``status`` shows no drain. ``billing`` got every message exactly once; ``audit``, back
    later, gets everything of the kept group and nothing of the dropped one (given up)."""
    subject = "hot.narrowed.released"
    c = LocalCluster(tmp_path / "c", n_delay=0, n_realtime=2, meta=True, env=ENV)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        first = (await admin.route(meta, subject)).groups[0].name  # first use: one group
        masters = {c.group_of[n.name]: n.address for n in c.realtime}
        other = next(g for g in masters if g != first)
        got: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
        sent: list[str] = []
        stop = {g: asyncio.Event() for g in GROUPS}

        def consume(group: str):
            return _consume(meta, subject, group, stop[group], got[group])

        async def send(ids: list[str]) -> None:
            await _send_now(meta, subject, ids, sent)

        async def has(group: str, ids) -> bool:
            return set(got[group]) >= set(ids)

        tasks = {g: asyncio.create_task(consume(g)) for g in GROUPS}
        try:
            await send([f"a-{j}" for j in range(10)])
            await _until(lambda: has("audit", sent), "audit got the first messages")
            stop["audit"].set()
            await tasks.pop("audit")  # audit stops (for good, as far as the drain can tell)
            r = _cli("admin", "route", subject, "--groups", f"{first},{other}", "--meta", meta)
            assert r.returncode == 0 and "epoch 2" in r.stdout, (r.stdout, r.stderr)
            ids = [f"b-{j}" for j in range(60)]
            await send(ids)
            dropped = [i for i in ids if group_of(i, tuple(sorted((first, other)))) == other]
            assert dropped
            await _until(lambda: has("billing", sent), "billing got every message, from both groups")
            r = _cli("admin", "route", subject, "--groups", first, "--meta", meta)
            assert r.returncode == 0 and r.stdout.startswith("narrowing: "), (r.stdout, r.stderr)

            async def waits_for_audit():
                d = await _drain_of(masters[other], subject)
                return d if d and d["left"] == len(dropped) and d["waiting_for"] == ["audit"] else None
            await _until_value(waits_for_audit, f"{other}'s drain waits for audit")

            r = _cli("admin", "release", subject, "audit", "--meta", meta)  # no --yes: says what, does nothing
            assert r.returncode == 1 and "--yes" in r.stdout and f"draining: {other} ({len(dropped)} left)" in \
                r.stdout, (r.stdout, r.stderr)
            assert [g.name for g in (await admin.route(meta, subject)).draining] == [other]
            r = _cli("admin", "release", subject, "audit", "--yes", "--meta", meta)
            assert r.returncode == 0 and r.stdout.startswith(f"released: the drains of {subject} on {other} "), \
                (r.stdout, r.stderr)

            async def finished() -> bool:
                now = await admin.route(meta, subject)
                return not now.draining and [g.name for g in now.groups] == [first]
            await _until(finished, f"{other} leaves the route: audit no longer holds it back")
            await _status_shows_no_drain(meta)
            r = _cli("admin", "release", subject, "audit", "--yes", "--meta", meta)  # nothing drains now
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 4 and len(lines) == 1 and lines[0].startswith("error: "), (r.stdout, r.stderr)

            await send([f"c-{j}" for j in range(10)])
            stop["audit"].clear()
            tasks["audit"] = asyncio.create_task(consume("audit"))  # back: it reads the route as it is now
            kept = [i for i in sent if i not in set(dropped)]
            await _until(lambda: has("audit", kept), "audit got every message of the kept group")
            await _until(lambda: has("billing", sent), "billing got the last messages")
        finally:
            for g in GROUPS:
                stop[g].set()
            await asyncio.gather(*tasks.values())
        assert set(got["billing"]) == set(sent)
        assert not set(got["audit"]) & set(dropped), "audit got messages of the drain it was released from"
        for g in GROUPS:
            twice = {i: n for i, n in got[g].items() if n > 1}
            assert not twice, f"{g}: delivered more than once: {list(twice.items())[:5]}"


async def _status_shows_no_drain(meta: str) -> None:
    """``hourglass status`` lists a drain from what the real-time masters report (their fence,
    ``route_drains``), so right after the meta server finished a drain a master may still show
    it until it learns of the new route (its next heartbeat): wait, bounded, until none does."""
    last = {}

    async def clean() -> bool:
        last["st"] = st = _cli("status", "--meta", meta)
        return st.returncode == 0 and "draining" not in st.stdout
    try:
        await _until(clean, "status without a drain line")
    except TimeoutError:
        raise AssertionError(last["st"].stdout + last["st"].stderr) from None


async def _until_value(pred, what: str):
    return await wait_until(pred, WAIT_S_MAX, what)


async def test_a_drain_survives_a_sigkill_of_the_draining_groups_master(tmp_path):
    """Both real-time groups are a master and a slave (``sync`` acks). The subject over both is
    narrowed to one while ``audit`` holds back: the dropped group drains, ``N left``. Its master
    is SIGKILLed mid-drain (and restarted, as a supervisor would: a ``sync`` group takes writes
    with a slave); the slave takes over with the fence, the group positions and the messages,
    and the drain goes on there: it does not finish while ``audit`` holds back, and once
    ``audit`` is back it finishes, every message delivered to each consumer group, and none again
    after its ack was answered. A long poll of ``audit``'s left in flight at the old master may
    fetch a batch there before the kill: its ack can only go there and fails, and the new master
    delivers those messages again (at least once, docs/replication.md)."""
    from cluster import errors as E

    subject = "hot.narrowed.failover"
    c = LocalCluster(tmp_path / "c", n_delay=0, n_realtime=4, meta=True, env=ENV, realtime_replicas=2,
                     ack_mode="sync", lease_ttl_ms=2000)
    with c:
        c.wait_registered()
        meta = c.meta_addresses[0]
        masters = await c.wait_masters("realtime")  # group -> its master's name
        assert sorted(masters) == ["realtime-g1", "realtime-g2"]
        first = (await admin.route(meta, subject)).groups[0].name
        other = next(g for g in masters if g != first)
        by_address = {n.address: c.group_of[n.name] for n in c.realtime}
        r = _cli("admin", "route", subject, "--groups", "realtime-g1,realtime-g2", "--meta", meta)
        assert r.returncode == 0 and "epoch 2" in r.stdout, (r.stdout, r.stderr)
        got: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
        where: dict[str, str] = {}
        sent: list[str] = []
        unconfirmed: dict[str, set[str]] = {g: set() for g in GROUPS}  # acks that failed: those may come again
        held, paused, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def consume(group: str) -> None:
            res = MetaResolver([meta], refresh_ms=REFRESH_MS, realtime_kind=mpb.CONSUMER)
            try:
                async with Consumer(res, subject, group=group) as cons:
                    while not stop.is_set():
                        if group == "audit" and held.is_set():
                            paused.set()  # no pull_batch now (a long poll left in flight may still fetch one)
                            await asyncio.sleep(0.05)
                            continue
                        if group == "audit":
                            paused.clear()
                        try:
                            batches = await cons.pull_batch(wait_ms=200)
                        except E.HourglassError:  # the killed master's pull: the next round asks again
                            await asyncio.sleep(0.1)
                            continue
                        for rb in batches:
                            for i in rb.ids:
                                got[group][i] = got[group].get(i, 0) + 1
                                where[i] = by_address.get(rb.node, rb.node)
                            try:
                                await rb.ack(wait=True)
                            except E.HourglassError:
                                unconfirmed[group].update(rb.ids)
            finally:
                await res.close()

        async def send(ids: list[str]) -> None:
            await send_all([meta], subject, ids, refresh_ms=REFRESH_MS, immediate=True)
            sent.extend(ids)

        async def has(group: str, ids) -> bool:
            return set(got[group]) >= set(ids)

        tasks = [asyncio.create_task(consume(g)) for g in GROUPS]
        try:
            await send([f"a-{j}" for j in range(40)])
            await _until(lambda: has("audit", sent), "audit got the first messages")
            held.set()
            await _until(lambda: _set(paused), "audit holds back")
            ids = [f"b-{j}" for j in range(60)]
            await send(ids)
            behind = [i for i in ids if group_of(i, ("realtime-g1", "realtime-g2")) == other]
            assert behind
            await _until(lambda: has("billing", sent), "billing got every message")
            r = _cli("admin", "route", subject, "--groups", first, "--meta", meta)
            assert r.returncode == 0 and r.stdout.startswith("narrowing: "), (r.stdout, r.stderr)

            old = next(n for n in c.realtime if n.name == masters[other])

            async def draining(address: str):
                d = await _drain_of(address, subject)
                return d if d and d["left"] == len(behind) and d["waiting_for"] == ["audit"] else None
            await _until_value(lambda: draining(old.address), f"{other}'s master drains, audit holding back")
            await c.wait_in_sync("realtime")  # the slave may be elected
            old.kill()
            new = next(n for n in c.realtime if c.group_of[n.name] == other and n is not old)

            async def promoted() -> bool:
                return bool((await c.statuses("realtime")).get(new.name, {}).get("master"))
            await _until(promoted, f"{new.name} takes over {other}")
            old.start()  # a supervisor restarts it: a sync group takes writes with a slave
            await asyncio.to_thread(old.wait_ready)
            assert (await c.wait_masters("realtime"))[other] == new.name
            # the drain goes on at the new master: same count, still waiting for audit
            await _until_value(lambda: draining(new.address), f"{other}'s new master drains, audit holding back")
            assert [g.name for g in (await admin.route(meta, subject)).draining] == [other]

            held.clear()

            async def finished() -> bool:
                route = await admin.route(meta, subject)
                return not route.draining and [g.name for g in route.groups] == [first]
            await _until(lambda: has("audit", sent), "audit got every message, the dropped group's too")
            await _until(finished, f"{other} leaves the route once audit acked it all")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert {where[i] for i in behind} == {other}
        for g in GROUPS:
            assert set(got[g]) == set(sent), g
            twice = {i: n for i, n in got[g].items() if n > 1}
            again = sorted(set(twice) - unconfirmed[g])  # at least once: only what was never acked OK comes again
            assert not again, f"{g}: delivered again after an answered ack: {again[:5]} ({len(twice)} twice in all)"


async def _set(event: asyncio.Event) -> bool:
    return event.is_set()
