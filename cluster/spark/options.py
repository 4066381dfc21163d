"""The ``hourglass`` data source's options: names, defaults and checks, in one place.

Pure (no pyspark): the data source checks its options with ``parse`` when Spark asks for
the schema (so a wrong option fails at ``load()``, not in a task), and the CLI calls the
same functions before it starts Spark, so a typo costs no Spark start-up.

=================  ==========  ==========================================================
option             default     meaning
=================  ==========  ==========================================================
``path``           (required)  node folders or a folder of node folders; comma separated
                               or a JSON list (``paths`` is what ``.load([a, b])`` sends)
``log``            ``message`` message | schedule | dispatch | realtime
``payload``        ``false``   ``true`` fills the ``payload`` column
``recordBytesMax`` 8 MiB       frames announcing a longer body are treated as corrupt
``pushdown``       ``true``    ``false``: a reader without filter pushdown
=================  ==========  ==========================================================

Anything else is refused with the list of valid names: ``.option("logs", "dispatch")``
must not quietly read the message log. Booleans are ``true`` or ``false`` (any case).

Example: ``parse({"path": "/data", "log": "dispatch"})`` ->
``ReadOptions(paths=["/data"], log="dispatch", payload=False, ...)``;
``parse({"path": "/data", "logs": "x"})`` raises ``InvalidArgument("option", "unknown
option 'logs'; valid options: path, log, payload, recordBytesMax, pushdown")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import InvalidArgument
from cluster.logformat import RECORD_BYTES_MAX_DEFAULT  # the node's logs' bound, without loading the node

from . import layout


RECORD_BYTES_MAX_LIMIT = 1 << 30      # Arrow binary offsets (rows.py) are i32: one frame stays well below 2 GiB
OPTIONS = ("path", "log", "payload", "recordBytesMax", "pushdown")
_ALIASES = {"paths": "path"}          # what Spark itself sends for .load([a, b])
_BY_LOWER = {o.lower(): o for o in OPTIONS} | _ALIASES
_NO_SCHEME = ("/", ".", "~")


@dataclass(frozen=True, slots=True)
class ReadOptions:
    paths: list[str]
    log: str = "message"
    payload: bool = False
    record_bytes_max: int = RECORD_BYTES_MAX_DEFAULT
    pushdown: bool = True


def _bool(name: str, value: str) -> bool:
    v = str(value).strip().lower()
    if v not in ("true", "false"):
        raise InvalidArgument(name, f"{str(value)[:64]!r} is not true or false")
    return v == "true"


def parse_log(value: str | None) -> str:
    log = (value or "message").strip().lower()
    if log not in layout.LOGS:
        raise InvalidArgument("log", f"{log[:64]!r} is not one of {', '.join(layout.LOGS)}")
    return log


def parse(options: Mapping[str, str], *, check_paths: bool = True) -> ReadOptions:
    """Check every option (names case-insensitive, as Spark treats them); ``InvalidArgument`` names
    the first wrong one. With ``check_paths`` every local path must exist."""
    given: dict[str, str] = {}
    for key, value in options.items():
        name = _BY_LOWER.get(str(key).lower())
        if name is None:
            raise InvalidArgument("option", f"unknown option {str(key)[:64]!r}; valid options: {', '.join(OPTIONS)}")
        if value is not None:
            given[name] = value
    paths = layout.split_paths(given.get("path"))
    if not paths:
        raise InvalidArgument("path", "give node data folders: .load('/data/delay-1,/data/realtime-1')")
    try:
        record_bytes_max = int(given.get("recordBytesMax", RECORD_BYTES_MAX_DEFAULT))
    except ValueError:
        raise InvalidArgument("recordBytesMax", f"{given['recordBytesMax'][:64]!r} is not a number of bytes") from None
    if not 0 < record_bytes_max <= RECORD_BYTES_MAX_LIMIT:
        raise InvalidArgument("recordBytesMax", f"{record_bytes_max} is not in 1..{RECORD_BYTES_MAX_LIMIT}")
    out = ReadOptions(paths=paths, log=parse_log(given.get("log")),
                      payload=_bool("payload", given.get("payload", "false")),
                      record_bytes_max=record_bytes_max, pushdown=_bool("pushdown", given.get("pushdown", "true")))
    if check_paths:
        check_local_paths(paths)
    return out


def is_local(path: str) -> bool:
    """A plain filesystem path (``file:`` counts), not ``hdfs://``, ``s3a://``..."""
    return path.startswith(_NO_SCHEME) or path.startswith("file:") or "://" not in path


def check_local_paths(paths: list[str]) -> None:
    """Every path exists and is a folder (the data source reads folders only)."""
    for raw in paths:
        p = Path(raw.removeprefix("file://").removeprefix("file:"))
        if not p.exists():
            raise InvalidArgument("path", f"{raw} does not exist")
        if not p.is_dir():
            raise InvalidArgument("path", f"{raw} is not a folder (give node data folders, or a folder holding them)")


def check_has_nodes(paths: list[str]) -> list[layout.NodeDir]:
    """The node folders under ``paths``; refuses paths under which there is none (a wrong path,
    most likely) - for jobs, where an empty input is a mistake rather than an answer."""
    check_local_paths(paths)
    nodes = layout.find_nodes(paths)
    if not nodes:
        raise InvalidArgument("path", f"no node data folder under {', '.join(paths)} (a delay node's folder has "
                                      "dispatch/ or schedule/, a real-time node's index/ or subjects.json)")
    return nodes
