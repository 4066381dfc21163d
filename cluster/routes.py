"""A subject's route: the real-time groups that serve it, with an epoch. Pure: no I/O.

A route is stored in etcd under ``/hourglass/subjects/{subject}`` (``metaserver/keyspace.py``)
and read by every process that sends or pulls a subject's messages: the delay nodes
(dispatching), immediate producers and consumers (``cluster/client.py``). The hash that
picks a message's group lives here, once, so all of them agree.

Value format (JSON, keys sorted)::

    {"epoch": 2, "groups": ["rt-1", "rt-2", "rt-3"]}
    {"draining": ["rt-3"], "epoch": 3, "groups": ["rt-1", "rt-2"]}

* ``groups``: sorted, distinct real-time group names, at least one (``ROUTE_GROUPS_MAX`` at
  most): the groups written to. Sorted so that the order (and with it the hash choice) does
  not depend on how an operator spelled the list.
* ``draining``: sorted, distinct, disjoint from ``groups``, often absent (written only when
  not empty, so a route that never narrowed keeps its bytes): groups dropped by a narrowing
  that may still hold messages. Nobody writes to them (their nodes refuse the subject, the
  fence: ``metaserver/fences.py``); consumers still pull from them. ``readable`` is
  ``groups`` and ``draining`` together: where a consumer pulls.
* ``epoch``: 1 when the route is created, +1 on every change. A reader keeps the route with
  the larger epoch (a cached answer never replaces a newer one).
* A value written before routes were lists is the bare group name (``rt-1``); it reads as
  ``{"epoch": 1, "groups": ["rt-1"]}``, so existing clusters keep their routes unchanged.

The message -> group rule (``group_index``): ``xxh3_64(id) % len(groups)``. It depends on the
id and the route only, so a retry of one id under one route lands in the group that has it
and is de-duplicated there. It is not ``crc32``, the hash that pins an id to a delay group
(``cluster.client.group_for``): with the same hash, all of one delay group's messages of a
subject would go to one real-time group whenever the two counts share a factor.

Changes (``change``, an operator's ``--groups``; each raises the epoch by one):

* widening adds groups: new messages spread over all listed groups at once; nothing stored
  moves, consumers pull from every readable group, so nothing is lost;
* narrowing drains first: a dropped group moves from ``groups`` to ``draining``; its nodes
  refuse new messages of the subject (``RouteMoved``: the writer refreshes its route and
  sends again), consumers keep pulling what it holds, and once every consumer group has
  acked everything there the meta server ``finish``es it: the group leaves the route;
* listing a draining group again takes it back (out of ``draining``, written to again).

So the readable set only loses a group by ``finish``, and ``groups`` is never empty.
``widen`` is the same rule refusing any drop (``narrowing_refusal``), for callers that may
not narrow.

Worked example: ``orders`` routed to ``["rt-1"]`` (epoch 1) is widened with
``--groups rt-1,rt-3,rt-2``: the route becomes ``["rt-1", "rt-2", "rt-3"]``, epoch 2. An id
whose xxh3 is 7 went to ``rt-1`` before and goes to ``groups[7 % 3] = rt-2`` now; a
consumer pulls from all three and finds the old copy in ``rt-1``. Narrowed with
``--groups rt-1,rt-2``: groups ``["rt-1", "rt-2"]``, draining ``["rt-3"]``, epoch 3; the id
goes to ``groups[7 % 2] = rt-2``; consumers pull from all three until ``rt-3`` is drained,
then the route is ``["rt-1", "rt-2"]`` at epoch 4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import xxhash

from cluster.errors import InvalidArgument

ROUTE_GROUPS_MAX = 64  # groups one subject may be spread over (a consumer holds a pull on each)
FENCE_REVISION_KEY = "fence_revision"  # a real-time node's record offsets entry: the fences it enforces
# a real-time master's record offsets entry: the fence revision up to which its consumer groups of
# every draining subject are recorded in the fences (metaserver/fences.py, "Who a drain waits for")
CONSUMERS_REVISION_KEY = "consumers_revision"
CONSUMERS_REPORT_MAX = 10_000  # consumer group names one master's heartbeat reports at most


@dataclass(frozen=True)
class Route:
    """A subject's real-time groups written to (sorted, distinct), the groups only read from
    while they drain (sorted, distinct, disjoint from ``groups``) and the route's epoch."""

    groups: tuple[str, ...]
    epoch: int = 1
    draining: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.groups and list(self.groups) == sorted(set(self.groups)), self.groups
        assert list(self.draining) == sorted(set(self.draining)), self.draining
        assert not set(self.groups) & set(self.draining), (self.groups, self.draining)
        assert self.epoch >= 1, self.epoch

    @property
    def readable(self) -> tuple[str, ...]:
        """Where consumers pull: ``groups`` and ``draining``, sorted."""
        return tuple(sorted(self.groups + self.draining))

    def encode(self) -> bytes:
        d: dict = {"epoch": self.epoch, "groups": list(self.groups)}
        if self.draining:  # absent when empty: a route that never narrowed keeps its bytes
            d["draining"] = list(self.draining)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Route":
        """A stored route; a bare group name (the format before routes were lists) is a list
        of one at epoch 1. Anything else unreadable is ``ValueError``."""
        text = raw.decode()
        if not text.startswith("{"):
            if not text or any(c.isspace() for c in text):
                raise ValueError(f"unreadable route {text[:80]!r}")
            return cls((text,), 1)
        d = json.loads(text)
        groups = d.get("groups")
        if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and g for g in groups):
            raise ValueError(f"route without groups: {text[:200]!r}")
        draining = d.get("draining", [])
        if not isinstance(draining, list) or not all(isinstance(g, str) and g for g in draining):
            raise ValueError(f"route with unreadable draining groups: {text[:200]!r}")
        epoch = d.get("epoch", 1)
        if not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"route epoch {epoch!r} is not a positive integer")
        written = set(groups)
        return cls(tuple(sorted(written)), epoch, tuple(sorted(set(draining) - written)))


