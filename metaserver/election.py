"""Master election per (role, group) on etcd: campaign, resign, observe.

One leader key per group, ``/hourglass/leaders/{role}/{group}``, attached to the
candidate's lease. Campaign is one transaction::

    if create_revision(leader_key) == 0 [and every guard key has its expected value]:
        put(leader_key, {node_id, address}, lease); get(leader_key)
    else:
        get(leader_key)

so at most one candidate holds the key at any revision (etcd serialises
transactions). The **epoch** is the key's create revision: a new term re-creates
the key, and etcd revisions only grow, so epochs strictly increase across terms
(and a replica can fence any request carrying a smaller one). A candidate that
loses waits for the key's delete event (watch from the revision it read) and
tries again, until ``timeout_s``; then it raises ``NotLeader(leader_hint)``.

The seat is lost when the lease ends: ``resign()`` (delete guarded by our epoch),
the owner's keep-alive stopping (process dead or frozen past the TTL), or the
lease being revoked. ``observe()`` yields every change of leader (or ``None``
while the seat is empty) from a watch; a holder that must know it was deposed
watches for a change of epoch, or checks ``lost`` for an own lease.

    election = Election(etcd, "delay", "g1")
    epoch = await election.campaign("node-a", "10.0.0.5:7001", timeout_s=30)
    async for leader in election.observe(): ...
    await election.resign()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aetcd import exceptions as aex
from aetcd.rtypes import EventKind

from cluster.errors import NotLeader, Unavailable
from metaserver import keyspace as ks
from metaserver.config import META_DEFAULTS
from metaserver.etcd import EtcdClient

log = logging.getLogger("hourglass.election")

CAMPAIGN_TIMEOUT_S_MAX = 3600.0
WATCH_SLICE_S = 1.0  # a waiting candidate re-reads the key at least this often (lost watch events)


class Election:
    def __init__(self, etcd: EtcdClient, role: str, group: str, *, ttl_s: int = META_DEFAULTS.node_ttl_s()) -> None:
        self.etcd = etcd
        self.role = ks.check_role(role)
        self.group = ks.check_name("group", group)
        self.key = ks.leader_key(role, group)
        self.ttl_s = ttl_s
        self.epoch = 0                   # our epoch while we hold the seat, else 0
        self.lease_id: int | None = None
        self._own_lease = False
        self._keepalive: asyncio.Task | None = None
        self.lost = asyncio.Event()      # set when an own lease could not be kept alive

    # ------------------------------------------------------------------ reading

    async def leader(self) -> ks.LeaderInfo | None:
        kv = await self.etcd.call(lambda c: c.get(self.key))
        return None if kv is None else ks.LeaderInfo.from_kv(kv.value, kv.create_revision)

    async def _read(self) -> tuple[ks.LeaderInfo | None, int]:
        """Leader (or None) and the revision it was read at."""
        r = await self.etcd.call(lambda c: c.get_range(self.key, self.key + b"\0"))
        if not r.count:
            return None, r.header.revision
        kv = r[0]
        return ks.LeaderInfo.from_kv(kv.value, kv.create_revision), r.header.revision

    # ------------------------------------------------------------------ campaigning

    async def _grant_own_lease(self) -> int:
        lease = await self.etcd.call(lambda c: c.lease(self.ttl_s))
        self.lease_id, self._own_lease = lease.id, True
        self.lost.clear()
        self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop(lease.id),
                                                                name=f"election-keepalive-{self.group}")
        return lease.id

    async def _keepalive_loop(self, lease_id: int) -> None:
        interval = max(0.2, self.ttl_s / 3)
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    reply = await self.etcd.call(lambda c: c.refresh_lease(lease_id))
                except (Unavailable, aex.ClientError) as e:
                    log.warning("election keepalive failed group=%s err=%s", self.group, e)
                    continue  # the lease may still be alive; etcd decides
                if reply is None or reply.TTL <= 0:
                    log.warning("election lease expired group=%s epoch=%d", self.group, self.epoch)
                    self.epoch = 0
                    self.lost.set()
                    return
        except asyncio.CancelledError:
            raise

    async def campaign(self, node_id: str, address: str, *, lease_id: int | None = None,
                       timeout_s: float | None = None, guards: list[tuple[bytes, bytes]] = (),
                       compares=None, puts=None) -> int:
        """Become the leader; return the epoch. ``lease_id`` ties the seat to an existing
        lease (a node's registration); without it the election grants and keeps alive its
        own. ``guards`` are (key, value) pairs that must hold in the same transaction;
        ``compares(c)`` / ``puts(c)`` add etcd compares and puts to it (the in-sync set).
        Raises ``NotLeader(leader_hint)`` if the seat is still taken after ``timeout_s``."""
        ks.check_name("node_id", node_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(timeout_s if timeout_s is not None else CAMPAIGN_TIMEOUT_S_MAX,
                                     CAMPAIGN_TIMEOUT_S_MAX)
        if lease_id is None:
            lease_id = self.lease_id if (self._own_lease and not self.lost.is_set()) else await self._grant_own_lease()
        else:
            self.lease_id, self._own_lease = lease_id, False
        value = ks.leader_value(node_id, address)
        while True:
            def txn(c, lease=lease_id):
                compare = [c.transactions.create(self.key) == 0]
                compare += [c.transactions.value(k) == v for k, v in guards]
                compare += compares(c) if compares else []
                return c.transaction(compare=compare,
                                     success=[c.transactions.put(self.key, value, lease=lease)]
                                     + (puts(c) if puts else []) + [c.transactions.get(self.key)],
                                     failure=[c.transactions.get(self.key)])
            try:
                ok, responses = await self.etcd.call(txn)
            except aex.ClientError as e:
                if "lease not found" in str(e):
                    raise NotLeader(None) from None  # the lease behind this campaign is gone
                raise
            kvs = responses[-1]
            current = ks.LeaderInfo.from_kv(kvs[0][1].value, kvs[0][1].create_revision) if kvs else None
            if ok:
                self.epoch = current.epoch
                log.info("elected role=%s group=%s node_id=%s epoch=%d", self.role, self.group, node_id, self.epoch)
                return self.epoch
            if current is None:
                # the seat is free but a guard failed: the caller's precondition does not hold
                raise NotLeader(None)
            if current.node_id == node_id and kvs[0][1].lease == lease_id:
                self.epoch = current.epoch  # we already hold it (retried campaign)
                return self.epoch
            left = deadline - loop.time()
            if left <= 0:
                raise NotLeader(current.address)
            await self._wait_deleted(kvs[0][1].mod_revision + 1, min(left, WATCH_SLICE_S))

    async def _wait_deleted(self, from_revision: int, timeout_s: float) -> None:
        try:
            await self.etcd.call(lambda c: c.watch_once(self.key, timeout=timeout_s, start_revision=from_revision,
                                                        kind=EventKind.DELETE), wait_s=timeout_s)
        except (aex.WatchTimeoutError, aex.RevisionCompactedError):
            pass
        except Unavailable:
            await asyncio.sleep(min(timeout_s, 0.2))

    async def resign(self) -> bool:
        """Give the seat up if we still hold our epoch. True when a key was deleted."""
        epoch, self.epoch = self.epoch, 0
        deleted = False
        if epoch:
            ok, _ = await self.etcd.call(lambda c: c.transaction(
                compare=[c.transactions.create(self.key) == epoch],
                success=[c.transactions.delete(self.key)], failure=[]))
            deleted = ok
        await self._drop_own_lease()
        return deleted

    async def _drop_own_lease(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        if self._own_lease and self.lease_id is not None:
            lease_id, self.lease_id, self._own_lease = self.lease_id, None, False
            with contextlib.suppress(Unavailable, aex.ClientError):
                await self.etcd.call(lambda c: c.revoke_lease(lease_id))

    async def abandon(self) -> None:
        """Stop keeping an own lease alive without resigning: the seat ends when the TTL
        runs out (what a frozen or killed process looks like). For tests and shutdown paths."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        self.epoch = 0
        self.lease_id, self._own_lease = None, False

    # ------------------------------------------------------------------ observing

    async def observe(self, *, changes_max: int | None = None) -> AsyncIterator[ks.LeaderInfo | None]:
        """Yield the current leader (or None), then every change, in etcd order.

        Reconnects after etcd errors and resumes from the last revision seen; a
        compacted history is answered with a fresh read."""
        leader, revision = await self._read()
        yield leader
        last = leader
        seen = 0
        while changes_max is None or seen < changes_max:
            try:
                watch = await self.etcd.call(lambda c: c.watch(self.key, start_revision=revision + 1))
                try:
                    async for ev in watch:
                        revision = ev.kv.mod_revision
                        if ev.kind == EventKind.DELETE:
                            now = None
                        else:
                            now = ks.LeaderInfo.from_kv(ev.kv.value, ev.kv.create_revision)
                        if now != last:
                            last = now
                            seen += 1
                            yield now
                            if changes_max is not None and seen >= changes_max:
                                return
                finally:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
            except aex.RevisionCompactedError:
                now, revision = await self._read()
                if now != last:
                    last = now
                    seen += 1
                    yield now
            except (Unavailable, aex.ClientError) as e:
                log.info("observe: etcd error %s; resuming from revision %d", e, revision)
                await self.etcd.rotate()
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self._drop_own_lease()
