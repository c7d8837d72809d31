#!/usr/bin/env bash
# One prepared device check (issue 13): the step scheduler at the paper's shapes on one GPU,
# random-weight Qwen2.5-Math-7B (evicted, random B=64) / -1.5B (full KV) configs, N = 8,
# 64 problems of decode room: tokens/s, occupancy, peak GPU memory, time share by phase.
# Runs from a plain checkout (PYTHONPATH, no install). The lent machine's image has torch (2.11)
# and transformers (5.17, which kvflow's hf engine supports) but not pydantic, pluggy or
# (perhaps) pyyaml, and no package index: a session carries them as wheels with the working
# tree and the script installs them, offline, into a directory it puts first on PYTHONPATH
# (bench/install_wheels.py: pip --no-index if the image has pip, else it unzips the wheels that
# fit the interpreter), then prints the versions in use. On a device, from a session:
#   bash bench/gpu_wheels.sh bench/wheels     # here, once: ~12 MiB of wheels (gitignored folder)
#   run(command="KVFLOW_WHEELS=bench/wheels bash bench/gpu_check.sh", carry=["bench/wheels"], timeout_s=540)
# (`bash bench/gpu_check.sh --wheels bench/wheels [sglang|alloc]` is the same.)
# A part that cannot run here (SGLang on an image without it) exits 4 and says NOT TESTED, unless
# KVFLOW_GPU_CHECK_SKIP names it (comma-separated: `KVFLOW_GPU_CHECK_SKIP=sglang`); a part whose
# runs failed exits 1. The hf part records failed runs as {"failed": ...} and exits 1 after them.
# Budget: about 8 minutes (model build ~1 min, three runs of growing size; the install ~10 s).
#   bash bench/gpu_check.sh            # writes $OUT/gpu_check.json (or ./gpu_check.json)
#   bash bench/gpu_check.sh sglang     # only the SGLang part (below), about 7 minutes
#   bash bench/gpu_check.sh fast       # issue 25, about 8 minutes: overlap off/on (base + helper, 32
#                                      # problems) and problems/min of KV-Rescue vs full-KV and evicted
#                                      # best-of-N at 8 and 64 problems (bench/scheduler_throughput.py)
#   bash bench/gpu_check.sh alloc      # only the allocations part (issue 18), about 4 minutes: the
#                                      # varying-budget evictors on CUDA (hf), tokens/s and bytes held
#                                      # vs uniform snapkv, 7B-shaped random weights, N = 8, 1024 tokens
#   bash bench/gpu_check.sh graphs     # issue 25, under a minute, no SGLang needed: kvflow's SGLang decode
#                                      # hook (graph.decode_step) captured in a real CUDA graph with no kvflow
#                                      # row, replayed after rows are admitted, vs eager (bench/sglang_graph_capture.py)
#   bash bench/gpu_check.sh batchinv   # issue 49, about 3 minutes: hf's batch-invariant forwards on CUDA
#                                      # (run.deterministic): a row's logits alone vs among 7 and 31 others,
#                                      # mode off and on, and the mode's decode cost (bench/batch_invariant_check.py)
#   bash bench/gpu_check.sh vllm       # issue 46, about 8 minutes: the vLLM graphs part below, then evicted (R-KV
#                                      # 64 + 128) vs full KV on vLLM with CUDA graphs, 7B-shaped random weights,
#                                      # N = 8, ample and tight KV memory (bench/vllm_evicted.py; where vLLM is
#                                      # importable: the lent image had none, and its wheel is past what a session carries)
#   bash bench/gpu_check.sh vllm_graphs  # issue 46, under a minute, no vLLM needed: the query ring write and H2O's
#                                      # statistic captured in a real CUDA graph with no kvflow request, replayed on
#                                      # new token maps and statistic entries, vs eager
# SGLang part (issue 16; runs only where SGLang 0.5.23 is importable, which the lent machine's
# image was not): a random-weight Qwen2.5-Math-7B-shaped checkpoint on disk, evicted (R-KV,
# B=64 + 128) vs full-KV decoding on SGLang at equal batch (N = 8) and growing output lengths:
# tokens/s and KV slots held (bench/sglang_evicted.py) -> $OUT/gpu_sglang_evicted.json; and the
# largest batch one 32k-token pool runs, evicted vs full (bench/sglang_admission.py).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="${KVFLOW_WHEELS:-}"
if [ "${1:-}" = "--wheels" ]; then wheels="${2:?--wheels DIR}"; shift 2; fi
if [ -n "$wheels" ]; then  # pydantic & co. from carried wheels, before the first kvflow import
  site="${TMPDIR:-/tmp}/kvflow-gpu-site-$(${PYTHON:-python3} -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  ${PYTHON:-python3} bench/install_wheels.py "$wheels" "$site" || { echo "gpu_check: installing $wheels failed" >&2; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-.}/gpu_check.json"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
