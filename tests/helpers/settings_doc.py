"""docs/settings.md, written from the settings models: every setting of the node, the meta
server, the security settings both read, and the SDK, with its environment variable and its
default. ``tests/test_docs.py`` fails when the file differs from what this renders; write it
again with ``PYTHONPATH=. python3 -m tests.helpers.settings_doc``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

from cluster.clientsettings import ClientSettings
from cluster.security import SecuritySettings
from metaserver.config import MetaSettings
from node.config import FLAT_NAMES, TREE

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
PATH = DOCS / "settings.md"

SECTION_HOMES = {"store": "`node/store/settings.py` `StoreSettings`", "realtime": "`node/store/settings.py` "
                 "`RealtimeSettings` (the real-time service's own settings: `node/config.py`)",
                 "scrub": "`node/store/settings.py` `ScrubSettings`",
                 "disk": "`node/store/settings.py` `DISK_DEFAULTS` (a `DiskWatermark`; the intervals: "
                         "`node/config.py`)",
                 "limits": "`cluster/codec.py` `Limits` (shared with the SDK; the RPC sizes: `node/config.py`)"}


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
    flat = {path: name for name, path in FLAT_NAMES.items()}
    out = ["# Settings reference", "",
           "Every setting of a node, a meta server and the SDK, with its default: written from the",
           "settings models by `tests/helpers/settings_doc.py` (`PYTHONPATH=. python3 -m",
           "tests.helpers.settings_doc`); `tests/test_docs.py` fails when this file differs from them.",
           "Each default is written once, in the model named in its heading (issue 29;",
           "`tests/test_settings_tree.py` fails on a second literal anywhere else). The other",
           "documents explain what the settings do; a default they repeat is checked against the",
           "model too.", "",
           "## Node", "",
           "One nested model, `node.config.NodeSettings`: a section per concern, each setting read by",
           "its path (`settings.store.tick_ms`). Each setting also has one flat name, the name it had",
           "before the tree was nested, and `HOURGLASS_<FLAT>` sets it (`HOURGLASS_TICK_MS`; a list as",
           "JSON: `HOURGLASS_META_SERVERS='[\"10.0.0.5:7100\"]'`); the nested form",
           "`HOURGLASS_<SECTION>__<NAME>` works too, and a flat variable wins over it. `hourglass node`",
           "options override both. The stores take the storage sections as dataclasses built from the",
           "section of the same name (`NodeSettings.section(name)`; `store_settings()`,",
           "`realtime_settings()`, `disk_watermark()`); their defaults are written in the dataclass,",
           "the section's field refers to it.", ""]
    for section, cls in TREE.items():
        rows = []
        for name, f in cls.model_fields.items():
            env = f"HOURGLASS_{flat[section, name].upper()}"
            rows.append((f"`{section}.{name}`", env, _value(f.default, name),
                         _what(f.description, name, flat[section, name], env)))
        title = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ").replace("``", "`")
        home = SECTION_HOMES.get(section, "`node/config.py`")
        out += [f"### {section}: `{cls.__name__}`", "", f"{title} Defaults: {home}.", ""]
        out += _table(rows) + [""]
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
