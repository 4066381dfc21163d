"""Repair of a corrupt sealed segment from a replica of the same group.

A slave's message and dispatch logs are byte-identical to its master's (``append_raw``
splits segments exactly as the master did), so a sealed segment the scrub finds corrupt on
one member can be replaced by the same segment of another. ``SegmentRepair`` is a mixin of
``ReplicatedDelayNode`` and ``ReplicatedRealtimeNode`` (its message log only):

* ``ReadLog`` (Replication service, any role): raw framed bytes of ``messages`` or
  ``dispatch`` from an offset, at most ``replication_chunk_bytes`` (``read_bytes``: whole
  records, never crossing a segment);
* ``repair_segment(kind, base, err)`` (the scrub's ``repair`` hook): asks the other members of
  the group (from the meta server), one after the other, for the segment's bytes, checks
  them (exact size, every frame's CRCs) and swaps them in (``SegmentedLog.replace_sealed``).
  Bounded: ``REPAIR_TIMEOUT_S`` per member, every answer must bring bytes.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from cluster.errors import CorruptRecord, HourglassError
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb

log = logging.getLogger("hourglass.replication.repair")

REPAIR_TIMEOUT_S = 60.0   # fetching one segment from one member
LOG_NAMES = ("messages", "dispatch")


class SegmentRepair:
    REPAIR_LOGS = LOG_NAMES  # the logs a member may be asked for (a real-time group: messages only)

    async def ReadLog(self, request: pb.ReadLogRequest, context) -> pb.ReadLogResponse:
        if request.log not in self.REPAIR_LOGS:
            return pb.ReadLogResponse(error=f"unknown log {request.log!r}")
        if self.mode == "switching":  # a worker thread promotes or opens the store now: ask again
            return pb.ReadLogResponse(error="switching roles; ask again")
        lg = self._log(request.log)
        try:
            data = lg.read_bytes(request.offset, min(request.max_bytes or (1 << 20),
                                                     self.settings.replication.chunk_bytes))
        except HourglassError as e:  # out of range here, or corrupt here too
            return pb.ReadLogResponse(error=str(e))
        return pb.ReadLogResponse(data=data)

    async def _member_addresses(self) -> list[str]:
        resp = await self.registrar.meta.call("GetServers", mpb.GetServersRequest(kind=self.DISCOVERY_KIND,
                                                                                   include_draining=True))
        return [m.address for g in resp.groups if g.name == self.settings.server.group for m in g.members
                if m.node_id != self.settings.server.node_id and m.address]

    async def _fetch_segment(self, address: str, kind: str, base: int, size: int) -> bytes:
        stub = rpc.ReplicationStub(self.channels.get(address))
        parts: list[bytes] = []
        got = 0
        async with asyncio.timeout(REPAIR_TIMEOUT_S):
            while got < size:
                chunk = min(size - got, self.settings.replication.chunk_bytes)
                r = await stub.ReadLog(pb.ReadLogRequest(log=kind, offset=base + got, max_bytes=chunk),
                                       timeout=10)
                if r.error or not r.data:
                    raise CorruptRecord(address, base + got, r.error or "no bytes in the answer")
                parts.append(r.data)
                got += len(r.data)
        return b"".join(parts)

    async def repair_segment(self, kind: str, base: int, err: CorruptRecord) -> bool:
        """Replace the sealed segment ``base`` of log ``kind`` by a member's copy; True when done."""
        if self.registrar is None:
            return False
        lg = self._log(kind)
        bases = lg.segment_bases()
        if base not in bases[:-1]:
            return False  # deleted by retention meanwhile, or not sealed
        size = bases[bases.index(base) + 1] - base
        try:
            members = await self._member_addresses()
        except (grpc.RpcError, HourglassError) as e:
            log.error("segment repair: cannot list the group's members kind=%s offset=%d: %s", kind, base, e)
            return False
        for address in members:
            try:
                data = await self._fetch_segment(address, kind, base, size)
                if self.mode == "switching" or lg is not self._log(kind) or base not in lg.segment_bases()[:-1]:
                    return False  # a role switch, or the segment deleted, while we fetched
                lg.replace_sealed(base, data)
            except (grpc.RpcError, HourglassError, TimeoutError) as e:
                log.warning("segment repair from %s failed kind=%s offset=%d: %s", address, kind, base, e)
                continue
            log.warning("segment repaired from %s kind=%s offset=%d bytes=%d (was: %s)", address, kind, base, size,
                        err.reason)
            return True
        return False
