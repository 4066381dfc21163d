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

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def producer(self, address: str) -> rpc.ProducerStub:
        return rpc.ProducerStub(self.get(address))

    def consumer(self, address: str) -> rpc.ConsumerStub:
        return rpc.ConsumerStub(self.get(address))

    def admin(self, address: str) -> rpc.AdminStub:
        return rpc.AdminStub(self.get(address))

    async def drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        chans, self._channels = list(self._channels.values()), {}
        for ch in chans:
            await ch.close()
