"""Free local ports for the processes the dev and test launchers start (``LocalCluster``,
``EtcdCluster``): below the kernel's ephemeral range, so a restarted process can bind its
port again.

``HOURGLASS_PORT_RANGE=LO-HI`` (both included) narrows the picks to that range: each worker of
a parallel test run (tests/conftest.py, pytest-xdist) gets a range of its own, so two workers
never hand out the same port before either binds it (its child processes inherit it)."""

from __future__ import annotations

import os
import random
import socket

from cluster.errors import InvalidArgument

# Ports this process handed out. A port is only free when checked: two picks for the same
# cluster (or two clusters of one test run) must not get the same one before either binds.
_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


PORT_RANGE_ENV = "HOURGLASS_PORT_RANGE"


def port_range() -> tuple[int, int]:
    """The range free_port picks from, ``[start, stop)``: HOURGLASS_PORT_RANGE when it is set
    and valid, else the 12,000 ports below the kernel's ephemeral range."""
    raw = os.environ.get(PORT_RANGE_ENV, "")
    if raw:
        try:
            lo_s, hi_s = raw.split("-", 1)
            lo, hi = int(lo_s), int(hi_s)
        except ValueError:
            raise InvalidArgument(PORT_RANGE_ENV, f"{raw!r}: expected LO-HI, e.g. 20768-26767") from None
        if not 1024 <= lo <= hi <= 65535:
            raise InvalidArgument(PORT_RANGE_ENV, f"{raw!r}: expected 1024 <= LO <= HI <= 65535")
        return lo, hi + 1
    lo, _ = _ephemeral_range()
    return max(1024, lo - 12_000), lo


def split_range(start: int, stop: int, index: int, count: int) -> tuple[int, int]:
    """Part ``index`` of ``count`` equal parts of ``[start, stop)``, as ``(lo, hi)`` with both
    included (the HOURGLASS_PORT_RANGE form)."""
    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}")
    size = (stop - start) // count
    return start + index * size, start + (index + 1) * size - 1


def free_port() -> int:
    """A free 127.0.0.1 port *below* the kernel's ephemeral range (or in HOURGLASS_PORT_RANGE).
    A node that is killed and restarted binds its port again; a port from the ephemeral range
    may meanwhile have been taken as the source port of some outgoing connection, and the
    restart fails to bind."""
    start, stop = port_range()
    for _ in range(200):
        port = random.randrange(start, stop)
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
