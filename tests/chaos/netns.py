"""Network namespaces for partition tests: a private switch the test builds and tears down.

``Netns(members=["core", "d1", "d2"])`` creates, all with names ``hg-<pid>-<n>-...``:

* a hub namespace holding a Linux bridge ``br0``;
* one namespace per member, joined to the bridge by a veth pair (``eth0`` inside the
  member, ``m-<member>`` in the hub), with ``10.213.<subnet>.<k>/24`` on ``eth0``;
* ``lo`` up everywhere.

Nothing is added to the root namespace: no address, route, link or iptables rule (veth
pairs are created from inside the hub, so neither end ever exists in the root namespace).
The root namespace cannot reach the members; a process that must talk to them runs inside
one (``exec_prefix(member)`` = ``["ip", "netns", "exec", ns]``; ``ip netns exec`` execs,
so the started process keeps the PID it was given).

``partition(member)`` sets the member's hub-side veth down: the member can still reach
its own addresses and ``lo``, nothing else, and nobody can reach it (packets are dropped,
connections time out, like a pulled cable). ``heal(member)`` sets it up again.

On exit (also after an exception, and from ``__init__`` if creation fails half way) every
namespace this object created is deleted by its name; deleting a namespace deletes its
veth ends and the bridge.

    with Netns(["core", "a"]) as net:
        subprocess.run([*net.exec_prefix("a"), "python", "-c", "..."])
        net.partition("a"); net.heal("a")

``available()`` says whether this can run here (root, ``ip`` present or installable,
``ip netns add`` and a bridge/veth work) and why not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

IP_TIMEOUT_S = 10.0
SUBNET_BASE = 213  # 10.213.x.0/24
_serial = itertools.count(1)


class NetnsError(RuntimeError):
    """An ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _ensure_ip() -> str | None:
    """``None`` when ``ip`` is there (installing iproute2 if missing and root), else why not."""
    if shutil.which("ip"):
        return None
    if os.geteuid() != 0:
        return "no `ip` command (iproute2) and not root to install it"
    r = subprocess.run(["apt-get", "install", "-y", "-q", "iproute2"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 or not shutil.which("ip"):
        return f"no `ip` command and `apt-get install iproute2` failed: {r.stderr.strip()[-300:]}"
    return None


def available() -> tuple[bool, str]:
    """(True, "") when namespaces, a bridge and veth pairs can be made here, else (False, reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "network namespaces need root"
    why = _ensure_ip()
    if why:
        return False, why
    try:
        with Netns(["probe"], subnet=254):
            pass
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create network namespaces here: {e}"
    return True, ""


class Netns:
    """A hub namespace with a bridge and one namespace per member; see the module docstring."""

    def __init__(self, members: list[str], *, subnet: int | None = None) -> None:
        if not members or len(members) > 200:
            raise ValueError("between 1 and 200 members")
        serial = next(_serial)
        self.prefix = f"hg-{os.getpid()}-{serial}-"
        self.subnet = subnet if subnet is not None else (os.getpid() + serial) % 200 + 20
        self.hub = self.prefix + "hub"
        self.names = {m: self.prefix + m for m in members}
        self.addresses = {m: f"10.{SUBNET_BASE}.{self.subnet}.{k + 2}" for k, m in enumerate(members)}
        self.created: list[str] = []
        self.partitioned: set[str] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for member, ns in self.names.items():
            self._add_ns(ns)
            port = self.hub_port(member)
            # created inside the hub, the peer moved straight into the member: never in the root namespace
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[member]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def hub_port(self, member: str) -> str:
        return f"m-{member}"[:15]

    def ns(self, member: str) -> str:
        return self.names[member]

    def exec_prefix(self, member: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[member]]

    def partition(self, member: str) -> None:
        """Cut ``member`` off from every other member (its hub-side link down)."""
        _ip("-n", self.hub, "link", "set", self.hub_port(member), "down")
        self.partitioned.add(member)

    def heal(self, member: str) -> None:
        _ip("-n", self.hub, "link", "set", self.hub_port(member), "up")
        self.partitioned.discard(member)

    def describe(self) -> dict:
        """JSON-able view for a process started inside a member (it may partition/heal too)."""
        return {"hub": self.hub, "names": self.names, "addresses": self.addresses, "prefix": self.prefix}

    def close(self) -> None:
        """Delete every namespace this object created, by name (members first, then the hub)."""
        errors = []
        for name in reversed(self.created):
            r = _ip("netns", "del", name, check=False)
            if r.returncode != 0:
                errors.append(f"{name}: {r.stderr.strip()}")
        self.created.clear()
        if errors:
            raise NetnsError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> "Netns":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def partition_from_description(desc: dict, member: str, *, down: bool) -> None:
    """Partition/heal from another process (the driver inside a member) given ``describe()``."""
    port = f"m-{member}"[:15]
    _ip("-n", desc["hub"], "link", "set", port, "down" if down else "up")
