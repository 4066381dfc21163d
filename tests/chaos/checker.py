"""The chaos invariant checker now lives in the package (``cluster/chaoscheck.py``) so that
``hourglass dev chaos`` can use it from an installed copy; this name stays for the harness,
``scripts/`` and ``python -m tests.chaos.checker DIR``."""

from cluster.chaoscheck import (EXAMPLES_MAX, FAULT_WINDOW_TAIL_MS, STORAGE_ERRORS, check,  # noqa: F401
                                percentiles, scan_logs, summarize)
from cluster.chaoscheck import main as _main

if __name__ == "__main__":
    _main()
