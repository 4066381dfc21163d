#!/usr/bin/env bash
# Installs everything Hourglass needs on a fresh Debian 12 machine (idempotent).
# Debian packages when root (apt-get), Python packages with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian packages the test suite uses (a missing one makes its tests skip, saying why):
#   redis-server  the Redis baseline of the benchmarks   etcd-server  etcd for the meta server
#   docker.io     etcd in a container, the image test    debootstrap  the image's local base
#   iproute2      network-namespace partitions           a Java runtime  Spark (pyspark)
want_apt=()
command -v redis-server >/dev/null 2>&1 || want_apt+=(redis-server)
command -v etcd >/dev/null 2>&1 || want_apt+=(etcd-server)
command -v dockerd >/dev/null 2>&1 || want_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || want_apt+=(debootstrap)
command -v ip >/dev/null 2>&1 || want_apt+=(iproute2)
command -v java >/dev/null 2>&1 || want_apt+=(default-jre-headless)
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
if ! $PY -c "import cluster, node, grpc, hypothesis, pytest_asyncio" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .setup-stamp ]; then
  echo "setup: pip install -e .[test,spark]"
  $PY -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".[test,spark]"
  touch .setup-stamp
fi
