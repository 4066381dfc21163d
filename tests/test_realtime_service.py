"""A real ``RealtimeNode`` in-process on a real port, driven with raw gRPC stubs and v2 messages."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from cluster.codec import Batch, encode_extra
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.wire import BatchResult, make_request, pack_ranges, request_batch
from node.config import NodeSettings
from node.realtime.nack import ORIGIN_ID
from node.realtime.service import RealtimeNode
from cluster.errors import Unavailable
from node.realtime.store import DLQ_SUBJECT
from node.role import Role
from tests.helpers.inprocess import serving


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class FakeDelayNode(rpc.ProducerServicer):
    """Stands in for a delay node: takes nacked copies and answers OK."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    async def SendBatch(self, request, context):
        b = request_batch(request, now_ms=now_ms())
        self.batches.append(b)
        res = BatchResult.sized(b.n)
        res.seqs[:] = np.arange(1, b.n + 1)
        return res.to_pb()


@pytest.fixture
async def node(tmp_path):
    delay = FakeDelayNode()
    delay_server = grpc.aio.server()
    rpc.add_ProducerServicer_to_server(delay, delay_server)
    delay_port = delay_server.add_insecure_port("127.0.0.1:0")
    await delay_server.start()
    settings = NodeSettings(role="realtime", node_id="rt-test", data_dir=tmp_path / "rt", port=0,
                            delay_nodes=[f"127.0.0.1:{delay_port}"], ack_timeout_ms=60_000, max_attempts=3,
                            batch_messages_max=100, pull_wait_ms_max=5_000)
    n = RealtimeNode(settings)
    try:
        async with serving(n) as channel:
            yield n, rpc.ProducerStub(channel), rpc.ConsumerStub(channel), delay
    finally:
        await delay_server.stop(None)


def msgs(subject, ids, *, tags=None, due=0, attempts=0) -> Batch:
    extras = None if tags is None else [encode_extra(tags)] * len(ids)
    return Batch.build(subject, [f"payload-{i}".encode() for i in ids], list(ids), due,
                       attempts=attempts, extras=extras)


async def send(producer, batch, **kw) -> BatchResult:
    resp = await producer.SendBatch(make_request(batch, **kw))
    return BatchResult.from_pb(resp, batch.n)


async def pull(consumer, subjects, group, *, max_messages=100, wait_ms=0, tags=()):
    resp = await consumer.Pull(pb.PullRequest(subjects=subjects, group=group, consumer_id="c1",
                                              max_messages=max_messages, wait_ms=wait_ms, tags=list(tags)))
    b = Batch.decode(resp.batch)
    h = np.frombuffer(resp.handles, "<u8")
    assert len(h) == b.n
    return b, h


def by_subject(b: Batch, h: np.ndarray) -> list[pb.SubjectHandles]:
    subj = np.array(b.subject_list())
    return [pb.SubjectHandles(subject=s, ranges=pack_ranges(h[subj == s])) for s in sorted(set(subj.tolist()))]


async def test_send_pull_ack_over_grpc(node):
    n, producer, consumer, _ = node
    t = now_ms()
    res = await send(producer, Batch.concat([msgs("orders", ["a", "b"]), msgs("audit", ["c"], tags=("eu",))]))
    assert res.codes.tolist() == [pb.OK] * 3 and res.duplicates.tolist() == [0] * 3 and (res.seqs > 0).all()
    assert (res.deliver_at_ms >= t).all()  # deliver_at_ms 0 = now
    again = await send(producer, msgs("orders", ["a"]))
    assert again.duplicates.tolist() == [1] and again.seqs[0] == res.seqs[0]

    b, h = await pull(consumer, ["orders", "audit"], "billing")
    assert sorted(zip(b.subject_list(), b.id_list(), h.tolist())) == \
        [("audit", "c", 0), ("orders", "a", 0), ("orders", "b", 1)]
    assert b.extra(b.id_list().index("c"))[0] == ("eu",) and (b.store_ms >= t).all()
    resp = await consumer.Ack(pb.AckRequest(group="billing", acks=by_subject(b, h)))
    assert resp.acked == 3
    assert n.store.lag("orders", "billing") == n.store.lag("audit", "billing") == 0
    assert n.store.group_doc("orders", "billing")["committed"] == 2  # the group file was written before the answer
    assert (await pull(consumer, ["orders", "audit"], "billing"))[0].n == 0


