"""End to end with real processes, real gRPC, real files: SDK producer -> delay node ->
real-time node -> SDK consumer."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import pytest

from cluster import errors as E
from cluster.client import Consumer, Producer, StaticResolver
from cluster.devcluster import LocalCluster
from cluster.codec import Batch
from cluster.proto import hourglass_pb2 as pb
from cluster.wire import BatchResult, make_request
from cluster.transport import Channels


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("e2e"), env={"HOURGLASS_PAYLOAD_BYTES_MAX": str(64 * 1024),
                                                          "HOURGLASS_ACK_TIMEOUT_MS": "2000",
                                                          "HOURGLASS_DISPATCH_ATTEMPTS_MAX": "2",
                                                          "HOURGLASS_MAX_ATTEMPTS": "3"})
    c.start()
    yield c
    c.stop()


async def collect(resolver, subject, group, n, timeout_s=15.0, tags=(), ack=True):
    got = []
    deadline = time.monotonic() + timeout_s
    async with Consumer(resolver, subject, group=group, wait_ms=300, tags=tags) as c:
        while len(got) < n and time.monotonic() < deadline:
            batch = await c.pull()
            got += batch
            if ack:
                await c.ack(batch)
    return got


async def test_delays_from_already_due_to_seconds(resolver):
    t = now_ms()
    async with Producer(resolver) as p:
        futs = [await p.send("e2e.delays", f"m{i}", deliver_at_ms=t + d, id=f"delays-{i}")
                for i, d in enumerate([-60_000, 0, 300, 1000, 2500])]
        res = await asyncio.gather(*futs)
    assert all(r.seq for r in res)
    got = await collect(resolver, "e2e.delays", "g", 5)
    assert sorted(m.id for m in got) == [f"delays-{i}" for i in range(5)]
    for m in got:
        assert m.received_ms >= m.deliver_at_ms  # never early: the delay node fires a round ahead, the real-time node holds it
        assert m.received_ms - max(m.deliver_at_ms, t) < 1000  # a past due time means now


async def test_the_iterators_hand_each_delayed_message_out_at_its_due_time_never_before(resolver):
    """``Consumer.batches()`` pulls with lookahead (docs/api.md, "Lookahead"): the real-time
    node hands out what becomes visible within it and the consumer holds each message until its
    due time. Against real nodes: every message comes once, none before its due time by this
    process's clock."""
    t = now_ms()
    ids = [f"la-{i}" for i in range(60)]
    async with Producer(resolver) as p:
        res = await (await p.send_many("e2e.lookahead", [b"x"] * len(ids), ids=ids,
                                       deliver_at_ms=[t + 300 + 7 * i for i in range(len(ids))]))
    assert not res.errors
    seen: dict[str, tuple[int, int]] = {}  # id -> (handed out at, due)

    async def take(c: Consumer) -> None:
        async for rb in c.batches():
            at = now_ms()
            for i, due in zip(rb.ids, rb.deliver_at_ms.tolist()):
                assert i not in seen, f"{i} twice"
                seen[i] = (at, int(due))
            await rb.ack()
            if len(seen) == len(ids):
                return
    async with Consumer(resolver, "e2e.lookahead", group="g", lookahead_ms=30) as c:
        await asyncio.wait_for(take(c), 30)
    assert set(seen) == set(ids)
    early = {i: due - at for i, (at, due) in seen.items() if at < due}
    assert not early, f"handed out before due (ms early): {early}"


async def test_cancel_lookup_and_too_late(resolver):
    async with Producer(resolver) as p:
        await p.send_and_wait("e2e.cancel", "keep", delay_ms=500, id="keep-1")
        await p.send_and_wait("e2e.cancel", "drop", delay_ms=1500, id="drop-1")
        assert (await p.lookup("drop-1")).status == "pending"
        await p.cancel("drop-1")
        assert (await p.lookup("drop-1")).status == "cancelled"
        with pytest.raises(E.NotFound):
            await p.cancel("never-sent")
        got = await collect(resolver, "e2e.cancel", "g", 1)
        assert [m.id for m in got] == ["keep-1"]
        await asyncio.sleep(2)
        assert await collect(resolver, "e2e.cancel", "g", 1, timeout_s=1) == []
        with pytest.raises(E.TooLate):
            await p.cancel("keep-1")
        assert (await p.lookup("keep-1")).status == "dispatched"


