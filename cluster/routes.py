"""A subject's route: the real-time groups that serve it, with an epoch. Pure: no I/O.

A route is stored in etcd under ``/hourglass/subjects/{subject}`` (``metaserver/keyspace.py``)
and read by every process that sends or pulls a subject's messages: the delay nodes
(dispatching), immediate producers and consumers (``cluster/client.py``). The hash that
picks a message's group lives here, once, so all of them agree.

Value format (JSON, keys sorted)::

    {"epoch": 2, "groups": ["rt-1", "rt-2", "rt-3"]}

* ``groups``: sorted, distinct real-time group names, at least one (``ROUTE_GROUPS_MAX`` at
  most). Sorted so that the order (and with it the hash choice) does not depend on how an
  operator spelled the list.
* ``epoch``: 1 when the route is created, +1 on every change. A reader keeps the route with
  the larger epoch (a cached answer never replaces a newer one).
* A value written before routes were lists is the bare group name (``rt-1``); it reads as
  ``{"epoch": 1, "groups": ["rt-1"]}``, so existing clusters keep their routes unchanged.

The message -> group rule (``group_index``): ``xxh3_64(id) % len(groups)``. It depends on the
id and the route only, so a retry of one id under one route lands in the group that has it
and is de-duplicated there. It is not ``crc32``, the hash that pins an id to a delay group
(``cluster.client.group_for``): with the same hash, all of one delay group's messages of a
subject would go to one real-time group whenever the two counts share a factor.

Changes: only widening (``widen``): the new list must contain every group of the old one.
New messages spread over all listed groups at once; nothing already stored moves, and the
consumers pull from every listed group, so messages stored before the change stay
deliverable. Narrowing would leave messages in a group nobody pulls any more: it needs a
drain first (not built), so it is refused (``narrowing_refusal``).

Worked example: ``orders`` routed to ``["rt-1"]`` (epoch 1) is widened with
``--groups rt-1,rt-3,rt-2``: the route becomes ``["rt-1", "rt-2", "rt-3"]``, epoch 2. An id
whose xxh3 is 7 went to ``rt-1`` before and goes to ``groups[7 % 3] = rt-2`` now; a
consumer pulls from all three and finds the old copy in ``rt-1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import xxhash

from cluster.errors import InvalidArgument

ROUTE_GROUPS_MAX = 64  # groups one subject may be spread over (a consumer holds a pull on each)


@dataclass(frozen=True)
class Route:
    """A subject's real-time groups (sorted, distinct) and the route's epoch."""

    groups: tuple[str, ...]
    epoch: int = 1

    def __post_init__(self) -> None:
        assert self.groups and list(self.groups) == sorted(set(self.groups)), self.groups
        assert self.epoch >= 1, self.epoch

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "groups": list(self.groups)}, sort_keys=True).encode()

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
        epoch = d.get("epoch", 1)
        if not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"route epoch {epoch!r} is not a positive integer")
        return cls(tuple(sorted(set(groups))), epoch)


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
    """Why ``wanted`` may not replace ``current`` ("" when it may: it keeps every group)."""
    dropped = sorted(set(current.groups) - set(wanted))
    if not dropped:
        return ""
    return (f"route of {subject!r} would drop {', '.join(dropped)}: narrowing needs a drain of the dropped "
            f"groups first (not built yet); the route stays {','.join(current.groups)}")


def widen(subject: str, current: Route | None, wanted: tuple[str, ...]) -> Route:
    """The route after an operator's ``--groups wanted``: ``current`` itself when nothing
    changes, a new route (epoch + 1) when groups are added. Narrowing is ``InvalidArgument``."""
    if current is None:
        return Route(wanted, 1)
    why = narrowing_refusal(subject, current, wanted)
    if why:
        raise InvalidArgument("groups", why)
    if set(wanted) == set(current.groups):
        return current
    return Route(tuple(sorted(set(wanted) | set(current.groups))), current.epoch + 1)


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
    master address ("" while it has none) and the route's epoch."""

    groups: tuple[str, ...]
    masters: tuple[str, ...]
    epoch: int = 1

    def __post_init__(self) -> None:
        assert len(self.groups) == len(self.masters) >= 1, (self.groups, self.masters)

    @classmethod
    def single(cls, address: str) -> "RouteView":
        """A route of one group named after its one node (a static resolver: no meta server)."""
        return cls((address,), (address,), 1)

    def live(self) -> list[str]:
        """Masters of the groups that have one (consumers pull from each)."""
        return [m for m in self.masters if m]

    def first_master(self) -> str:
        return next((m for m in self.masters if m), "")

    def targets(self, ids: list[bytes] | list[str]) -> np.ndarray:
        """Index into ``groups``/``masters`` of each id's group (``group_index``)."""
        return group_index(ids, len(self.groups))
