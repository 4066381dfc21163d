#!/usr/bin/env bash
# Installs promtool (Prometheus's rule checker; idempotent, cached) and prints its path on stdout.
# Built from source with `go install github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION`
# (Go module proxy; no prebuilt binary is downloaded). A copy is kept per version under
# $HOURGLASS_TOOLS_CACHE (default ~/.cache/hourglass-tools), so a fresh clone on the same machine
# (CI) does not build it again. The first build takes several minutes and ~2 GB of Go modules.
# Exit 1 with the reason on stderr when it cannot be built.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-v0.316.0}
KEY=promtool-$PROMETHEUS_VERSION
BIN=$PWD/.cache/tools/bin
SHARED=${HOURGLASS_TOOLS_CACHE:-$HOME/.cache/hourglass-tools}
mkdir -p "$BIN" "$SHARED"
ok() { [ -x "$1" ] && [ "$(cat "$1.key" 2>/dev/null)" = "$KEY" ] && "$1" --version >/dev/null 2>&1; }
install_copy() { cp "$1" "$2.tmp" && mv "$2.tmp" "$2" && echo "$KEY" > "$2.key"; }

if ! ok "$BIN/promtool"; then
  if ! ok "$SHARED/$KEY"; then
    command -v go >/dev/null 2>&1 || { echo "promtool.sh: no go toolchain to build promtool" >&2; exit 1; }
    exec 8>"$SHARED/.promtool.lock"  # one build at a time
    flock -w 2400 8 || { echo "promtool.sh: lock busy" >&2; exit 1; }
    if ! ok "$SHARED/$KEY"; then
      echo "promtool.sh: building promtool $PROMETHEUS_VERSION with go install (first time: several minutes)" >&2
      tmp=$(mktemp -d)
      GOBIN=$tmp GOFLAGS=-mod=mod CGO_ENABLED=0 go install -ldflags "-s -w" \
        "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION" >&2 \
        || { rm -rf "$tmp"; echo "promtool.sh: go install promtool@$PROMETHEUS_VERSION failed" >&2; exit 1; }
      install_copy "$tmp/promtool" "$SHARED/$KEY"; rm -rf "$tmp"
    fi
  fi
  install_copy "$SHARED/$KEY" "$BIN/promtool"
fi
echo "$BIN/promtool"