async def test_tag_filter(resolver):
    async with Producer(resolver) as p:
        await asyncio.gather(*[await p.send("e2e.tags", str(i), tags=["red" if i % 2 else "blue"], id=f"tag-{i}")
                               for i in range(10)])
    got = await collect(resolver, "e2e.tags", "reds", 5, tags=["red"])
    assert sorted(m.id for m in got) == [f"tag-{i}" for i in range(1, 10, 2)]


async def test_group_with_two_consumers_shares_work(resolver):
    async with Producer(resolver) as p:
        await asyncio.gather(*[await p.send("e2e.share", str(i), delay_ms=200, id=f"share-{i}") for i in range(40)])
    seen: dict[str, list[str]] = {"a": [], "b": []}

    async def consumer(name):
        async with Consumer(resolver, "e2e.share", group="workers", consumer_id=name, batch_max=5,
                            wait_ms=300) as c:
            deadline = time.monotonic() + 10
            while sum(map(len, seen.values())) < 40 and time.monotonic() < deadline:
                batch = await c.pull()
                seen[name] += [m.id for m in batch]
                await c.ack(batch)
                await asyncio.sleep(0.01)

    await asyncio.gather(consumer("a"), consumer("b"))
    assert sorted(seen["a"] + seen["b"]) == sorted(f"share-{i}" for i in range(40))
    assert seen["a"] and seen["b"], "both consumers got work"
    # another group sees everything too
    assert len(await collect(resolver, "e2e.share", "auditors", 40)) == 40


async def test_browse_reads_without_consuming(resolver):
    async with Producer(resolver) as p:
        await asyncio.gather(*[await p.send("e2e.browse", str(i), immediate=True, id=f"br-{i}") for i in range(6)])
    ids = {f"br-{i}" for i in range(6)}
    async with Consumer(resolver, "e2e.browse", group="readers", wait_ms=300) as c:
        first = []
        deadline = time.monotonic() + 15
        while len(first) < 2 and time.monotonic() < deadline:
            batch = await c.pull(max_messages=2 - len(first))
            first += batch
            await c.ack(batch)
        held = await c.pull(max_messages=1)  # in flight, not acked: still the group's to finish
        assert len(first) == 2 and len(held) == 1
        page = await c.browse(max_messages=10)
        assert {m.id for m in page.messages} == ids - {m.id for m in first}
        assert page.next_position == page.end_position == 6
        again = await c.browse(max_messages=10)
        assert [m.id for m in again.messages] == [m.id for m in page.messages]  # nothing was handed out
        await c.ack(held)
    rest = await collect(resolver, "e2e.browse", "readers", 3)
    assert {m.id for m in first + held + rest} == ids


async def test_nack_retries_then_dead_letters(resolver):
    async with Producer(resolver) as p:
        await p.send_and_wait("e2e.nack", "fails", id="nack-1", immediate=True)
    attempts = []
    async with Consumer(resolver, "e2e.nack", group="g", wait_ms=300) as c:
        deadline = time.monotonic() + 15
        while len(attempts) < 3 and time.monotonic() < deadline:
            for m in await c.pull():
                attempts.append(m.attempts)
                assert m.id == "nack-1"  # the producer's id, also on retries
                await m.nack(retry_after_ms=100)
    assert attempts == [0, 1, 2]
    dead = await collect(resolver, "hourglass.dlq", "ops", 1)
    assert dead and dead[0].properties["hourglass.origin_id"] == "nack-1"


