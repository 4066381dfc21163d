"""Edges of the server a client can reach with odd input (issue 13), on real processes
and real gRPC: bytes protobuf cannot parse, a batch whose subject is not UTF-8, the
delay horizon to the millisecond, a cancelled id sent again, an oversized payload."""

from __future__ import annotations

import grpc
import pytest

from cluster import errors as E
from cluster.client import Producer
from cluster.codec import Batch
from cluster.devcluster import LocalCluster
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc

HORIZON_MS = 10_000  # small, to test the setting reaches the node and applies exactly
PAYLOAD_MAX = 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("edges"), env={"HOURGLASS_DELAY_HORIZON_MS": str(HORIZON_MS),
                                                            "HOURGLASS_PAYLOAD_BYTES_MAX": str(PAYLOAD_MAX)})
    c.start()
    yield c
    c.stop()


def field(number: int, raw: bytes) -> bytes:
    """One length-delimited protobuf field, written by hand (so it can hold any bytes)."""
    assert len(raw) < 128
    return bytes([number << 3 | 2, len(raw)]) + raw


NOT_UTF8 = b"orders\xff\xfe"


def batch_with_subject(subject: bytes) -> bytes:
    raw = Batch.build("placeholder", [b"x"], ["edge-1"], [0]).encode()
    assert raw.count(b"placeholder") == 1 and len(subject) == len(b"placeholder")
    return raw.replace(b"placeholder", subject)


@pytest.mark.parametrize("role,method,body", [
    ("realtime", "/hourglass.v1.Consumer/Pull", field(1, NOT_UTF8) + field(2, b"g")),
    ("realtime", "/hourglass.v1.Consumer/Pull", field(7, NOT_UTF8) + field(2, b"g")),
    ("realtime", "/hourglass.v1.Consumer/Ack", field(2, b"g") + field(4, field(1, NOT_UTF8))),
    ("realtime", "/hourglass.v1.Consumer/Nack", field(2, b"g") + field(5, field(1, NOT_UTF8))),
    ("delay", "/hourglass.v1.Producer/Cancel", field(1, NOT_UTF8)),
    ("delay", "/hourglass.v1.Producer/Lookup", field(1, NOT_UTF8)),
    ("realtime", "/hourglass.v1.Producer/Lookup", field(1, NOT_UTF8)),
])
async def test_request_protobuf_cannot_parse_is_invalid_argument(cluster, role, method, body):
    node = (cluster.delay if role == "delay" else cluster.realtime)[0]
    async with grpc.aio.insecure_channel(node.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            await ch.unary_unary(method)(body, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert method in info.value.details() and "UTF-8" in info.value.details()
        status = await rpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=10)  # still serving
        assert status.role == role
    assert "Traceback" not in node.tail_log(200)


@pytest.mark.parametrize("role", ["delay", "realtime"])
async def test_batch_subject_not_utf8_is_invalid_argument(cluster, role):
    node = (cluster.delay if role == "delay" else cluster.realtime)[0]
    bad = batch_with_subject(b"ord\xff\xfeers.ne")
    async with grpc.aio.insecure_channel(node.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            await rpc.ProducerStub(ch).SendBatch(pb.SendBatchRequest(batch=bad), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("invalid subject: subject 0 of the batch is not UTF-8")
    assert "Traceback" not in node.tail_log(200)


async def test_horizon_setting_applies_to_the_millisecond(resolver):
    async with Producer(resolver) as p:
        at = await p.send_and_wait("edges.horizon", b"x", delay_ms=HORIZON_MS, id="horizon-at")
        assert at.seq
        with pytest.raises(E.InvalidArgument) as info:
            await p.send_and_wait("edges.horizon", b"x", delay_ms=HORIZON_MS + 1, id="horizon-over")
    assert str(info.value) == (f"invalid request: deliver_at_ms: {HORIZON_MS + 1} ms ahead is beyond the delay "
                               f"horizon, delay_horizon_ms = {HORIZON_MS} ms")


async def test_cancelled_id_sent_again_says_cancelled(resolver):
    async with Producer(resolver) as p:
        await p.send_and_wait("edges.cancel", b"x", delay_ms=5_000, id="cancel-1")
        await p.cancel("cancel-1")
        with pytest.raises(E.AlreadyExists) as info:
            await p.send_and_wait("edges.cancel", b"x", delay_ms=5_000, id="cancel-1")
    assert str(info.value) == "id 'cancel-1' was cancelled; a cancelled id cannot be reused"


async def test_payload_too_large_says_it_once(resolver):
    async with Producer(resolver) as p:
        with pytest.raises(E.PayloadTooLarge) as info:
            await p.send_and_wait("edges.big", b"x" * (PAYLOAD_MAX + 1), delay_ms=1000, id="big-1")
    assert str(info.value) == f"invalid payload: {PAYLOAD_MAX + 1} bytes exceeds {PAYLOAD_MAX}"
