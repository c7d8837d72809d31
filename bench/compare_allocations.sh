#!/usr/bin/env bash
# Allocations compared (issue 18; docs/results/allocations.md): snapkv vs ada-snapkv vs
# pyramidkv (vs rkv, the reproduction's row) as the evicted 1.5B base, at the reproduction's
# budget (B = 64 + buffer 64, window 16, prompt not protected) on its GSM8K order, with the
# round-1 greedy float32 settings of bench/reproduce_cpu_round2.sh's evicted baselines (N = 1,
# temperature 0), so the rkv B=64 row of the reproduction is the fourth column.
#
# LIMIT problems (16 first, then grown to 64: a larger limit resumes the same runs). One
# torch thread per run; runs are resumable.
# Usage: bench/compare_allocations.sh [LIMIT] [rescue]   (rescue: the KV-Rescue rows instead)
set -euo pipefail
cd "$(dirname "$0")/.."
KVFLOW=${KVFLOW:-.venv/bin/kvflow}
LIMIT=${1:-16}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
[ "${2:-}" = rescue ] || "$KVFLOW" run pipelines/cpu/baselines/best_of_n.yaml \
  --set dataset.name=gsm8k --set dataset.shuffle=true --set limits.max_tokens=400 --set run.batch_problems=16 \
  --set run.threads=1 --set dataset.limit="$LIMIT" --set run.output=docs/results/repro/gsm8k \
  --set models.base.dtype=float32 --set models.helper.dtype=float32 --set proposers.base.n=1 \
  --set proposers.base.sampling.temperature=0 \
  --set 'proposers.base.evictor={kind: snapkv, budget: 64, buffer: 64, window: 16, protect_prompt: false}' \
  --sweep proposers.base.evictor.kind=snapkv,ada-snapkv,pyramidkv

# KV-Rescue with each allocation as the evicted base (`rescue` argument): the reproduction's
# round-2 configuration (pipelines/cpu/kv_rescue.yaml, N = 2 + 2 sampled, bf16, the base's own
# full-context likelihood as the scorer, pruner thresholds from the calibration split), only
# the evictor changed (the round-2 row is random at the same budget).
if [ "${2:-}" = rescue ]; then
  THRESHOLDS=$(.venv/bin/python - <<'PY'
import glob, json
(path,) = glob.glob("docs/results/repro/calib/cpu_kv_rescue__*/calibrate/calibrate.json")
got = {r["name"]: r["threshold"] for r in json.load(open(path))}
print(f"[{{kind: entropy, threshold: {got['entropy']:.4g}, window: 32}}, {{kind: gzip, threshold: {got['gzip']:.4g}, window: 256}}]")
PY
)
  "$KVFLOW" run pipelines/cpu/kv_rescue.yaml \
    --set dataset.name=gsm8k --set dataset.shuffle=true --set limits.max_tokens=400 --set run.batch_problems=16 \
    --set run.threads=1 --set dataset.limit="$LIMIT" --set run.output=docs/results/repro/gsm8k \
    --set models.base.dtype=bfloat16 --set models.helper.dtype=bfloat16 \
    --set 'scorer={kind: likelihood, model: base}' --set "proposers.base.pruners=$THRESHOLDS" \
    --set 'proposers.base.evictor={kind: snapkv, budget: 64, buffer: 64, window: 16, protect_prompt: false}' \
    --sweep proposers.base.evictor.kind=ada-snapkv,pyramidkv,snapkv,rkv
fi
