#!/usr/bin/env bash
# Sets everything up, starts a local cluster, schedules messages a few seconds ahead,
# shows them delivered with their lateness, and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m cluster.cli demo "$@"
