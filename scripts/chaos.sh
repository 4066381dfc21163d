#!/usr/bin/env bash
# Long chaos run: a real local cluster (3-member etcd, 2 meta servers, 2 replicated delay groups,
# 2 replicated real-time groups), continuous delayed traffic, seeded faults, independent invariant check.
#
#   bash scripts/chaos.sh [SEED] [DURATION_S]           # defaults: SEED=$RANDOM, DURATION_S=1200
#   HOURGLASS_CHAOS_KINDS=delay_master_kill,realtime_kill bash scripts/chaos.sh 3 600
#   HOURGLASS_CHAOS_OUT=/tmp/run bash scripts/chaos.sh 3 600
#
# Writes sends/cancels/receives/faults JSON lines, run.json, report.json and summary.txt in the
# output directory (printed at the end); exits 1 if an invariant is violated, printing the seed.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${1:-${HOURGLASS_CHAOS_SEED:-$RANDOM}}
DURATION=${2:-${HOURGLASS_CHAOS_DURATION_S:-1200}}
OUT=${HOURGLASS_CHAOS_OUT:-/tmp/hourglass-chaos-$SEED-$(date +%s)}
echo "chaos: seed=$SEED duration=${DURATION}s out=$OUT"
. scripts/python.sh
exec "$PYTHON" -m tests.chaos.harness --seed "$SEED" --duration "$DURATION" --out "$OUT" \
  ${HOURGLASS_CHAOS_KINDS:+--kinds "$HOURGLASS_CHAOS_KINDS"} ${HOURGLASS_CHAOS_RATE:+--rate "$HOURGLASS_CHAOS_RATE"}
