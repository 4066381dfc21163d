"""The SDK (``cluster/client.py``) against an in-process fake v2 node
(``tests/helpers/fake_node.py``): real gRPC on 127.0.0.1, in-memory behaviour.

Producer: batching, id generation, delay-group pinning, retrying retryable indices
only, per-index errors, relative delays on the wire, the per-message convenience API.
Consumer: several subjects over several nodes, lazy batch views, acks as ranges,
the exact tag check, nack, and ``close()`` during a long poll.
"""

from __future__ import annotations

import asyncio
import zlib

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster import client as client_mod
from cluster import errors as E
from cluster.client import BatchSendResult, Consumer, Producer, SendResult, StaticResolver, group_for
from cluster.codec import Batch
from cluster.proto import hourglass_pb2 as pb
from tests.helpers.fake_node import FakeNode, now_ms

GUARD_S = 30  # a bound on waits that must end long before it (a hang fails instead of blocking the suite)


@pytest.fixture
async def nodes():
    started: list[FakeNode] = []

    async def make(n: int = 1) -> list[FakeNode]:
        for _ in range(n):
            started.append(await FakeNode().start())
        return started[-n:]

    yield make
    for node in started:
        await node.stop()


def fast(resolver, **kw) -> Producer:
    """A producer whose retries do not wait long."""
    return Producer(resolver, backoff_ms_min=1, backoff_ms_max=5, **kw)


# ---------------------------------------------------------------------- producer


async def test_send_many_cuts_wire_batches_at_batch_max_and_answers_once(nodes):
    (node,) = await nodes()
    async with fast(StaticResolver(delay=[node.address]), batch_max=1000) as p:
        fut = await p.send_many("orders", [b"x%d" % i for i in range(2500)], delay_ms=60_000)
        res = await fut
    assert isinstance(res, BatchSendResult) and res.ok and len(res) == 2500
    assert sorted(len(r.ids) for r in node.requests) == [500, 1000, 1000]  # in flight together, any order
    assert sorted(i for r in node.requests for i in r.ids) == sorted(res.ids)
    assert [res.ids[k] for k in np.argsort(res.seqs)] == [i for r in node.requests for i in r.ids]
    assert sorted(res.seqs.tolist()) == list(range(1, 2501))
    assert not res.duplicates.any()


async def test_calls_queued_together_share_one_request(nodes):
    (node,) = await nodes()
    async with fast(StaticResolver(delay=[node.address]), batch_max=1000, linger_ms=50) as p:
        a = await p.send_many("a", [b"1"] * 300, delay_ms=1000)
        b = await p.send_many(["b", "c"] * 150, [b"2"] * 300, delay_ms=1000)
        ra, rb = await a, await b
    assert len(node.requests) == 1 and len(node.requests[0].ids) == 600
    assert node.requests[0].subjects == ["a"] * 300 + ["b", "c"] * 150
    assert ra.ok and rb.ok and set(ra.ids).isdisjoint(rb.ids)


async def test_an_awaited_callers_next_call_is_not_held_by_the_linger(nodes):
    """The batcher lingers only while messages are on the wire without their answer: the
    next call of a caller that awaited its last one goes at once, though the task that sent
    the last one may not have finished yet (a linger longer than the call's deadline would
    fail it)."""
    three = await nodes(3)  # a call's messages over three groups: its send waits on three nodes at once
    async with fast(StaticResolver(delay=[n.address for n in three]), linger_ms=600_000, call_timeout_s=5) as p:
        for _ in range(4):
            res = await (await p.send_many("s", [b"x"] * 30, delay_ms=1000))
            assert res.ok
            assert p._unanswered == p._queued == 0  # nothing on the wire, whatever ``_sending`` holds
    assert sum(len(r.ids) for n in three for r in n.requests) == 120


async def test_generated_ids_are_unique_with_one_prefix_per_producer(nodes):
    (node,) = await nodes()
    r = StaticResolver(delay=[node.address])
    async with fast(r) as p1, fast(r) as p2:
        a = await (await p1.send_many("s", [b""] * 500, delay_ms=10))
        b = await (await p1.send_many("s", [b""] * 500, delay_ms=10))
        c = await (await p2.send_many("s", [b""] * 10, delay_ms=10))
    ids1 = a.ids + b.ids
    assert len(set(ids1)) == 1000
    prefix = ids1[0][:16]
    assert all(i.startswith(prefix) for i in ids1)
    assert not any(i.startswith(prefix) for i in c.ids)
    assert set(node.stored) == set(ids1) | set(c.ids)


