"""A delay group drained under load, on real processes (etcd, a meta server, delay groups, a
real-time node): messages due 5-60 s later are sent before and while ``hourglass admin drain``
runs; some are cancelled before or after their move. The drained group ends ``empty``; every
acknowledged message not cancelled is delivered exactly once, with its original due time and
none early; no cancelled one is delivered; a lookup of a moved id at the drained group is
answered by the group that holds it. The second test does the same with replicated groups
(``sync`` acks) and a SIGKILL of the drained group's master in the middle of the drain, and
the third with a SIGKILL of the target group's master."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time

import grpc
import pytest

from cluster import errors as E
from cluster.client import Consumer, Producer
from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from tests.helpers import admin
from cluster.discovery import MetaResolver
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import meta_pb2 as mpb
from cluster.proto import meta_pb2_grpc as mrpc
from cluster.transport import Channels
from cluster.wire import make_request

pytestmark = pytest.mark.skipif(not __import__("shutil").which("etcd"), reason="etcd binary not installed")

SUBJECT = "drain.orders"
REFRESH_MS = 300
ENV = {"HOURGLASS_META_LEASE_TTL_MS": "2000", "HOURGLASS_META_REFRESH_MS": str(REFRESH_MS),
       "HOURGLASS_DRAIN_POLL_MS": "300", "HOURGLASS_DRAIN_IDLE_POLL_MS": "300",
       "HOURGLASS_DRAIN_BATCH_MAX": "20", "HOURGLASS_DRAIN_ROUND_MAX": "20"}
PER_ROUND = 30                 # messages a send round
ROUNDS_BEFORE = 12             # rounds before the drain starts
ROUNDS_DURING = 12             # rounds while it drains
DUE_MS = (5_000, 60_000)       # due this far after sending
CANCELS_PER_ROUND = 2
DELIVER_S_MAX = 150            # everything delivered within this (a bound, not a timing)
DRAIN_WAIT_S = 150
CLI_TIMEOUT_S = DRAIN_WAIT_S + 60
KILL_POLLS_MAX = 400           # the drained master's status asked at most this often before the kill


def _cli(*args: str) -> subprocess.CompletedProcess:
    return admin.cli(*args, timeout_s=CLI_TIMEOUT_S)


async def _delay_groups(meta: str, include_draining: bool) -> dict[str, mpb.Group]:
    async with grpc.aio.insecure_channel(meta) as ch:
        r = await mrpc.MetaStub(ch).GetServers(mpb.GetServersRequest(kind=mpb.DELAYED_PRODUCER,
                                                                      include_draining=include_draining), timeout=10)
    return {g.name: g for g in r.groups}


async def _drain_status(address: str) -> dict:
    ch = Channels()
    try:
        r = await ch.admin(address).Status(pb.StatusRequest(), timeout=5)
        return json.loads(r.json)["drain"]
    finally:
        await ch.close()


class Load:
    """Producer and consumer of the test: what was acknowledged, cancelled and received."""

    def __init__(self, meta: str) -> None:
        self.meta = meta
        self.sent: dict[str, int] = {}        # acknowledged id -> deliver_at_ms
        self.cancelled: set[str] = set()      # cancels acknowledged
        self.uncertain: set[str] = set()      # cancels without an answer: may or may not be delivered
        self.got: dict[str, int] = {}         # id -> times received
        self.due_seen: dict[str, int] = {}    # id -> deliver_at_ms as received
        self.early: list[tuple[str, int]] = []
        self.stop = asyncio.Event()
        self.rnd = random.Random(30)

    async def consume(self) -> None:
        r = MetaResolver([self.meta], refresh_ms=REFRESH_MS, realtime_kind=mpb.CONSUMER)
        try:
            async with Consumer(r, SUBJECT, group="g") as cons:
                while not self.stop.is_set():
                    try:
                        batches = await cons.pull_batch(wait_ms=200)
                    except E.Unavailable:
                        await asyncio.sleep(0.2)
                        continue
                    for rb in batches:
                        for i, late, due in zip(rb.ids, rb.lateness_ms.tolist(), rb.deliver_at_ms.tolist()):
                            self.got[i] = self.got.get(i, 0) + 1
                            self.due_seen[i] = int(due)
                            if late < 0:
                                self.early.append((i, late))
                        await rb.ack(wait=True)
        finally:
            await r.close()

    async def send_round(self, p: Producer, k: int) -> None:
        ids = [f"m-{k}-{j}" for j in range(PER_ROUND)]
        res = await (await p.send_many(SUBJECT, [b"x"] * PER_ROUND, ids=ids,
                                       delay_ms=[self.rnd.randrange(*DUE_MS) for _ in ids]))
        for j, msg_id in enumerate(res.ids):
            if j not in res.errors:
                self.sent[msg_id] = int(res.deliver_at_ms[j])
        # cancel a few messages sent earlier (before or after their move, whichever comes)
        for msg_id in self.rnd.sample(sorted(self.sent), CANCELS_PER_ROUND):
            if msg_id in self.cancelled or self.sent[msg_id] < time.time() * 1000 + 3_000:
                continue
            try:
                await p.cancel(msg_id)
                self.cancelled.add(msg_id)
            except (E.TooLate, E.NotFound):
                pass
            except E.Unavailable:  # no answer (a failover): cancelled or not, never delivered twice
                self.uncertain.add(msg_id)

    async def delivered(self) -> None:
        want = set(self.sent) - self.cancelled - self.uncertain
        deadline = time.monotonic() + DELIVER_S_MAX
        while time.monotonic() < deadline and not want <= set(self.got):
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)  # a redelivery, if any, would show by now
        self.stop.set()

    def check(self, where: dict[str, str]) -> None:
        want = set(self.sent) - self.cancelled - self.uncertain
        assert len(want) > (ROUNDS_BEFORE + ROUNDS_DURING) * PER_ROUND // 2
        missing = want - set(self.got)
        assert not missing, f"{len(missing)} acknowledged messages never delivered, e.g. {sorted(missing)[:5]}; " \
                            f"lookups: {where}"
        twice = {i: n for i, n in self.got.items() if n > 1}
        assert not twice, f"delivered more than once: {list(twice.items())[:5]}"
        back = self.cancelled & set(self.got)
        assert not back, f"cancelled yet delivered: {sorted(back)[:5]}"
        assert set(self.got) <= set(self.sent)
        assert not self.early, f"delivered before due: {self.early[:5]}"
        moved_due = {i: (self.sent[i], d) for i, d in self.due_seen.items() if d != self.sent[i]}
        assert not moved_due, f"due time changed: {list(moved_due.items())[:5]}"


async def _forwarded_at_the_drained_group(c: LocalCluster, load: Load, drained: str) -> None:
    """A lookup and a cancel of a moved message asked of the drained group itself are answered
    by the group that holds it now (the drained group only has its moved tombstone)."""
    node = next(n for n in c.delay if n.name == drained)
    ch = Channels()
    try:
        later = time.time() * 1000 + 15_000
        for msg_id in sorted(set(load.sent) - load.cancelled - load.uncertain - set(load.got)):
            if load.sent[msg_id] < later:
                continue
            r = await ch.producer(node.address).Lookup(pb.LookupRequest(id=msg_id), timeout=5)
            if r.code != pb.OK:
                continue
            assert r.status == "pending", r  # the holder's answer, not the tombstone's "cancelled"
            done = await ch.producer(node.address).Cancel(pb.CancelRequest(id=msg_id), timeout=5)
            assert done.code == pb.OK, done
            load.cancelled.add(msg_id)
            holder = next(n for n in c.delay if n.name != drained)
            there = await ch.producer(holder.address).Lookup(pb.LookupRequest(id=msg_id), timeout=5)
            assert there.code == pb.OK and there.status == "cancelled", there
            return
        raise AssertionError("no moved message still pending was found at the drained group")
    finally:
        await ch.close()


async def _drain_under_load(c: LocalCluster, drained: str, *, kill: str | None) -> dict:
    meta = c.meta_addresses[0]
    load = Load(meta)
    consumer = asyncio.create_task(load.consume())
    resolver = MetaResolver([meta], refresh_ms=REFRESH_MS)
    try:
        async with Producer(resolver, retries_max=40) as p:
            for k in range(ROUNDS_BEFORE):
                await load.send_round(p, k)
            r = _cli("admin", "drain", drained, "--meta", meta)
            assert r.returncode in (0, 1) and f"draining: {drained}" in r.stdout, (r.stdout, r.stderr)
            if kill:  # SIGKILL a master (the drained group's or the target's) once some moved, not all
                masters = await c.wait_masters("delay")
                await c.wait_in_sync("delay")  # the victim's slave may campaign
                source = next(n for n in c.delay if n.name == masters[drained])
                victim_group = drained if kill == "drained" else next(g for g in masters if g != drained)
                victim = next(n for n in c.delay if n.name == masters[victim_group])
                for _ in range(KILL_POLLS_MAX):
                    st = await _drain_status(source.address)
                    if st["moved"] > 0:
                        break
                    await asyncio.sleep(0.05)
                victim.kill()
                assert st["moved"] > 0 and st["state"] == "draining", st
                far = st["pending"] - st["near"]
                assert far > 0, f"the drain was over before the kill: {st}"
                if kill == "target":
                    # a new master there; the killed one back as its slave (sync acks need one)
                    await c.wait_masters("delay")
                    await asyncio.to_thread(c.restart, victim)
            for k in range(ROUNDS_BEFORE, ROUNDS_BEFORE + ROUNDS_DURING):
                await load.send_round(p, k)
            # a producer with the current view is never given the drained group
            assert drained not in await _delay_groups(meta, include_draining=False)
            assert (await _delay_groups(meta, include_draining=True))[drained].draining
            # the CLI reports progress, then 'empty' once the group holds nothing
            r = _cli("admin", "drain", drained, "--meta", meta, "--wait-s", str(DRAIN_WAIT_S))
            assert r.returncode == 0 and f"empty: {drained}" in r.stdout, (r.stdout, r.stderr)
            assert "already draining" in r.stdout
            # a moved id is found by the SDK (its home among the other groups)
            moved = sorted(set(load.sent) - load.cancelled - set(load.got))
            if moved:
                found = await p.lookup(moved[-1])
                assert found.status in ("pending", "in_flight", "dispatched"), found
            if not kill:
                await _forwarded_at_the_drained_group(c, load, drained)
        await load.delivered()
    finally:
        load.stop.set()
        await consumer
        await resolver.close()
    where = {}
    async with Producer(MetaResolver([meta], refresh_ms=REFRESH_MS)) as p:
        for msg_id in sorted(set(load.sent) - load.cancelled - load.uncertain - set(load.got))[:5]:
            try:
                where[msg_id] = str(await p.lookup(msg_id))
            except E.HourglassError as e:
                where[msg_id] = repr(e)
    load.check(where)
    masters = await c.wait_masters("delay")
    node = next(n for n in c.delay if n.name == masters[drained])
    st = await _drain_status(node.address)
    assert st["state"] == "empty" and st["pending"] == 0, st
    status = _cli("status", "--meta", meta)
    assert "(empty, 0 pending)" in status.stdout, status.stdout
    return st


@pytest.mark.integration
async def test_a_delay_group_drained_under_load_ends_empty_and_loses_nothing(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=2, n_realtime=1, meta=True, env=ENV)
    with c:
        c.wait_registered()
        st = await _drain_under_load(c, "delay-2", kill=None)
        assert st["moved"] > 0
        # a lookup of a moved id asked of the drained group itself is answered by its new group
        ch = Channels()
        try:
            node = next(n for n in c.delay if n.name == "delay-2")
            r = _cli("admin", "drain", "delay-1", "--meta", c.meta_addresses[0])
            assert r.returncode == 2 and "last delay group" in r.stderr, (r.stdout, r.stderr)
            refused = None
            try:
                late = Batch.build(SUBJECT, [b"x"], ["late-1"], [int(time.time() * 1000) + 30_000])
                await ch.producer(node.address).SendBatch(make_request(late), timeout=5)
            except grpc.RpcError as e:
                refused = e
            assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in refused.details(), refused.details()
        finally:
            await ch.close()


@pytest.mark.slow  # tier: replicated groups, a SIGKILL and a failover under load
async def test_a_drain_survives_a_sigkill_of_the_drained_masters(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=4, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                     lease_ttl_ms=2000, env=ENV)
    with c:
        c.wait_registered()
        await c.wait_masters("delay")
        st = await _drain_under_load(c, "delay-g2", kill="drained")
        assert st["moved"] + st["duplicates"] > 0  # the new master carried the drain on


@pytest.mark.slow  # tier: replicated groups, a SIGKILL and a failover under load
async def test_a_drain_survives_a_sigkill_of_the_target_groups_master(tmp_path):
    c = LocalCluster(tmp_path / "c", n_delay=4, n_realtime=1, meta=True, delay_replicas=2, ack_mode="sync",
                     lease_ttl_ms=2000, env=ENV)
    with c:
        c.wait_registered()
        await c.wait_masters("delay")
        st = await _drain_under_load(c, "delay-g2", kill="target")
        assert st["moved"] > 0
