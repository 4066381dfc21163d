#!/usr/bin/env bash
# Installs the chart tools (idempotent, cached) and prints the helm binary path on stdout.
#   helm                 built from source with `go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION`
#                        (Go module proxy; no prebuilt binary is downloaded) into .cache/tools/bin.
#                        A copy is kept per version under $HOURGLASS_TOOLS_CACHE (default
#                        ~/.cache/hourglass-tools) so a fresh clone on the same machine (CI) does
#                        not build it again; Go's own module and build caches make a rebuild cheap.
#   kubernetes-validate  with pip (offline Kubernetes JSON schemas, used by tests/test_helm.py).
# Exit 1 with the reason on stderr when a tool cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
HELM_VERSION=${HELM_VERSION:-v3.22.0}
# the Kubernetes version helm assumes without --kube-version (helm's Makefile derives it from its
# client-go, v0.37 for helm v3.22; a plain `go install` would leave it at 1.20)
HELM_KUBE_MINOR=${HELM_KUBE_MINOR:-37}
KEY=helm-$HELM_VERSION-kube1.$HELM_KUBE_MINOR
KV_VERSION=${KUBERNETES_VALIDATE_VERSION:-1.37.0}
BIN=$PWD/.cache/tools/bin
SHARED=${HOURGLASS_TOOLS_CACHE:-$HOME/.cache/hourglass-tools}
. scripts/python.sh  # python3, or .venv/bin/python where python3 is externally managed
PY=$PYTHON
mkdir -p "$BIN" "$SHARED"
helm_ok() { [ -x "$1" ] && [ "$(cat "$1.key" 2>/dev/null)" = "$KEY" ] \
  && "$1" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; }
install_copy() { cp "$1" "$2.tmp" && mv "$2.tmp" "$2" && echo "$KEY" > "$2.key"; }

if ! helm_ok "$BIN/helm"; then
  if helm_ok "$SHARED/$KEY"; then
    install_copy "$SHARED/$KEY" "$BIN/helm"
  else
    command -v go >/dev/null 2>&1 || { echo "helm-tools.sh: no go toolchain to build helm" >&2; exit 1; }
    # one build at a time (two test processes may ask together)
    exec 8>"$SHARED/.lock"
    flock -w 900 8 || { echo "helm-tools.sh: lock busy" >&2; exit 1; }
    if ! helm_ok "$SHARED/$KEY"; then
      echo "helm-tools.sh: building helm $HELM_VERSION with go install (first time: a few minutes)" >&2
      tmp=$(mktemp -d)
      # -ldflags sets the version helm reports (it would say v3.x-dev otherwise)
      GOBIN=$tmp GOFLAGS=-mod=mod CGO_ENABLED=0 go install \
        -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
          -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$HELM_KUBE_MINOR \
          -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$HELM_KUBE_MINOR" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2 \
        || { rm -rf "$tmp"; echo "helm-tools.sh: go install helm@$HELM_VERSION failed" >&2; exit 1; }
      install_copy "$tmp/helm" "$SHARED/$KEY"; rm -rf "$tmp"
    fi
    install_copy "$SHARED/$KEY" "$BIN/helm"
  fi
fi

if ! $PY -c "import kubernetes_validate" >/dev/null 2>&1; then
  echo "helm-tools.sh: pip install kubernetes-validate==$KV_VERSION" >&2
  $PY -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    "kubernetes-validate==$KV_VERSION" >&2 \
    || { echo "helm-tools.sh: pip install kubernetes-validate failed" >&2; exit 1; }
fi
echo "$BIN/helm"
