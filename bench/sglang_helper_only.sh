#!/usr/bin/env bash
# Helper-only best-of-N on the catalog 0.5B: `backend: hf` vs `backend: sglang`, same problems,
# same settings, one after the other on this machine (docs/benchmarks.md, "SGLang").
# N = 4 sampled candidates (temperature 0.7), the likelihood scorer under the helper, a gzip
# pruner on the helper (so that stream aborts have candidates to stop), PROBLEMS GSM8K problems.
# Prints, per backend: wall seconds, tokens generated, tokens/s, and the SGLang engine's stats
# (prefix-cache hit rate, tokens produced after a stop) from manifest.json.
# Usage: bench/sglang_helper_only.sh [OUT]   (needs `scripts/install.sh sglang`)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kvflow-bench-sglang}
PROBLEMS=${PROBLEMS:-4}
KVFLOW=${KVFLOW:-.venv/bin/kvflow}
rm -rf "$OUT"
COMMON=(--set dataset.name=gsm8k --set dataset.limit="$PROBLEMS" --set limits.max_tokens=256
        --set models.helper.dtype=bfloat16 --set proposers.helper.n=4 --set proposers.helper.sampling.max_step_tokens=96
        --set 'proposers.helper.pruners=[{kind: gzip, threshold: 0.45, window: 64, min_tokens: 24}]'
        --set run.batch_problems=4 --set run.record_signals=false)
for backend in hf sglang; do
  start=$(date +%s.%N)
  "$KVFLOW" run pipelines/cpu/baselines/helper_only.yaml "${COMMON[@]}" --set "models.helper.backend=$backend" \
      --set "run.output=$OUT/$backend" 2>/dev/null
  end=$(date +%s.%N)
  python3 - "$OUT/$backend" "$start" "$end" "$backend" <<'PY'
import glob, json, sys
run_dir, start, end, backend = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
(d,) = glob.glob(f"{run_dir}/*/")
records = [json.loads(x) for x in open(f"{d}/samples.jsonl")]
tokens = sum(sum(r["tokens_generated"].values()) for r in records)
decode = max(r["seconds"] for r in records)  # all problems are admitted at once: the decode wall
manifest = json.load(open(f"{d}/manifest.json"))
print(json.dumps({"backend": backend, "problems": len(records), "wall_s_incl_load": round(end - start, 1),
                  "decode_wall_s": round(decode, 1), "tokens": tokens, "tok_per_s": round(tokens / decode, 2), "correct": sum(r["correct"] for r in records),
                  "pruned": sum(sum(r["pruned"].values()) for r in records),
                  "engine_stats": manifest.get("engine_stats")}))
PY
done
