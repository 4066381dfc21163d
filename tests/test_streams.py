"""Ordered streams (docs/api.md, "Ordered streams"): ``serve_ordered`` on a real grpc.aio
server and ``OrderedStream`` as its client. One response per request, in request order,
even when later requests finish first; a refusal answers one request and leaves the stream
open; a broken or timed-out stream fails the calls waiting on it and the next call opens a
new one; an unparsable request is refused alone."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from cluster import status
from cluster.errors import InvalidArgument, NotLeader, Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.transport import Channels
from cluster.wire import UndecodableRequests, serve_ordered


class _Producer(rpc.ProducerServicer):
    """SendBatch answers ``epoch`` back in ``seqs`` after ``epoch`` ms (so later requests can
    finish first); epoch 999 is refused as "not the master"; 777 raises a bug; 555 hangs."""

    def __init__(self) -> None:
        self.hang = asyncio.Event()
        self.streams_opened = 0

    async def SendBatch(self, request, context):
        if request.epoch == 999:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not the master; leader_hint=127.0.0.1:1")
        if request.epoch == 777:
            raise RuntimeError("boom")
        if request.epoch == 555:
            await self.hang.wait()
        await asyncio.sleep(request.epoch / 1000)
        return pb.SendBatchResponse(seqs=request.epoch.to_bytes(8, "little"))

    async def SendBatchStream(self, requests, context):
        self.streams_opened += 1
        async for resp in serve_ordered(requests, context, self.SendBatch, pb.SendBatchResponse, window=8):
            yield resp


async def _serve() -> tuple[grpc.aio.Server, _Producer, str]:
    srv = grpc.aio.server(interceptors=[UndecodableRequests()])
    svc = _Producer()
    rpc.add_ProducerServicer_to_server(svc, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    return srv, svc, f"127.0.0.1:{port}"


@pytest.fixture
async def server():
    srv, svc, address = await _serve()
    channels = Channels()
    try:
        yield svc, address, channels
    finally:
        svc.hang.set()
        await channels.close()
        await srv.stop(None)


def _req(epoch: int) -> pb.SendBatchRequest:
    return pb.SendBatchRequest(epoch=epoch)


def _got(resp) -> int:
    return int.from_bytes(resp.seqs, "little")


async def test_responses_come_back_in_request_order(server):
    svc, address, channels = server
    stream = channels.send_stream(address)
    delays = [40, 5, 30, 1, 20, 0, 10, 2, 15, 3]  # later requests finish first inside the window
    got = await asyncio.gather(*(stream.call(_req(d), timeout=5) for d in delays))
    assert [_got(r) for r in got] == delays
    assert svc.streams_opened == 1 and stream.opened == 1


async def test_a_refusal_answers_one_request_and_the_stream_stays_open(server):
    svc, address, channels = server
    stream = channels.send_stream(address)
    results = await asyncio.gather(stream.call(_req(3), timeout=5), stream.call(_req(999), timeout=5),
                                   stream.call(_req(777), timeout=5), stream.call(_req(4), timeout=5),
                                   return_exceptions=True)
    assert _got(results[0]) == 3 and _got(results[3]) == 4
    assert isinstance(results[1], grpc.RpcError) and results[1].code() == grpc.StatusCode.UNAVAILABLE
    err = status.from_rpc_error(results[1])
    assert isinstance(err, NotLeader) and err.leader_hint == "127.0.0.1:1"  # the unary call's error, as it was
    assert isinstance(results[2], grpc.RpcError) and results[2].code() == grpc.StatusCode.UNKNOWN
    assert "boom" in results[2].details()
    assert _got(await stream.call(_req(1), timeout=5)) == 1
    assert svc.streams_opened == 1


async def test_a_timeout_closes_the_stream_and_the_next_call_opens_a_new_one(server):
    svc, address, channels = server
    stream = channels.send_stream(address)
    hung = asyncio.create_task(stream.call(_req(555), timeout=5))
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:
        await stream.call(_req(1), timeout=0.2)  # queued behind the hung one
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError):  # the call waiting on the closed stream fails too, at once
        await asyncio.wait_for(hung, 2)
    assert _got(await stream.call(_req(2), timeout=5)) == 2
    assert stream.opened == 2
    await asyncio.sleep(0.05)
    assert svc.streams_opened == 2


async def test_a_dead_server_fails_the_waiting_calls_with_unavailable():
    srv, svc, address = await _serve()
    channels = Channels()
    try:
        stream = channels.send_stream(address)
        assert _got(await stream.call(_req(1), timeout=5)) == 1
        waiting = asyncio.create_task(stream.call(_req(555), timeout=10))
        await asyncio.sleep(0.05)
        await srv.stop(None)
        with pytest.raises(grpc.RpcError) as e:
            await asyncio.wait_for(waiting, 5)
        assert isinstance(status.from_rpc_error(e.value), Unavailable)
    finally:
        svc.hang.set()
        await channels.close()
        await srv.stop(None)


async def test_an_unparsable_request_is_refused_alone(server):
    svc, address, channels = server
    ch = channels.get(address)
    raw = ch.stream_stream("/hourglass.v1.Producer/SendBatchStream", request_serializer=lambda b: b,
                           response_deserializer=pb.SendBatchResponse.FromString)()
    await raw.write(_req(2).SerializeToString())
    await raw.write(b"\xff\xff\xff")  # not a protobuf message
    await raw.write(_req(1).SerializeToString())
    first, bad, third = [await asyncio.wait_for(raw.read(), 5) for _ in range(3)]
    assert _got(first) == 2 and _got(third) == 1
    assert bad.refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "cannot parse the request" in bad.refused.details
    assert isinstance(status.from_status(status.status_code(bad.refused.code), bad.refused.details), InvalidArgument)
    raw.cancel()


async def test_a_write_cancelled_midway_ends_the_stream_and_later_calls_still_match(server):
    svc, address, channels = server
    stream = channels.send_stream(address)
    assert _got(await stream.call(_req(1), timeout=5)) == 1
    big = pb.SendBatchRequest(epoch=2, batch=bytes(8 << 20))  # a write that takes a while
    loop = asyncio.get_running_loop()
    unretrieved = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx.get("message")))
    task = asyncio.create_task(stream.call(big, timeout=5))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    got = await asyncio.gather(*(stream.call(_req(d), timeout=5) for d in (3, 4, 5)))
    assert [_got(r) for r in got] == [3, 4, 5]  # every later caller gets its own answer
    del task
    gc.collect()  # a failed future nobody awaited says so when it is collected
    loop.set_exception_handler(None)
    assert not unretrieved, unretrieved


def _requests_counted(method: str) -> float:
    from cluster.wire import REQUESTS

    return REQUESTS.labels(method=method)._value.get()


async def test_every_request_is_counted_by_method_a_refused_one_too(server):
    """``hourglass_requests{method}`` counts a unary call once and each request of a stream
    once, the unparsable one included (docs/operations.md, Metrics)."""
    svc, address, channels = server
    ch = channels.get(address)
    unary0, stream0 = _requests_counted("Producer/SendBatch"), _requests_counted("Producer/SendBatchStream")
    send = ch.unary_unary("/hourglass.v1.Producer/SendBatch", request_serializer=pb.SendBatchRequest.SerializeToString,
                          response_deserializer=pb.SendBatchResponse.FromString)
    for e in (1, 2):
        assert _got(await asyncio.wait_for(send(_req(e)), 10)) == e
    raw = ch.stream_stream("/hourglass.v1.Producer/SendBatchStream", request_serializer=lambda b: b,
                           response_deserializer=pb.SendBatchResponse.FromString)()
    for body in (_req(1).SerializeToString(), b"\xff\xff\xff", _req(2).SerializeToString()):
        await raw.write(body)
    answers = [await asyncio.wait_for(raw.read(), 10) for _ in range(3)]
    raw.cancel()
    assert [_got(a) for a in answers if not a.HasField("refused")] == [1, 2]
    assert _requests_counted("Producer/SendBatch") - unary0 == 2
    assert _requests_counted("Producer/SendBatchStream") - stream0 == 3


class _Sized:
    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def ByteSize(self) -> int:
        return self.size


async def test_the_window_reads_no_further_while_the_requests_answered_hold_its_bytes():
    """``window_bytes``: a request is read only while the ones being answered hold at most
    that many bytes with it (one alone is always read, however large): a client's stream
    holds a bounded part of the node's memory whatever its requests' sizes."""
    sizes = [40, 40, 40, 100, 10]
    release = {i: asyncio.Event() for i in range(len(sizes))}
    started: list[int] = []
    read: list[int] = []

    async def requests():
        for i, size in enumerate(sizes):
            read.append(i)
            yield _Sized(i, size)

    async def handler(req, ctx):
        started.append(req.n)
        await release[req.n].wait()
        return req.n

    out: list[int] = []

    async def consume():
        async for r in serve_ordered(requests(), None, handler, lambda: None, window=16, window_bytes=100):
            out.append(r)

    task = asyncio.create_task(consume())
    for _ in range(20):
        await asyncio.sleep(0)
    assert started == [0, 1]  # 40 + 40 held; the third (40) would pass 100
    release[0].set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert started == [0, 1, 2] and out == [0]
    release[1].set(), release[2].set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert started == [0, 1, 2, 3] and out == [0, 1, 2]  # 100 alone: read once nothing else is held
    release[3].set(), release[4].set()
    await asyncio.wait_for(task, 5)
    assert out == [0, 1, 2, 3, 4]