${PYTHON:-python3} - <<'PY' || exit 3
import importlib.util, platform, sys
from importlib.metadata import version
print("python", platform.python_version(), sys.executable)
dists = {"pydantic": "pydantic", "pydantic_core": "pydantic-core", "typing_extensions": "typing-extensions",
         "yaml": "pyyaml", "pluggy": "pluggy", "torch": "torch", "transformers": "transformers"}
missing = [m for m in dists if importlib.util.find_spec(m) is None]
for mod, dist in dists.items():
    if mod not in missing:
        print(f"  {dist} {version(dist)}  ({importlib.util.find_spec(mod).origin})")
if missing:
    sys.exit(f"gpu_check: missing {missing} (carry the wheels of bench/gpu_wheels.sh: KVFLOW_WHEELS=DIR)")
import kvflow.config.schema  # pydantic models: what fails first without a working pydantic
from kvflow.backends.hf.compat import check_transformers
why = check_transformers()
if why:
    sys.exit(f"gpu_check: {why}")
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA")
PY
skipped() {  # a part that could not run is never a success, unless the caller said to skip it
  case ",${KVFLOW_GPU_CHECK_SKIP:-}," in *",$1,"*)
    echo "gpu_check: $1 part skipped as asked (KVFLOW_GPU_CHECK_SKIP): $2" >&2; return 0 ;;
  esac
  echo "gpu_check: $1 part NOT TESTED: $2 (set KVFLOW_GPU_CHECK_SKIP=$1 to skip it on purpose)" >&2
  return 4
}
sglang_part() {
  ${PYTHON:-python3} -c "import sglang" 2>/dev/null || { skipped sglang "SGLang is not importable on this machine"; return $?; }
  dir="${TMPDIR:-/tmp}/kvflow-random-qwen2.5-math-7b"
  ${PYTHON:-python3} bench/scheduler_throughput.py --save-model "$dir" --shape 7b || return 1
  timeout 420 ${PYTHON:-python3} bench/sglang_evicted.py --engines sglang --device cuda --model "$dir" \
    --dtype bfloat16 --n 8 --lengths 512,1024,2048 --evictor rkv --budget 64 --buffer 128 \
    --out "${OUT:-.}/gpu_sglang_evicted.json"
  timeout 240 ${PYTHON:-python3} bench/sglang_admission.py --device cuda --model "$dir" --dtype bfloat16 \
    --pool 32768 --n 128 --tokens 1024 --budget 64 --buffer 128 --out "${OUT:-.}/gpu_sglang_admission.json"
}
alloc_part() {
  dir="${TMPDIR:-/tmp}/kvflow-random-qwen2.5-math-7b"
  ${PYTHON:-python3} bench/scheduler_throughput.py --save-model "$dir" --shape 7b || return 1
  timeout 300 ${PYTHON:-python3} bench/sglang_evicted.py --engines hf --device cuda --model "$dir" \
    --dtype bfloat16 --n 8 --lengths 256,512,1024 --evictor snapkv,pyramidkv,ada-snapkv --budget 64 \
    --buffer 128 --out "${OUT:-.}/gpu_allocations.json"
}
fast_part() {  # issue 25: engines that overlap, and Table 3's throughput rows, on one GPU
  # 7B/1.5B shapes at 14 of their 28 layers (to fit the budget), N = 8, 3 steps of <= 64 tokens
  local common="--device cuda --layers 14 --n 8 --steps 3" f="${OUT:-.}/gpu_fast.jsonl" failed=0
  : > "$f"
  for o in off on; do  # base and helper on threads of their own (one GPU: launches interleave)
    timeout 150 ${PYTHON:-python3} bench/scheduler_throughput.py $common --problems 32 --overlap $o | tee -a "$f" \
      || { echo "{\"failed\": \"overlap $o\"}" >> "$f"; failed=1; }
  done
  for b in 8 64; do  # problems/min: KV-Rescue vs best-of-N of the base with full / evicted KV
    for p in full-bon evicted-bon rescue; do
      timeout 150 ${PYTHON:-python3} bench/scheduler_throughput.py $common --problems $b --pipeline $p | tee -a "$f" \
        || { echo "{\"failed\": \"$p $b\"}" >> "$f"; failed=1; }
    done
  done
  return $failed
}
graphs_part() {  # issue 25: the capturable SGLang hook under torch.cuda.graph, 7B-like shapes
  PYTHONPATH="src:plugins:${PYTHONPATH:-}" timeout 120 ${PYTHON:-python3} bench/sglang_graph_capture.py --bs 64 \
    | tee "${OUT:-.}/gpu_sglang_graph_capture.json"
}
vllm_part() {  # issue 46: evicted requests in vLLM's blocks on CUDA (graphs and torch.compile on), where vLLM is importable
  ${PYTHON:-python3} -c "import vllm" 2>/dev/null || { skipped vllm "vLLM is not importable on this machine"; return $?; }
  dir="${TMPDIR:-/tmp}/kvflow-random-qwen2.5-math-7b"
  ${PYTHON:-python3} bench/scheduler_throughput.py --save-model "$dir" --shape 7b || return 1
  KVFLOW_VLLM_PYTHON="$(command -v ${PYTHON:-python3})" timeout 480 ${PYTHON:-python3} bench/vllm_evicted.py \
    --engines vllm --device cuda --model "$dir" --dtype bfloat16 --n 8 --lengths 512,1024,2048 --evictor rkv \
    --budget 64 --buffer 128 --memory ample,tight --tight-tokens 16384 --out "${OUT:-.}/gpu_vllm_evicted.json"
}
vllm_graphs_part() {  # issue 46: kvflow's ops inside vLLM's forward (the query ring write, H2O's statistic) under torch.cuda.graph, no vLLM
  PYTHONPATH="src:plugins:${PYTHONPATH:-}" timeout 120 ${PYTHON:-python3} bench/vllm_graph_capture.py --bs 64 \
    | tee "${OUT:-.}/gpu_vllm_graph_capture.json"
}
batchinv_part() {  # issue 49: cuBLAS and CUDA sdpa under kvflow's tiles and row-by-row attention
  timeout 300 ${PYTHON:-python3} bench/batch_invariant_check.py --device cuda --shape qwen2.5-7b --layers 8 \
    --batches 1,8,32 --steps 32 --prompt 200 --out "${OUT:-.}/gpu_batch_invariant.json"
}
if [ "${1:-}" = "batchinv" ]; then batchinv_part; exit $?; fi
if [ "${1:-}" = "vllm" ]; then vllm_graphs_part && vllm_part; exit $?; fi
if [ "${1:-}" = "vllm_graphs" ]; then vllm_graphs_part; exit $?; fi
if [ "${1:-}" = "sglang" ]; then sglang_part; exit $?; fi
if [ "${1:-}" = "graphs" ]; then graphs_part; exit $?; fi
if [ "${1:-}" = "fast" ]; then fast_part; exit $?; fi
if [ "${1:-}" = "alloc" ]; then alloc_part; exit $?; fi
: > "$out"
status=0
for spec in "--problems 8 --n 8 --steps 2" "--problems 32 --n 8 --steps 3" "--problems 64 --n 8 --steps 3"; do
  echo "== $spec" >&2
  timeout 200 ${PYTHON:-python3} bench/scheduler_throughput.py --device cuda $spec | tee -a "$out" \
    || { echo "{\"failed\": \"$spec\"}" >> "$out"; status=1; }
done
exit $status
