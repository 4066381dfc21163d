"""Fences of real-time groups on subjects, and the end of a narrowing's drain (docs/design.md,
"Narrowing drains first"). The rules are pure (``fence_ops``, ``finish_refusal``); ``Fences``
is the etcd shell.

Keys (no lease: they outlive every process)::

    /hourglass/fences/{group}/{subject} -> {"draining": true, "epoch": 3}

* written in the same transaction as the route that drops ``group`` from ``subject``
  (``Registry.set_route``), so no node can see the narrowed route without the fence existing;
  its mod revision is the narrowing's revision;
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
from a snapshot taken with its fence in force, that every consumer group of the subject on it
acked its index end. The master says (b) on its heartbeats (``HeartbeatRequest.drained``);
the meta server that gets it checks (a) and writes the new route and the finished fence in
one transaction guarded by both keys' mod revisions, so several meta servers may try at once
and one wins. A group with no master, or a member that does not report, is not finished
yet; the next heartbeat tries again.

Example: ``orders`` narrowed from rt-1,rt-2,rt-3 to rt-1,rt-2 at revision 900: fence
``rt-3/orders`` (mod revision 900). rt-3's members report fence revisions 905 and 903; its
master reports ``orders`` drained -> route ``rt-1,rt-2`` (draining none), fence draining false.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from cluster.routes import FENCE_REVISION_KEY, Route, dropped, finish
from metaserver import keyspace as ks

log = logging.getLogger("hourglass.fences")

FENCES_PER_GROUP_MAX = 10_000  # fences one answer carries (a node enforces those; more is an operator's mess)


def fence_key(group: str, subject: str) -> bytes:
    return f"{ks.PREFIX}/fences/{group}/{subject}".encode()


def fences_prefix(group: str) -> bytes:
    return f"{ks.PREFIX}/fences/{group}/".encode()


@dataclass(frozen=True)
class FenceValue:
    epoch: int          # the route epoch that dropped the group
    draining: bool = True

    def encode(self) -> bytes:
        return json.dumps({"draining": self.draining, "epoch": self.epoch}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "FenceValue":
        d = json.loads(raw)
        return cls(int(d.get("epoch", 0)), bool(d.get("draining", True)))


def fence_ops(subject: str, before: Route | None, after: Route) -> tuple[dict[str, FenceValue], list[str]]:
    """What a route change writes beside the route: fences to put (groups it starts
    draining) and fences to delete (every group it writes to: one taken back, or added after
    an earlier drain finished)."""
    puts = {g: FenceValue(after.epoch, True) for g in dropped(before, after)}
    return puts, list(after.groups)


def finish_refusal(*, members: list[tuple[str, int]], needed_revision: int, reporter: str, master: str,
                   reporter_revision: int, drained: bool = True) -> str:
    """Why a draining group may not leave the route yet ("" when it may). ``members``:
    ``(node_id, fence revision reported)`` of every registered member; ``needed_revision``:
    the fence's mod revision; ``reporter``/``master``: addresses of the member that said
    "drained" (``drained``) and of the group's master now; ``reporter_revision``: the fence
    revision of the snapshot the claim was made from."""
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
    return ""


class Fences:
    def __init__(self, etcd) -> None:
        self.etcd = etcd

    async def of_group(self, group: str) -> tuple[list[tuple[str, bool]], int]:
        """The group's fences ``(subject, draining)`` and the etcd revision they were read at."""
        prefix = fences_prefix(group)
        resp = await self.etcd.call(lambda c: c.get_prefix(prefix))
        out = []
        for kv in resp:
            try:
                out.append((kv.key[len(prefix):].decode(), FenceValue.decode(kv.value).draining))
            except (ValueError, TypeError) as e:  # written by something else: a fence all the same
                log.error("unreadable fence key=%s: %s", kv.key, e)
                out.append((kv.key[len(prefix):].decode(), True))
            if len(out) >= FENCES_PER_GROUP_MAX:
                log.error("group=%s has more than %d fences; the rest are not sent", group, FENCES_PER_GROUP_MAX)
                break
        return out, resp.header.revision

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
        view = next((g for g in (await registry.groups("realtime"))[0] if g.name == group), None)
        members = [(m.node_id, m.offsets.get(FENCE_REVISION_KEY, 0)) for m in (view.members if view else [])]
        why = finish_refusal(members=members, needed_revision=fkv.mod_revision, reporter=reporter,
                             master=view.master if view else "", reporter_revision=reporter_revision)
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
