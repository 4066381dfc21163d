"""Log shipping between the members of a group: the master's side of a fetch (fencing,
divergence and retention checks, the long poll) and the slave's follower loop (fetch,
truncate when told, CRC-checked append, fsync, ask for the next offset: the
acknowledgement). ``LogShipping`` is a mixin of the replicated nodes beside
``ReplicaRoles`` (node/replication/roles.py); the node says which log a name means
(``_log``) and what to do with what an answer carries (``_on_truncate``, ``_on_data``,
``_on_answer``, ``_on_reset``). The pure rules (``answer_fetch``, ``take_answer``,
``truncate_allowed``) are in node/replication/core.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from cluster import errors as E
from cluster import status
from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from node.aio import finish_then_cancel, wait_event, within
from node.replication.core import EpochHistory, answer_fetch, take_answer, truncate_allowed

log = logging.getLogger("hourglass.replication")

REST_AFTER_S = 1.0  # a master is at rest this long after its last change for the slaves (docs/replication.md "At rest")


class LogShipping:
    def _caught_up(self, master_end: int, own_end: int) -> None:
        self.lag_bytes = max(0, master_end - own_end)
        if self.lag_bytes == 0:
            self._caught_up_at = time.monotonic()


    # ------------------------------------------------------------------ master side of a fetch

    async def _fetch_preamble(self, req, context, logs: dict) -> tuple[dict, pb.FetchResponse | None]:
        """Fencing, divergence and retention checks every fetch goes through. Returns the
        fields every answer carries and, when the slave must first truncate or reset, that
        answer (the caller yields it and goes on with the next request)."""
        await self._refuse_newer_term(req.epoch, context)  # believed only once the election confirms it
        if req.log not in logs:
            await status.abort(context, E.InvalidArgument("log", f"unknown log {req.log!r}"))
        lg = logs[req.log]
        hist = self.histories[req.log].history
        try:
            theirs = EpochHistory.decode(req.history or "[]")
        except (ValueError, TypeError) as e:
            await status.abort(context, E.InvalidArgument("history", f"bad history: {e}"))
        base = dict(epoch=self.member.epoch, offset=req.offset, end_offset=lg.end_offset, truncate_to=-1,
                    reset_to=-1, history=json.dumps(hist.entries))
        ans = answer_fetch(serving=self.is_master(), my_epoch=self.member.epoch, req_epoch=req.epoch, theirs=theirs,
                           offset=req.offset, mine=hist, start=lg.start_offset, end=lg.end_offset)
        if ans.kind == "not_master":
            await self._not_master(context)
        if ans.kind == "truncate":
            return base, pb.FetchResponse(**dict(base, truncate_to=ans.to))
        if ans.kind == "reset":
            return base, pb.FetchResponse(**dict(base, reset_to=ans.to))
        self.slave_offsets.setdefault(req.node_id, {})[req.log] = req.offset
        return base, None

    async def _wait_for_change(self, req, lg, idle: bool = True) -> None:
        """Long poll of a caught-up slave, at most ``_poll_cap_ms()``: ``replication_wait_ms``
        (the tick-state period), or ``replication_idle_wait_ms`` while the master is at rest
        (a subclass's rule; then anything new sets ``_changed`` at once)."""
        if req.offset >= lg.end_offset and req.wait_ms and idle:
            self._changed.clear()
            cap = self._poll_cap_ms()
            at_rest = cap > self.settings.replication.wait_ms
            self._idle_polls += at_rest
            try:
                await wait_event(self._changed, (cap if at_rest else min(req.wait_ms, cap)) / 1000)
            except TimeoutError:
                pass
            finally:
                self._idle_polls -= at_rest

    def _poll_cap_ms(self) -> int:
        """How long a caught-up slave's fetch may wait for something new."""
        return self.settings.replication.wait_ms

    def _fetch_request(self, name: str, lg) -> pb.FetchRequest:
        return pb.FetchRequest(node_id=self.settings.server.node_id, epoch=self.member.epoch, log=name,
                               offset=lg.end_offset,
                               max_bytes=self.settings.replication.chunk_bytes,
                               wait_ms=self.settings.replication.wait_ms,
                               history=self.histories[name].history.encode())

    # ------------------------------------------------------------------ slave side

    def _log(self, name: str):
        """The SegmentedLog replicated as ``name`` (the store may have been reopened)."""
        raise NotImplementedError

    def _on_truncate(self, name: str, cut: int) -> None:
        raise NotImplementedError

    def _may_truncate(self, name: str, cut: int, master: str) -> bool:
        """A master asks this slave to cut ``name`` at ``cut``: refused (False: the stream is
        dropped and retried) when that would remove bytes a master told this slave were
        acknowledged. Only a member holding every acknowledged record can be elected, so a
        master that asks for that is wrong: nothing is cut, the refusal is logged and counted
        (``hourglass_truncations_refused``), and this slave stays out of the in-sync set."""
        acked = self.acked_known.get(name, -1)
        if truncate_allowed(cut, acked):
            return True
        self.metrics.truncations_refused.inc()
        log.error("refusing to truncate %s to %d from master %s: bytes up to %d were acknowledged "
                  "(docs/replication.md, Truncation never removes acknowledged records)", name, cut, master, acked)
        return False

    def _note_acked(self, name: str, acked: int) -> None:
        """A master says the group holds ``name`` up to ``acked`` (its acknowledged point)."""
        if acked > self.acked_known.get(name, -1):
            self.acked_known[name] = acked
            self.histories[name].note_acked(acked)

    def _on_reset(self, name: str, offset: int) -> None:
        raise E.StorageError(f"the master no longer holds the bytes this replica of {name} needs (it starts at "
                             f"{offset}): rebuild this replica from an empty data folder")

    def _before_data(self, name: str, resp: pb.FetchResponse) -> None:
        """An answer carrying bytes of ``name``, before they are appended."""

    async def _on_data(self, name: str) -> None:
        """Replicated bytes of ``name`` were appended and fsynced."""

    def _on_answer(self, name: str, resp: pb.FetchResponse) -> None:
        """Whatever else an answer carries (tick state, group documents)."""

    async def _follow(self, name: str) -> None:
        """Fetch ``name`` from the master over one stream: truncate when told, append CRC-checked
        whole records, fsync, then ask for the next offset (the acknowledgement)."""
        backoff = 0.05
        while True:
            addr = self.member.leader_address
            if not addr or self.member.leader == self.settings.server.node_id:
                await asyncio.sleep(0.05)
                continue
            call = rpc.ReplicationStub(self.channels.get(addr)).Replicate()
            try:
                while True:
                    lg = self._log(name)
                    await call.write(self._fetch_request(name, lg))
                    resp = await within(call.read(), 10)
                    if resp is grpc.aio.EOF or not take_answer(
                            my_epoch=self.member.epoch, answer_epoch=resp.epoch, from_leader=addr == self.member.leader_address,
                            acting_master=self.is_master()):
                        break
                    self.member.epoch = max(self.member.epoch, resp.epoch)
                    if resp.truncate_to >= 0:
                        if not self._may_truncate(name, resp.truncate_to, addr):
                            break
                        self._on_truncate(name, resp.truncate_to)
                        self.histories[name].truncate(resp.truncate_to)
                        continue
                    if resp.reset_to >= 0:
                        self._on_reset(name, resp.reset_to)
                        continue
                    if resp.data:
                        # the history first: bytes of a term never sit in this log under an older
                        # term's entry (a promotion between the two steps would begin its own term
                        # after bytes it attributes to the wrong one, and a later divergence check
                        # would cut records both members hold)
                        self.histories[name].adopt(resp.history, resp.offset + len(resp.data))
                        self._before_data(name, resp)
                        lg.append_raw(resp.offset, resp.data)  # checks every record's CRC
                        await finish_then_cancel(asyncio.to_thread(lg.flush))
                        await self._on_data(name)
                    else:
                        self.histories[name].adopt(resp.history, lg.end_offset)
                    self._on_answer(name, resp)
                    self._refusals = 0
                    backoff = 0.05
            except (grpc.RpcError, TimeoutError, E.HourglassError, asyncio.InvalidStateError) as e:
                # InvalidStateError: the stream ended (the master died) between a read and the next write
                log.info("replication of %s from %s interrupted: %s", name, addr, e)
                if isinstance(e, grpc.RpcError):
                    await self._master_refused(addr, e)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                call.cancel()

    def _master_history_begins(self, ends: dict[str, int]) -> None:
        for name, end in ends.items():
            self.histories[name].clamp(end)
            self.histories[name].history.begin(self.member.epoch, end)
            self.histories[name].save()

    async def _master_refused(self, addr: str, err: grpc.RpcError) -> None:
        """A fetch failed: when the master's port refuses connections ``dead_master_refusals``
        times in a row (no process listens: killed, not paused), ask the meta server to end
        its term now (it checks the port itself) instead of waiting out the lease."""
        details = (err.details() or "") if hasattr(err, "details") else ""
        if "refused" not in details.lower():
            self._refusals = 0
            return
        self._refusals += 1
        epoch = self.member.epoch
        if self._refusals < self.settings.replication.dead_master_refusals or self._reported_dead == epoch:
            return
        self._reported_dead = epoch
        try:
            r = await self.registrar.meta.call("ReportDead", mpb.ReportDeadRequest(
                role=self.ROLE, group=self.settings.server.group, epoch=epoch, reporter=self.settings.server.node_id))
            log.warning("reported master %s of epoch %d dead: %s", addr, epoch, "term ended" if r.ended else r.reason)
        except E.HourglassError as e:
            log.info("dead-master report failed: %s", e)