async def test_delayed_messages_go_to_the_group_their_id_hashes_to(nodes):
    three = await nodes(3)
    resolver = StaticResolver(delay=[n.address for n in three])
    groups = await resolver.delay_groups()
    ids = [f"order-{i}" for i in range(300)]
    async with fast(resolver) as p:
        res = await (await p.send_many("orders", [b"x"] * 300, ids=ids, delay_ms=5000))
    assert res.ok
    for node in three:
        assert set(node.stored) == {i for i in ids if group_for(i, groups) == node.address}
    assert sum(len(n.stored) for n in three) == 300


async def test_only_retryable_indices_are_retried_and_to_the_same_group(nodes):
    three = await nodes(3)
    resolver = StaticResolver(delay=[n.address for n in three])
    groups = await resolver.delay_groups()
    ids = [f"m-{i}" for i in range(30)]
    home = {n.address: n for n in three}
    busy, moved = ids[3], ids[7]
    home[group_for(busy, groups)].script[busy] = [pb.OVERLOADED]
    home[group_for(moved, groups)].script[moved] = [pb.NOT_LEADER]
    ids[11] = "has space"  # refused for good by the node (INVALID_ARGUMENT)
    async with fast(resolver) as p:
        res = await (await p.send_many("s", [b"p"] * 30, ids=ids, delay_ms=1000))
    assert set(res.errors) == {11} and isinstance(res.errors[11], E.InvalidArgument)
    assert res.seqs[3] and res.seqs[7] and res.seqs[11] == 0
    for mid in (busy, moved):  # both sends of each went to its own group's node, and only there
        assert [sum(mid in r.ids for r in n.requests) for n in three] == \
            [2 if n.address == group_for(mid, groups) else 0 for n in three]
    retried = [i for n in three for r in n.requests[1:] for i in r.ids]
    assert sorted(retried) == sorted([busy, moved])


async def test_a_message_that_stays_refused_gets_its_own_error(nodes):
    (node,) = await nodes()
    node.script["stuck"] = [pb.OVERLOADED] * 10
    async with fast(StaticResolver(delay=[node.address]), retries_max=2) as p:
        res = await (await p.send_many("s", [b"a", b"b", b"c"], ids=["ok-1", "stuck", "ok-2"], delay_ms=10))
    assert set(res.errors) == {1} and isinstance(res.errors[1], E.Unavailable)
    assert "gave up after 2 retries" in str(res.errors[1])
    assert res.seqs[0] and res.seqs[2] and not res.seqs[1]
    assert [r.ids for r in node.requests] == [["ok-1", "stuck", "ok-2"], ["stuck"], ["stuck"]]
    with pytest.raises(E.Unavailable):
        res.result(1)
    assert res.result(0) == SendResult("ok-1", int(res.seqs[0]), int(res.deliver_at_ms[0]), False)


async def test_a_wire_batch_travels_in_due_order_and_answers_come_back_in_call_order(nodes):
    """The SDK sorts each wire batch by due time (a delay node files sorted runs without
    copying records); seqs, due times and errors still answer the caller's indices."""
    (node,) = await nodes()
    t0 = now_ms() + 60_000
    due = [t0 + 5000, t0 + 1000, t0 + 3000, t0 + 1000, t0 + 4000]
    ids = ["e", "b", "c", "has space", "d"]  # index 3 is refused for good by the node
    async with fast(StaticResolver(delay=[node.address])) as p:
        res = await (await p.send_many("s", [i.encode() for i in ids], ids=ids, deliver_at_ms=due))
    [req] = node.requests
    assert req.ids == ["b", "has space", "c", "d", "e"]  # stable: equal due times keep call order
    assert set(res.errors) == {3} and isinstance(res.errors[3], E.InvalidArgument)
    assert res.deliver_at_ms.tolist()[:3] == due[:3] and int(res.deliver_at_ms[4]) == due[4]
    assert all(node.stored[ids[i]] == (int(res.seqs[i]), due[i]) for i in (0, 1, 2, 4))
    # immediate messages go to a real-time node in the order they were sent, never sorted
    async with fast(StaticResolver(delay=[node.address], realtime=[node.address])) as p:
        now = now_ms()
        res = await (await p.send_many("s", [b"1", b"2", b"3"], ids=["i1", "i2", "i3"],
                                       deliver_at_ms=[now, now - 2000, now - 1000], immediate=True))
    assert res.ok and node.requests[-1].ids == ["i1", "i2", "i3"]


