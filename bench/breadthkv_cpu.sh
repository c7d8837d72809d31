#!/usr/bin/env bash
# Eviction only vs BreadthKV at equal KV bytes, at CPU scale (docs/breadthkv.md).
# Qwen2.5-Coder-0.5B-Instruct as the evicted base alone, greedy (n=1), 8 GSM8K problems,
# 512 committed tokens; two byte budgets = 64 and 128 full-precision tokens of this model
# (24 layers x 2 KV heads x head_dim 64 x 2 (K, V) x 2 bytes = 12288 bytes per token).
# quantize=null is decode-time SnapKV alone; the other point keeps the kept tokens at 4 bits.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/breadthkv}
SETS=(--set models.base.id=catalog:qwen2.5-coder-0.5b-instruct
      --set models.helper.id=catalog:qwen2.5-coder-0.5b-instruct
      --set proposers.base.n=1 --set proposers.base.sampling.temperature=0
      --set 'scorer={kind: random}'
      --set limits.max_tokens=512 --set run.output="$OUT")
.venv/bin/kvflow run pipelines/cpu/breadthkv.yaml "${SETS[@]}" \
  --sweep proposers.base.evictor.budget_bytes=786432,1572864 \
  --sweep 'proposers.base.evictor.quantize=null,{bits: 4, group_size: 32, residual: 16}' "$@"
# the full-KV reference on the same problems
.venv/bin/kvflow run pipelines/cpu/breadthkv.yaml "${SETS[@]}" --set 'proposers.base.evictor={kind: none}' "$@"
# and a report over the five runs
.venv/bin/kvflow report "$OUT" --out "$OUT/report"
