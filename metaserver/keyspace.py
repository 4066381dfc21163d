"""The etcd keyspace of Hourglass and the records stored in it. Pure: no I/O.

Keys (all under ``/hourglass``)::

    /hourglass/ids/{node_id}                   -> claim {"lease", "role", "group"}    (node's lease)
    /hourglass/nodes/{role}/{group}/{node_id}  -> NodeRecord JSON                    (node's lease)
    /hourglass/leaders/{role}/{group}          -> {"node_id", "address"}             (leader's lease)
    /hourglass/subjects/{subject}              -> route {"epoch", "groups", "draining"?} (no lease: permanent)
    /hourglass/fences/{group}/{subject}        -> {"draining", "epoch"}             (no lease: metaserver/fences.py)

Invariants:

* a node id is held by at most one live lease (the claim key is created with a
  compare on its version, and every heartbeat compares the claim's value);
* a node record only exists while its claim does (both share the lease);
* the epoch of a leader is the create revision of its leader key; etcd
  revisions only grow, so every new term has a larger epoch than all before;
* a subject's route is created once (create-if-absent, one group, epoch 1) and afterwards
  changed by an operator (widened, or narrowed: a dropped group drains first) or by a drain
  that finished, each change guarded by the key's mod revision and raising the epoch by one
  (``cluster/routes.py``: the format, and a bare group name written before routes were lists
  reads as a list of one); the fences a narrowing writes beside it: ``metaserver/fences.py``.

Worked example of discovery (``build_groups``): records for realtime/rt-1/{a, b}
where ``a`` says master and no leader key -> group rt-1, master = a's address;
if ``/hourglass/leaders/realtime/rt-1`` names ``b`` at epoch 41 -> master = b,
epoch 41, whatever the records say.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster import codec
from cluster.errors import InvalidArgument

PREFIX = "/hourglass"
ROLES = ("delay", "realtime")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
SUBJECT_BYTES_MAX = codec.SUBJECT_BYTES_MAX  # a longer subject is never routed (nor written to etcd)
OFFSETS_MAX = 16


def id_key(node_id: str) -> bytes:
    return f"{PREFIX}/ids/{node_id}".encode()


def node_key(role: str, group: str, node_id: str) -> bytes:
    return f"{PREFIX}/nodes/{role}/{group}/{node_id}".encode()


def nodes_prefix(role: str) -> bytes:
    return f"{PREFIX}/nodes/{role}/".encode()


def leader_key(role: str, group: str) -> bytes:
    return f"{PREFIX}/leaders/{role}/{group}".encode()


def leaders_prefix(role: str) -> bytes:
    return f"{PREFIX}/leaders/{role}/".encode()


def subject_key(subject: str) -> bytes:
    return f"{PREFIX}/subjects/{subject}".encode()


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidArgument("role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def check_name(field_name: str, value: str) -> str:
    if not NAME_RE.fullmatch(value or ""):  # whole: "$" alone also matches before a trailing newline
        raise InvalidArgument(field_name, f"{value!r} must match {NAME_RE.pattern}")
    return value


def check_subject(subject: str) -> str:
    """The one subject rule (``codec.check_subject``): an etcd key is made of nothing else."""
    return codec.check_subject(subject, "subject", SUBJECT_BYTES_MAX)


class NodeRecord(BaseModel):
    """What a node says about itself; stored as JSON under its node key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str
    group: str
    node_id: str
    address: str
    master: bool = False
    offsets: dict[str, int] = Field(default_factory=dict)
    lag_ms: int = Field(default=0, ge=0)
    lag_bytes: int = Field(default=0, ge=0)
    epoch: int = Field(default=0, ge=0)
    updated_ms: int = Field(default=0, ge=0)

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    @field_validator("group", "node_id")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} must match {NAME_RE.pattern}")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(v) > 255:
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("offsets")
    @classmethod
    def _offsets(cls, v: dict[str, int]) -> dict[str, int]:
        if len(v) > OFFSETS_MAX:
            raise ValueError(f"at most {OFFSETS_MAX} offsets")
        for k, off in v.items():
            if not NAME_RE.fullmatch(k) or off < 0:
                raise ValueError(f"offset {k!r}={off} must be a name and >= 0")
        return v

    @classmethod
    def parse(cls, **fields) -> "NodeRecord":
        """Build from untrusted input; any problem is an ``InvalidArgument`` naming the field."""
        try:
            return cls(**fields)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "node"
            raise InvalidArgument(f"node.{where}", err["msg"]) from None

    def to_value(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_value(cls, raw: bytes) -> "NodeRecord":
        return cls.model_validate_json(raw)


def claim_value(lease_id: int, role: str, group: str) -> bytes:
    return json.dumps({"lease": lease_id, "role": role, "group": group}, sort_keys=True).encode()


def parse_claim(raw: bytes) -> dict:
    return json.loads(raw)


def leader_value(node_id: str, address: str) -> bytes:
    return json.dumps({"node_id": node_id, "address": address}, sort_keys=True).encode()


def in_sync_key(role: str, group: str) -> bytes:
    """The group's in-sync set and its store-epoch counter (not attached to any lease)."""
    return f"{PREFIX}/insync/{role}/{group}".encode()


@dataclass(frozen=True)
class InSync:
    """``/hourglass/insync/{role}/{group}``: the members whose logs hold every acknowledged
    record (only they may be elected) and the last store epoch handed to a term (each term
    gets a larger one, so seqs of two terms never collide, even terms that never saw each
    other's records)."""

    members: tuple[str, ...] = ()
    store_epoch: int = 0

    def encode(self) -> bytes:
        return json.dumps({"members": sorted(self.members), "store_epoch": self.store_epoch}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "InSync":
        d = json.loads(raw)
        return cls(tuple(sorted(str(m) for m in d.get("members", []))), int(d.get("store_epoch", 0)))


def campaign_in_sync(current: InSync | None, candidate: str, store_epoch_min: int) -> tuple[str, InSync]:
    """Pure rule of a campaign: ``("", the set to write with the seat)`` when ``candidate``
    may be elected, else ``(why not, current)``. A group with no set yet (new, or from before
    in-sync sets) starts one with the winner; the master adds the others as they catch up."""
    if current is not None and current.members and candidate not in current.members:
        return (f"{candidate!r} is not in the in-sync set {list(current.members)}: it may lack acknowledged "
                f"records (an operator can force it: hourglass admin force-in-sync)"), current
    base = current or InSync()
    members = base.members if base.members else (candidate,)
    return "", InSync(members, max(base.store_epoch, store_epoch_min) + 1)


@dataclass(frozen=True)
class LeaderInfo:
    node_id: str
    address: str
    epoch: int  # create revision of the leader key

    @classmethod
    def from_kv(cls, value: bytes, create_revision: int) -> "LeaderInfo":
        d = json.loads(value)
        return cls(node_id=d["node_id"], address=d["address"], epoch=create_revision)


@dataclass
class GroupView:
    role: str
    name: str
    master: str = ""
    epoch: int = 0
    members: list[NodeRecord] = field(default_factory=list)


def build_groups(role: str, records: list[NodeRecord], leaders: dict[str, LeaderInfo]) -> list[GroupView]:
    """Groups of one role, sorted by name. The leader key names the master when there is
    one; otherwise the member that says it is master (lowest node id if several)."""
    groups: dict[str, GroupView] = {}
    for r in records:
        if r.role == role:
            groups.setdefault(r.group, GroupView(role, r.group)).members.append(r)
    out = []
    for name in sorted(groups):
        g = groups[name]
        g.members.sort(key=lambda r: r.node_id)
        leader = leaders.get(name)
        if leader is not None:
            g.master, g.epoch = leader.address, leader.epoch
        else:
            masters = [r for r in g.members if r.master]
            g.master = masters[0].address if masters else ""
        out.append(g)
    return out


def choose_group(subject: str, groups: list[GroupView]) -> GroupView | None:
    """First-use route of a subject: a stable hash over the live groups' names."""
    live = sorted((g for g in groups if g.master), key=lambda g: g.name)
    if not live:
        return None
    return live[zlib.crc32(subject.encode()) % len(live)]


def route_views(route, groups: list[GroupView], *, draining: bool = False) -> list[GroupView]:
    """The views of a route's groups (``draining``: of its draining groups), in its order; a
    group with no live node is a view without a master (its share of the subject waits
    until one is elected)."""
    by_name = {g.name: g for g in groups}
    return [by_name.get(name) or GroupView("realtime", name) for name in (route.draining if draining else route.groups)]
