#!/usr/bin/env bash
# The CPU-scale reproduction of issue 7 (docs/reproduction.md): every configuration of the
# paper's Table 2 and ablation on a fixed, seeded GSM8K / MATH500 subset (dataset.shuffle with
# run.seed 0, then the first LIMIT problems), with the pipelines under pipelines/cpu/
# (Qwen2.5-Coder-1.5B base, 0.5B helper). Sized for a 2-core CPU: greedy, N = 1 (+ 1) candidates
# per step, float32 weights (faster than bf16 for batched decoding on AVX2 CPUs without bf16
# instructions: docs/benchmarks.md), 400 committed tokens. Every run is resumable: rerun after
# an interruption and finished problems are kept. Two queues run side by side, one torch
# thread each.
#
# Usage: bench/reproduce_cpu.sh [gsm8k|math500|calib] [extra kvflow args]
#   LIMIT=100 (default 16 for gsm8k, 8 for math500): problems of the seeded order to run.
set -euo pipefail
cd "$(dirname "$0")/.."
KVFLOW=${KVFLOW:-.venv/bin/kvflow}
OUT=${OUT:-docs/results/repro}
which=${1:-gsm8k}; shift || true
case "$which" in
  gsm8k)   DATA=(--set dataset.name=gsm8k --set dataset.shuffle=true --set dataset.limit="${LIMIT:-16}") ;;
  math500) DATA=(--set dataset.name=math500 --set dataset.shuffle=true --set dataset.limit="${LIMIT:-8}"
                 --set limits.max_tokens=768) ;;
  # held out for threshold calibration: GSM8K problems 100..123 of the same shuffled order
  calib)   DATA=(--set dataset.name=gsm8k --set dataset.shuffle=true --set dataset.offset=100 --set dataset.limit=24) ;;
  *) echo "usage: $0 [gsm8k|math500|calib] [kvflow args...]" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=1
BATCH=${BATCH:-16}
COMMON=(--set run.output="$OUT/$which" --set run.batch_problems="$BATCH" --set limits.max_tokens=400
        --set models.base.dtype=float32 --set models.helper.dtype=float32 "${DATA[@]}" "$@")
GREEDY_BASE=(--set proposers.base.n=1 --set proposers.base.sampling.temperature=0)
GREEDY_HELPER=(--set proposers.helper.n=1 --set proposers.helper.sampling.temperature=0)
run() { echo "== $*" >&2; "$KVFLOW" run "$@" "${COMMON[@]}"; }
evicted() { run pipelines/cpu/baselines/best_of_n.yaml "${GREEDY_BASE[@]}" --set "proposers.base.evictor=$1"; }

if [ "$which" = calib ]; then
  run pipelines/cpu/kv_rescue.yaml "${GREEDY_BASE[@]}" "${GREEDY_HELPER[@]}"
  exec "$KVFLOW" calibrate "$OUT/calib"/cpu_kv_rescue__*
fi
# Two queues, in priority order (what the Table 2 form needs first). QUEUE=1 or QUEUE=2 runs one.
queue1() {
  run pipelines/cpu/baselines/best_of_n.yaml "${GREEDY_BASE[@]}" --set 'proposers.base.evictor={kind: none}'
  evicted '{kind: random, budget: 64, buffer: 64, window: 16, protect_prompt: false}'
  run pipelines/cpu/baselines/helper_only.yaml "${GREEDY_HELPER[@]}"
  evicted '{kind: random, budget: 128, buffer: 64, window: 16, protect_prompt: false}'
  run pipelines/cpu/ablations/early_exit_only.yaml "${GREEDY_BASE[@]}"
}
queue2() {
  run pipelines/cpu/kv_rescue.yaml "${GREEDY_BASE[@]}" "${GREEDY_HELPER[@]}"
  evicted '{kind: rkv, budget: 64, buffer: 64, window: 16, protect_prompt: false}'
  run pipelines/cpu/ablations/interleave_only.yaml "${GREEDY_BASE[@]}" "${GREEDY_HELPER[@]}"
  evicted '{kind: rkv, budget: 128, buffer: 64, window: 16, protect_prompt: false}'
}
case "${QUEUE:-both}" in
  1) queue1 ;;
  2) queue2 ;;
  *) queue1 & queue2 & wait ;;
esac