async def test_a_retry_goes_only_to_the_nacking_group(resolver):
    """Groups A and B on one subject: A nacks m, B acks it. A gets the retry copy; B never
    sees m again (it sees a marker sent after A's copy arrived, and m exactly once)."""
    subject = "e2e.nackgroup"
    async with Producer(resolver) as p:
        await p.send_and_wait(subject, "m", id="ng-m", immediate=True)
        seen_b: list[tuple[str, int]] = []
        seen_a: list[tuple[str, int]] = []
        async with Consumer(resolver, subject, group="B", wait_ms=300) as b, \
                Consumer(resolver, subject, group="A", wait_ms=300) as a:
            deadline = time.monotonic() + 15
            while not seen_b and time.monotonic() < deadline:
                batch = await b.pull()
                seen_b += [(m.id, m.attempts) for m in batch]
                await b.ack(batch)
            assert seen_b == [("ng-m", 0)]
            deadline = time.monotonic() + 15
            while len(seen_a) < 2 and time.monotonic() < deadline:
                for m in await a.pull():
                    seen_a.append((m.id, m.attempts))
                    if m.attempts == 0:
                        await m.nack(retry_after_ms=100)
                    else:
                        await a.ack([m])
            assert seen_a == [("ng-m", 0), ("ng-m", 1)]  # A got its retry copy
            await p.send_and_wait(subject, "marker", id="ng-marker", immediate=True)  # stored after the copy
            deadline = time.monotonic() + 15
            while ("ng-marker", 0) not in seen_b and time.monotonic() < deadline:
                batch = await b.pull()
                seen_b += [(m.id, m.attempts) for m in batch]
                await b.ack(batch)
            assert seen_b == [("ng-m", 0), ("ng-marker", 0)]  # m exactly once: no copy of A's nack


async def test_unknown_subject_goes_to_dead_letter(tmp_path):
    with LocalCluster(tmp_path, env={"HOURGLASS_AUTO_CREATE_SUBJECTS": "false",
                                     "HOURGLASS_DISPATCH_ATTEMPTS_MAX": "2"}) as c:
        r = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])
        async with Producer(r) as p:
            await p.send_and_wait("no.such.subject", "x", delay_ms=100, id="orphan-1")
        dead = await collect(r, "hourglass.dlq", "ops", 1)
        assert [m.properties.get("dlq.subject") for m in dead] == ["no.such.subject"]


async def test_a_status_read_counts_every_acknowledged_message_though_the_filer_lingers(tmp_path):
    """The delay node's filer waits up to ``file_linger_ms`` to file writes together; a status
    read (the console's Schedule page, ``hourglass status``) files what waits first, so its
    pending count includes every message whose send was answered. With a linger of a second
    the count read right after the answer would otherwise miss them."""
    with LocalCluster(tmp_path, env={"HOURGLASS_FILE_LINGER_MS": "1000"}) as c:
        r = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])
        ids = [f"linger-{i}" for i in range(20)]
        async with Producer(r) as p:
            res = await (await p.send_many("e2e.linger", [b"x"] * len(ids), ids=ids, delay_ms=[600_000] * len(ids)))
            assert res.ok, res.errors
        ch = Channels()
        try:
            st = json.loads((await ch.admin(c.delay[0].address).Status(pb.StatusRequest(), timeout=10)).json)
        finally:
            await ch.close()
        assert st["pending"] == 20, st["pending"]
        assert st["counters"]["filed"] >= 20
        async with Producer(r) as p:  # and a lookup reads a new message as filed (its effective time)
            await (await p.send("e2e.linger", b"y", id="linger-late", delay_ms=600_000))  # answered
            lk = await p.lookup("linger-late")
        assert lk.status == "pending" and lk.effective_ms > 0, lk


