"""The send path both node kinds share: ``SendIntake``, a mixin of ``DelayNode`` and
``RealtimeNode`` (``node/delay/service.py``, ``node/realtime/service.py``).

A ``SendBatch`` on either node goes: the caller may send this batch
(``_authorized_batch``, ``cluster/security.py``) -> this node serves clients now
(``_serving``; a replicated node's ``ReplicaRoles`` answers NotLeader or refuses a newer
term) -> the batch is admitted (``_admit_batch``: at most ``batch_messages_max`` messages,
else INVALID_ARGUMENT; a write that would take free space below the watermark, or that comes
while the node refuses writes, DiskFull; either refuses the whole batch, nothing stored) ->
the node's own store appends it -> its errors go out through ``cluster/status.py``, a
``DiskFull`` completed first (``_refusal``). ``SendBatchStream`` serves the same handler on an
ordered stream. What differs (the delay store's ``accept`` and its filing, the real-time
node's subject creation, frame slices and due-later rule) stays in each node's own
``SendBatch`` path.

The node provides ``settings`` (``NodeSettings``), ``clock``, ``disk`` (``DiskMonitor``) and
``metrics`` (``NodeMetrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster import security
from cluster.codec import Batch
from cluster.errors import DiskFull, HourglassError, InvalidArgument
from cluster.proto import hourglass_pb2 as pb
from cluster.wire import serve_ordered


class SendIntake:
    async def _authorized_batch(self, request: pb.SendBatchRequest, context) -> tuple[Batch, int]:
        """First thing of a send: the batch, if the caller may send it (``security.authorized_batch``)."""
        return await security.authorized_batch(context, request, self.clock)

    async def _serving(self, context, epoch: int = 0) -> None:
        """After authorization, before any work: a replicated node answers NotLeader here
        unless it serves clients now, and refuses a newer term than its own (``ReplicaRoles``)."""

    async def SendBatchStream(self, requests, context):
        """SendBatch on an ordered stream (docs/api.md): one response per request, in order."""
        async for resp in serve_ordered(requests, context, self._timed_send, pb.SendBatchResponse,
                                        window=self.settings.limits.stream_window_max,
                                        window_bytes=self.settings.limits.stream_window_bytes_max):
            yield resp

    async def _timed_send(self, request: pb.SendBatchRequest, context) -> pb.SendBatchResponse:
        """``SendBatch``, observed into ``hourglass_send_seconds`` whatever its outcome."""
        began = time.perf_counter()
        try:
            return await self.SendBatch(request, context)
        finally:
            self.metrics.send_seconds.observe(time.perf_counter() - began)

    def _admit_batch(self, batch: Batch, write_bytes_bound: Callable[[Batch], int]) -> None:
        """Raise unless the whole batch may be stored: ``InvalidArgument`` over
        ``batch_messages_max`` messages, ``DiskFull`` when its bound (``write_bytes_bound``, the
        store's) would take free space below the watermark or the node refuses writes."""
        limit = self.settings.limits.batch_messages_max
        if batch.n > limit:
            raise InvalidArgument("batch", f"{batch.n} messages exceeds batch_messages_max {limit}")
        self.disk.admit(write_bytes_bound(batch))

    def _refusal(self, e: HourglassError) -> HourglassError:
        """The error to answer with for ``e``: a ``DiskFull`` is counted, and one from a write
        that hit ENOSPC (a store's, which knows no node) makes the node refuse writes and is
        answered with its address and free space; any other error as it is."""
        if not isinstance(e, DiskFull):
            return e
        self.metrics.disk_refusals.inc()
        if e.free_bytes < 0:
            self.disk.note_enospc(str(e))
            return self.disk.error()
        return e
