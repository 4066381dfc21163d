"""The documents must match the code: every name a user or operator meets is written down.

Each list is derived from the code (the CLI's command tree, the proto's ``Code`` enum and
``cluster.status.TABLE``, the settings models, the metrics registry, the on-disk formats),
so a new command, setting, code or metric without documentation fails here.

Settings and metrics that were undocumented when these checks were written are listed in
``*_UNDOCUMENTED``; the lists may only shrink (a listed name that gets documented fails
the test until it is taken off the list).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import grpc
import pytest
import typer.main

from cluster import codec, status
from cluster import errors as E
from cluster.cli import app
from cluster.clientsettings import ClientSettings
from cluster.devcluster import RestartPolicy
from cluster.proto import hourglass_pb2 as pb
from cluster.security import SecuritySettings
from metaserver.config import MetaSettings
from node import wheel
from node.config import FLAT_NAMES, NodeSettings
from node.metrics import NodeMetrics
from node.realtime import store as rt_store
from node.replication import delay as delay_replication
from node.replication import realtime as realtime_replication
from node.store import idindex, log, schedule, verify
from tests.helpers import settings_doc

DOCS = Path(__file__).resolve().parent.parent / "docs"
FORMAT = (DOCS / "format.md").read_text()
API = (DOCS / "api.md").read_text()
CLI = (DOCS / "cli.md").read_text()
ALL_DOCS = "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))

NODE_SETTINGS_UNDOCUMENTED: set[str] = set()
META_SETTINGS_UNDOCUMENTED: set[str] = set()
METRICS_UNDOCUMENTED: set[str] = set()


def code_words(text: str) -> set[str]:
    """Every identifier inside an inline code span (`...`): where the documents name things."""
    return {w for span in re.findall(r"`([^`\n]+)`", text) for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


DOC_WORDS = code_words(ALL_DOCS)


def ratchet(names: set[str], documented, known_undocumented: set[str], what: str) -> None:
    missing = {n for n in names if not documented(n)}
    new = sorted(missing - known_undocumented)
    assert not new, f"{what} not documented in docs/*.md (name them in `code`): {new}"
    fixed = sorted(known_undocumented - missing)
    assert not fixed, f"{what} now documented or gone: take them off the undocumented list in {__file__}: {fixed}"


# ---------------------------------------------------------------------------------------------- CLI


def cli_commands(group=None, prefix: tuple[str, ...] = ()) -> list[str]:
    group = group or typer.main.get_command(app)
    out = []
    for name, cmd in sorted(group.commands.items()):
        if getattr(cmd, "commands", None):
            out += cli_commands(cmd, prefix + (name,))
        else:
            out.append(" ".join(prefix + (name,)))
    return out


def test_cli_tree_is_found():
    assert {"send", "dev up", "admin verify"} <= set(cli_commands())


@pytest.mark.parametrize("command", cli_commands())
def test_every_cli_command_is_in_the_command_table(command):
    rows = [line for line in CLI.splitlines() if line.startswith("| `hourglass ")]
    assert any(re.search(rf"`hourglass {re.escape(command)}( [^`]*)?`", row) for row in rows), \
        f"`hourglass {command}` has no row in the command table of docs/cli.md"


# ----------------------------------------------------------------------------------- error codes


def api_error_rows() -> list[tuple[str, str, str]]:
    """(domain error, Code, gRPC status) of each row of the table in docs/api.md, 'Errors'."""
    section = API.split("## Errors", 1)[1]
    return re.findall(r"^\| (`\w+`|anything else) \| `(\w+)` \| `(\w+)` \|", section, re.M)


def test_every_code_of_the_proto_is_in_the_error_table():
    documented = {code for _, code, _ in api_error_rows()}
    missing = sorted(set(pb.Code.keys()) - {"OK"} - documented)
    assert not missing, f"Code values without a row in docs/api.md 'Errors': {missing}"


@pytest.mark.parametrize("row", api_error_rows(), ids=lambda r: r[0].strip("`"))
def test_each_error_row_says_what_the_status_table_does(row):
    name, code, grpc_status = row
    if name == "anything else":
        exc = RuntimeError("a bug")
    else:
        cls = getattr(E, name.strip("`"))
        exc = cls.__new__(cls)  # the table matches on the class only
    assert pb.Code.Name(status.to_code(exc)) == code
    assert status.to_grpc(exc) == getattr(grpc.StatusCode, grpc_status)


# ------------------------------------------------------------------------------ settings, metrics


def test_every_node_setting_is_documented():
    ratchet(set(FLAT_NAMES), lambda f: f in DOC_WORDS or f"HOURGLASS_{f.upper()}" in DOC_WORDS,
            NODE_SETTINGS_UNDOCUMENTED, "node settings")


def test_every_meta_setting_is_documented():
    ratchet(set(MetaSettings.model_fields), lambda f: f in DOC_WORDS or f"HOURGLASS_META_{f.upper()}" in DOC_WORDS,
            META_SETTINGS_UNDOCUMENTED, "meta server settings")


def test_the_settings_reference_is_written_from_the_models():
    """docs/settings.md lists every setting of every model with its default, as
    tests/helpers/settings_doc.py renders them (a new setting or a changed default changes it)."""
    assert (DOCS / "settings.md").read_text() == settings_doc.render(), \
        "docs/settings.md is not the models' (PYTHONPATH=. python3 -m tests.helpers.settings_doc writes it again)"


def test_every_sdk_setting_is_documented():
    client = ClientSettings.model_construct()
    names = {(section, name) for section in ClientSettings.model_fields
             for name in (getattr(client, section).__class__.model_fields
                          if not dataclasses.is_dataclass(getattr(client, section)) else ())}
    missing = sorted(f"{s}.{n}" for s, n in names
                     if f"HOURGLASS_CLIENT_{s.upper()}__{n.upper()}" not in DOC_WORDS or n not in DOC_WORDS)
    assert not missing, f"SDK settings not in docs/*.md: {missing}"


def _defaults(model) -> dict[str, object]:
    if dataclasses.is_dataclass(model):
        return {f.name: f.default for f in dataclasses.fields(model)}
    return {name: f.default for name, f in model.model_fields.items()}


def _node_defaults() -> dict[str, object]:
    """A node setting's default by its flat name (``tick_ms``, what the documents name) and by
    its path (``store.tick_ms``)."""
    tree = NodeSettings.model_construct()
    out = {}
    for flat, (section, field) in FLAT_NAMES.items():
        out[flat] = out[f"{section}.{field}"] = type(getattr(tree, section)).model_fields[field].default
    return out


NODE_DEFAULTS = {**_defaults(SecuritySettings), **_node_defaults()}
META_DEFAULTS = _defaults(MetaSettings)
DEV_DEFAULTS = _defaults(RestartPolicy)


def _documented_default(cell: str) -> list[object]:
    """The values a default cell states: numbers and booleans (``10000 / 100000``); anything
    else (``none``, ``0 = TTL / 3``, an address) is prose and is not compared."""
    out = []
    for part in cell.split(" / "):
        part = part.strip().strip("`")
        if re.fullmatch(r"-?\d+(\.\d+)?", part):
            out.append(float(part) if "." in part else int(part))
        elif part in ("true", "false"):
            out.append(part == "true")
        else:
            return []
    return out


def documented_defaults() -> list[tuple[str, str, str, object, object]]:
    """(file, table row's setting, model, documented default, model default) of every row of
    a table with a ``default`` column in docs/*.md that states a number or a boolean
    (docs/settings.md aside: it is the models' own list)."""
    rows = []
    for path in sorted(DOCS.glob("*.md")):
        if path.name == "settings.md":  # written from the models (checked whole above)
            continue
        header = None
        for line in path.read_text().splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
                continue
            if "default" not in header or set(line) <= set("|-: "):
                continue
            col = header.index("default")
            first, values = cells[0], _documented_default(cells[col])
            names = [n.strip() for n in first.split(" / ")]
            if not values or len(names) != len(values):
                continue
            for name_cell, value in zip(names, values):
                words = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", name_cell)
                if not words:
                    continue
                word = words[0]
                if header[0].startswith("setting (`dev up`"):
                    model, defaults, name = "RestartPolicy", DEV_DEFAULTS, word
                elif word.startswith("HOURGLASS_META_") and "(node)" not in name_cell:
                    model, defaults, name = "MetaSettings", META_DEFAULTS, word[len("HOURGLASS_META_"):].lower()
                elif word.startswith("HOURGLASS_"):
                    model, defaults, name = "NodeSettings", NODE_DEFAULTS, word[len("HOURGLASS_"):].lower()
                elif header[0].startswith("meta server") or "HOURGLASS_META_" in name_cell or "(meta)" in name_cell:
                    model, defaults, name = "MetaSettings", META_DEFAULTS, word
                else:
                    model, defaults, name = "NodeSettings", NODE_DEFAULTS, word
                rows.append((path.name, name, model, value, defaults.get(name, "(no such setting)")))
    return rows


def test_documented_defaults_are_found():
    assert len(documented_defaults()) >= 50


@pytest.mark.parametrize("row", documented_defaults(), ids=lambda r: f"{r[0]}:{r[1]}")
def test_each_documented_default_is_the_models(row):
    """A default written in a document is the model's (the model is the one place it is set;
    a document that repeats it must say the same)."""
    doc, name, model, documented, default = row
    assert documented == default, f"docs/{doc} says {name} defaults to {documented}; {model} says {default}"


def test_every_metric_is_documented():
    names = {m.name for m in NodeMetrics("delay", "docs").registry.collect()}
    assert len(names) >= 20
    ratchet(names, lambda n: n in DOC_WORDS or f"{n}_total" in DOC_WORDS, METRICS_UNDOCUMENTED, "metrics")


# ------------------------------------------------------------------------------ on-disk formats


def test_schedule_index_layout_documented():
    assert schedule.ENTRY.format in FORMAT
    assert schedule.ENTRY_SIZE == 48 and "48-byte" in FORMAT
    assert schedule.HEADS_MAGIC.decode() in FORMAT


def test_frame_header_documented():
    assert log.HEADER_SIZE == 12
    for field in ("u32 body_len", "u32 body_crc", "u32 header_crc"):
        assert field in FORMAT


def test_batch_record_documented():
    assert codec.VERSION == 2 and codec.HEADER.format in FORMAT and codec.HEADER_SIZE == 24
    assert codec.COLUMN_BYTES == 49 and "49 bytes per record" in FORMAT
    for field in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end", "payload_end", "extra_end",
                  "attempts", "subject_idx", "kind"):
        assert f"| {field} |" in FORMAT
    assert codec.DISPATCH_HEADER.size == 16 and "16 + 24 n bytes" in FORMAT


def test_tick_state_documented():
    assert '"HGTS"' in FORMAT
    assert len(wheel.TickState(1, 2, 3, 4).encode()) == 37


def test_id_index_layout_documented():
    assert idindex.ENTRY.format in FORMAT and idindex.ENTRY_SIZE == 40
    assert f'"{idindex.MAGIC.decode()}"' in FORMAT


def test_realtime_layout_documented():
    assert rt_store.ENTRY.format in FORMAT and rt_store.ENTRY.size == 32 and "32 bytes" in FORMAT
    for field in ('"committed"', '"next"', '"pending"'):
        assert field in FORMAT


def test_every_checkpoint_file_is_documented():
    names = {*verify.CHECKPOINT_NAMES, *(f"{log_name}.epochs" for log_name in (*delay_replication.LOGS,
                                                                              realtime_replication.LOG))}
    missing = sorted(n for n in names if f"{{data}}/{n}" not in FORMAT and f"`{n}`" not in FORMAT)
    assert not missing, f"checkpoint files not in docs/format.md: {missing}"
    assert '"replicated"' in FORMAT
