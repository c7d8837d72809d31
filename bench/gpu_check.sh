#!/usr/bin/env bash
# One prepared device check (issue 13): the step scheduler at the paper's shapes on one GPU,
# random-weight Qwen2.5-Math-7B (evicted, random B=64) / -1.5B (full KV) configs, N = 8,
# 64 problems of decode room: tokens/s, occupancy, peak GPU memory, time share by phase.
# Runs from a plain checkout (PYTHONPATH, no install: the lent machine has torch and
# transformers but no package index); needs pydantic, pyyaml and pluggy importable.
# Budget: about 8 minutes (model build ~1 min, three runs of growing size).
#   bash bench/gpu_check.sh            # writes $OUT/gpu_check.json (or ./gpu_check.json)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-.}/gpu_check.json"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
${PYTHON:-python3} - <<'PY' || exit 3
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "pydantic", "yaml", "pluggy") if importlib.util.find_spec(m) is None]
import torch, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)
if missing or not torch.cuda.is_available():
    sys.exit(f"gpu_check: missing {missing} or no CUDA")
PY
: > "$out"
for spec in "--problems 8 --n 8 --steps 2" "--problems 32 --n 8 --steps 3" "--problems 64 --n 8 --steps 3"; do
  echo "== $spec" >&2
  timeout 200 ${PYTHON:-python3} bench/scheduler_throughput.py --device cuda $spec | tee -a "$out" || echo "{\"failed\": \"$spec\"}" >> "$out"
done
