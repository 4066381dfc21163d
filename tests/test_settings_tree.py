"""Every default of a setting is written once, in the settings models (issue 29).

The models: the node's tree (``node.config.NodeSettings``, its sections, and the storage
sections' dataclasses in ``node/store/settings.py``), the meta server's (``MetaSettings``), the SDK's
(``cluster.clientsettings.ClientSettings``), ``SecuritySettings`` and ``Limits``. Elsewhere,
a constructor's keyword default for a setting refers to the model (``window_ms: int =
STORE_DEFAULTS.window_ms``), never a literal of its own: a second literal is how the wheel
came to default to a 2,000 ms window against the node's 500.

The check reads the code (ast) of the modules outside the models and fails on
* a parameter named after a setting (its name, or a name one of them ends with) whose
  default is a number literal other than 0 or 1 (or an expression of literals, ``32 << 20``);
* a module constant named ``*_DEFAULT``, or named after a setting and equal to its default,
  unless it is the one place a model takes that default from (``SOURCES``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import operator
from pathlib import Path

import pytest

from cluster.client import Consumer, Producer, StaticResolver
from cluster.clientsettings import CallSettings, ClientSettings
from cluster.discovery import MetaClient, MetaResolver
from cluster.codec import Limits
from cluster.security import SecuritySettings
from metaserver.config import MetaSettings
from node.config import FLAT_NAMES, SECTION_DEFAULTS, TREE, NodeSettings, StoreSection

ROOT = Path(__file__).resolve().parent.parent

# where the models are written: their defaults are the ones
MODELS = {"node/config.py", "node/store/settings.py", "metaserver/config.py", "cluster/clientsettings.py"}
# modules checked: every module of the distribution (node, meta server, SDK, CLI, Spark reader)
CHECKED = sorted({str(p.relative_to(ROOT)) for pattern in ("node/**/*.py", "metaserver/**/*.py", "cluster/**/*.py")
                  for p in ROOT.glob(pattern) if "proto" not in p.parts} - MODELS)
# module constants that are the one source of a model's default (the model refers to them:
# a bottom-layer core the model's package imports, so the literal cannot live in the model)
SOURCES = {
    ("cluster/codec.py", "SUBJECT_BYTES_MAX"),          # Limits.subject_bytes_max (and the meta servers' routes)
    ("cluster/codec.py", "DELAY_HORIZON_MS_DEFAULT"),   # Limits.delay_horizon_ms
    ("cluster/logformat.py", "BUCKET_MS_DEFAULT"),      # StoreSettings.bucket_ms (and the Spark reader's fallback)
    ("cluster/quota.py", "NEW_PER_MINUTE_MAX_DEFAULT"),  # subjects_new_per_minute_max, routes_new_per_minute_max
    ("cluster/quota.py", "OWNED_MAX_DEFAULT"),          # subjects_owned_max
    ("cluster/auththrottle.py", "AUTH_FAILURES_MAX"),   # SecuritySettings.auth_failures_max
    ("cluster/auththrottle.py", "AUTH_FAILURES_WINDOW_MS"),
    ("cluster/auththrottle.py", "AUTH_THROTTLE_PEERS_MAX"),
    ("cluster/transport.py", "MESSAGE_BYTES_MAX"),      # NodeSettings.limits.request_bytes_max
}
# bounds of a format, not settings, named ``*_DEFAULT`` for the readers that import them
NOT_SETTINGS = {
    ("cluster/logformat.py", "RECORD_BYTES_MAX_DEFAULT"),  # the largest record any reader of a log accepts
}
# written twice still, in modules being rewritten in parallel (issue 29): (module, name); this
# list may only shrink (it is empty: keep it so)
LEFT_FOR_AFTER_MERGE: set[tuple[str, str]] = set()

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Pow: operator.pow}


def number(node: ast.AST | None) -> float | None:
    """The value of a number literal or an expression of them (``64 * 1024 * 1024``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = number(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = number(node.left), number(node.right)
        return None if a is None or b is None else _OPS[type(node.op)](a, b)
    return None


def _fields(model) -> dict[str, object]:
    if dataclasses.is_dataclass(model):  # a defaults object (a section of the node's tree)
        return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    return {name: f.default for name, f in model.model_fields.items()}


def settings() -> dict[str, set]:
    """Every setting's name -> its defaults (a name may be in several models). A node setting
    counts under its name in its section and under its flat name."""
    models = [*TREE.values(), MetaSettings, SecuritySettings, Limits(), *SECTION_DEFAULTS.values()]
    client = ClientSettings.model_construct()
    models += [v if dataclasses.is_dataclass(v) else type(v) for v in (getattr(client, n) for n in ClientSettings.model_fields)]
    out: dict[str, set] = {}
    for model in models:
        for name, default in _fields(model).items():
            out.setdefault(name, set()).add(default if isinstance(default, (int, float)) else None)
    for flat, (section, field) in FLAT_NAMES.items():
        out.setdefault(flat, set()).update(out[field] if field in out else {None})
    return out


SETTINGS = settings()


def setting_named(name: str) -> str | None:
    """The setting ``name`` names: the same, or one ending in ``_<name>`` or ``<name>`` ends in
    ``_<setting>`` (``window_ms`` / ``data_segment_bytes`` -> ``segment_bytes``)."""
    if name in SETTINGS:
        return name
    for s in SETTINGS:
        if "_" in s and (s.endswith("_" + name) or name.endswith("_" + s)) and name.count("_") >= 1:
            return s
    return None


def findings(path: str) -> list[str]:
    tree = ast.parse((ROOT / path).read_text(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
            for arg, default in pairs:
                v = number(default)
                setting = setting_named(arg.arg)
                if v is None or v in (0, 1) or setting is None:
                    continue
                out.append(f"{path}:{default.lineno}: {arg.arg}={ast.unparse(default)} "
                           f"(setting {setting}: refer to its model)")
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        for t in targets:
            if not isinstance(t, ast.Name) or (path, t.id) in SOURCES | NOT_SETTINGS | LEFT_FOR_AFTER_MERGE:
                continue
            v = number(stmt.value)
            if v is None:
                continue
            name = t.id.lower()
            if t.id.endswith("_DEFAULT") or (name in SETTINGS and v in SETTINGS[name]):
                out.append(f"{path}:{stmt.lineno}: {t.id} = {ast.unparse(stmt.value)} "
                           f"(a setting's default: write it in the settings model)")
    return out


def test_the_models_are_found():
    assert {"window_ms", "segment_bytes", "linger_ms", "node_ttl_ms", "payload_bytes_max",
            "reload_check_ms", "rate_mib_s"} <= set(SETTINGS)
    assert len(CHECKED) > 20


@pytest.mark.parametrize("path", CHECKED)
def test_no_default_of_a_setting_outside_the_models(path):
    found = findings(path)
    assert not found, "defaults written outside the settings models:\n" + "\n".join(found)


def test_allowed_names_still_exist():
    """A name that was removed or renamed must leave its allow-list too (the lists only shrink)."""
    for path, name in SOURCES | NOT_SETTINGS | LEFT_FOR_AFTER_MERGE:
        tree = ast.parse((ROOT / path).read_text())
        names = {t.id for s in tree.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                 for t in (s.targets if isinstance(s, ast.Assign) else [s.target]) if isinstance(t, ast.Name)}
        assert name in names, f"{path}: {name} is gone: take it off SOURCES"


def test_the_check_finds_a_second_literal(tmp_path, monkeypatch):
    """The check is not blind: the wheel as it was (window_ms=2000 against 500) fails it."""
    bad = tmp_path / "bad.py"
    bad.write_text("WINDOW_MS_DEFAULT = 2000\n"
                   "def wheel(*, tick_ms: int = 10, window_ms: int = 2000, start_ms: int, n: int = 7) -> None: ...\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = findings("bad.py")
    assert [f.split(": ", 1)[1].split(" ")[0] for f in found] == ["tick_ms=10", "window_ms=2000", "WINDOW_MS_DEFAULT"]


# ---------------------------------------------------------------------------------- the SDK's tree


def _changed(section) -> dict[str, object]:
    """Every field of an SDK section, set to another valid value than its default."""
    return {n: (v + 1 if isinstance(v, int) else v * 2) for n, v in section.model_dump().items()}


def test_sdk_constructors_default_to_the_model():
    d = ClientSettings.model_construct()
    want = {Producer: {**d.calls.model_dump(), **d.producer.model_dump(), "limits": d.limits},
            Consumer: {**d.calls.model_dump(), **d.consumer.model_dump()},
            MetaResolver: {"timeout_s": d.discovery.meta_timeout_ms / 1000, "refresh_ms": d.discovery.refresh_ms,
                           "refresh_min_ms": d.discovery.refresh_min_ms, "routes_max": d.discovery.routes_max},
            MetaClient: {"timeout_s": d.discovery.meta_timeout_ms / 1000}}
    for cls, values in want.items():
        params = inspect.signature(cls).parameters
        for name, value in values.items():
            assert params[name].default == value, f"{cls.__name__}({name}=...) defaults to another value than the model"


def test_from_settings_carries_every_value():
    d = ClientSettings.model_construct()
    s = ClientSettings(calls=_changed(d.calls), producer=_changed(d.producer), consumer=_changed(d.consumer),
                       discovery=_changed(d.discovery))
    resolver = StaticResolver(delay=["127.0.0.1:1"], realtime=["127.0.0.1:2"])
    p = Producer.from_settings(resolver, s)
    for name in ("linger_ms", "batch_max", "batch_bytes_max", "queue_max", "timeout_s", "call_timeout_s",
                 "retries_max", "backoff_ms_min", "backoff_ms_max"):
        assert getattr(p, name) == getattr(s.calls if name in CallSettings.model_fields else s.producer, name), name
    c = Consumer.from_settings(resolver, "orders", s, group="billing")
    for name in ("batch_max", "wait_ms", "ack_linger_ms", "nack_retry_after_ms"):
        assert getattr(c, name) == getattr(s.consumer, name), name
    assert (c.timeout_s, c.call_timeout_s) == (s.calls.timeout_s, s.calls.call_timeout_s)
    r = MetaResolver.from_settings(["127.0.0.1:3"], s)
    assert (r.refresh_ms, r.refresh_min_ms, r.routes_max, r.meta.timeout_s) == (
        s.discovery.refresh_ms, s.discovery.refresh_min_ms, s.discovery.routes_max, s.discovery.meta_timeout_ms / 1000)


def test_sdk_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("HOURGLASS_CLIENT_PRODUCER__LINGER_MS", "7")
    monkeypatch.setenv("HOURGLASS_CLIENT_DISCOVERY__REFRESH_MS", "900")
    monkeypatch.setenv("HOURGLASS_CLIENT_LIMITS__PAYLOAD_BYTES_MAX", "1234")
    s = ClientSettings()
    assert (s.producer.linger_ms, s.discovery.refresh_ms, s.limits.payload_bytes_max) == (7, 900, 1234)
    assert ClientSettings.model_construct().producer.linger_ms != 7  # the defaults object reads no environment


def test_the_spark_reader_takes_the_bucket_default_from_the_node_without_loading_it():
    """``StoreSettings.bucket_ms`` and the Spark reader's fallback are one value, written in
    ``cluster/logformat.py``, a module that imports nothing (Spark planning loads no numpy)."""
    from cluster import logformat
    from cluster.spark import layout
    from node.store.settings import StoreSettings

    tree = ast.parse(Path(logformat.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert StoreSettings().bucket_ms == layout.BUCKET_MS_DEFAULT == logformat.BUCKET_MS_DEFAULT
    assert StoreSection.model_fields["bucket_ms"].default == logformat.BUCKET_MS_DEFAULT
    assert NodeSettings.model_construct().store.bucket_ms == logformat.BUCKET_MS_DEFAULT