async def test_acks_riding_on_a_pull_are_applied_before_it(node):
    n, producer, consumer, _ = node
    await send(producer, msgs("orders", ["a", "b", "c"]))
    b, h = await pull(consumer, ["orders"], "g")
    assert b.n == 3
    await send(producer, msgs("orders", ["d"]))
    resp = await consumer.Pull(pb.PullRequest(subjects=["orders"], group="g", consumer_id="c1", max_messages=10,
                                              acks=by_subject(b.take(np.array([0, 1])), h[:2])))
    assert Batch.decode(resp.batch).id_list() == ["d"]
    assert n.store.lag("orders", "g") == 2  # c (not acked) and d (just pulled)
    assert n.calls["ack_on_pull"] == 1


async def test_long_poll_wakes_on_any_subject(node):
    n, producer, consumer, _ = node
    woke: list[tuple[str, int]] = []  # (subject, pulls waiting on it) at each wake-up
    wake = n._wake

    def counting_wake(subjects):
        woke.extend((s, len(n._new_data.get(s, ()))) for s in subjects)
        wake(subjects)

    n._wake = counting_wake
    waiter = asyncio.create_task(pull(consumer, ["x", "y", "z"], "g", wait_ms=4_000))
    for _ in range(600):  # bounded: until the pull waits on its subjects (an order, not a time)
        if all(n._new_data.get(s) for s in ("x", "y", "z")):
            break
        await asyncio.sleep(0.01)
    assert not waiter.done()
    await send(producer, msgs("y", ["late"]))
    assert ("y", 1) in woke  # the store of a "y" message woke the waiting pull (not its deadline)
    b, h = await asyncio.wait_for(waiter, 60)
    assert b.id_list() == ["late"] and b.subject(0) == "y" and h.tolist() == [0]
    t0 = time.monotonic()
    b, _ = await pull(consumer, ["x"], "g", wait_ms=300)  # nothing comes: answered empty at the deadline
    assert b.n == 0 and 0.25 < time.monotonic() - t0  # not before its deadline (after it: a starved machine may be late)