async def test_a_call_failing_as_unavailable_is_sent_again(nodes):
    (node,) = await nodes()
    node.fail_rpc = [grpc.StatusCode.UNAVAILABLE]
    async with fast(StaticResolver(delay=[node.address])) as p:
        res = await (await p.send_many("s", [b"a"] * 5, delay_ms=10))
    assert res.ok and len(node.stored) == 5


async def test_a_call_refused_for_good_fails_every_message_of_it(nodes):
    (node,) = await nodes()
    node.fail_rpc = [grpc.StatusCode.INVALID_ARGUMENT]
    async with fast(StaticResolver(delay=[node.address])) as p:
        res = await (await p.send_many("s", [b"a"] * 4, delay_ms=10))
    assert sorted(res.errors) == [0, 1, 2, 3]
    assert all(isinstance(e, E.InvalidArgument) for e in res.errors.values())
    assert not node.stored


async def test_sends_ride_one_stream_and_fall_back_to_unary_on_an_older_node(nodes):
    new, old = await nodes(2)
    old.streams = False  # a node of an older version: no SendBatchStream
    for node in (new, old):
        async with fast(StaticResolver(delay=[node.address])) as p:
            for k in range(3):
                assert (await (await p.send_many("s", [b"a", b"b"], ids=[f"a{k}", f"b{k}"], delay_ms=10))).ok
            stream = p.channels.send_stream(node.address)
            assert (stream.opened, stream.unary_only) == ((1, False) if node is new else (1, True))
    assert len(new.requests) == len(old.requests) == 3 and len(new.stored) == len(old.stored) == 6


async def test_a_wire_batch_over_the_stream_limit_goes_as_a_unary_call(nodes, monkeypatch):
    (node,) = await nodes()
    monkeypatch.setattr(client_mod, "STREAM_REQUEST_BYTES_MAX", 1000)
    async with fast(StaticResolver(delay=[node.address])) as p:
        assert (await (await p.send_many("s", [b"x" * 300] * 2, ids=["s1", "s2"], delay_ms=10))).ok
        assert p.channels.send_stream(node.address).opened == 1  # 2 x 300 B: on the stream
        assert (await (await p.send_many("s", [b"x" * 300] * 4, ids=[f"u{i}" for i in range(4)], delay_ms=10))).ok
        assert p.channels.send_stream(node.address).opened == 1  # 4 x 300 B: unary, the stream untouched
    assert len(node.requests) == 2 and len(node.stored) == 6


async def test_a_refusal_on_the_stream_is_the_same_error_as_the_unary_calls(nodes):
    """A request the ordered stream refuses whole carries the server's error class and
    arguments (``StreamStatus.error``/``error_args``), so the caller gets the very error a unary
    call gives, also one its status and text alone would not rebuild (the epochs of a
    ``StaleEpoch``; from the status alone they read 0, 0)."""
    new, old = await nodes(2)
    old.streams = False
    errs = []
    for node in (new, old):
        node.fail_error = [E.StaleEpoch(5, 7)]
        async with fast(StaticResolver(delay=[node.address])) as p:
            res = await (await p.send_many("s", [b"a"], delay_ms=10))
            assert p.channels.send_stream(node.address).unary_only is (node is old)
        errs.append(res.errors[0])
    assert [(type(e), e.got, e.current, str(e)) for e in errs] == [(E.StaleEpoch, 5, 7, "stale epoch 5, current epoch is 7")] * 2


async def test_relative_delays_travel_as_delay_column_and_absolute_times_as_they_are(nodes):
    (node,) = await nodes()
    t0 = now_ms()
    async with fast(StaticResolver(delay=[node.address])) as p:
        rel = await (await p.send_many("s", [b"a", b"b"], ids=["r1", "r2"], delay_ms=[60_000, 120_000]))
        at = await (await p.send_many("s", [b"c"], ids=["a1"], deliver_at_ms=t0 + 5000))
        with pytest.raises(E.InvalidArgument):
            await p.send_many("s", [b"x"], deliver_at_ms=t0 + 1, delay_ms=5)
    assert node.requests[0].delay_given and not node.requests[1].delay_given
    assert rel.deliver_at_ms[0] >= t0 + 60_000 and rel.deliver_at_ms[1] - rel.deliver_at_ms[0] == 60_000
    assert at.deliver_at_ms[0] == t0 + 5000
    assert len(node.requests) == 2  # the refused call sent nothing


