#!/usr/bin/env bash
# Is a problem's trajectory independent of scheduling when the forward is not batch-invariant?
# The quickstart pipeline's evicted base alone (Qwen2.5-Coder-0.5B, bf16, random eviction
# B = 64 + 64, N = 2 sampled candidates per step with the entropy and gzip pruners, scored by
# the base's own full-context likelihood; the full-context helper left out to fit the CPU) on
# GSM8K-16 with a decode room of 1 problem vs 8:
# the same seeds, the same problems; only which rows share a forward differs. Then
# bench/batch_invariance.py counts the trajectories that differ and the first step they differ
# at (docs/concepts.md, "Independent of scheduling"). Resumable (rerun the same command).
#   bash bench/batch_invariance.sh [OUT]        # default docs/results/batch_invariance
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/results/batch_invariance}"
kvflow="${KVFLOW:-.venv/bin/kvflow}"
common=(--unset proposers.helper --set scorer.model=base --set dataset.limit=16 --set limits.max_tokens=160
        --set limits.max_steps=12 --set run.output="$out")
for batch in 1 8; do
  "$kvflow" run pipelines/quickstart.yaml "${common[@]}" --set run.batch_problems=$batch \
    --set run.live_problems=$batch --set name=invariance_b$batch
done
.venv/bin/python bench/batch_invariance.py "$out"/invariance_b1__* "$out"/invariance_b8__* | tee "$out/summary.txt"
