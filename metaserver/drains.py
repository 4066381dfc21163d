"""Drained delay groups in etcd: the operator's ``hourglass admin drain GROUP``.

Key (no lease: it outlives every node and meta server, so a failover of the drained group's
master, or of a meta server, does not end the drain)::

    /hourglass/drains/delay/{group} -> {"since_ms": 1764216000000}

Rules (docs/design.md, "Draining a delay group"):

* only a registered delay group is drained, and never the last one not draining: its
  messages must have somewhere to go (``InvalidArgument``, nothing written);
* draining is idempotent: asking again answers the same ``since_ms`` and writes nothing;
* a drain is never undone by this module: the group is removed (Helm values) once empty,
  and its key is deleted by hand (docs/operations.md) if the group is ever brought back.

``GetServers`` for ``DELAYED_PRODUCER`` leaves a draining group out unless the caller asks
for it (``include_draining``: SDKs that ask it about ids, the drained node itself).
"""

from __future__ import annotations

import json
import logging
import time

from cluster.errors import InvalidArgument
from metaserver import keyspace as ks
from metaserver.etcd import EtcdClient

log = logging.getLogger("hourglass.meta.drains")


def drain_key(group: str) -> bytes:
    return f"{ks.PREFIX}/drains/delay/{group}".encode()


def drains_prefix() -> bytes:
    return f"{ks.PREFIX}/drains/delay/".encode()


def check_drain(group: str, registered: set[str], draining: set[str]) -> None:
    """``InvalidArgument`` unless ``group`` may start draining now (pure)."""
    if group not in registered:
        raise InvalidArgument("group", f"no registered delay group named {group!r} "
                                       f"(registered: {', '.join(sorted(registered)) or 'none'})")
    others = registered - draining - {group}
    if group not in draining and not others:
        raise InvalidArgument("group", f"{group!r} is the last delay group not draining: its messages "
                                       f"would have nowhere to go (add a delay group first)")


class Drains:
    def __init__(self, etcd: EtcdClient, *, clock=time.time) -> None:
        self.etcd = etcd
        self._clock = clock

    async def draining(self) -> dict[str, int]:
        """Draining delay group -> since_ms (one range read)."""
        kvs = await self.etcd.call(lambda c: c.get_prefix(drains_prefix()))
        plen = len(drains_prefix())
        out = {}
        for kv in kvs:
            try:
                out[kv.key[plen:].decode()] = int(json.loads(kv.value)["since_ms"])
            except (ValueError, KeyError, TypeError):
                log.error("unreadable drain key=%s", kv.key)
                out[kv.key[plen:].decode()] = 0  # still draining: a key means a drain
        return out

    async def drain(self, group: str, registered: set[str]) -> tuple[int, bool]:
        """Start draining ``group``: (since_ms, changed)."""
        ks.check_name("group", group)
        now = await self.draining()
        check_drain(group, registered, set(now))
        if group in now:
            return now[group], False
        since = int(self._clock() * 1000)
        key = drain_key(group)
        ok, resps = await self.etcd.call(lambda c: c.transaction(
            compare=[c.transactions.version(key) == 0],
            success=[c.transactions.put(key, json.dumps({"since_ms": since}).encode())],
            failure=[c.transactions.get(key)]))
        if not ok:  # another operator at the same moment: theirs stands
            return int(json.loads(resps[0][0][0])["since_ms"]), False
        log.warning("drain started group=%s since_ms=%d", group, since)
        return since, True
