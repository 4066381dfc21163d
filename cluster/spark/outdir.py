"""A job's output folder: refused when it exists (unless ``overwrite``), never left half-written.

A job writes into a hidden sibling (``.NAME.partial-PID``) and renames it to ``NAME`` when it
succeeded, so a failed or interrupted run leaves no folder behind, and ``overwrite``
replaces an earlier output only once the new one is complete. ``overwrite`` replaces only
a folder that looks like an earlier output of a job (it holds ``summary.json``, or is
empty): ``--out $HOME --overwrite`` is refused, not emptied.

Local filesystem only: the jobs write ``summary.json`` and the report with the driver's
filesystem anyway (docs/spark.md, "Running on a Spark cluster").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.errors import InvalidArgument

MARKER = "summary.json"   # every job writes it last: its presence means "an earlier output"


def check(out: Path, *, overwrite: bool) -> None:
    """Refuse an ``out`` that exists (without ``overwrite``) or that is not an earlier output."""
    if not out.exists():
        if out.parent.exists() and not out.parent.is_dir():
            raise InvalidArgument("--out", f"{out.parent} is not a folder")
        return
    if not overwrite:
        raise InvalidArgument("--out", f"{out} exists; give a new folder, or --overwrite to replace an earlier output")
    if not out.is_dir():
        raise InvalidArgument("--out", f"{out} is a file, not an earlier output folder")
    if any(out.iterdir()) and not (out / MARKER).is_file():
        raise InvalidArgument("--out", f"{out} holds files but no {MARKER}: not an earlier output, not replaced")


@contextmanager
def writing(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield the folder to write into; on success it becomes ``out``, on any failure it is removed."""
    check(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():  # checked above: an earlier output, and overwrite was given
        shutil.rmtree(out)
    partial.rename(out)
