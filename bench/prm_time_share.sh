#!/usr/bin/env bash
# KV-Rescue's scorer time share with a PRM, before/after prefix reuse, on the CPU reproduction's
# pipeline (docs/benchmarks.md, "PRM scoring: prefix reuse"; issue 26).
#
#   bench/prm_time_share.sh [OUT_DIR] [PROBLEMS] [MAX_TOKENS]     # defaults: /tmp/prm_time_share 2 128
#
# pipelines/cpu/kv_rescue.yaml with `likelihood` replaced by a tiny-PRM stand-in (a random
# Qwen2 PRM, hidden 512, 8 layers, float32, tiny tokenizer + <extra_0>: bench/scoring_prefix.py's
# builder; its scores are noise, its cost is what is measured), kept small for a CPU:
# PROBLEMS GSM8K problems, MAX_TOKENS committed tokens. The base is the catalog's
# Qwen2.5-Coder-0.5B-Instruct (the reproduction's 1.5B is not in this machine's cache), the
# helper the same model at full context. Runs:
#   hf-reencode  every model on hf, prm prefix_reuse: false (what kvflow did before issue 26)
#   hf-reuse     every model on hf, prm prefix_reuse: true (the default now)
#   sglang       base (evicted), helper and PRM on SGLang
# Prints each run's summary lines `time share` and `wall`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/prm_time_share}
PROBLEMS=${2:-2}
MAX_TOKENS=${3:-128}
PY=.venv/bin/python
mkdir -p "$OUT"
PRM="$OUT/tiny-prm-512x8"
[ -f "$PRM/config.json" ] || $PY -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from scoring_prefix import tiny_prm; tiny_prm(Path('$PRM'), 512, 8)"

common=(--set "models.prm={id: $PRM, dtype: float32}" --set "scorer={kind: prm, model: prm}"
        --set models.base.id=catalog:qwen2.5-coder-0.5b-instruct --set "dataset.limit=$PROBLEMS"
        --set "limits.max_tokens=$MAX_TOKENS" --set "run.output=$OUT/results")
run() {
  local name=$1; shift
  echo "== $name"
  .venv/bin/kvflow run pipelines/cpu/kv_rescue.yaml "${common[@]}" --set "name=prm_share_$name" "$@" \
    > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
  grep -E "time share|wall|correct|pass@1" "$OUT/$name.log" || tail -15 "$OUT/$name.log"
}
run hf-reencode --set scorer.prefix_reuse=false
run hf-reuse --set scorer.prefix_reuse=true
run sglang --set models.base.backend=sglang --set models.helper.backend=sglang --set models.prm.backend=sglang
