"""gRPC channels: one cached ``grpc.aio`` channel per address, with the size limits set once."""

from __future__ import annotations

import grpc

from cluster.proto import hourglass_pb2_grpc as rpc

MESSAGE_BYTES_MAX = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]


class Channels:
    """Owns channels to many peers; close() closes them all."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], object] = {}  # a stub per (kind, address): made once

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def _stub(self, kind: type, address: str):
        stub = self._stubs.get((kind, address))
        if stub is None:
            stub = self._stubs[(kind, address)] = kind(self.get(address))
        return stub

    def producer(self, address: str) -> rpc.ProducerStub:
        return self._stub(rpc.ProducerStub, address)

    def consumer(self, address: str) -> rpc.ConsumerStub:
        return self._stub(rpc.ConsumerStub, address)

    def admin(self, address: str) -> rpc.AdminStub:
        return self._stub(rpc.AdminStub, address)

    async def drop(self, address: str) -> None:
        self._stubs = {k: v for k, v in self._stubs.items() if k[1] != address}
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        chans, self._channels = list(self._channels.values()), {}
        self._stubs = {}
        for ch in chans:
            await ch.close()
