"""The import graph keeps its layers (docs/design.md "Layers"): the contracts in
pyproject.toml ``[tool.importlinter]``, checked by import-linter. A change that makes the
shared base import a server, a server import the CLI or a launcher, node and metaserver
import each other, or two modules of a package import each other (a cycle) fails here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept(capsys):
    from importlinter import cli  # the test extra (pyproject.toml)

    cwd = os.getcwd()
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    enabled = [lg for lg in loggers if not lg.disabled]
    os.chdir(ROOT)  # the configuration is read from ./pyproject.toml
    try:
        code = cli.lint_imports(no_cache=True)
    finally:
        os.chdir(cwd)
        for lg in enabled:  # its logging setup (dictConfig) disables every existing logger
            lg.disabled = False
    out = capsys.readouterr().out
    assert code == 0, out[out.find("Broken contracts"):] or out
    assert "BROKEN" not in out and out.count("KEPT") >= 2