async def test_refusals(node):
    _, producer, consumer, _ = node
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await send(producer, msgs("orders", [f"m{i}" for i in range(101)]))  # over batch_messages_max
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await producer.SendBatch(pb.SendBatchRequest(batch=b"garbage"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    res = await send(producer, msgs("orders", ["now", "later"]), delay_ms=[0, 60_000])
    assert res.codes.tolist() == [pb.OK, pb.INVALID_ARGUMENT] and "delay node" in res.errors[1]
    res = await send(producer, msgs("orders", ["later2"]), delay_ms=[60_000], immediate=True)  # dispatching
    assert res.codes.tolist() == [pb.OK]
    res = await send(producer, msgs("bad subject", ["x"]))
    assert res.codes.tolist() == [pb.INVALID_ARGUMENT] and res.seqs.tolist() == [0]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await consumer.Pull(pb.PullRequest(subjects=["orders"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await consumer.Ack(pb.AckRequest(group="g", acks=[pb.SubjectHandles(subject="orders", ranges=b"123")]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_nack_retries_through_a_delay_node_then_dead_letters(node):
    n, producer, consumer, delay = node
    await send(producer, Batch.concat([msgs("orders", ["a"], tags=("eu",)), msgs("orders", ["b"], attempts=2)]))
    b, h = await pull(consumer, ["orders"], "g")
    t = now_ms()
    resp = await consumer.Nack(pb.NackRequest(group="g", retry_after_ms=5_000, nacks=by_subject(b, h)))
    assert (resp.retried, resp.dead_lettered) == (1, 1)
    [copy] = delay.batches
    assert copy.id_list() == ["a~r1"] and int(copy.attempts[0]) == 1 and copy.subject(0) == "orders"
    tags, props = copy.extra(0)
    assert tags == ("eu",) and dict(props)[ORIGIN_ID] == "a"
    assert t + 5_000 <= int(copy.deliver_at_ms[0]) <= now_ms() + 5_000
    assert n.store.lag("orders", "g") == 0  # both acked once their copies were stored
    d, dh = await pull(consumer, [DLQ_SUBJECT], "ops")
    assert d.id_list() == ["b~r3"] and int(d.attempts[0]) == 3
    props = dict(d.extra(0)[1])
    assert props["dlq.subject"] == "orders" and props[ORIGIN_ID] == "b"
    # a retry copy nacked again keeps the first origin
    await send(producer, copy.replace(deliver_at_ms=0), immediate=True)
    b, h = await pull(consumer, ["orders"], "g")
    await consumer.Nack(pb.NackRequest(group="g", nacks=by_subject(b, h)))
    assert delay.batches[-1].id_list() == ["a~r2"] and dict(delay.batches[-1].extra(0)[1])[ORIGIN_ID] == "a"
    resp = await consumer.Nack(pb.NackRequest(group="g", nacks=by_subject(b, h)))  # no longer in flight
    assert (resp.retried, resp.dead_lettered) == (0, 0)


async def test_a_nack_whose_store_is_swapped_meanwhile_stops_with_not_leader(node, monkeypatch):
    """Issue 29: a role change may end the node's role (and replace its store) while a Nack
    awaits the delay node; the call then answers NOT_LEADER (retryable) and acks nothing on
    either store."""
    n, producer, consumer, delay = node
    await send(producer, msgs("orders", ["a"]))
    b, h = await pull(consumer, ["orders"], "g")
    real_send, other = n._send_to_delay, Role("slave", object(), None)

    async def send_then_switch(batch):
        await real_send(batch)
        monkeypatch.setattr(n.role, "ended", True)  # what a role switch does (ReplicaRoles._switch)
        monkeypatch.setattr(n, "role", other)
    monkeypatch.setattr(n, "_send_to_delay", send_then_switch)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await consumer.Nack(pb.NackRequest(group="g", nacks=by_subject(b, h)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    monkeypatch.undo()
    assert len(delay.batches) == 1  # the retry copy went out before the switch
    assert n.store.lag("orders", "g") == 1  # not acked: it comes again (at least once)


async def test_a_failed_offsets_write_fails_its_ack_and_its_retry_writes_again(node, monkeypatch):
    """An Ack is answered OK only once its group document is durable: when the offsets-log
    write fails, that Ack fails, and the client's retry of the same Ack writes the document
    again (it must not find the group "already persisted" and answer OK for an unwritten
    position)."""
    from concurrent.futures import Future

    n, producer, consumer, _ = node
    await send(producer, msgs("orders", ["a", "b"]))
    b, h = await pull(consumer, ["orders"], "g")
    real_commit = n.store._offsets.commit
    written: list[list[dict]] = []

    def failing_commit(docs):
        f = Future()
        f.set_exception(OSError(28, "No space left on device"))
        return f

    ack = pb.AckRequest(group="g", acks=by_subject(b.take(np.array([0])), h[:1]))
    monkeypatch.setattr(n.store._offsets, "commit", failing_commit)
    with pytest.raises(grpc.aio.AioRpcError):
        await consumer.Ack(ack)

    def recording_commit(docs):
        written.append(list(docs))
        return real_commit(docs)

    monkeypatch.setattr(n.store._offsets, "commit", recording_commit)
    await consumer.Ack(ack)  # the retry: its handle is no longer in flight, the document still must be written
    assert written and written[-1][0]["committed"] == 1
    assert n.store.group_doc("orders", "g")["committed"] == 1


async def test_a_waiting_pull_gets_messages_before_their_fsync_but_no_ack_outruns_it(node):
    """A long poll is woken at the append, not after the group-commit fsync (lateness); the
    sender is answered only after the fsync, and a position that passes those messages is
    written only after they are durable (else a crash could leave it beyond the log's end)."""
    import threading

    n, producer, consumer, _ = node
    await send(producer, msgs("orders", ["warm"]))
    b, h = await pull(consumer, ["orders"], "g2")
    await consumer.Ack(pb.AckRequest(group="g2", acks=by_subject(b, h)))
    gate, order = threading.Event(), []
    flush = n.committer.log.flush

    def slow_flush():  # runs on the group-commit thread
        assert gate.wait(10)
        flush()
        order.append("messages fsynced")

    write_groups = n.store.write_groups_async

    def logged_write_groups(items):
        order.append("positions written")
        return write_groups(items)

    n.committer.log.flush = slow_flush
    n.store.write_groups_async = logged_write_groups
    try:
        waiting = asyncio.create_task(pull(consumer, ["orders"], "g2", wait_ms=5_000))
        await asyncio.sleep(0.2)  # the pull is parked
        sending = asyncio.create_task(send(producer, msgs("orders", ["a", "b"])))
        b, h = await asyncio.wait_for(waiting, 5)
        assert b.id_list() == ["a", "b"]
        await asyncio.sleep(0.1)
        assert not sending.done()  # not durable yet: the sender waits
        acking = asyncio.ensure_future(consumer.Ack(pb.AckRequest(group="g2", acks=by_subject(b, h))))
        await asyncio.sleep(0.2)
        assert not acking.done() and order == []  # the positions wait for the messages' fsync
    finally:
        gate.set()
    assert (await asyncio.wait_for(sending, 5)).codes.tolist() == [pb.OK, pb.OK]
    assert (await asyncio.wait_for(acking, 5)).acked == b.n
    assert order[0] == "messages fsynced" and "positions written" in order


async def test_a_message_sent_ahead_of_its_due_time_is_held_until_due(node):
    """Delay nodes dispatch a firing round dispatch_lead_ms ahead (``immediate``): a parked
    pull is answered when the message is due, not when it arrives."""
    n, producer, consumer, _ = node
    await send(producer, msgs("orders", ["warm"]))
    b, h = await pull(consumer, ["orders"], "g3")
    await consumer.Ack(pb.AckRequest(group="g3", acks=by_subject(b, h)))
    waiting = asyncio.create_task(pull(consumer, ["orders"], "g3", wait_ms=5_000))
    await asyncio.sleep(0.1)  # the pull is parked
    due = now_ms() + 60
    res = await send(producer, msgs("orders", ["ahead"], due=due), immediate=True)
    assert res.codes.tolist() == [pb.OK]
    b, _ = await asyncio.wait_for(waiting, 5)
    assert b.id_list() == ["ahead"] and now_ms() >= due
    # not immediate: a message due later is refused (it belongs on a delay node)
    res = await send(producer, msgs("orders", ["later"], due=now_ms() + 60_000))
    assert res.codes.tolist() == [pb.INVALID_ARGUMENT]


def _count_appends(n, monkeypatch) -> list[list[str]]:
    """Spy on the store's appends: the subjects of each frame, in order."""
    frames: list[list[str]] = []
    real = n.store.append

    def append(batch, **kw):
        frames.append(list(dict.fromkeys(batch.subject_list())))
        return real(batch, **kw)
    monkeypatch.setattr(n.store, "append", append)
    return frames


async def test_a_send_of_many_new_subjects_is_stored_in_frames_of_a_few_new_subjects(node, monkeypatch):
    """Issue 27: a frame writes at most subjects_new_per_frame_max first index entries on the
    loop; the send is answered as one batch, each subject's messages in one frame, in order."""
    n, producer, consumer, _ = node
    n.settings = n.settings.replace(subjects_new_per_frame_max=3)
    assert (await send(producer, msgs("old", ["o-warm"]))).codes.tolist() == [pb.OK]
    frames = _count_appends(n, monkeypatch)
    subjects = [s for i in range(8) for s in ("old", f"new.{i % 7}")] + ["new.0"]
    ids = [f"m{i}" for i in range(len(subjects) - 1)] + ["m1"]  # the last repeats new.0's first id
    b = Batch.build(subjects, [f"p-{i}".encode() for i in ids], ids, 0)
    res = await send(producer, b)
    assert res.codes.tolist() == [pb.OK] * b.n
    assert res.duplicates.tolist() == [0] * (b.n - 1) + [1] and res.seqs[-1] == res.seqs[1]
    assert frames == [["old", "new.0", "new.1", "new.2"], ["new.3", "new.4", "new.5"], ["new.6"]]
    for s in ["old", *(f"new.{i}" for i in range(7))]:
        got, _ = await pull(consumer, [s], "g")
        want = [i for i, x in zip(ids[:-1], subjects[:-1]) if x == s]
        assert got.id_list() == (["o-warm"] if s == "old" else []) + want
    again = await send(producer, b)  # a retry: every message answered as the duplicate it is
    assert again.codes.tolist() == [pb.OK] * b.n and again.duplicates.tolist() == [1] * b.n
    assert again.seqs.tolist() == res.seqs.tolist()


async def test_a_send_of_many_known_subjects_is_stored_in_frames_of_a_few_subjects(node, monkeypatch):
    """Issue 27: not only new subjects: a send over more than subjects_per_frame_max known
    subjects (one index write each) is stored as frames of at most that many, in order."""
    n, producer, consumer, _ = node
    n.settings = n.settings.replace(subjects_per_frame_max=2, subjects_new_per_frame_max=10)
    subjects = [f"k.{i}" for i in range(5)]
    assert (await send(producer, Batch.build(subjects, [b"w"] * 5, [f"w{i}" for i in range(5)], 0))).codes.tolist() \
        == [pb.OK] * 5  # new subjects within subjects_new_per_frame_max, but 5 > 2 subjects: three frames
    frames = _count_appends(n, monkeypatch)
    b = Batch.build(subjects * 2, [b"x"] * 10, [f"m{i}" for i in range(10)], 0)
    res = await send(producer, b)
    assert res.codes.tolist() == [pb.OK] * 10 and res.duplicates.tolist() == [0] * 10
    assert frames == [["k.0", "k.1"], ["k.2", "k.3"], ["k.4"]]
    for i, s in enumerate(subjects):
        got, _ = await pull(consumer, [s], "g")
        assert got.id_list() == [f"w{i}", f"m{i}", f"m{i + 5}"]


async def test_a_refusal_after_the_first_frame_refuses_the_rest_and_a_retry_stores_it_once(node, monkeypatch):
    n, producer, consumer, _ = node
    n.settings = n.settings.replace(subjects_new_per_frame_max=2)
    frames = _count_appends(n, monkeypatch)
    spied = n.store.append

    def fail_second(batch, **kw):
        if len(frames) == 1:
            frames.append(["refused"])
            raise Unavailable("the store closed")
        return spied(batch, **kw)
    monkeypatch.setattr(n.store, "append", fail_second)
    subjects = [f"s.{i}" for i in range(5)]
    b = Batch.build(subjects, [b"x"] * 5, [f"m{i}" for i in range(5)], 0)
    res = await send(producer, b)
    assert res.codes.tolist() == [pb.OK, pb.OK] + [pb.OVERLOADED] * 3  # retryable
    assert "the store closed" in res.errors[4] and res.seqs[2:].tolist() == [0, 0, 0]
    monkeypatch.setattr(n.store, "append", spied)
    again = await send(producer, b)
    assert again.codes.tolist() == [pb.OK] * 5 and again.duplicates.tolist() == [1, 1, 0, 0, 0]
    for s in subjects:
        got, _ = await pull(consumer, [s], "g")
        assert got.n == 1
