"""A real-time node in a replicated group: master or slave, chosen by election.

Same rules (``node/replication/core.py``) and the same shape as ``ReplicatedDelayNode``:

* **role loop** - role ``realtime``, group ``settings.server.group``: watch the leader through the
  meta server, campaign with the registration lease when the seat is empty (most
  caught-up slave first), act as master only while the lease is surely alive (``Member``).
* **master** - the plain ``RealtimeNode`` (SendBatch, Pull, Ack, Nack) plus ``Replicate``
  for the one log ``messages``. Each ``FetchResponse`` also carries, in ``checkpoint``,
  ``{"groups": [doc, ...]}``: the consumer-group documents written since the previous
  answer on that stream (the first answers of a stream carry all of them, paged). The
  docs are exactly what ``RealtimeStore`` commits to its offsets log (``groups/``).
  Every group commit has a store-local seq (``RealtimeStore.group_seq``); a slave's next
  request on a stream acknowledges everything the previous answer carried. It also carries
  ``"subjects": [[name, owner], ...]``, the subjects created since the previous answer (all
  of them first, paged by ``SUBJECT_OWNERS_MAX``), so a promoted slave counts each
  principal's subjects as its master did (``RealtimeStore.adopt_owners``; the slave also
  creates a subject when its first frame arrives, as replay does).
* **sync ack mode** - SendBatch answers once every slave holds the bytes (byte offset,
  ``SyncTracker``); Ack (and Nack) answers once every slave holds the group document that
  records it (group seq, a second ``SyncTracker``). No live slave, or a timeout: the
  caller gets ``REPLICATION_TIMEOUT``, never a silent downgrade.
* **slave** - CRC-checked ``append_raw`` of the master's frames, byte for byte (each frame
  one codec batch), fsync, ``index_appended`` (one index run per subject of each frame
  and the dedup map, as the store's own replay does), then the shipped group documents
  are committed (one offsets-log record and one fsync per answer); then the next fetch
  (the acknowledgement). Pull/Ack/Nack/SendBatch answer
  ``UNAVAILABLE "not the master; leader_hint=..."``: clients re-resolve the subject's
  route through the meta server, which names the group's elected master.
* **promotion / demotion** - close the store and reopen it: the epoch goes above every
  seq in the log, groups load from the replicated offsets log (in-flight handles redelivered at
  once: at-least-once), the dedup map is rebuilt from the log. A returning old master
  truncates the suffix the new master never had (``truncate_log``: log, index entries
  past the cut, dedup entries).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from cluster.proto import hourglass_pb2 as pb
from cluster.proto import hourglass_pb2_grpc as rpc
from cluster.proto import meta_pb2 as mpb
from node.realtime.service import RealtimeNode
from node.realtime.store import RealtimeStore
from node.replication.core import SyncTracker
from node.replication.history import HistoryFile
from node.replication.repair import SegmentRepair
from node.replication.roles import ReplicaRoles, mono_ms
from node.replication.shipping import REST_AFTER_S, LogShipping
from node.store.retention import slave_holds

log = logging.getLogger("hourglass.replication.realtime")

LOG = "messages"
GROUP_DOCS_BYTES_MAX = 512 * 1024   # group documents one FetchResponse carries (the rest follow)
SUBJECT_OWNERS_MAX = 2000           # (subject, owner) pairs one FetchResponse carries (the rest follow)
ROLE = "realtime"


class ReplicatedRealtimeNode(ReplicaRoles, LogShipping, SegmentRepair, RealtimeNode, rpc.ReplicationServicer):
    ROLE = ROLE
    DISCOVERY_KIND = mpb.CONSUMER

    def __init__(self, settings, **kw) -> None:
        super().__init__(settings, **kw)
        self._init_replica(settings, {LOG: HistoryFile(Path(settings.server.data_dir) / f"{LOG}.epochs")})
        self.history = self.histories[LOG]
        sync_ms = settings.replication.sync_timeout_ms
        self.tracker = SyncTracker(timeout_ms=sync_ms)    # message-log bytes
        self.gtracker = SyncTracker(timeout_ms=sync_ms)   # group documents (store group_seq)
        self.scrubber.repair = self.repair_segment  # a corrupt sealed segment: fetched again from a member
        self.server = None
        self._handing_over = False
        self._active_at = time.monotonic()  # last append or group move shipped to the slaves (_poll_cap_ms)

    # ------------------------------------------------------------------ hooks of ReplicaRoles

    def _trackers(self) -> dict[str, SyncTracker]:
        return {"bytes": self.tracker, "groups": self.gtracker}

    def _role_log_end(self) -> int:
        return self.store.messages.end_offset

    def _grpc_services(self) -> dict:
        return {"producer": self, "consumer": self, "admin": self}

    async def _close_clients(self) -> None:
        if self.resolver is not None:
            await self.resolver.close()

    REPAIR_LOGS = (LOG,)

    def _log(self, name: str):
        return self.store.messages

    def _may_serve(self) -> bool:
        """Clients are served by the master, except while it hands over (it still serves Replicate)."""
        return self.is_master() and not self._handing_over

    def stats(self) -> dict:
        s = super().stats()
        s["group_seq"] = self.store.group_seq
        return s

    # ------------------------------------------------------------------ at rest (issue 28)

    def _wake_slaves(self) -> None:
        """Something for the slaves (bytes appended, group positions moved, a handover): the
        waiting polls are answered at once, and the master is not at rest for a while."""
        self._active_at = time.monotonic()
        self._changed.set()

    def _poll_cap_ms(self) -> int:
        """``replication_idle_wait_ms`` (1 s) once nothing was appended and no group moved for
        ``REST_AFTER_S`` (docs/replication.md, "At rest"), else ``replication_wait_ms``. What
        ends the rest wakes the polls at once (``_wake_slaves``), so bytes and group documents
        never wait for the longer cap."""
        s = self.settings
        if time.monotonic() - self._active_at < REST_AFTER_S:
            return s.replication.wait_ms
        return max(s.replication.wait_ms, s.replication.idle_wait_ms)

    # ------------------------------------------------------------------ client API (master only)

    async def SendBatch(self, request, context):
        batch, now = await self._authorized_batch(request, context)  # who may, before who is master
        await self._serving(context, request.epoch)
        term, tracker = self._term(), self.tracker
        resp = await self._store_batch(batch, now, request.immediate, context)
        self._wake_slaves()
        # within one term a master never truncates: the end now covers this write
        await self._confirm_ack(term, tracker, "bytes", self.store.messages.end_offset, context)
        return resp

    async def Ack(self, request, context):
        term = self._term()
        resp = await super().Ack(request, context)  # the group documents are committed before this returns
        if self._term_over(term):  # a role switch meanwhile: its slaves' acknowledgements are another term's
            await self._term_ended(context)
        await self._groups_replicated([(sh.subject, request.group) for sh in request.acks], context)
        return resp

    async def Nack(self, request, context):
        term = self._term()
        resp = await super().Nack(request, context)
        if self._term_over(term):
            await self._term_ended(context)
        if self.settings.replication.ack_mode == "sync":
            await self._wait(self.tracker, "bytes", self.store.messages.end_offset, context)  # dead letters
        await self._groups_replicated([(sh.subject, request.group) for sh in request.nacks], context)
        return resp

    async def _groups_replicated(self, keys: list[tuple[str, str]], context) -> None:
        """Sync mode: answer once every slave holds the newest written document of these groups."""
        self._wake_slaves()
        if self.settings.replication.ack_mode == "sync":
            seq = max((self.store.group_written_seq(s, g) for s, g in keys), default=0)
            if seq:
                await self._wait(self.gtracker, "groups", seq, context)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.delay.checkpoint_interval_ms / 1000)
            seq = self.store.group_seq
            await self._flush_once(at_rest_skip=True)
            if self.store.group_seq != seq:
                self._wake_slaves()  # pulls moved group positions: ship them

    # ------------------------------------------------------------------ master side of replication

    async def Replicate(self, request_iterator, context):
        store: RealtimeStore | None = None
        sent_seq, backlog, complete, sent_subjects = -1, [], None, 0
        async for req in request_iterator:
            if self.store is not store:  # (re)opened: group seqs start again, send every document
                store, sent_seq, backlog, complete, sent_subjects = self.store, -1, [], None, 0
            base, early = await self._fetch_preamble(req, context, {LOG: store.messages})
            if early is not None:
                yield early
                continue
            lg = store.messages
            now = mono_ms()
            self._release("bytes", self.tracker.on_fetch(req.node_id, req.offset, now))
            if complete is not None:  # this request says the previous answer's documents are written
                self._release("groups", self.gtracker.on_fetch(req.node_id, complete, now))
            await self._wait_for_change(req, lg, idle=not backlog and store.group_seq == sent_seq
                                        and sent_subjects == len(store.subject_order))
            if self.store is not store:
                await self._not_master(context)
            # subjects and their owners first (a subject is created before its first frame is appended)
            owners = store.subject_owners(sent_subjects, SUBJECT_OWNERS_MAX)
            sent_subjects += len(owners)
            data = b""
            if req.offset < lg.end_offset:
                data = lg.read_bytes(req.offset, min(req.max_bytes or (1 << 20), self.settings.replication.chunk_bytes))
            upto = store.group_seq
            keys = backlog + [k for k in store.changed_groups(sent_seq) if k not in set(backlog)]
            docs, size, backlog = [], 0, []
            for i, k in enumerate(keys):
                doc = store.group_doc(*k)
                if doc is None:
                    continue
                text = json.dumps(doc)
                if docs and size + len(text) > GROUP_DOCS_BYTES_MAX:
                    backlog = keys[i:]
                    break
                docs.append(text)
                size += len(text)
            sent_seq, complete = upto, (upto if not backlog else None)
            doc = {}
            if docs:
                doc["groups"] = "[" + ", ".join(docs) + "]"
            if owners:
                doc["subjects"] = json.dumps(owners)
            yield pb.FetchResponse(**dict(base, end_offset=lg.end_offset, data=data,
                                          checkpoint="{" + ", ".join(f'"{k}": {v}' for k, v in doc.items()) + "}"
                                          if doc else ""))

    # ------------------------------------------------------------------ slave side

    def _on_truncate(self, name: str, cut: int) -> None:
        self.store.truncate_log(cut)

    async def _on_data(self, name: str) -> None:
        self.store.index_appended(now_ms=self.clock.now_ms())

    def _on_answer(self, name: str, resp: pb.FetchResponse) -> None:
        if resp.checkpoint:  # one fsynced offsets record, acknowledged by the next fetch
            doc = json.loads(resp.checkpoint)
            if doc.get("subjects"):  # who created which subject: the quotas count it after a promotion
                self.store.adopt_owners([(s, o) for s, o in doc["subjects"]], now_ms=self.clock.now_ms())
            self.store.apply_group_docs(doc.get("groups", []))
        self._caught_up(resp.end_offset, self.store.messages.end_offset)

    def _retention_slave_holds(self) -> dict[str, int] | None:
        """A master keeps message-log segments until every registered slave fetched them (a
        master that has not read its group's members yet keeps everything); a slave deletes
        by its own groups (the master's documents) and holds for nobody."""
        if self.mode != "master":
            return None
        return slave_holds(sorted(self._peers), self.slave_offsets, LOG, known=self._peers_read)

    # ------------------------------------------------------------------ roles

    def _master_tasks(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self.committer.run(self.metrics.observe_commit), name="group-commit")
        tg.create_task(self.creator.run(), name="subjects")
        tg.create_task(self._flush_loop(), name="flush")
        tg.create_task(self._sync_expiry_loop(), name="sync-expiry")
        tg.create_task(self._disk_loop(), name="disk")
        tg.create_task(self._retention_loop(), name="retention")

    def _slave_tasks(self, tg: asyncio.TaskGroup) -> None:
        tg.create_task(self._follow(LOG), name="follow")
        tg.create_task(self._flush_loop(), name="flush")
        tg.create_task(self._retention_loop(), name="retention")

    def _role_store(self, mode: str, store: RealtimeStore, now_ms: int, store_epoch: int) -> RealtimeStore:
        """Both ways the store is closed and opened again (on a worker thread: ``_switch``)."""
        store.close()
        return RealtimeStore.open(self.settings.server.data_dir, self.settings.realtime_settings(), now_ms=now_ms)

    def _recover_store(self, store: RealtimeStore, now_ms: int) -> RealtimeStore:
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - the half-opened store is dropped either way
            log.warning("closing a store after a failed promotion: %r", e)
        return RealtimeStore.open(self.settings.server.data_dir, self.settings.realtime_settings(), now_ms=now_ms)

    def _role_began(self, mode: str) -> None:
        self.creator.quotas = self._new_quotas()  # what this store's journal says each principal owns
        for waiting in self._new_data.values():
            for ev in waiting:
                ev.set()  # long polls re-check (and answer NOT_LEADER on a slave)
        self._new_data.clear()
        if mode == "master":
            self._master_history_begins({LOG: self.store.messages.end_offset})
            self.tracker = SyncTracker(timeout_ms=self.settings.replication.sync_timeout_ms)
            self.gtracker = SyncTracker(timeout_ms=self.settings.replication.sync_timeout_ms)
            self.tracker.set_slaves(self._required_slaves())
            self.gtracker.set_slaves(self._required_slaves())
            self._term_start_ms = mono_ms()
            self.slave_offsets = {}
            log.warning("became MASTER group=%s epoch=%d store_epoch=%d log_end=%d groups=%d",
                        self.settings.server.group, self.member.epoch, self.store.epoch,
                        self.store.messages.end_offset, self.store.group_seq)

    # ------------------------------------------------------------------ handover

    async def Handover(self, request, context) -> pb.HandoverResponse:
        """Graceful handover: stop serving clients, wait until a slave holds the whole log
        and every group document, resign; that slave wins the next election."""
        if not self.is_master():
            return pb.HandoverResponse(done=False, error="not the master")
        if not self._peers:
            return pb.HandoverResponse(done=False, error="no slave to hand over to")
        self._handing_over = True  # clients get NOT_LEADER from now on; Replicate is still served below
        role = self.role
        await role.stop_tasks()
        self.store.flush()
        self._wake_slaves()
        end, seq = self.store.messages.end_offset, self.store.group_seq
        deadline = time.monotonic() + min(request.wait_ms or 5000, 30_000) / 1000
        while time.monotonic() < deadline:
            if self.tracker.acked_offset >= end and self.gtracker.acked_offset >= seq:
                break
            await asyncio.sleep(0.02)
        else:
            self._handing_over = False
            if self.role is role and not role.ended:  # the role loop may have stood it down meanwhile
                role.start(self._tg, self._master_tasks)
            return pb.HandoverResponse(done=False, error="no slave caught up in time; still master")
        self._handing_over = False
        return await self._resign_and_follow()
