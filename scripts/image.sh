#!/usr/bin/env bash
# Builds the Hourglass container image without pulling anything, then runs the demo inside it.
#
#   1. Docker: `scripts/dockerd.sh start`. When no daemon can be started, prints
#      "image.sh: SKIP: <reason>" and exits 0 (nothing else to do on this machine).
#   2. Base image $BASE (default hourglass-base:bookworm-<hash of $PACKAGES>): reused when the daemon
#      has it, else imported from the cached root-filesystem tar .cache/image/, else made with
#      `debootstrap --variant=minbase bookworm` (python3, venv, CA certificates, etcd-server) and
#      `docker import`.
#   3. Wheelhouse .cache/wheelhouse: `pip wheel` of the dependencies on the host, so the image
#      build installs offline (this host reaches the package index only through its own
#      certificate store). The Dockerfile uses it when present and the index otherwise.
#   4. `docker build --build-arg BASE_IMAGE=$BASE -t $IMAGE .`
#   5. `docker run --rm --network host --read-only $IMAGE demo ...` (the daemon runs without a bridge).
# Usage: scripts/image.sh [build|demo|all] (default all); extra args after `--` go to `hourglass demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
[ "${1:-}" = "--" ] && shift
# what the base holds: python3 for Hourglass, etcd-server for `hourglass demo`/`dev up` (they start etcd)
PACKAGES=python3,python3-venv,ca-certificates,etcd-server
KEY=$(echo "$PACKAGES" | sha256sum | cut -c1-8)
BASE=${HOURGLASS_BASE_IMAGE:-hourglass-base:bookworm-$KEY}
IMAGE=${HOURGLASS_IMAGE:-hourglass:dev}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=.cache/image
BASE_TAR=$CACHE/bookworm-base-$KEY.tar.gz
. scripts/python.sh  # python3, or .venv/bin/python where python3 is externally managed
PY=$PYTHON
log() { echo "image.sh: $*" >&2; }

if ! reason=$(bash scripts/dockerd.sh start 2>&1); then
  echo "image.sh: SKIP: Docker daemon cannot start: ${reason:-unknown reason}"
  exit 0
fi

base_image() {
  if docker image inspect "$BASE" >/dev/null 2>&1; then log "base $BASE present"; return; fi
  mkdir -p "$CACHE"
  if [ ! -s "$BASE_TAR" ]; then
    command -v debootstrap >/dev/null 2>&1 || {
      [ "$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null 2>&1
    } || { echo "image.sh: SKIP: no debootstrap to make a base image (needs root and apt-get)"; exit 0; }
    root=$(mktemp -d /tmp/hourglass-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    log "debootstrap bookworm from $MIRROR (first time: a few minutes)"
    debootstrap --variant=minbase --include="$PACKAGES" \
      bookworm "$root" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
      || { log "debootstrap failed; last lines:"; tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
    tar -C "$root" -czf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$root"; trap - EXIT
  fi
  log "docker import $BASE_TAR as $BASE"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    "$BASE_TAR" "$BASE" >/dev/null
}

wheelhouse() {
  mkdir -p .cache/wheelhouse
  $PY - > .cache/requirements.txt <<'PYEOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(deps + ["setuptools>=68", "wheel"]))
PYEOF
  log "pip wheel dependencies into .cache/wheelhouse"
  $PY -m pip wheel -q --disable-pip-version-check \
    --wheel-dir .cache/wheelhouse -r .cache/requirements.txt >&2
}

build() {
  # one build at a time on this machine (two test workers, or two shells): the base tarball,
  # .cache/wheelhouse and the image tag are shared
  exec 8>/tmp/hourglass-image.lock
  flock -w 1800 8 || { log "another image.sh build held /tmp/hourglass-image.lock for 30 min"; exit 1; }
  base_image
  wheelhouse
  log "docker build $IMAGE on $BASE"
  docker build -q --network host --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE" . >&2
  # the legacy builder keeps every build stage as a dangling image: drop day-old ones (recent ones are the layer cache)
  docker image prune -f --filter label=org.hourglass.stage=build --filter until=24h >/dev/null 2>&1 || true
  docker image inspect "$IMAGE" --format 'image.sh: built {{.RepoTags}} user={{.Config.User}} entrypoint={{.Config.Entrypoint}}' >&2
}

demo() {
  log "docker run --network host $IMAGE demo $*"
  # read-only root and a tmpfs /tmp, as the chart runs it (readOnlyRootFilesystem)
  docker run --rm --network host --read-only --tmpfs /tmp "$IMAGE" demo "$@"
}

case "$what" in
  build) build ;;
  demo) demo "$@" ;;
  all) build; demo "$@" ;;
  *) echo "usage: scripts/image.sh [build|demo|all] [-- demo args]" >&2; exit 2 ;;
esac
