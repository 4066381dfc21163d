"""Sending a nack's retry copies to a delay node (the shell of ``node/realtime/nack.py``).

The real-time node is a producer of delayed messages here: the copies go to the first delay
node that takes them whole (``SendBatch``); a copy it refuses is an error for the whole nack
(the servicer acks nothing then, so the messages come again); no delay node answering is
``Unavailable``.
"""

from __future__ import annotations

import grpc
import numpy as np

from cluster import status
from cluster.codec import Batch
from cluster.errors import Unavailable
from cluster.proto import hourglass_pb2 as pb
from cluster.wire import BatchResult, make_request

RETRY_SEND_TIMEOUT_S = 10.0   # one SendBatch of nacked copies to a delay node


async def send_retries(channels, nodes: list[str], batch: Batch) -> None:
    """Send ``batch`` to the first of ``nodes`` that takes it; raises what refused it."""
    if not nodes:
        raise Unavailable("no delay node configured for retries")
    req = make_request(batch)
    last: Exception | None = None
    for address in nodes:
        try:
            resp = await channels.producer(address).SendBatch(req, timeout=RETRY_SEND_TIMEOUT_S)
        except grpc.RpcError as e:
            last = status.from_rpc_error(e)
            continue
        res = BatchResult.from_pb(resp, batch.n)
        bad = np.flatnonzero(res.codes != pb.OK)
        if len(bad):
            i = int(bad[0])
            raise status.from_code(int(res.codes[i]), res.errors.get(i, "refused"))
        return
    raise Unavailable(f"no delay node took the retries: {last}")