async def test_bad_input_gets_clear_errors_and_node_keeps_serving(cluster, resolver):
    delay = cluster.delay[0].address
    ch = Channels()
    try:
        stub = ch.producer(delay)
        now = now_ms()
        batch = Batch.build(["s", "", "s", "s", "s", "e2e.bad"],
                            [b"", b"", b"x" * (64 * 1024 + 1), b"", b"", b""],
                            ["bad id", "ok-id", "big", "far", "past", "fine"],
                            [0, 0, 0, 0, -5, 0])
        delays = [10, 10, 10, 3 * 366 * 24 * 3600 * 1000, 0, 10]
        resp = await stub.SendBatch(make_request(batch, delay_ms=delays))
        res = BatchResult.from_pb(resp, batch.n)
        assert res.codes.tolist() == [pb.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, pb.PAYLOAD_TOO_LARGE,
                                      pb.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, pb.OK]
        assert sorted(res.errors) == [0, 1, 2, 3, 4] and all(res.errors.values())
        assert res.seqs[5] > 0 and res.deliver_at_ms[5] >= now + 10
        for bad in (pb.SendBatchRequest(batch=b"garbage"),                          # not a batch
                    make_request(batch, delay_ms=[1, 2]),                           # columns disagree
                    make_request(Batch.build("s", [b""] * 10_001, [f"i{i}" for i in range(10_001)],
                                             [now] * 10_001))):                     # over batch_messages_max
            with pytest.raises(grpc.RpcError) as e:
                await stub.SendBatch(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            await ch.consumer(cluster.realtime[0].address).Pull(pb.PullRequest(subject="x"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await ch.close()
    # garbage bytes on the gRPC port
    host, port = delay.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 4)
        s.settimeout(2)
        try:
            s.recv(1024)
        except OSError:
            pass
    got_status = None
    ch = Channels()
    try:
        got_status = json.loads((await ch.admin(delay).Status(pb.StatusRequest(), timeout=5)).json)
    finally:
        await ch.close()
    assert got_status["role"] == "delay"
    assert [m.id for m in await collect(resolver, "e2e.bad", "g", 1)] == ["fine"]


async def test_each_node_sigkilled_mid_flow_loses_nothing_and_no_double_delivery(tmp_path):
    with LocalCluster(tmp_path) as c:
        r = StaticResolver(delay=[c.delay[0].address], realtime=[c.realtime[0].address])
        t = now_ms()
        async with Producer(r) as p:
            futs = [await p.send("e2e.kill", str(i), deliver_at_ms=t + 500 + (i % 40) * 100, id=f"kill-{i}")
                    for i in range(400)]
            await asyncio.gather(*futs)
        got: list[str] = []
        async with Consumer(r, "e2e.kill", group="g", wait_ms=200) as cons:
            batch = await cons.pull()
            got += [m.id for m in batch]
            await cons.ack(batch)
            c.delay[0].kill()
            c.delay[0].start()
            c.delay[0].wait_ready()
            await asyncio.sleep(0.5)
            c.realtime[0].kill()
            c.realtime[0].start()
            c.realtime[0].wait_ready()
            deadline = time.monotonic() + 20
            while len(set(got)) < 400 and time.monotonic() < deadline:
                try:
                    batch = await cons.pull()
                except E.Unavailable:
                    await asyncio.sleep(0.1)
                    continue
                got += [m.id for m in batch]
                await cons.ack(batch)
        assert sorted(set(got)) == sorted(f"kill-{i}" for i in range(400))
        # acks are durable before they are answered and both sides de-duplicate by id:
        # nothing reaches the group twice
        dupes = len(got) - len(set(got))
        assert dupes == 0, f"{dupes} duplicates"


async def test_an_id_always_goes_to_one_delay_group(tmp_path):
    """Sends, retries and re-sends of one id go to one delay group: a re-send is a duplicate
    there (never a second copy in another group) and a cancel finds it."""
    with LocalCluster(tmp_path, n_delay=2) as c:
        r = StaticResolver(delay=[n.address for n in c.delay], realtime=[c.realtime[0].address])
        async with Producer(r) as p:
            first = [await p.send_and_wait("e2e.pin", "x", id=f"p{i}", delay_ms=60_000) for i in range(20)]
            again = [await p.send_and_wait("e2e.pin", "x", id=f"p{i}", delay_ms=60_000) for i in range(20)]
            assert not any(a.duplicate for a in first) and all(a.duplicate for a in again)
            for i in range(20):
                assert (await p.cancel(f"p{i}")).seq == first[i].seq
                assert (await p.lookup(f"p{i}")).status == "cancelled"
        stores = []
        for n in c.delay:
            ch = Channels()
            try:
                st = json.loads((await ch.admin(n.address).Status(pb.StatusRequest())).json)
            finally:
                await ch.close()
            stores.append((st["counters"]["accepted"], st["counters"]["cancelled"]))
        # 20 messages stored once each, spread over both groups, each cancelled where it lives
        assert sum(a for a, _ in stores) == 20 and all(a for a, _ in stores)
        assert [a for a, _ in stores] == [c_ for _, c_ in stores]
