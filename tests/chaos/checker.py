"""The chaos invariant checker now lives in the package (``cluster/chaoscheck.py``) so that
``hourglass dev chaos`` can use it from an installed copy; this name stays for the harness,
``scripts/`` and ``python -m tests.chaos.checker DIR``."""

from cluster.chaoscheck import (ACK_WINDOW_PAD_MS, EXAMPLES_MAX, FAULT_WINDOW_TAIL_MS, STORAGE_ERRORS,  # noqa: F401
                                ack_overlaps, ack_windows, check, master_changes, percentiles, resume_times,
                                scan_logs, shared_epochs, summarize)
from cluster.chaoscheck import main as _main

if __name__ == "__main__":
    _main()
