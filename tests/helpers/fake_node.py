"""An in-process fake v2 node for SDK tests and the SDK micro-benchmark: the ``Producer``
and ``Consumer`` services of ``hourglass.proto`` v2 on a grpc.aio server on 127.0.0.1,
with in-memory behaviour and knobs to script answers. It speaks the wire exactly as
the real nodes do (``cluster.wire``, ``cluster.codec``); what it stores is a dict.

Producer side:

* ``SendBatch`` resolves due times (``wire.request_batch``), stores each id once (a
  re-send of a stored id answers ``duplicate`` with the first seq) and records each
  request in ``requests`` (ids, subjects, delay column given, immediate);
* ``script[id]``: codes to answer for that id, one per request that carries it (then
  OK), e.g. ``[OVERLOADED]`` refuses it once, retryably; ``fail_rpc``: gRPC status
  codes to fail whole calls with, one per call; ``disk_full``: refuse every ``SendBatch`` (whole
  call, RESOURCE_EXHAUSTED with the ``DiskFull`` metadata a real node sends) and ``Cancel``
  (per-message OVERLOADED "disk full: ...") as a node whose disk is full does, counted in
  ``disk_full_refusals``;
* ``sink=True`` (benchmarks): answer OK with fresh seqs, store nothing;
* ``Lookup``/``Cancel`` answer from ``stored`` (``pending`` / ``cancelled``, NOT_FOUND for
  an unknown id); ``stall``: every call (``Pull`` too) waits (up to ``RUN_S_MAX``) and
  never answers, as a node that accepted the connection but hangs.

Consumer side:

* ``ready(subject, ids, payloads, ...)`` makes messages deliverable; ``Pull`` hands up
  to ``max_messages`` of the requested subjects (``subject`` and/or ``subjects``) as
  one codec batch with a handle per message (one counter per node), long-polling up
  to ``wait_ms`` when nothing is ready; ``pulls`` records each request's subjects,
  ``pull_waiting`` is set while a pull waits, ``pulls_cancelled`` counts pulls the
  client cancelled (``pull_cancelled`` is set at the first);
* ``Ack``/``Nack`` record ``(subject, handles)`` in ``acked`` / ``nacked`` (and how
  many ranges each ack carried in ``ack_ranges``);
* ``endless`` (benchmarks): a codec batch body every Pull answers with, forever.

Run alone (the micro-benchmark runs it in its own process so that the SDK's CPU is
measured apart): ``python -m tests.helpers.fake_node PORT_FILE [--endless N]``.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from dataclasses import dataclass, field

import grpc
import numpy as np

from cluster import errors as E
from cluster import status
from cluster.codec import Batch, encode_extra
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.transport import CHANNEL_OPTIONS
from cluster.wire import BatchResult, expand_ranges, request_batch, serve_ordered, unpack_ranges

RUN_S_MAX = 3600.0  # a standalone fake stops after this long whatever happens


def now_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


@dataclass
class SendRecord:
    ids: list[str]
    subjects: list[str]
    delay_given: bool
    immediate: bool
    request_bytes: int = 0  # the serialized SendBatchRequest


@dataclass
class FakeNode:
    sink: bool = False
    endless: bytes | None = None
    script: dict[str, list[int]] = field(default_factory=dict)
    fail_rpc: list[grpc.StatusCode] = field(default_factory=list)
    fail_error: list[E.HourglassError] = field(default_factory=list)  # SendBatch: end calls with these, one each
    requests: list[SendRecord] = field(default_factory=list)
    stored: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (seq, deliver_at_ms)
    pulls: list[list[str]] = field(default_factory=list)
    lookaheads: list[int] = field(default_factory=list)  # each pull's lookahead_ms
    acked: list[tuple[str, list[int]]] = field(default_factory=list)
    ack_ranges: list[int] = field(default_factory=list)  # [lo, hi) ranges per SubjectHandles acked
    acks_on_pull: int = 0  # pulls that carried acks
    nacked: list[tuple[str, list[int], int]] = field(default_factory=list)
    pulls_cancelled: int = 0
    stall: bool = False
    streams: bool = True  # serves PullStream and SendBatchStream (False: a node of an older version, unary calls only)
    cancelled: set[str] = field(default_factory=set)
    disk_full: bool = False
    disk_full_refusals: int = 0
    free_bytes: int = 999_424  # what a refusal says is left

    def __post_init__(self) -> None:
        self.address = ""
        self.seq_next = 1
        self.handle_next = 1
        self._ready: dict[str, deque[tuple[Batch, int]]] = {}  # subject -> (one-message batch, handle)
        self._arrived = asyncio.Event()
        self.pull_waiting = asyncio.Event()
        self.pull_cancelled = asyncio.Event()
        self._server: grpc.aio.Server | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> "FakeNode":
        self._server = grpc.aio.server(options=CHANNEL_OPTIONS)
        rpc.add_ProducerServicer_to_server(_Producer(self), self._server)
        rpc.add_ConsumerServicer_to_server(_Consumer(self), self._server)
        port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)

    # ------------------------------------------------------------------ test helpers

    def ready(self, subject: str, ids: list[str], payloads: list[bytes] | None = None, *,
              deliver_at_ms: int | None = None, tags: list[tuple[str, ...]] | None = None,
              properties: list[dict[str, str]] | None = None) -> list[int]:
        """Make messages deliverable on ``subject``; returns their handles."""
        payloads = payloads or [i.encode() for i in ids]
        extras = None
        if tags or properties:
            extras = [encode_extra((tags or [()] * len(ids))[k], (properties or [{}] * len(ids))[k])
                      for k in range(len(ids))]
        due = now_ms() if deliver_at_ms is None else deliver_at_ms
        b = Batch.build(subject, payloads, ids, np.full(len(ids), due, np.int64), extras=extras)
        q = self._ready.setdefault(subject, deque())
        handles = []
        for k in range(b.n):
            q.append((b.take(np.array([k])), self.handle_next))
            handles.append(self.handle_next)
            self.handle_next += 1
        self._arrived.set()
        return handles

    def acked_handles(self) -> set[tuple[str, int]]:
        return {(s, h) for s, hs in self.acked for h in hs}

    # ------------------------------------------------------------------ behaviour

    def send_batch(self, req: pb.SendBatchRequest) -> pb.SendBatchResponse:
        b = request_batch(req, now_ms=now_ms(), immediate=req.immediate)
        res = BatchResult.sized(b.n)
        if self.sink:
            res.seqs[:] = np.arange(self.seq_next, self.seq_next + b.n, dtype=np.uint64)
            self.seq_next += b.n
            res.deliver_at_ms[:] = b.deliver_at_ms
            return res.to_pb()
        ids = b.id_list()
        self.requests.append(SendRecord(ids, b.subject_list(), bool(req.delay_ms), req.immediate, req.ByteSize()))
        codes, reasons = b.validate(now_ms=now_ms())
        due = b.deliver_at_ms.tolist()
        for i, mid in enumerate(ids):
            scripted = self.script.get(mid)
            if scripted:
                code = scripted.pop(0)
                if code != pb.OK:
                    res.refuse(i, code, f"scripted {pb.Code.Name(code)}")
                    continue
            if codes[i] != pb.OK:
                res.refuse(i, int(codes[i]), reasons[i])
                continue
            if mid in self.stored:
                res.seqs[i], res.deliver_at_ms[i] = self.stored[mid]
                res.duplicates[i] = 1
                continue
            self.stored[mid] = (self.seq_next, due[i])
            res.seqs[i], res.deliver_at_ms[i] = self.seq_next, due[i]
            self.seq_next += 1
        return res.to_pb()

    def take(self, subjects: list[str], max_messages: int) -> pb.PullResponse:
        picked: list[tuple[Batch, int]] = []
        for s in subjects:
            q = self._ready.get(s)
            while q and len(picked) < max_messages:
                picked.append(q.popleft())
        if not picked:
            return pb.PullResponse()
        batch = Batch.concat([b for b, _ in picked])
        return pb.PullResponse(batch=batch.encode(), handles=np.array([h for _, h in picked], "<u8").tobytes())

    async def pull(self, req: pb.PullRequest) -> pb.PullResponse:
        if self.endless is not None:
            n = int.from_bytes(self.endless[4:8], "little")
            h = np.arange(self.handle_next, self.handle_next + n, dtype="<u8")
            self.handle_next += n
            return pb.PullResponse(batch=self.endless, handles=h.tobytes())
        subjects = ([req.subject] if req.subject else []) + list(req.subjects)
        self.pulls.append(subjects)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.wait_ms / 1000
        while True:
            resp = self.take(subjects, req.max_messages or 1)
            left = deadline - loop.time()
            if resp.batch or left <= 0:
                return resp
            self._arrived.clear()
            self.pull_waiting.set()
            try:
                async with asyncio.timeout(left):
                    await self._arrived.wait()
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                self.pulls_cancelled += 1
                self.pull_cancelled.set()
                raise
            finally:
                self.pull_waiting.clear()


class _Producer(rpc.ProducerServicer):
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    def _disk_full(self) -> E.DiskFull:
        self.node.disk_full_refusals += 1
        return E.DiskFull(f"node {self.node.address} has {self.node.free_bytes} bytes free on its data disk (fake)",
                          self.node.address, self.node.free_bytes)

    async def SendBatch(self, request, context):
        await self._maybe_stall()
        if self.node.disk_full:
            await status.abort(context, self._disk_full())
        if self.node.fail_rpc:
            await context.abort(self.node.fail_rpc.pop(0), "scripted failure")
        if self.node.fail_error:
            await status.abort(context, self.node.fail_error.pop(0))
        return self.node.send_batch(request)

    async def SendBatchStream(self, requests, context):
        if not self.node.streams:  # a node of an older version: no SendBatchStream (UNIMPLEMENTED)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        async for resp in serve_ordered(requests, context, self.SendBatch, pb.SendBatchResponse, window=8):
            yield resp

    async def Lookup(self, request, context):
        await self._maybe_stall()
        if request.id not in self.node.stored:
            return pb.LookupResponse(code=pb.NOT_FOUND, error=f"no message {request.id!r}")
        seq, due = self.node.stored[request.id]
        return pb.LookupResponse(code=pb.OK, status="cancelled" if request.id in self.node.cancelled else "pending",
                                 seq=seq, deliver_at_ms=due)

    async def Cancel(self, request, context):
        await self._maybe_stall()
        if request.id not in self.node.stored:
            return pb.CancelResponse(code=pb.NOT_FOUND, error=f"no message {request.id!r}")
        if self.node.disk_full:
            err = self._disk_full()
            return pb.CancelResponse(code=status.to_code(err), error=str(err))
        self.node.cancelled.add(request.id)
        return pb.CancelResponse(code=pb.OK, seq=self.node.stored[request.id][0])

    async def _maybe_stall(self) -> None:
        if self.node.stall:
            await asyncio.sleep(RUN_S_MAX)


class _Consumer(rpc.ConsumerServicer):
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    async def Pull(self, request, context):
        if self.node.stall:
            await asyncio.sleep(RUN_S_MAX)
        if request.acks:  # acks riding on a pull are recorded like an Ack's
            self._record_acks(request.acks)
            self.node.acks_on_pull += 1
        self.node.lookaheads.append(request.lookahead_ms)
        return await self.node.pull(request)

    async def PullStream(self, requests, context):
        if not self.node.streams:  # a node of an older version: no PullStream (UNIMPLEMENTED)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        async for resp in serve_ordered(requests, context, self.Pull, pb.PullResponse, window=1):
            yield resp

    async def Ack(self, request, context):
        return pb.AckResponse(acked=self._record_acks(request.acks))

    def _record_acks(self, acks) -> int:
        n = 0
        for sh in acks:
            hs = expand_ranges(unpack_ranges(sh.ranges)).tolist()
            if self.node.endless is None:
                self.node.acked.append((sh.subject, hs))
                self.node.ack_ranges.append(len(sh.ranges) // 16)
            n += len(hs)
        return n

    async def Nack(self, request, context):
        n = 0
        for sh in request.nacks:
            hs = expand_ranges(unpack_ranges(sh.ranges)).tolist()
            self.node.nacked.append((sh.subject, hs, request.retry_after_ms))
            n += len(hs)
        return pb.NackResponse(retried=n)


def endless_batch(n: int, subjects: list[str], payload_bytes: int = 256) -> bytes:
    """A codec batch body of n messages over ``subjects`` (for ``FakeNode.endless``)."""
    ids = [f"bench-{i:08d}" for i in range(n)]
    subs = [subjects[i % len(subjects)] for i in range(n)]
    return Batch.build(subs, [bytes(payload_bytes)] * n, ids, np.full(n, now_ms(), np.int64)).encode()


async def _serve(port_file: str, endless_n: int) -> None:
    node = FakeNode(sink=True, endless=endless_batch(endless_n, [f"bench.s{i}" for i in range(16)])
                    if endless_n else None)
    await node.start()
    with open(port_file, "w") as f:
        f.write(node.address)
    await asyncio.sleep(RUN_S_MAX)


if __name__ == "__main__":
    # python -m tests.helpers.fake_node PORT_FILE [ENDLESS_N]
    asyncio.run(_serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