async def test_send_keeps_one_future_per_message(nodes):
    (node,) = await nodes()
    async with fast(StaticResolver(delay=[node.address])) as p:
        futs = [await p.send("s", f"v{i}", delay_ms=1000, id=f"one-{i}") for i in range(20)]
        first = await asyncio.gather(*futs)
        again = await p.send_and_wait("s", "v0", delay_ms=1000, id="one-0")
        bad = await p.send("bad subject!", "x", delay_ms=10)
        with pytest.raises(E.InvalidArgument):
            await bad
        gen = await p.send_and_wait("s", b"no id", delay_ms=10)
    assert [r.id for r in first] == [f"one-{i}" for i in range(20)]
    assert all(isinstance(r, SendResult) and r.seq and not r.duplicate for r in first)
    assert again.duplicate and again.seq == first[0].seq
    assert len(node.requests[0].ids) == 20  # consecutive sends share a request
    assert gen.id and gen.id in node.stored


async def test_immediate_messages_go_to_the_subjects_real_time_node(nodes):
    delay_node, rt1, rt2 = await nodes(3)
    resolver = StaticResolver(delay=[delay_node.address], realtime=[rt1.address, rt2.address])
    subjects = [f"s{i}" for i in range(8)]
    async with fast(resolver) as p:
        res = await (await p.send_many(subjects, [b"x"] * 8, ids=[f"i{i}" for i in range(8)], immediate=True))
    assert res.ok and not delay_node.requests
    for rt in (rt1, rt2):
        want = {f"i{i}" for i, s in enumerate(subjects) if await resolver.realtime_for(s) == rt.address}
        assert set(rt.stored) == want and all(r.immediate for r in rt.requests)


async def test_tags_and_properties_travel_as_extras(nodes):
    (node,) = await nodes()
    async with fast(StaticResolver(delay=[node.address], realtime=[node.address])) as p:
        await (await p.send_many("t", [b"a", b"b"], ids=["t1", "t2"], tags=[("red",), ()],
                                 properties=[{"k": "v"}, {}], immediate=True))
    async with Consumer(StaticResolver(realtime=[node.address]), "t", group="g", wait_ms=0) as c:
        node.ready("t", ["t1", "t2"], tags=[("red",), ()], properties=[{"k": "v"}, {}])
        (m1, m2) = await c.pull()
    assert m1.tags == ("red",) and m1.properties == {"k": "v"} and m2.tags == () and m2.properties == {}


# ---------------------------------------------------------------------- consumer


async def test_pulls_ride_one_stream_and_fall_back_to_unary_on_an_older_node(nodes):
    new, old = await nodes(2)
    old.streams = False  # a node of an older version: no PullStream
    for node in (new, old):
        async with Consumer(StaticResolver(realtime=[node.address]), "up", group="g", wait_ms=0) as c:
            for k in range(3):
                node.ready("up", [f"u{k}"])
                (m,) = await c.pull()
                assert m.id == f"u{k}"
            stream = c.channels.pull_stream(node.address)
            assert (stream.opened, stream.unary_only) == ((1, False) if node is new else (1, True))
    assert len(new.pulls) == len(old.pulls) == 3


async def test_several_subjects_are_pulled_with_one_request_per_node(nodes):
    rt1, rt2 = await nodes(2)
    resolver = StaticResolver(realtime=[rt1.address, rt2.address])
    subjects = [f"sub{i}" for i in range(6)]
    where = {s: await resolver.realtime_for(s) for s in subjects}
    assert len(set(where.values())) == 2  # the subjects do spread over both nodes
    by_addr = {rt1.address: rt1, rt2.address: rt2}
    handles = {s: by_addr[where[s]].ready(s, [f"{s}-{j}" for j in range(5)]) for s in subjects}
    got: list[str] = []
    async with Consumer(resolver, subjects, group="g", wait_ms=0) as c:
        for _ in range(10):
            for rb in await c.pull_batch():
                got += rb.ids
                await rb.ack()
            if len(got) == 30:
                break
    assert sorted(got) == sorted(f"{s}-{j}" for s in subjects for j in range(5))
    for node in (rt1, rt2):
        mine = sorted(s for s in subjects if where[s] == node.address)
        assert node.pulls and all(sorted(p) == mine for p in node.pulls)
        assert node.acked_handles() == {(s, h) for s in mine for h in handles[s]}  # each under its subject


