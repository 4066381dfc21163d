"""Chart tools the tests build from the Go module proxy and cache (scripts/helm-tools.sh,
scripts/promtool.sh): each returns the binary's path, or skips the test saying why."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def built_tool(script: str, name: str, timeout_s: float) -> str:
    """Run ``scripts/<script>`` (it prints the binary's path last); skip without a Go toolchain
    and no cached binary; fail, with the script's stderr, when the build fails."""
    if shutil.which("go") is None and not (ROOT / ".cache/tools/bin" / name).exists():
        pytest.skip(f"no Go toolchain to build {name} with (scripts/{script} needs `go`)")
    r = subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"scripts/{script} failed:\n{r.stderr[-3000:]}"
    return r.stdout.strip().splitlines()[-1]


def helm_binary() -> str:
    return built_tool("helm-tools.sh", "helm", 1200)


def promtool_binary() -> str:
    return built_tool("promtool.sh", "promtool", 2400)
