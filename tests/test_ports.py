"""cluster/ports.py: the range free_port picks from, and its parts for parallel test workers."""

from __future__ import annotations

import socket

import pytest

from cluster import ports
from cluster.errors import InvalidArgument


def test_default_range_is_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)
    lo, _ = ports._ephemeral_range()
    assert ports.port_range() == (max(1024, lo - 12_000), lo)


def test_the_environment_narrows_the_range(monkeypatch):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "15000-15009")
    assert ports.port_range() == (15000, 15010)
    picked = set()
    for _ in range(5):
        picked.add(ports.free_port())
    assert picked <= set(range(15000, 15010)) and len(picked) == 5  # no port handed out twice


@pytest.mark.parametrize("raw", ["21000", "a-b", "21010-21000", "80-90", "60000-70000"])
def test_a_bad_range_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, raw)
    with pytest.raises(InvalidArgument, match=ports.PORT_RANGE_ENV):
        ports.port_range()


def test_parts_cover_the_range_without_overlap():
    parts = [ports.split_range(20768, 32768, i, 3) for i in range(3)]
    assert parts == [(20768, 24767), (24768, 28767), (28768, 32767)]
    with pytest.raises(ValueError):
        ports.split_range(20768, 32768, 3, 3)


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{port}-{port}")
        got = ports.free_port()  # the one port of the range is taken: the kernel chooses
        assert got != port
