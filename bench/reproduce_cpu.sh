#!/usr/bin/env bash
# The CPU-scale reproduction of issue 7 (docs/reproduction.md): every configuration on the
# fixed, seeded subsets GSM8K-100 and MATH500-50 (dataset.shuffle with run.seed 0, then the
# first 100 / 50), with the pipelines under pipelines/cpu/ (Qwen2.5-Coder-1.5B base, 0.5B
# helper, N = 2 + 2). Every run is resumable: rerun the script after an interruption and
# finished problems are kept. Usage: bench/reproduce_cpu.sh [gsm8k|math500|calib] [extra kvflow args]
set -euo pipefail
cd "$(dirname "$0")/.."
KVFLOW=${KVFLOW:-.venv/bin/kvflow}
OUT=${OUT:-docs/results/repro}
which=${1:-gsm8k}; shift || true
case "$which" in
  gsm8k)   DATA=(--set dataset.name=gsm8k --set dataset.shuffle=true --set dataset.limit=100) ;;
  math500) DATA=(--set dataset.name=math500 --set dataset.shuffle=true --set dataset.limit=50) ;;
  # thresholds are calibrated on GSM8K problems 100..123 of the same shuffled order (disjoint)
  calib)   DATA=(--set dataset.name=gsm8k --set dataset.shuffle=true --set dataset.offset=100 --set dataset.limit=24) ;;
  *) echo "usage: $0 [gsm8k|math500|calib] [kvflow args...]" >&2; exit 2 ;;
esac
COMMON=(--set run.output="$OUT/$which" --set run.batch_problems=8 "${DATA[@]}" "$@")
run() { echo "== $*" >&2; "$KVFLOW" run "$@" "${COMMON[@]}"; }

if [ "$which" = calib ]; then
  run pipelines/cpu/kv_rescue.yaml
  exec "$KVFLOW" calibrate "$OUT/calib"/cpu_kv_rescue__*
fi
# full-KV base, best-of-N
run pipelines/cpu/baselines/best_of_n.yaml --set 'proposers.base.evictor={kind: none}'
# evicted base, best-of-N: two evictors x two budgets
run pipelines/cpu/baselines/best_of_n.yaml --sweep 'proposers.base.evictor={kind: random, budget: 64, buffer: 64, window: 16},{kind: random, budget: 128, buffer: 64, window: 16},{kind: rkv, budget: 64, buffer: 64, window: 16},{kind: rkv, budget: 128, buffer: 64, window: 16}'
# KV-Rescue and its ablations (random eviction at B=64), and the helper alone
run pipelines/cpu/kv_rescue.yaml
run pipelines/cpu/ablations/interleave_only.yaml
run pipelines/cpu/ablations/early_exit_only.yaml
run pipelines/cpu/baselines/helper_only.yaml
