#!/usr/bin/env bash
# Sets everything up, starts a local cluster, schedules messages a few seconds ahead,
# shows them delivered with their lateness, and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh  # PYTHON: python3, or .venv/bin/python where python3 is externally managed
bash scripts/setup.sh
exec "$PYTHON" -m cluster.cli demo "$@"