async def test_a_batch_decodes_lazily_and_acks_as_ranges(nodes):
    (node,) = await nodes()
    due = now_ms() - 250
    handles = node.ready("lazy", [f"l{i}" for i in range(100)], [b"p%d" % i for i in range(100)], deliver_at_ms=due)
    node.ready("lazy", ["l~r1"], properties=[{"hourglass.origin_id": "l-original"}], deliver_at_ms=due)
    async with Consumer(StaticResolver(realtime=[node.address]), "lazy", group="g", wait_ms=0) as c:
        (rb,) = await c.pull_batch()
        assert len(rb) == 101
        assert rb.payloads[:2] == [b"p0", b"p1"] and rb.subjects == ["lazy"] * 101
        assert rb.ids[-1] == "l-original" and rb.wire_ids[-1] == "l~r1"
        assert rb.ids[:100] == [f"l{i}" for i in range(100)]
        assert isinstance(rb.lateness_ms, np.ndarray) and (rb.lateness_ms >= 250).all()
        assert rb.handles.tolist()[:100] == handles
        assert await rb.ack() == 101
    assert node.ack_ranges == [1]  # 101 consecutive handles: one [lo, hi) range
    assert len(node.acked_handles()) == 101


async def test_per_message_view_and_nack(nodes):
    (node,) = await nodes()
    node.ready("pm", ["a", "b", "c"])
    async with Consumer(StaticResolver(realtime=[node.address]), "pm", group="g", wait_ms=0) as c:
        seen = []
        async for m in c:
            seen.append(m)
            if len(seen) == 3:
                break
        await seen[0].ack()
        await seen[1].nack(retry_after_ms=250)
        await c.ack([seen[2]])
    assert [m.id for m in seen] == ["a", "b", "c"]
    assert all(m.subject == "pm" and m.lateness_ms >= 0 and m.node == node.address for m in seen)
    assert node.acked == [("pm", [seen[0].handle]), ("pm", [seen[2].handle])]
    assert node.nacked == [("pm", [seen[1].handle], 250)]


async def test_tags_are_checked_exactly_and_the_others_acked_away(nodes):
    (node,) = await nodes()
    node.ready("tg", ["red-1", "blue-1", "plain", "both"],
               tags=[("red",), ("blue",), (), ("blue", "red")])
    async with Consumer(StaticResolver(realtime=[node.address]), "tg", group="g", tags=["red"], wait_ms=0) as c:
        got = await c.pull()
    assert [m.id for m in got] == ["red-1", "both"]
    assert len(node.acked_handles()) == 2  # blue-1 and plain, acked away
    assert {h for _, h in node.acked_handles()}.isdisjoint(m.handle for m in got)


async def test_close_cancels_a_long_poll(nodes):
    (node,) = await nodes()
    c = Consumer(StaticResolver(realtime=[node.address]), ["idle.a", "idle.b"], group="g", wait_ms=600_000)
    seen: list = []

    async def consume() -> None:
        async for rb in c.batches():
            seen.append(rb)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(node.pull_waiting.wait(), GUARD_S)
    await c.close()
    await asyncio.wait_for(task, GUARD_S)  # the iterator ended; it did not wait out the 600 s poll
    await asyncio.wait_for(node.pull_cancelled.wait(), GUARD_S)
    assert not seen and node.pulls_cancelled == 1
    with pytest.raises(E.Closed):
        await c.pull()


async def test_a_pull_in_flight_when_the_caller_gives_up_is_kept_for_the_next_pull(nodes):
    (node,) = await nodes()
    async with Consumer(StaticResolver(realtime=[node.address]), "keep", group="g", wait_ms=600_000) as c:
        first = asyncio.create_task(c.pull())
        await asyncio.wait_for(node.pull_waiting.wait(), GUARD_S)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        node.ready("keep", ["k1"])
        got = await asyncio.wait_for(c.pull(), GUARD_S)
    assert [m.id for m in got] == ["k1"] and len(node.pulls) == 1


@pytest.mark.unit
def test_group_for_matches_crc32_over_sorted_groups():
    groups = [("g0", "a"), ("g1", "b"), ("g2", "c")]
    assert all(group_for(i, groups) == groups[zlib.crc32(i.encode()) % 3][0] for i in ("x", "y", "order-42"))


