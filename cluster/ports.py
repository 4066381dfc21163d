"""Free local ports for the processes the dev and test launchers start (``LocalCluster``,
``EtcdCluster``): below the kernel's ephemeral range, so a restarted process can bind its
port again."""

from __future__ import annotations

import random
import socket

# Ports this process handed out. A port is only free when checked: two picks for the same
# cluster (or two clusters of one test run) must not get the same one before either binds.
_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free 127.0.0.1 port *below* the kernel's ephemeral range. A node that is killed and
    restarted binds its port again; a port from the ephemeral range may meanwhile have been
    taken as the source port of some outgoing connection, and the restart fails to bind."""
    lo, _ = _ephemeral_range()
    start = max(1024, lo - 12_000)
    for _ in range(200):
        port = random.randrange(start, lo)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # everything below was busy: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
