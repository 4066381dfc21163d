"""node/config.py: one settings tree. The sections' defaults are written once
(node/store/settings.py); every one of them can be set as HOURGLASS_<FIELD>, and the
sections a node builds carry what was set."""

from __future__ import annotations

import dataclasses

import pytest

from node.config import SECTION_DEFAULTS as DEFAULTS
from node.config import SECTIONS, NodeSettings


def test_every_section_has_its_defaults_object():
    assert set(DEFAULTS) == set(SECTIONS)
    assert all(isinstance(DEFAULTS[name], cls) for name, (cls, _) in SECTIONS.items())


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_section_setting_has_one_default_and_can_be_set(monkeypatch, section):
    cls, renamed = SECTIONS[section]
    defaults = DEFAULTS[section]
    build = lambda n: n.section(section)  # noqa: E731
    mine = {store: node for node, store in renamed.items()}
    fields = [f for f in dataclasses.fields(cls) if f.name != "limits"]
    built = build(NodeSettings())
    for f in fields:
        assert getattr(built, f.name) == getattr(defaults, f.name), f"{f.name}: NodeSettings has another default"
    for f in fields:
        name = mine.get(f.name, f.name)
        assert name in NodeSettings.model_fields, f"{f.name} cannot be set (no NodeSettings.{name})"
        value = getattr(defaults, f.name)
        new = (not value) if isinstance(value, bool) else value * 2 if isinstance(value, int) else value / 2
        monkeypatch.setenv(f"HOURGLASS_{name.upper()}", str(new).lower() if isinstance(new, bool) else str(new))
    built = build(NodeSettings())
    for f in fields:
        value = getattr(defaults, f.name)
        want = (not value) if isinstance(value, bool) else value * 2 if isinstance(value, int) else value / 2
        assert getattr(built, f.name) == want, f"HOURGLASS_{mine.get(f.name, f.name).upper()} did not reach {f.name}"


def test_limits_reach_both_stores(monkeypatch):
    monkeypatch.setenv("HOURGLASS_PAYLOAD_BYTES_MAX", "1234")
    n = NodeSettings()
    assert n.store_settings().limits.payload_bytes_max == n.realtime_settings().limits.payload_bytes_max == 1234