def parse_groups(groups: list[str] | str, check_name) -> tuple[str, ...]:
    """An operator's list (``"rt-1,rt-2"`` or a list) as sorted distinct names, each checked
    with ``check_name(field, value)``; empty or too long is ``InvalidArgument``."""
    if isinstance(groups, str):
        groups = groups.split(",")
    names = sorted({g.strip() for g in groups if g.strip()})
    if not names:
        raise InvalidArgument("groups", "give at least one real-time group")
    if len(names) > ROUTE_GROUPS_MAX:
        raise InvalidArgument("groups", f"{len(names)} groups; a subject may have at most {ROUTE_GROUPS_MAX}")
    for n in names:
        check_name("groups", n)
    return tuple(names)


def narrowing_refusal(subject: str, current: Route, wanted: tuple[str, ...]) -> str:
    """Why ``wanted`` may not replace ``current`` where narrowing is not allowed ("" when it
    may: it keeps every group)."""
    dropped = sorted(set(current.groups) - set(wanted))
    if not dropped:
        return ""
    return (f"route of {subject!r} would drop {', '.join(dropped)}: this caller only widens; "
            f"the route stays {','.join(current.groups)}")


def change(subject: str, current: Route | None, wanted: tuple[str, ...]) -> Route:
    """The route after an operator's ``--groups wanted``: ``current`` itself when nothing
    changes, else a new route at epoch + 1 whose ``groups`` are ``wanted``; a dropped group
    goes to ``draining``, a listed draining group comes back out of it."""
    if current is None:
        return Route(tuple(sorted(set(wanted))), 1)
    groups = tuple(sorted(set(wanted)))
    if groups == current.groups:
        return current
    draining = (set(current.draining) | set(current.groups)) - set(groups)
    return Route(groups, current.epoch + 1, tuple(sorted(draining)))