async def test_deferred_acks_ride_on_the_next_pull_and_close_sends_the_rest(nodes):
    (node,) = await nodes()
    node.ready("dfr", [f"d{i}" for i in range(10)])
    async with Consumer(StaticResolver(realtime=[node.address]), "dfr", group="g", wait_ms=0) as c:
        (rb,) = await c.pull_batch()
        assert await rb.ack(defer=True) == 10
        assert node.acked_handles() == set()  # no call of its own
        node.ready("dfr", ["e0"])
        (rb2,) = await c.pull_batch()       # this pull carries the first batch's acks
        assert node.acks_on_pull == 1 and len(node.acked_handles()) == 10
        await rb2.ack(defer=True)
    assert len(node.acked_handles()) == 11  # close() sent the last deferred acks with an Ack


async def test_queued_acks_of_several_batches_reach_the_node_as_one_range_per_subject(nodes):
    """Pipelined acks are queued as arrays and made into ranges once, for the request that
    carries them: three batches' acks (each pull with its own subject table) ride on one
    pull as one ``SubjectHandles`` per subject, each a single [lo, hi) range, covering
    exactly the handles handed out (not one entry per subject per batch)."""
    (node,) = await nodes()
    ha = node.ready("ma", ["a0", "a1", "a2"])
    hb = node.ready("mb", ["b0", "b1", "b2"])
    async with Consumer(StaticResolver(realtime=[node.address]), ["ma", "mb"], group="g", wait_ms=0) as c:
        got = [(await c.pull_batch(max_messages=2))[0] for _ in range(3)]
        assert [rb.subjects for rb in got] == [["ma", "ma"], ["ma", "mb"], ["mb", "mb"]]
        for rb in got:
            assert await rb.ack(defer=True) == 2
        assert node.acked == []
        node.ready("ma", ["a3"])
        (rb,) = await c.pull_batch()  # carries the three batches' acks
        assert node.acks_on_pull == 1
        assert sorted(node.acked) == [("ma", ha), ("mb", hb)] and node.ack_ranges == [1, 1]
        await rb.ack(defer=True)
    assert node.acked_handles() == {("ma", h) for h in ha} | {("mb", h) for h in hb} | {("ma", 7)}


