"""docs/settings.md, written from the settings models: every setting of the node, the meta
server, the security settings both read, and the SDK, with its environment variable and its
default. ``tests/test_docs.py`` fails when the file differs from what this renders; write it
again with ``PYTHONPATH=. python3 -m tests.helpers.settings_doc``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from cluster.clientsettings import ClientSettings
from cluster.security import SecuritySettings
from metaserver.config import MetaSettings
from node.config import SECTION_DEFAULTS, SECTIONS, NodeSettings

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
PATH = DOCS / "settings.md"

SECTION_HOMES = {"store": "`node/store/settings.py` `StoreSettings`", "realtime": "`node/store/settings.py` "
                 "`RealtimeSettings`", "scrub": "`node/store/settings.py` `ScrubSettings`",
                 "disk": "`node/store/settings.py` `DISK_DEFAULTS` (a `DiskWatermark`)",
                 "limits": "`cluster/codec.py` `Limits` (shared with the SDK)"}
SECTION_TITLES = {"store": "delay store: wheel, schedule, id index, segments", "realtime": "real-time store",
                  "scrub": "scrub and verify", "disk": "disk watermark", "limits": "producer limits"}


def _value(v, name: str = "") -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, Path):
        return f"`{v}`"
    if isinstance(v, list):
        return f"`{json.dumps(v)}`"
    if isinstance(v, int) and "bytes" in name and v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v} ({v >> 30} GiB)" if v % (1 << 30) == 0 else f"{v} ({v >> 20} MiB)"
    if isinstance(v, str):
        return f"`{v}`"
    return str(v)


def _code_words_by_doc() -> dict[str, set[str]]:
    out = {}
    for p in sorted(DOCS.glob("*.md")):
        if p.name == PATH.name:
            continue
        text = p.read_text()
        out[p.name] = {w for span in re.findall(r"`([^`\n]+)`", text)
                       for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}
    return out


WORDS = _code_words_by_doc()


def _what(description: str | None, *names: str) -> str:
    """The model's description, else where the documents explain the setting."""
    if description:
        return description.replace("|", "\\|").replace("\n", " ")
    where = [doc for doc, words in WORDS.items() if any(n in words for n in names)]
    where = sorted(where, key=lambda d: d == "benchmarks.md")  # the benchmarks' history last
    return f"see {', '.join(f'docs/{d}' for d in where[:3])}" if where else ""


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    out = ["| setting | environment | default | what |", "|---|---|---|---|"]
    out += [f"| {name} | `{env}` | {default} | {what} |" for name, env, default, what in rows]
    return out


def _pydantic_rows(model, prefix: str, names=None) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, f in model.model_fields.items():
        if names is not None and name not in names:
            continue
        env = f"{prefix}{name.upper()}"
        rows.append((f"`{name}`", env, _value(f.default, name), _what(f.description, name, env)))
    return rows


def render() -> str:
    node_fields = NodeSettings.model_fields
    out = ["# Settings reference", "",
           "Every setting of a node, a meta server and the SDK, with its default: written from the",
           "settings models by `tests/helpers/settings_doc.py` (`PYTHONPATH=. python3 -m",
           "tests.helpers.settings_doc`); `tests/test_docs.py` fails when this file differs from them.",
           "Each default is written once, in the model named in its heading (issue 29;",
           "`tests/test_settings_tree.py` fails on a second literal anywhere else). The other",
           "documents explain what the settings do; a default they repeat is checked against the",
           "model too.", "",
           "## Node", "",
           "One model, `node.config.NodeSettings`, environment `HOURGLASS_<NAME>` (`hourglass node`",
           "options override it). Its storage sections are built from it (`NodeSettings.section(name)`:",
           "`store_settings()`, `realtime_settings()`, `scrub_settings()`, `disk_watermark()`,",
           "`limits()`); their defaults are written in the section's class, the node's field refers to it.", ""]
    in_sections: set[str] = set()
    for section, (cls, renamed) in SECTIONS.items():
        mine = {field: node for node, field in renamed.items()}
        defaults = SECTION_DEFAULTS[section]
        rows = []
        for f in dataclasses.fields(cls):
            if f.name == "limits":
                continue
            name = mine.get(f.name, f.name)
            in_sections.add(name)
            env = f"HOURGLASS_{name.upper()}"
            label = f"`{name}`" if name == f.name else f"`{name}` (`{section}.{f.name}`)"
            rows.append((label, env, _value(getattr(defaults, f.name), name),
                         _what(node_fields[name].description, name, f.name, env)))
        out += [f"### {section}: {SECTION_TITLES[section]}", "", f"Defaults: {SECTION_HOMES[section]}.", ""]
        out += _table(rows) + [""]
    rest = [n for n in node_fields if n not in in_sections]
    out += ["### the process: serving, meta servers, replication, dispatch, real-time service", "",
            "Defaults: `node/config.py` `NodeSettings`.", ""]
    out += _table(_pydantic_rows(NodeSettings, "HOURGLASS_", set(rest))) + [""]
    out += ["## Security (nodes, meta servers, the CLI)", "",
            "`cluster.security.SecuritySettings`, environment `HOURGLASS_<NAME>` (docs/security.md).", ""]
    out += _table(_pydantic_rows(SecuritySettings, "HOURGLASS_")) + [""]
    out += ["## Meta server", "",
            "`metaserver.config.MetaSettings`, environment `HOURGLASS_META_<NAME>`.", ""]
    out += _table(_pydantic_rows(MetaSettings, "HOURGLASS_META_")) + [""]
    out += ["## SDK", "",
            "`cluster.clientsettings.ClientSettings`, environment `HOURGLASS_CLIENT_<SECTION>__<NAME>`",
            "(read only when a program builds `ClientSettings()`; `Producer.from_settings`,",
            "`Consumer.from_settings` and `MetaResolver.from_settings` take the tree). The constructors'",
            "keyword arguments of the same names default to these values.", ""]
    client = ClientSettings.model_construct()
    for section in ClientSettings.model_fields:
        value = getattr(client, section)
        out += [f"### {section}", ""]
        if dataclasses.is_dataclass(value):
            out += [f"`{type(value).__name__}`: the node's `limits` section above, the same defaults.", ""]
            continue
        out += _table(_pydantic_rows(type(value), f"HOURGLASS_CLIENT_{section.upper()}__")) + [""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
