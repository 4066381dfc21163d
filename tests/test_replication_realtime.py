"""Replication and failover of a real-time group with real processes, a real etcd and a meta server.

One real-time group of a master and a slave (``LocalCluster(realtime_replicas=2)``, 2 s
leases). Checks: under load in ``sync`` mode the master is SIGKILLed: no acknowledged
immediate message is lost, no message whose Ack was answered is delivered again (consumer
group offsets survive the failover), duplicates are bounded by what was pulled and not yet
acked at the kill; the old master returns as a slave and its log ends byte-identical with
the new master's. In ``async`` mode a returning old master truncates the divergent suffix
(log and consume index) it had alone. Lookahead consumers (``Consumer.batches()`` with
``lookahead_ms``) of delayed messages across a SIGKILL of the master in ``sync`` mode:
nothing lost, nothing handed out before its due time, nothing again after an answered ack.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from cluster import errors as E
from cluster.client import Consumer, Producer
from cluster.devcluster import LocalCluster, wait_until as wait_for
from tests.helpers.flow import send_all
from tests.helpers.logs import log_bytes
from cluster.discovery import MetaResolver
from cluster.proto import meta_pb2 as mpb

needs_etcd = pytest.mark.skipif(not __import__("shutil").which("etcd"), reason="etcd binary not installed")

BATCH = 50  # consumer pull size: bounds the duplicates a failover may cause


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def statuses(cluster) -> dict[str, dict]:
    return await cluster.statuses("realtime")


async def master_of(cluster) -> str:
    return await cluster.wait_master("realtime")


async def caught_up_slave(cluster, name: str) -> None:
    await cluster.wait_caught_up_slave(name, "realtime")


def index_bytes(node, subject: str) -> bytes:
    return (node.data_dir / "index" / subject / "entries").read_bytes()


@needs_etcd
async def test_master_sigkill_under_load_keeps_messages_and_group_offsets(tmp_path):
    with LocalCluster(tmp_path, n_delay=0, n_realtime=2, meta=True, realtime_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000) as c:
        c.wait_registered()
        master = await master_of(c)
        old = next(n for n in c.realtime if n.name == master)
        resolver = MetaResolver(c.meta_addresses, refresh_ms=500)
        acked_sends: set[str] = set()
        confirmed_at: dict[str, int] = {}   # id -> delivery count when its Ack was answered OK
        deliveries: dict[str, int] = {}     # id -> times delivered to the group
        late: list[str] = []                # delivered again after its Ack was answered
        stop_producing = asyncio.Event()
        killed = asyncio.Event()

        async def produce():
            i = 0
            async with Producer(resolver, retries_max=40) as p:
                while not stop_producing.is_set():
                    futs = [await p.send("rt.load", f"v{i + k}", id=f"m{i + k}", immediate=True) for k in range(20)]
                    res = await asyncio.gather(*futs, return_exceptions=True)
                    acked_sends.update(f"m{i + k}" for k, r in enumerate(res) if not isinstance(r, BaseException))
                    i += 20
                    await asyncio.sleep(0.01)

        async def consume(until):
            async with Consumer(resolver, "rt.load", group="g", wait_ms=200, batch_max=BATCH, timeout_s=5) as cons:
                while not until():
                    try:
                        batch = await cons.pull()
                    except E.Unavailable:
                        await asyncio.sleep(0.1)
                        continue
                    for m in batch:
                        deliveries[m.id] = deliveries.get(m.id, 0) + 1
                        if m.id in confirmed_at:
                            late.append(m.id)
                    try:
                        await cons.ack(batch)
                    except E.HourglassError:
                        continue  # not confirmed: these may come again
                    for m in batch:
                        confirmed_at.setdefault(m.id, deliveries[m.id])

        try:
            prod = asyncio.create_task(produce())
            # the consumer ends once the producer has ended (not when it was told to stop: its last
            # round is still being answered then, and ids acknowledged after the consumer's last
            # look would read as lost) and everything acknowledged was delivered
            cons = asyncio.create_task(consume(lambda: prod.done() and acked_sends <= set(deliveries)))
            async def confirmed_and_sent(n_confirmed: int, n_sent: int):
                return len(confirmed_at) >= n_confirmed and len(acked_sends) >= n_sent

            # the kill comes once acks are flowing (an outcome, not a time: a starved CI machine
            # may need far longer than a quiet one to get there)
            await wait_for(lambda: confirmed_and_sent(1, 100), 120, "acks flowing before the kill")
            await c.wait_in_sync("realtime")  # the slave may campaign
            before_kill = len(confirmed_at)
            old.kill()
            killed.set()
            await asyncio.sleep(1.0)
            old.start()  # a supervisor restarts it: in sync mode the group needs a slave to take writes
            await asyncio.to_thread(old.wait_ready)
            sent_at_restart = len(acked_sends)
            # writes are taken again (sync mode: the group has a slave again) before stopping
            await wait_for(lambda: confirmed_and_sent(before_kill + 1, max(sent_at_restart, 200) + 100), 180,
                           "sends and acks taken again after the restart")
            stop_producing.set()
            await asyncio.wait_for(prod, 60)
            await asyncio.wait_for(cons, 60)
            new_master = await master_of(c)  # either node: the restarted one may be the most caught up
            assert before_kill > 0 and len(acked_sends) > 200
            lost = acked_sends - set(deliveries)
            assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"
            assert not late, f"{len(late)} messages delivered again after their Ack was answered: {late[:5]}"
            dups = sum(n - 1 for n in deliveries.values())
            print(f"sent={len(acked_sends)} delivered={len(deliveries)} duplicates={dups}")
            assert dups <= 2 * BATCH, f"{dups} duplicate deliveries (at most the batches in flight at the kill)"
            await caught_up_slave(c, next(n.name for n in c.realtime if n.name != new_master))
        finally:
            stop_producing.set()
            await resolver.close()
        await asyncio.sleep(0.5)
        new = next(n for n in c.realtime if n.name != master)
        a, b = log_bytes(old.data_dir / "messages"), log_bytes(new.data_dir / "messages")
        assert a == b and len(a) > 0, "slave log is not byte-identical with its master's"
        ia, ib = index_bytes(old, "rt.load"), index_bytes(new, "rt.load")
        assert ia == ib, "consume indexes differ"


@needs_etcd
async def test_returning_master_truncates_divergent_suffix_and_index(tmp_path):
    """async mode: the master takes writes while its slave is frozen, then dies; the slave
    wins without them. The old master returns, truncates its log and consume index to what
    the new master has, and both then hold the same bytes; the group's offsets are the new
    master's."""
    with LocalCluster(tmp_path, n_delay=0, n_realtime=2, meta=True, realtime_replicas=2, ack_mode="async",
                      lease_ttl_ms=2000) as c:
        c.wait_registered()
        master = await master_of(c)
        m = next(n for n in c.realtime if n.name == master)
        s = next(n for n in c.realtime if n.name != master)
        resolver = MetaResolver(c.meta_addresses, refresh_ms=500)
        try:
            async with Producer(resolver) as p:
                await asyncio.gather(*[await p.send("rt.div", "x", id=f"a{k}", immediate=True) for k in range(50)])
            async with Consumer(resolver, "rt.div", group="g", wait_ms=200, batch_max=20) as cons:
                await cons.ack(await cons.pull())  # 20 acked
            # the slave may campaign only once it is in the in-sync set, and it has the bytes and
            # the group document
            await c.wait_in_sync("realtime")
            await caught_up_slave(c, s.name)
            await asyncio.sleep(1.0)
            s.proc.send_signal(signal.SIGSTOP)
            # the slave's pending long poll (a master at rest answers it only after
            # replication_idle_wait_ms) is answered now, into its socket buffer, by one write: w0
            # reaches the slave; b* after it cannot, since a stopped slave asks nothing more
            async with Producer(resolver) as p:
                await (await p.send("rt.div", "w", id="w0", immediate=True))
            await asyncio.sleep(0.3)
            async with Producer(resolver) as p:
                await asyncio.gather(*[await p.send("rt.div", "y", id=f"b{k}", immediate=True) for k in range(50)])
            m.kill()
            s.proc.send_signal(signal.SIGCONT)

            async def slave_is_master():
                return (await statuses(c)).get(s.name, {}).get("master")
            await wait_for(slave_is_master, 30, "the slave to take over")
            async with Producer(resolver, retries_max=20) as p:
                await asyncio.gather(*[await p.send("rt.div", "z", id=f"c{k}", immediate=True) for k in range(10)])
            m.start()
            await asyncio.to_thread(m.wait_ready)
            await caught_up_slave(c, m.name)
            got: list[str] = []
            async with Consumer(resolver, "rt.div", group="g", wait_ms=200, batch_max=100) as cons:
                deadline = time.monotonic() + 20
                while len(got) < 41 and time.monotonic() < deadline:
                    try:
                        batch = await cons.pull()
                    except E.Unavailable:
                        await asyncio.sleep(0.2)
                        continue
                    got += [x.id for x in batch]
                    await cons.ack(batch)
            # the 20 acked before never come back; w0 was; b* were never on the new master
            assert sorted(got) == sorted([f"a{k}" for k in range(20, 50)] + ["w0"] + [f"c{k}" for k in range(10)])
            await asyncio.sleep(0.5)
        finally:
            await resolver.close()
        assert "truncated" in m.log_path.read_text(), "the old master did not truncate its suffix"
        assert log_bytes(m.data_dir / "messages") == log_bytes(s.data_dir / "messages")
        assert index_bytes(m, "rt.div") == index_bytes(s, "rt.div")



