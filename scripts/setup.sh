#!/usr/bin/env bash
# Installs everything Hourglass needs on a fresh Debian 12 machine (idempotent).
# Debian packages when root (apt-get), Python packages with pip: into python3, or into the
# project's virtual environment .venv when python3 is "externally managed" (PEP 668, a stock
# Debian 12 / Ubuntu 24.04) or HOURGLASS_VENV=1 (scripts/python.sh decides; PYTHON overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
PY=$PYTHON
# Debian packages the test suite uses (a missing one makes its tests skip, saying why):
#   redis-server  the Redis baseline of the benchmarks   etcd-server  etcd for the meta server
#   docker.io     etcd in a container, the image test    debootstrap  the image's local base
#   iproute2      network-namespace partitions           a Java runtime  Spark (pyspark)
#   chromium, chromium-driver  headless browser of the console's browser tests (tests/test_console_browser.py)
want_apt=()
command -v redis-server >/dev/null 2>&1 || want_apt+=(redis-server)
command -v etcd >/dev/null 2>&1 || want_apt+=(etcd-server)
command -v dockerd >/dev/null 2>&1 || want_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || want_apt+=(debootstrap)
command -v ip >/dev/null 2>&1 || want_apt+=(iproute2)
command -v java >/dev/null 2>&1 || want_apt+=(default-jre-headless)
command -v chromium >/dev/null 2>&1 || want_apt+=(chromium)
command -v chromedriver >/dev/null 2>&1 || want_apt+=(chromium-driver)
if [ ${#want_apt[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: apt-get install ${want_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || true
  if ! apt-get install -y -qq --no-install-recommends "${want_apt[@]}" >/dev/null 2>&1; then
    for pkg in "${want_apt[@]}"; do  # one refused package must not stop the others
      apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
        || echo "setup: apt-get install $pkg failed; the tests that need it will skip and say why"
    done
  fi
  # Debian starts the services it installs; Hourglass starts its own on free ports.
  for svc in redis-server etcd docker containerd; do
    if command -v systemctl >/dev/null 2>&1; then systemctl stop "$svc" >/dev/null 2>&1 || true; fi
  done
fi
if [ "$PY" = "$HOURGLASS_VENV_DIR/bin/python" ] && [ ! -x "$PY" ]; then
  base=$HOURGLASS_BASE_PYTHON
  if ! "$base" -c "import ensurepip, venv" >/dev/null 2>&1; then
    # Debian splits venv's pip bootstrap out of python3
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: apt-get install python3-venv"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq >/dev/null 2>&1 || true
      apt-get install -y -qq --no-install-recommends python3-venv >/dev/null 2>&1 \
        || echo "setup: apt-get install python3-venv failed"
    fi
  fi
  why="$base is externally managed (PEP 668)"
  [ "${HOURGLASS_VENV:-}" = 1 ] && why="HOURGLASS_VENV=1"
  echo "setup: $why: $base -m venv .venv"
  rm -rf "$HOURGLASS_VENV_DIR"  # a half-made one from an interrupted run
  if ! "$base" -m venv "$HOURGLASS_VENV_DIR"; then
    rm -rf "$HOURGLASS_VENV_DIR"
    echo "setup: cannot create .venv with $base; install python3-venv (as root: apt-get install python3-venv)" >&2
    exit 1
  fi
fi
stamp=.setup-stamp
[ "$PY" = "$HOURGLASS_VENV_DIR/bin/python" ] && stamp=$HOURGLASS_VENV_DIR/.setup-stamp
# installed, and installed from this checkout (an editable install of another clone, or of a
# folder since deleted, would serve the hourglass command and child processes other code)
here=$(pwd -P)
if ! (cd / && "$PY" -c "import sys, cluster, node, grpc, hypothesis, pytest_asyncio, xdist
sys.exit(0 if cluster.__file__.startswith('$here/') else 1)") >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: pip install -e .[test,spark] into $PY"
  "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".[test,spark]"
  touch "$stamp"
fi
if [ "$PY" = "$HOURGLASS_VENV_DIR/bin/python" ]; then
  echo "setup: Hourglass is installed in .venv; for the hourglass command: source .venv/bin/activate"
fi
