"""Registration, discovery and subject routing on etcd (the shell around ``keyspace``).

Register: check the node's claim key; if free, grant a lease and, in one
transaction guarded by ``version(claim) == 0``, write the claim and the node
record under that lease. If the id is held by a live lease, the request is
refused with ``AlreadyExists`` and nothing is written, unless the holder has the
same role, group and address (the same node restarted before its old lease ran
out): then the claim moves to the new lease in a transaction guarded by the old
claim's value, and the old lease is revoked.

Heartbeat: refresh the lease (a lease that is gone is ``NotFound``: register
again), then rewrite the record in a transaction guarded by the claim's value,
so a node can only ever write its own record.

Route: read ``/hourglass/subjects/{subject}``; if absent, choose among the live
real-time groups (``keyspace.choose_group``) and create the key, a route of one group at
epoch 1 (``cluster/routes.py``), if still absent (a concurrent first use reads the winner's
choice). A route is rewritten by an operator (``set_route``, ``hourglass admin route``): widened
(groups added) or narrowed (a dropped group drains first, its fence written in the same
transaction: ``metaserver/fences.py``, which also finishes drains), the epoch growing by one;
nothing stored moves.
A new route counts against the caller's ``routes_new_per_minute_max`` (a token bucket per
principal, ``cluster/quota.py``, in this meta server's memory; nodes are not limited), so
one token cannot fill etcd with keys; at most ``route_creations_max`` creations wait on
etcd at once (the rest wait their turn), so a flood of new subjects cannot take every
etcd round trip from registration and elections.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from aetcd import exceptions as aex

from cluster import security
from cluster.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from cluster.quota import SubjectQuota, SubjectQuotas
from cluster.routes import Route, change, parse_groups, widen
from metaserver import keyspace as ks
from metaserver.config import MetaSettings
from metaserver.etcd import EtcdClient
from metaserver.fences import fence_key, fence_ops

log = logging.getLogger("hourglass.registry")

TTL_S_MIN = 2
TTL_S_MAX = 300
ROUTES_RATE_SETTING = "routes_new_per_minute_max"
ANONYMOUS = "anonymous"  # the one tenant of an open cluster


def quota_owner() -> str | None:
    """Whom a new route counts against: the caller's principal, ``anonymous`` when security is
    off, nobody (None) for a node certificate (a delay node routing what it fires)."""
    p = security.caller()
    if p is None:
        return ANONYMOUS
    return None if p.node else p.name


class Registry:
    def __init__(self, etcd: EtcdClient, settings: MetaSettings, *, clock=time.time) -> None:
        self.etcd = etcd
        self.default_ttl_s = settings.node_ttl_s()
        self.route_quotas = SubjectQuotas(SubjectQuota(settings.routes_new_per_minute_max, None),
                                          rate_setting=ROUTES_RATE_SETTING, where="at the meta server")
        self._creations = asyncio.Semaphore(settings.route_creations_max)
        self._clock = clock

    @staticmethod
    def ttl_s(ttl_ms: int, default_s: int) -> int:
        if ttl_ms < 0:
            raise InvalidArgument("ttl_ms", "must be >= 0")
        s = math.ceil(ttl_ms / 1000) if ttl_ms else default_s
        if not TTL_S_MIN <= s <= TTL_S_MAX:
            raise InvalidArgument("ttl_ms", f"{ttl_ms} ms is outside [{TTL_S_MIN}, {TTL_S_MAX}] s")
        return s

    # ------------------------------------------------------------------ registration

    async def register(self, node: ks.NodeRecord, *, ttl_s: int) -> int:
        claim_k = ks.id_key(node.node_id)
        node = node.model_copy(update={"updated_ms": time.time_ns() // 1_000_000})
        existing = await self.etcd.call(lambda c: c.get(claim_k))
        takeover: tuple[bytes, int] | None = None
        if existing is not None:
            takeover = (existing.value, await self._check_takeover(node, existing.value))
        lease = await self.etcd.call(lambda c: c.lease(ttl_s))
        new_claim = ks.claim_value(lease.id, node.role, node.group)

        def txn(c):
            guard = (c.transactions.version(claim_k) == 0 if takeover is None
                     else c.transactions.value(claim_k) == takeover[0])
            return c.transaction(compare=[guard], success=[
                c.transactions.put(claim_k, new_claim, lease=lease.id),
                c.transactions.put(ks.node_key(node.role, node.group, node.node_id), node.to_value(), lease=lease.id),
            ], failure=[])
        ok, _ = await self.etcd.call(txn)
        if not ok:
            await self._revoke(lease.id)
            raise AlreadyExists(f"node id {node.node_id!r} was registered concurrently by another process")
        if takeover is not None:
            await self._revoke(takeover[1])
            log.info("re-registered node_id=%s lease=%x (old lease %x revoked)", node.node_id, lease.id, takeover[1])
        else:
            log.info("registered node_id=%s role=%s group=%s address=%s lease=%x", node.node_id, node.role,
                     node.group, node.address, lease.id)
        return lease.id

    async def _check_takeover(self, node: ks.NodeRecord, claim_raw: bytes) -> int:
        """The id is held: allow only the same node (role, group, address) restarting."""
        claim = ks.parse_claim(claim_raw)
        old = None
        if claim["role"] == node.role and claim["group"] == node.group:
            kv = await self.etcd.call(lambda c: c.get(ks.node_key(node.role, node.group, node.node_id)))
            old = ks.NodeRecord.from_value(kv.value) if kv is not None else None
        if old is None or old.address != node.address:
            where = f"{claim['role']}/{claim['group']}" + (f" at {old.address}" if old else "")
            raise AlreadyExists(f"node id {node.node_id!r} is held by a live registration ({where}); "
                                f"choose another id or wait for its lease to expire")
        return int(claim["lease"])

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self.etcd.call(lambda c: c.revoke_lease(lease_id))
        except aex.ClientError as e:  # already gone: fine
            log.debug("revoke lease=%x: %s", lease_id, e)

    async def heartbeat(self, lease_id: int, node: ks.NodeRecord) -> int:
        """Keep the registration alive and store the fresh record. Returns the remaining TTL (s)."""
        try:
            reply = await self.etcd.call(lambda c: c.refresh_lease(lease_id))
        except aex.ClientError as e:
            raise NotFound(f"lease {lease_id:x} unknown: {e}; register again") from None
        if reply is None or reply.TTL <= 0:
            raise NotFound(f"lease {lease_id:x} expired; register again")
        claim_k = ks.id_key(node.node_id)
        expected = ks.claim_value(lease_id, node.role, node.group)
        node = node.model_copy(update={"updated_ms": time.time_ns() // 1_000_000})
        ok, resps = await self.etcd.call(lambda c: c.transaction(
            compare=[c.transactions.value(claim_k) == expected],
            success=[c.transactions.put(ks.node_key(node.role, node.group, node.node_id), node.to_value(),
                                        lease=lease_id)],
            failure=[c.transactions.get(claim_k)]))
        if not ok:
            kvs = resps[0] if resps else []
            if not kvs:
                raise NotFound(f"node id {node.node_id!r} is not registered (lease expired?); register again")
            claim = ks.parse_claim(kvs[0][0])
            if claim["lease"] != lease_id:
                raise AlreadyExists(f"node id {node.node_id!r} is held by another registration")
            raise InvalidArgument("node", f"registered as {claim['role']}/{claim['group']}, heartbeat says "
                                          f"{node.role}/{node.group}; register again to move")
        return int(reply.TTL)

    async def deregister(self, lease_id: int, node_id: str) -> None:
        claim = await self.etcd.call(lambda c: c.get(ks.id_key(node_id)))
        if claim is None or ks.parse_claim(claim.value)["lease"] != lease_id:
            raise NotFound(f"node id {node_id!r} holds no lease {lease_id:x}")
        await self._revoke(lease_id)

    # ------------------------------------------------------------------ discovery

    async def groups(self, role: str) -> tuple[list[ks.GroupView], int]:
        nodes = await self.etcd.call(lambda c: c.get_prefix(ks.nodes_prefix(role)))
        leaders = await self.etcd.call(lambda c: c.get_prefix(ks.leaders_prefix(role)))
        records = []
        for kv in nodes:
            try:
                records.append(ks.NodeRecord.from_value(kv.value))
            except ValueError:
                log.error("unreadable node record key=%s", kv.key)  # written by something else: skip it
        lead: dict[str, ks.LeaderInfo] = {}
        plen = len(ks.leaders_prefix(role))
        for kv in leaders:
            try:
                lead[kv.key[plen:].decode()] = ks.LeaderInfo.from_kv(kv.value, kv.create_revision)
            except ValueError:
                log.error("unreadable leader key=%s", kv.key)
        return ks.build_groups(role, records, lead), max(nodes.header.revision, leaders.header.revision)

    async def route(self, subject: str) -> tuple[Route, list[ks.GroupView], list[ks.GroupView]]:
        """The subject's route (created on first use with one group), a view of each of its
        groups, in the route's order (a group with no live node is a view without a master),
        and every real-time group's view (for the draining ones: ``ks.route_views``)."""
        ks.check_subject(subject)
        key = ks.subject_key(subject)
        groups, _ = await self.groups("realtime")
        kv = await self.etcd.call(lambda c: c.get(key))
        if kv is None:
            chosen = ks.choose_group(subject, groups)
            if chosen is None:
                raise Unavailable("no live real-time group to route the subject to")
            owner = quota_owner()
            if owner is not None:
                adm = self.route_quotas.admit(owner, 1, now_ms=int(self._clock() * 1000))
                if adm.refusal is not None:
                    log.info("route quota: refused principal=%s subject=%s", owner, subject[:200])
                    raise adm.refusal
            first = Route((chosen.name,), 1)
            try:
                async with self._creations:
                    ok, resps = await self.etcd.call(lambda c: c.transaction(
                        compare=[c.transactions.version(key) == 0],
                        success=[c.transactions.put(key, first.encode())],
                        failure=[c.transactions.get(key)]))
            except BaseException:
                if owner is not None:
                    self.route_quotas.refund(owner, 1)
                raise
            route = first if ok else self._decode(subject, resps[0][0][0])
            if ok:
                log.info("routed subject=%s group=%s", subject, chosen.name)
            elif owner is not None:
                self.route_quotas.refund(owner, 1)  # a concurrent first use created it
        else:
            route = self._decode(subject, kv.value)
        return route, ks.route_views(route, groups), groups

    @staticmethod
    def _decode(subject: str, raw: bytes) -> Route:
        try:
            return Route.decode(raw)
        except ValueError as e:  # written by something else: say so, write nothing
            log.error("unreadable route subject=%s: %s", subject[:200], e)
            raise Unavailable(f"the route of {subject!r} in etcd is unreadable: {e}") from None

    async def set_route(self, subject: str, groups: list[str], *,
                        narrowing: bool = False) -> tuple[Route | None, Route]:
        """An operator sets a subject's route to ``groups`` (every one a registered real-time
        group). Returns (the route before, the route now); a no-op writes nothing. A dropped
        group drains (``cluster/routes.py`` ``change``) when ``narrowing`` is allowed, else
        it is ``InvalidArgument``. The route and its fences (``metaserver/fences.py``) are
        one transaction guarded by the key's mod revision, so two concurrent changes cannot
        lose one another and no node sees a narrowed route without its fence. No ``groups``:
        the route as it is (``NotFound`` when the subject has none)."""
        ks.check_subject(subject)
        if not groups:  # no list: the route as it is (``hourglass admin route SUBJECT``), nothing written
            kv = await self.etcd.call(lambda c: c.get(ks.subject_key(subject)))
            if kv is None:
                raise NotFound(f"subject {subject!r} has no route yet (it gets one on first use)")
            now = self._decode(subject, kv.value)
            return now, now
        wanted = parse_groups(groups, ks.check_name)
        known = {g.name for g in (await self.groups("realtime"))[0]}
        unknown = [g for g in wanted if g not in known]
        key = ks.subject_key(subject)
        kv = await self.etcd.call(lambda c: c.get(key))
        before = None if kv is None else self._decode(subject, kv.value)
        after = change(subject, before, wanted) if narrowing else widen(subject, before, wanted)
        if after is before:
            return before, after
        new_groups = [g for g in unknown if before is None or g not in before.readable]
        if new_groups:
            raise InvalidArgument("groups", f"no registered real-time group named {', '.join(new_groups)} "
                                            f"(registered: {', '.join(sorted(known)) or 'none'})")
        rev = 0 if kv is None else kv.mod_revision
        puts, deletes = fence_ops(subject, before, after)
        ok, _ = await self.etcd.call(lambda c: c.transaction(
            compare=[c.transactions.mod(key) == rev],
            success=[c.transactions.put(key, after.encode()),
                     *(c.transactions.put(fence_key(g, subject), v.encode()) for g, v in puts.items()),
                     *(c.transactions.delete(fence_key(g, subject)) for g in deletes)],
            failure=[]))
        if not ok:
            raise Unavailable(f"the route of {subject!r} changed meanwhile; try again")
        log.warning("route changed subject=%s groups=%s epoch=%d draining=%s (was %s)", subject[:200],
                    ",".join(after.groups), after.epoch, ",".join(after.draining) or "none",
                    ",".join(before.groups) if before else "none")
        return before, after