narrow = change  # the name the design uses for a change that drops groups: drop means drain


def dropped(current: Route | None, after: Route) -> tuple[str, ...]:
    """Groups ``after`` starts draining (written to under ``current``, not any more)."""
    return tuple(g for g in after.draining if current is None or g not in current.draining)


def taken_back(current: Route | None, after: Route) -> tuple[str, ...]:
    """Draining groups of ``current`` that ``after`` writes to again."""
    return tuple(g for g in after.groups if current is not None and g in current.draining)


def finish(current: Route, group: str) -> Route:
    """The route once ``group`` (draining) holds nothing any consumer group still needs: it
    leaves the route, epoch + 1. ``InvalidArgument`` when it is not draining."""
    if group not in current.draining:
        raise InvalidArgument("group", f"{group!r} is not draining in this route")
    return Route(current.groups, current.epoch + 1, tuple(g for g in current.draining if g != group))


def widen(subject: str, current: Route | None, wanted: tuple[str, ...]) -> Route:
    """``change`` for callers that may only widen: dropping a group is ``InvalidArgument``."""
    if current is not None:
        why = narrowing_refusal(subject, current, wanted)
        if why:
            raise InvalidArgument("groups", why)
        wanted = tuple(sorted(set(wanted) | set(current.groups)))
    return change(subject, current, wanted)


def id_hash(msg_id: bytes | str) -> int:
    return xxhash.xxh3_64_intdigest(msg_id.encode() if isinstance(msg_id, str) else msg_id)


def group_of(msg_id: bytes | str, groups: tuple[str, ...] | list[str]) -> str:
    """The group of ``groups`` (a route's, sorted) that message ``msg_id`` goes to."""
    if not groups:
        raise InvalidArgument("groups", "a route has at least one group")
    return groups[id_hash(msg_id) % len(groups)]


def group_index(ids: list[bytes] | list[str], n_groups: int) -> np.ndarray:
    """``group_of`` over many ids at once: the index into the route's groups of each id."""
    assert n_groups >= 1, n_groups
    if n_groups == 1:
        return np.zeros(len(ids), np.int64)
    h = np.fromiter(map(id_hash, ids), np.uint64, len(ids))
    return (h % np.uint64(n_groups)).astype(np.int64)


@dataclass(frozen=True)
class RouteView:
    """What a client knows of a subject's route: its groups (the route's order), each one's
    master address ("" while it has none), the route's epoch, and the draining groups with
    their masters (read only: consumers pull from them, nobody sends there)."""

    groups: tuple[str, ...]
    masters: tuple[str, ...]
    epoch: int = 1
    draining: tuple[str, ...] = ()
    draining_masters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.groups) == len(self.masters) >= 1, (self.groups, self.masters)
        assert len(self.draining) == len(self.draining_masters), (self.draining, self.draining_masters)

    @classmethod
    def single(cls, address: str) -> "RouteView":
        """A route of one group named after its one node (a static resolver: no meta server)."""
        return cls((address,), (address,), 1)

    def live(self) -> list[str]:
        """Masters of the readable groups that have one (consumers pull from each): the
        groups written to first, then the draining ones."""
        return [m for m in self.masters + self.draining_masters if m]

    def writable_live(self) -> list[str]:
        """Masters of the groups written to that have one."""
        return [m for m in self.masters if m]

    def readable(self) -> list[tuple[str, str]]:
        """``(group, master)`` of every readable group: written ones first, then draining."""
        return list(zip(self.groups + self.draining, self.masters + self.draining_masters))

    def first_master(self) -> str:
        return next((m for m in self.masters if m), "")

    def targets(self, ids: list[bytes] | list[str]) -> np.ndarray:
        """Index into ``groups``/``masters`` of each id's group (``group_index``)."""
        return group_index(ids, len(self.groups))
