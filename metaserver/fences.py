"""Fences of real-time groups on subjects, and the end of a narrowing's drain (docs/design.md,
"Narrowing drains first"). The rules are pure (``fence_ops``, ``finish_refusal``); ``Fences``
is the etcd shell.

Keys (no lease: they outlive every process)::

    /hourglass/fences/{group}/{subject} -> {"consumers": ["audit", "billing"], "draining": true, "epoch": 3,
                                            "released": ["audit"]}

* written in the same transaction as the route that drops ``group`` from ``subject``
  (``Registry.set_route``), so no node can see the narrowed route without the fence existing;
  its mod revision is the narrowing's revision;
* ``consumers``: the consumer groups the drain waits for (below), absent while none is known;
* ``released``: consumer groups an operator released from the drain (``hourglass admin
  release``, ``release``): the drain no longer waits for them, their unacked messages here are
  given up, and a report of them is not added to ``consumers`` again; absent while none;
* ``draining`` true while the route lists the group as draining; set false, in the same
  transaction that takes the group out of the route, when the drain finishes. The key stays:
  a writer with a route cached from before the narrowing is refused for as long as the group
  is not in the route again;
* deleted when an operator lists the group for the subject again (widening takes it back).

Every member of ``group`` gets the group's fences on each Register and Heartbeat answer,
with the etcd revision they were read at, enforces them (``node/realtime/fence.py``) and
reports that revision back (``offsets["fence_revision"]`` of its record).

**Finishing** (``finish_refusal``): a draining group leaves a subject's route when (a) every
registered member of the group reports a fence revision at or above the fence's mod revision
(the fence is in force wherever a write could land, a slave that may be promoted included),
and (b) the group's master (the reporter: it must be the master the meta server knows) says,
from a snapshot taken with its fence in force, that every consumer group the drain waits for
(those with state on it and those the fence names) acked its index end. The master says (b) on its heartbeats (``HeartbeatRequest.drained``);
the meta server that gets it checks (a) and writes the new route and the finished fence in
one transaction guarded by both keys' mod revisions, so several meta servers may try at once
and one wins. A group with no master, or a member that does not report, is not finished
yet; the next heartbeat tries again.

**Who a drain waits for** (``consumers``): every consumer group of the subject, by name, not
only those with state on the draining group. Each answer to a real-time node carries ``watch``
(the subjects draining in any group); every master reports its consumer groups (not idle) of
them on its heartbeats (``HeartbeatRequest.consumers``, against the watch list read at
``watch_revision``); the meta server adds new names to the subject's draining fences
(``consumers_after``, ``merge_consumers``: guarded by each fence's mod revision) and answers
``consumers_merged``, which the master reports back (``offsets["consumers_revision"]``). A
finish also needs (c): the master of every other readable group of the route reports a
consumers revision at or above the fence's mod revision. A new name rewrites the fence, so a
claim or a report older than it does not count.

Example: ``orders`` narrowed from rt-1,rt-2,rt-3 to rt-1,rt-2 at revision 900: fence
``rt-3/orders`` (mod revision 900). rt-1's master reports consumer groups ``audit`` (it never
pulled from rt-3) and ``billing``: the fence names them (mod revision 910). rt-3's members
report fence revisions 915 and 913; the masters of rt-1 and rt-2 consumers revisions 912 and
914; rt-3's master, once ``audit`` pulled and acked all of it there too, reports ``orders``
drained -> route ``rt-1,rt-2`` (draining none), fence draining false.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from cluster.codec import check_subject
from cluster.errors import InvalidArgument, NotFound, Unavailable
from cluster.routes import CONSUMERS_REPORT_MAX, CONSUMERS_REVISION_KEY, FENCE_REVISION_KEY, Route, dropped, finish
from metaserver import keyspace as ks

log = logging.getLogger("hourglass.fences")

FENCES_PER_GROUP_MAX = 10_000  # fences one answer carries (a node enforces those; more is an operator's mess)
CONSUMERS_PER_FENCE_MAX = 1_000  # consumer groups one drain waits for by name (more: reports are not merged)
WATCH_MAX = 10_000             # subjects draining at once that masters report their consumer groups of
RELEASE_TRIES_MAX = 5          # a release reads the fences again this often when one changed meanwhile


def fence_key(group: str, subject: str) -> bytes:
    return f"{ks.PREFIX}/fences/{group}/{subject}".encode()


def fences_prefix(group: str) -> bytes:
    return f"{ks.PREFIX}/fences/{group}/".encode()


@dataclass(frozen=True)
class FenceValue:
    epoch: int          # the route epoch that dropped the group
    draining: bool = True
    consumers: tuple[str, ...] = ()  # draining: the consumer groups the drain waits for (sorted)
    released: tuple[str, ...] = ()  # draining: consumer groups an operator released from it (sorted)

    def encode(self) -> bytes:
        d: dict = {"draining": self.draining, "epoch": self.epoch}
        if self.consumers:  # absent when none: a fence from before keeps its bytes
            d["consumers"] = sorted(self.consumers)
        if self.released:
            d["released"] = sorted(self.released)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "FenceValue":
        d = json.loads(raw)
        names = {}
        for key in ("consumers", "released"):
            v = d.get(key, [])
            if not isinstance(v, list) or not all(isinstance(g, str) and g for g in v):
                raise ValueError(f"fence with unreadable {key}: {raw[:200]!r}")
            names[key] = tuple(sorted(set(v)))
        return cls(int(d.get("epoch", 0)), bool(d.get("draining", True)), names["consumers"], names["released"])


@dataclass(frozen=True)
class StoredFence:
    group: str
    subject: str
    value: FenceValue
    mod_revision: int


def consumers_after(value: FenceValue, reported) -> FenceValue | None:
    """``value`` with the consumer groups ``reported`` (a master's, for the fence's subject)
    added, or None when nothing is new or the fence is not draining. Add only: a group
    that stops consuming stays required (``drain_left``: an idle one holds nothing back)."""
    if not value.draining:
        return None
    new = set(reported) - set(value.consumers) - set(value.released)  # a released group stays released
    if not new:
        return None
    return FenceValue(value.epoch, True, tuple(sorted(set(value.consumers) | new)), value.released)


def released_after(value: FenceValue, name: str) -> FenceValue | None:
    """``value`` with the consumer group ``name`` released from the drain (``Fences.release``),
    or None when the fence is not draining or has released it already."""
    if not value.draining or name in value.released:
        return None
    return FenceValue(value.epoch, True, value.consumers, tuple(sorted({*value.released, name})))


def fence_ops(subject: str, before: Route | None, after: Route) -> tuple[dict[str, FenceValue], list[str]]:
    """What a route change writes beside the route: fences to put (groups it starts
    draining) and fences to delete (every group it writes to: one taken back, or added after
    an earlier drain finished)."""
    puts = {g: FenceValue(after.epoch, True) for g in dropped(before, after)}
    return puts, list(after.groups)


def report_refusal(reported: dict[str, list[str]]) -> str:
    """Why a master's report of consumer groups is not merged ("" when it is): more than
    ``CONSUMERS_REPORT_MAX`` names, or a subject or group name outside the subject rule (a
    consumer group's name follows it too, ``node/realtime/groups.py``)."""
    n = sum(len(g) for g in reported.values())
    if n > CONSUMERS_REPORT_MAX:
        return f"{n} consumer group names, more than {CONSUMERS_REPORT_MAX}"
    try:
        for subject, groups in reported.items():
            check_subject(subject, "subject", ks.SUBJECT_BYTES_MAX)
            for g in groups:
                check_subject(g, "consumer group", ks.SUBJECT_BYTES_MAX)
    except InvalidArgument as e:
        return str(e)
    return ""


def finish_refusal(*, members: list[tuple[str, int]], needed_revision: int, reporter: str, master: str,
                   reporter_revision: int, drained: bool = True,
                   others: list[tuple[str, str, int]] | None = None) -> str:
    """Why a draining group may not leave the route yet ("" when it may). ``members``:
    ``(node_id, fence revision reported)`` of every registered member; ``needed_revision``:
    the fence's mod revision; ``reporter``/``master``: addresses of the member that said
    "drained" (``drained``) and of the group's master now; ``reporter_revision``: the fence
    revision of the snapshot the claim was made from; ``others``: ``(group, its master
    ("" none), the consumers revision its master's record reports)`` of every other readable
    group of the route: each must have reported its consumer groups of the subject at or
    after ``needed_revision`` (so the fence names them all: a new name rewrites the fence)."""
    if not drained:
        return "the master holds messages a consumer group has not acked"
    if not master:
        return "the group has no master"
    if reporter != master:
        return f"{reporter} said drained but the master is {master}"
    if reporter_revision < needed_revision:
        return f"the master's claim predates its fence (revision {reporter_revision} < {needed_revision})"
    if not members:
        return "no registered member"
    behind = [f"{n} ({r})" for n, r in members if r < needed_revision]
    if behind:
        return f"fence revision {needed_revision} not reported by {', '.join(behind)}"
    unknown = [g for g, m, _ in others or [] if not m]
    if unknown:
        return f"{', '.join(unknown)} of the route has no master: its consumer groups are not known"
    behind = [f"{g} ({r})" for g, m, r in others or [] if m and r < needed_revision]
    if behind:
        return f"consumer groups as of revision {needed_revision} not reported by the master of {', '.join(behind)}"
    return ""


class Fences:
    def __init__(self, etcd) -> None:
        self.etcd = etcd

    async def read_all(self) -> tuple[list[StoredFence], int]:
        """Every fence and the etcd revision they were read at (an unreadable one is a
        draining fence without consumers: a fence all the same)."""
        prefix = f"{ks.PREFIX}/fences/".encode()
        resp = await self.etcd.call(lambda c: c.get_prefix(prefix))
        out = []
        for kv in resp:
            group, _, subject = kv.key[len(prefix):].decode().partition("/")
            try:
                value = FenceValue.decode(kv.value)
            except (ValueError, TypeError) as e:  # written by something else
                log.error("unreadable fence key=%s: %s", kv.key, e)
                value = FenceValue(0, True)
            out.append(StoredFence(group, subject, value, kv.mod_revision))
        return out, resp.header.revision

    @staticmethod
    def answer(stored: list[StoredFence], group: str) -> tuple[list[tuple], list[str]]:
        """What a member of ``group`` is told: its fences ``(subject, draining, consumers,
        released)`` and the subjects draining in any group (``watch``)."""
        own = [(f.subject, f.value.draining, f.value.consumers, f.value.released) for f in stored if f.group == group]
        if len(own) > FENCES_PER_GROUP_MAX:
            log.error("group=%s has more than %d fences; the rest are not sent", group, FENCES_PER_GROUP_MAX)
            own = own[:FENCES_PER_GROUP_MAX]
        watch = sorted({f.subject for f in stored if f.value.draining})
        if len(watch) > WATCH_MAX:
            log.error("%d subjects drain at once, more than %d: the rest are not watched", len(watch), WATCH_MAX)
            watch = watch[:WATCH_MAX]
        return own, watch

    async def merge_consumers(self, stored: list[StoredFence], reported: dict[str, list[str]]) -> bool:
        """Add a master's consumer groups (``subject -> names``) to every draining fence of
        their subjects (``consumers_after``), each write guarded by the fence's mod revision
        as read (``stored``). True when every fence names them now (nothing to add, or every
        write done); False when a fence changed meanwhile or would name too many (the master
        reports again on its next heartbeat)."""
        ok = True
        for f in stored:
            names = reported.get(f.subject)
            after = consumers_after(f.value, names) if names else None
            if after is None:
                continue
            if len(after.consumers) > CONSUMERS_PER_FENCE_MAX:
                log.error("drain of subject=%s group=%s would wait for %d consumer groups, more than %d: not "
                          "recorded (it does not finish)", f.subject[:200], f.group, len(after.consumers),
                          CONSUMERS_PER_FENCE_MAX)
                ok = False
                continue
            fkey = fence_key(f.group, f.subject)
            done, _ = await self.etcd.call(lambda c, fkey=fkey, after=after, f=f: c.transaction(
                compare=[c.transactions.mod(fkey) == f.mod_revision],
                success=[c.transactions.put(fkey, after.encode())], failure=[]))
            if done:
                log.warning("drain of subject=%s group=%s waits for consumer groups %s too", f.subject[:200],
                            f.group, ",".join(sorted(set(after.consumers) - set(f.value.consumers)))[:500])
            ok = ok and bool(done)
        return ok

    async def release(self, subject: str, name: str) -> tuple[list[str], bool]:
        """An operator releases consumer group ``name`` from every drain of ``subject``
        (``released_after``, each write guarded by the fence's mod revision; a fence that changed
        meanwhile is read again, at most ``RELEASE_TRIES_MAX`` times). Returns the real-time groups
        draining the subject and whether anything was written (False: released from all of them
        already). ``NotFound`` when the subject drains nowhere."""
        check_subject(subject, "subject", ks.SUBJECT_BYTES_MAX)
        check_subject(name, "consumer group", ks.SUBJECT_BYTES_MAX)
        changed = False
        for _ in range(RELEASE_TRIES_MAX):
            stored, _ = await self.read_all()
            mine = [f for f in stored if f.subject == subject and f.value.draining]
            if not mine:
                raise NotFound(f"subject {subject!r} drains in no real-time group: nothing to release "
                               f"consumer group {name!r} from")
            ok = True
            for f in mine:
                after = released_after(f.value, name)
                if after is None:
                    continue
                if len(after.released) > CONSUMERS_PER_FENCE_MAX:
                    raise InvalidArgument("consumer_group", f"the drain of {subject!r} on {f.group} has released "
                                                            f"{CONSUMERS_PER_FENCE_MAX} consumer groups already")
                fkey = fence_key(f.group, f.subject)
                done, _ = await self.etcd.call(lambda c, fkey=fkey, after=after, f=f: c.transaction(
                    compare=[c.transactions.mod(fkey) == f.mod_revision],
                    success=[c.transactions.put(fkey, after.encode())], failure=[]))
                if done:
                    changed = True
                    log.warning("drain of subject=%s group=%s no longer waits for consumer group %s (released by an "
                                "operator: its unacked messages there are given up)", subject[:200], f.group, name)
                ok = ok and bool(done)
            if ok:
                return sorted(f.group for f in mine), changed
        raise Unavailable(f"the fences of subject {subject!r} kept changing while consumer group {name!r} was "
                          f"released ({RELEASE_TRIES_MAX} tries): run it again")

    async def try_finish(self, registry, group: str, subject: str, reporter: str, reporter_revision: int) -> str:
        """Finish ``group``'s drain of ``subject`` if ``finish_refusal`` allows: "" when
        finished (by this call), else why not."""
        key, fkey = ks.subject_key(subject), fence_key(group, subject)
        kv = await self.etcd.call(lambda c: c.get(key))
        fkv = await self.etcd.call(lambda c: c.get(fkey))
        if kv is None or fkv is None:
            return "no route or no fence"
        route = Route.decode(kv.value)
        if group not in route.draining or not FenceValue.decode(fkv.value).draining:
            return "not draining"
        views = {g.name: g for g in (await registry.groups("realtime"))[0]}
        view = views.get(group)
        members = [(m.node_id, m.offsets.get(FENCE_REVISION_KEY, 0)) for m in (view.members if view else [])]
        others = []
        for name in route.readable:
            if name != group:
                v = views.get(name)
                rec = next((m for m in v.members if m.address == v.master), None) if v and v.master else None
                others.append((name, rec.address, rec.offsets.get(CONSUMERS_REVISION_KEY, 0)) if rec else (name, "", 0))
        why = finish_refusal(members=members, needed_revision=fkv.mod_revision, reporter=reporter,
                             master=view.master if view else "", reporter_revision=reporter_revision, others=others)
        if why:
            log.info("drain not finished subject=%s group=%s: %s", subject[:200], group, why)
            return why
        after = finish(route, group)
        ok, _ = await self.etcd.call(lambda c: c.transaction(
            compare=[c.transactions.mod(key) == kv.mod_revision, c.transactions.mod(fkey) == fkv.mod_revision],
            success=[c.transactions.put(key, after.encode()),
                     c.transactions.put(fkey, FenceValue(after.epoch, False).encode())],
            failure=[]))
        if not ok:
            return "the route or the fence changed meanwhile"
        log.warning("drain finished subject=%s group=%s: route %s epoch=%d draining=%s", subject[:200], group,
                    ",".join(after.groups), after.epoch, ",".join(after.draining) or "none")
        return ""