def _slices_model(batch: Batch, handles: np.ndarray, received_ms: int, lookahead_ms: int, now: int):
    """``Consumer._hold``'s slicing as first written (a stable sort by release step, one
    ``take`` per slice): [(release ms, ids, handles)]."""
    due = np.minimum(batch.deliver_at_ms.astype(np.int64), received_ms + lookahead_ms)
    if int(due.max()) <= now:
        return [(None, batch.id_list(), handles.tolist())]
    step = -(-np.maximum(due, now) // client_mod.RELEASE_STEP_MS)
    order = np.argsort(step, kind="stable")
    cuts = np.flatnonzero(np.diff(step[order])) + 1
    return [(int(due[part].max()), batch.take(part).id_list(), handles[part].tolist())
            for part in np.split(order, cuts)]


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_lookahead_slices_equal_the_sort_and_take_per_slice_rule(data):
    """``_hold`` puts a batch in release-step order once and cuts slices as runs of it; the
    slices, their order, messages, handles and release times are those of a stable sort
    and one ``take`` per slice (what a node sends is seldom in due order: many subjects)."""
    now = 1_000_000
    lookahead = data.draw(st.integers(0, 100))
    n = data.draw(st.integers(1, 40))
    offsets = data.draw(st.lists(st.integers(-20, 120), min_size=n, max_size=n))
    subjects = data.draw(st.lists(st.sampled_from(["s0", "s1", "s2"]), min_size=n, max_size=n))
    received = now - data.draw(st.integers(0, 30))
    batch = Batch.build(subjects, [b"p%d" % i for i in range(n)], [f"m{i}" for i in range(n)],
                        np.array([now + o for o in offsets], np.int64))
    handles = np.array(data.draw(st.permutations(range(100, 100 + n))), np.uint64)
    c = Consumer(StaticResolver(realtime=["127.0.0.1:1"]), "s0", group="g", lookahead_ms=lookahead)
    clock, client_mod._now_ms = client_mod._now_ms, lambda: now
    try:
        ready = c._hold([client_mod.ReceivedBatch(c, "n1", batch, handles, received)])
    finally:
        client_mod._now_ms = clock
    want = _slices_model(batch, handles, received, lookahead, now)
    assert [(rb.ids, rb.handles.tolist()) for rb in ready] == \
        [(ids, hs) for at, ids, hs in want if at is None or at <= now]
    assert [(at, rb.ids, rb.handles.tolist()) for at, _, rb in sorted(c._held, key=lambda e: e[:2])] == \
        [w for w in want if w[0] is not None and w[0] > now]
    assert all(rb.received_ms == now for rb in ready)


async def test_an_awaited_batch_ack_is_pipelined_and_wait_true_is_a_round_trip(nodes):
    """Issue 28: ``await batch.ack()`` returns at once; its acks ride on the next pull, or,
    when no pull goes to that node within ack_linger_ms, on an Ack call of their own.
    ``ack(wait=True)`` is one Ack call, answered once the node has the ack."""
    (node,) = await nodes()
    node.ready("pip", [f"p{i}" for i in range(4)])
    async with Consumer(StaticResolver(realtime=[node.address]), "pip", group="g", wait_ms=0,
                        ack_linger_ms=0) as c:
        (rb,) = await c.pull_batch()
        assert await rb.ack() == 4  # no pull follows: the linger's own Ack call takes them
        for _ in range(GUARD_S * 50):  # bounded wait for an outcome, not a timing claim
            if len(node.acked_handles()) == 4:
                break
            await asyncio.sleep(0.02)
        assert len(node.acked_handles()) == 4 and node.acks_on_pull == 0
    async with Consumer(StaticResolver(realtime=[node.address]), "pip", group="g", wait_ms=0,
                        ack_linger_ms=10_000) as c:
        node.ready("pip", ["q0"])
        (rb2,) = await c.pull_batch()
        await rb2.ack()
        assert len(node.acked_handles()) == 4  # queued, no call of its own yet
        node.ready("pip", ["q1"])
        (rb3,) = await c.pull_batch()  # the next pull carries rb2's ack
        assert node.acks_on_pull == 1 and len(node.acked_handles()) == 5
        assert await rb3.ack(wait=True) == 1
        assert len(node.acked_handles()) == 6  # answered: applied
    with pytest.raises(E.InvalidArgument, match="ack_linger_ms"):
        Consumer(StaticResolver(realtime=[node.address]), "pip", group="g", ack_linger_ms=-1)


async def test_a_message_of_a_bad_subject_fails_at_once_and_is_never_sent(nodes):
    """The one subject rule (``codec.subject_problem``), in the SDK: ``orders.a\\n`` is no subject."""
    (node,) = await nodes()
    r = StaticResolver(delay=[node.address], realtime=[node.address])
    async with fast(r) as p:
        with pytest.raises(E.InvalidArgument, match="does not match"):
            await p.send_and_wait("orders.a\n", b"x", delay_ms=60_000)
        res = await (await p.send_many(["orders.a", "orders.a\n", "orders/x"], [b"1", b"2", b"3"], delay_ms=60_000))
        assert sorted(res.errors) == [1, 2] and "message 1" in str(res.errors[1])
    assert [s for rec in node.requests for s in rec.subjects] == ["orders.a"]
    for subjects, group in ((["orders.a\n"], "g"), (["orders.a"], "billing\n")):
        with pytest.raises(E.InvalidArgument):
            Consumer(r, subjects, group=group)


async def test_the_iterators_take_messages_due_soon_and_hand_each_out_at_its_due_time(nodes):
    """Lookahead (``lookahead_ms``): the iterators' pulls ask for what is due within it; what
    comes early is held and handed out at its due time by this process's clock, never before,
    in slices, and never held past ``lookahead_ms`` after it arrived (a node hands a message out early only
    past its own hold limit). ``pull`` takes what is visible only (lookahead 0)."""
    (node,) = await nodes()
    t = now_ms()
    node.ready("la", ["now"], deliver_at_ms=t - 5)
    node.ready("la", ["soon-1", "soon-2"], deliver_at_ms=t + 40)  # within the lookahead, as a node hands out
    node.ready("la", ["later"], deliver_at_ms=t + 80)
    node.ready("la", ["far"], deliver_at_ms=t + 3_600_000)  # stored past the node's hold limit: handed out early
    seen: dict[str, tuple[int, int]] = {}  # id -> (handed out at, due)
    async with Consumer(StaticResolver(realtime=[node.address]), "la", group="g", wait_ms=200, lookahead_ms=100,
                        batch_max=10) as c:
        async def take() -> None:
            async for rb in c.batches():
                at = now_ms()
                for i, due in zip(rb.ids, rb.deliver_at_ms.tolist()):
                    seen[i] = (at, int(due))
                await rb.ack()
                if len(seen) == 5:
                    return
        await asyncio.wait_for(take(), GUARD_S)
    assert set(node.lookaheads) == {100}
    async with Consumer(StaticResolver(realtime=[node.address]), "la", group="g", lookahead_ms=100) as c:
        assert await c.pull(wait_ms=0) == []  # pull: what is visible only
    assert node.lookaheads[-1] == 0
    assert set(seen) == {"now", "soon-1", "soon-2", "later", "far"}
    for i in ("now", "soon-1", "soon-2", "later"):
        at, due = seen[i]
        assert at >= due, (i, at, due)  # never early
    assert seen["soon-1"][0] == seen["soon-2"][0]  # one slice
    assert seen["far"][0] < t + 60_000  # held at most lookahead_ms, not an hour


async def test_lookahead_zero_hands_out_what_comes_at_once(nodes):
    (node,) = await nodes()
    node.ready("l0", ["a"], deliver_at_ms=now_ms() + 60_000)
    async with Consumer(StaticResolver(realtime=[node.address]), "l0", group="g", wait_ms=200, lookahead_ms=0) as c:
        async def first():
            async for rb in c.batches():
                return rb.ids
        assert await asyncio.wait_for(first(), GUARD_S) == ["a"]
    assert set(node.lookaheads) == {0}


def _build_model(pieces, now_ms):
    """The wire batch of ``pieces`` as a list per message, sorted by due time (stable): what
    ``_build`` made before it numbered subjects and permuted with C calls."""
    rows = []
    for job, idx, _ in pieces:
        for i in idx.tolist():
            subject = job.subjects if isinstance(job.subjects, str) else job.subjects[i]
            delay = int(job.delay[i]) if job.delay is not None else 0
            extra = job.extras[i] if job.extras is not None else b""
            rows.append((subject, job.payloads[i], job.ids[i], int(job.deliver[i]), delay, extra))
    key = [now_ms + d if d else t for _, _, _, t, d, _ in rows]
    order = sorted(range(len(rows)), key=key.__getitem__)
    rows = [rows[k] for k in order]
    any_extras = any(j.extras is not None for j, _, _ in pieces)
    batch = Batch.build([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                        np.array([r[3] for r in rows], np.int64), extras=[r[5] for r in rows] if any_extras else None)
    any_delay = any(j.delay is not None for j, _, _ in pieces)
    return batch, [r[4] for r in rows] if any_delay else None


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_wire_batch_is_the_sorted_list_of_its_pieces_messages(data):
    """``_build`` numbers subjects once per job and permutes ids and payloads with C calls;
    the batch it encodes (subject table order included), its delay column and its order are
    those of the per-message list sorted by due time, whatever the pieces, subjects, extras
    and delays."""
    now = 1_000_000
    pool = ["s.a", "s.b", "s.c", "s.d"]
    jobs = []
    for j in range(data.draw(st.integers(1, 3))):
        n = data.draw(st.integers(1, 12))
        subjects = data.draw(st.one_of(st.sampled_from(pool), st.lists(st.sampled_from(pool), min_size=n, max_size=n)))
        extras = data.draw(st.one_of(st.none(), st.lists(st.sampled_from([b"", b"x", b"yz"]), min_size=n, max_size=n)))
        relative = data.draw(st.booleans())
        times = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        job = client_mod._Job([f"j{j}-{i}" for i in range(n)], subjects, [b"p%d.%d" % (j, i) for i in range(n)], extras,
                              [0] * n if relative else [now + t for t in times],
                              times if relative else None, False, None)
        job.seal()
        jobs.append(job)
    pieces = []
    for job in jobs:
        idx = np.array(sorted(data.draw(st.sets(st.integers(0, job.n - 1), min_size=1))), np.int64)
        cut = data.draw(st.integers(1, len(idx)))
        pieces += [(job, part, None) for part in (idx[:cut], idx[cut:]) if len(part)]
    clock, client_mod._now_ms = client_mod._now_ms, lambda: now
    try:
        batch, delay, order = client_mod._build(pieces)
    finally:
        client_mod._now_ms = clock
    want, want_delay = _build_model(pieces, now)
    assert batch.encode() == want.encode()
    assert (None if delay is None else delay.tolist()) == want_delay
    # ``order`` takes the pieces' messages (in piece order) to the batch's positions
    flat = [j.ids[i] for j, idx, _ in pieces for i in idx.tolist()]
    assert batch.id_list() == (flat if order is None else [flat[k] for k in order.tolist()])
