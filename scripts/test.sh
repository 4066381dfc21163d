#!/usr/bin/env bash
# Sets everything up and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh  # PYTHON: python3, or .venv/bin/python where python3 is externally managed
bash scripts/setup.sh
PY=$PYTHON
set +e
# HOURGLASS_TEST_WORKERS (default 2, one per CPU of the CI machine): pytest-xdist workers, each
# taking a whole module at a time (module fixtures start once); 0 runs in this process
WORKERS=${HOURGLASS_TEST_WORKERS:-2}
$PY -m pytest -q --durations=25 -n "$WORKERS" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "test.sh: pytest collected no tests: failing"; exit 1; fi
exit "$rc"