LA_LOOKAHEAD_MS = 50      # the consumers' lookahead (a node cuts it to 100 ms)
LA_ROUND = 150            # messages sent before the kill, as many during the failover, as many once the slave is back
LA_DELAY_MS_MAX = 2000    # each due 0 .. this after it was sent
LA_ACK_TIMEOUT_MS = 8000  # the nodes redeliver what was not acked this long after it was handed out
LA_ACK_CALL_S = 3.0       # the waited group's Ack calls give up after this (well inside LA_ACK_TIMEOUT_MS)
LA_WAIT_S_MAX = 120       # bounds of the waits below (outcomes, not timings)


@needs_etcd
async def test_lookahead_consumers_across_a_master_sigkill_lose_nothing_never_early_no_redelivery_after_answered_ack(
        tmp_path):
    """Lookahead across a failover: a delay node and a real-time group of a master and a slave
    (``sync``); two consumer groups read one subject with ``batches()`` and ``lookahead_ms``
    (docs/api.md, "Lookahead"): ``waited`` acks each batch with ``ack(wait=True)`` and records
    whether the ack was answered, ``piped`` acks pipelined (``await rb.ack()``, whose answer it
    cannot see). Delayed messages (due 0-2 s after sending) are sent in three rounds: before
    the master is SIGKILLed (once acks are answered), during the failover, and once the old
    master is back as a slave (restarted as a supervisor would: a ``sync`` group takes writes
    with a slave). After every message came, the consumers go on for longer than the nodes'
    ack timeout, so that whatever is still in flight unacked comes again within the test.
    Outcomes: every message reaches both groups (nothing lost); none is handed out before its
    due time, by the producer's due time and this process's clock (no slack, as
    ``test_the_iterators_hand_each_delayed_message_out_at_its_due_time_never_before``), held
    batches from the dead master included; ``waited`` gets nothing again after an ack of it
    was answered (what was in a batch whose ack failed, e.g. one of the dead master's handed
    out from the hold after the kill, or one the new master took while it had no slave, may
    come again: at least once)."""
    subject = "rt.lookahead"
    rng = random.Random(20261127)
    with LocalCluster(tmp_path, n_delay=1, n_realtime=2, meta=True, realtime_replicas=2, ack_mode="sync",
                      lease_ttl_ms=2000, env={"HOURGLASS_ACK_TIMEOUT_MS": str(LA_ACK_TIMEOUT_MS)}) as c:
        c.wait_registered()
        master = await master_of(c)
        old = next(n for n in c.realtime if n.name == master)
        new = next(n for n in c.realtime if n is not old)
        await c.wait_in_sync("realtime")  # the slave acknowledges: acks are answered from the start
        due: dict[str, int] = {}            # id -> deliver_at_ms the producer gave it (set before it is sent)
        seen: dict[str, dict[str, list[tuple[int, str]]]] = {"waited": {}, "piped": {}}  # group -> id -> [(at, node)]
        confirmed_at: dict[str, int] = {}   # waited: id -> its deliveries when an ack of it was answered
        confirmed_by: set[str] = set()      # waited: the nodes that answered acks
        failed: dict[str, int] = {}         # waited: ids of batches whose ack failed (those may come again) -> times
        errors: dict[str, int] = {}         # waited: "node: error" -> batches whose ack failed so
        late: list[tuple[str, int]] = []    # waited: (id, delivery) after an answered ack
        early: list[tuple[str, str, int]] = []  # (group, id, ms before due)
        all_sent = asyncio.Event()

        def complete(group: str) -> bool:
            return all_sent.is_set() and set(due) <= set(seen[group])

        async def consume(group: str) -> None:
            res = MetaResolver(c.meta_addresses, refresh_ms=500, realtime_kind=mpb.CONSUMER)
            try:
                async with Consumer(res, subject, group=group, lookahead_ms=LA_LOOKAHEAD_MS, timeout_s=5,
                                    call_timeout_s=LA_ACK_CALL_S) as cons:
                    async for rb in cons.batches():
                        at = now_ms()
                        got = seen[group]
                        for i in rb.ids:
                            got.setdefault(i, []).append((at, rb.node))
                            if at < due[i]:
                                early.append((group, i, due[i] - at))
                            if group == "waited" and i in confirmed_at:
                                late.append((i, len(got[i])))
                        if group == "piped":
                            await rb.ack()
                            continue
                        try:
                            await rb.ack(wait=True)
                        except E.HourglassError as e:
                            for i in rb.ids:
                                failed[i] = failed.get(i, 0) + 1
                            key = f"{'old' if rb.node == old.address else 'new'} master: {type(e).__name__}"
                            errors[key] = errors.get(key, 0) + 1
                        else:
                            confirmed_by.add(rb.node)
                            for i in rb.ids:
                                confirmed_at.setdefault(i, len(got[i]))
            finally:
                await res.close()

        async def send(prefix: str) -> None:
            ids = [f"{prefix}{k}" for k in range(LA_ROUND)]
            t = now_ms()
            at = [t + rng.randrange(LA_DELAY_MS_MAX + 1) for _ in ids]
            due.update(zip(ids, at))  # before the send: a message due now may be handed out before it returns
            await send_all(c.meta_addresses, subject, ids, refresh_ms=500, deliver_at_ms=at)

        async def answered(n: int) -> bool:
            return len(confirmed_at) >= n

        async def promoted() -> bool:
            return bool((await statuses(c)).get(new.name, {}).get("master"))

        async def everything_came() -> bool:
            return all(complete(g) for g in seen)

        tasks = {g: asyncio.create_task(consume(g)) for g in seen}

        async def consumers_ok() -> None:
            for t in tasks.values():
                if t.done():
                    t.result()  # a consumer that raised fails the test with its error
                    raise AssertionError("a consumer stopped by itself")

        try:
            await send("la-a")
            await wait_for(lambda: answered(LA_ROUND // 3), LA_WAIT_S_MAX, "acks answered before the kill")
            at_kill = {g: len(seen[g]) for g in seen}
            confirmed_before = len(confirmed_at)
            old.kill()
            await send("la-b")  # the delay node dispatches them to whoever is master
            await wait_for(promoted, LA_WAIT_S_MAX, f"{new.name} takes over")
            old.start()  # a supervisor restarts it: a sync group takes writes with a slave
            await asyncio.to_thread(old.wait_ready)
            await c.wait_in_sync("realtime")
            await send("la-c")
            all_sent.set()
            await wait_for(everything_came, LA_WAIT_S_MAX, "every message in both consumer groups")
            await consumers_ok()
            # what is in flight unacked (an ack that failed and did not take effect) comes again
            # after the ack timeout: the consumers go on past it so that it comes within the test
            await asyncio.sleep(LA_ACK_TIMEOUT_MS / 1000 + 2)
            await consumers_ok()
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        twice = {g: sorted(i for i, d in seen[g].items() if len(d) > 1) for g in seen}
        print(f"at the kill: delivered {at_kill}, {confirmed_before} acks answered; in all: delivered twice or "
              f"more {({g: len(v) for g, v in twice.items()})}; waited: acks answered for {len(confirmed_at)} "
              f"ids, failed for {len(failed)} ids, failed batches {errors}")
        for g in seen:
            missing = sorted(set(due) - set(seen[g]))
            assert not missing, f"{g}: {len(missing)} of {len(due)} messages never delivered, e.g. {missing[:5]}"
        assert len(due) == 3 * LA_ROUND
        assert not early, f"handed out before due (group, id, ms early): {early[:10]} ({len(early)} in all)"
        assert not late, f"waited: delivered again after an ack of it was answered (id, delivery): {late[:10]} " \
                         f"({len(late)} in all)"
        again = sorted(set(twice["waited"]) - set(failed))
        assert not again, f"waited: delivered twice without a failed ack: {again[:10]}"
        # the failover happened under this flow: what was sent after the kill came from the new
        # master, and it answered acks (so "never again after an answered ack" covers both masters)
        for g in seen:
            nodes = {node for k in range(LA_ROUND) for _, node in seen[g][f"la-b{k}"]}
            assert new.address in nodes, (g, nodes)
        assert confirmed_by == {old.address, new.address}, confirmed_by
