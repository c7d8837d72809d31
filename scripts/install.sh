#!/usr/bin/env bash
# Create ./.venv (or $VENV) and install kvflow into it, editable, with optional extras.
#   scripts/install.sh            # kvflow only
#   scripts/install.sh dev,docs   # plus test and docs tools
#   scripts/install.sh dev,docs,sglang   # plus SGLang (the `sglang` backend)
#   scripts/install.sh ray        # plus Ray (run.executor: ray; any extras combine: dev,docs,sglang,ray,serve)
#   scripts/install.sh serve      # plus FastAPI and uvicorn (`kvflow serve`)
#   scripts/install.sh vllm       # plus vLLM's own environment, ./.venv-vllm (or $VLLM_VENV), for
#                                 # `backend: vllm` (combines: dev,docs,sglang,ray,serve,vllm)
# torch: with an NVIDIA GPU, PyPI's default (CUDA) build; without one, the CPU build of
# torch 2.13.0 (set KVFLOW_TORCH_INDEX to a CPU wheel index where PyPI would give CUDA).
# sglang: SGLang 0.5.23 needs torch 2.14.1 (PyPI's build, which also runs on a CPU). With a GPU
# it is installed the ordinary way; without one, the CPU recipe: sglang without its CUDA-only
# dependencies, the pure-Python set it needs (scripts/sglang-cpu-requirements.txt) and
# kvflow's out-of-tree CPU platform (plugins/kvflow-sglang-cpu). With a GPU, every install step
# is constrained to one tested combination, scripts/constraints-gpu.txt (SGLang's own pins,
# transformers 5.19.0 included, which kvflow's range >=5.17 admits); without one, transformers
# stays at the newest of kvflow's range (5.24 in kvflow's CI, which runs SGLang on it).
# vllm: vLLM cannot share SGLang's torch, so it gets a venv of its own (scripts/install-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"

vllm=0
case ",$extras," in *,vllm,*) vllm=1 ;; esac
extras=$(echo "$extras" | tr ',' '\n' | { grep -vx vllm || true; } | paste -sd, -)  # not a pip extra: its own venv

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip>=24"

gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1
sglang=0
case ",$extras," in *,sglang,*) sglang=1 ;; esac
extras=$(echo "$extras" | tr ',' '\n' | { grep -vx sglang || true; } | paste -sd, -)  # not a pip extra: see above
constraints=()
if [ "$sglang" = 1 ] && [ "$gpu" = 1 ]; then
  constraints=(-c scripts/constraints-gpu.txt)  # one tested combination: see its header
fi

if [ "$sglang" = 1 ]; then
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" 2>/dev/null; then
    echo "install: sglang: torch 2.14.1 and torchvision 0.29.1" >&2
    "${pip[@]}" install -q "torch==2.14.1" "torchvision==0.29.1" ${constraints[@]+"${constraints[@]}"}
  fi
elif [ "$gpu" = 1 ]; then
  echo "install: NVIDIA GPU found: default torch build" >&2
  "${pip[@]}" install -q "torch>=2.4,<2.15"
elif ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "install: no GPU: CPU build of torch 2.13.0" >&2
  if [ -n "${KVFLOW_TORCH_INDEX:-}" ]; then
    "${pip[@]}" install -q "torch==2.13.0" --index-url "$KVFLOW_TORCH_INDEX"
  else
    "${pip[@]}" install -q "torch==2.13.0"
  fi
fi

# dev: headless Chromium (Debian's package) for the viewer's browser tests
# (tests/test_view_browser.py), where this runs as root with apt; never fatal: without it
# those tests skip with the reason
case ",$extras," in *,dev,*)
  if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install: chromium (Debian) for the viewer's browser tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
      >/dev/null 2>&1 || echo "install: chromium could not be installed; the browser tests will skip" >&2
  fi ;;
esac

spec="."
[ -n "$extras" ] && spec=".[${extras}]"
"${pip[@]}" install -q -e "$spec" ${constraints[@]+"${constraints[@]}"}

if [ "$sglang" = 1 ]; then
  if [ "$gpu" = 1 ]; then
    echo "install: sglang 0.5.23 (GPU), constrained by scripts/constraints-gpu.txt" >&2
    "${pip[@]}" install -q "sglang==0.5.23" "${constraints[@]}"
  else
    echo "install: sglang 0.5.23, CPU recipe" >&2
    "${pip[@]}" install -q --no-deps "sglang==0.5.23"
    "${pip[@]}" install -q -r scripts/sglang-cpu-requirements.txt
    "${pip[@]}" install -q --no-deps -e plugins/kvflow-sglang-cpu
  fi
  # CPU: back to kvflow's own transformers/tokenizers range; GPU: the constrained set again
  "${pip[@]}" install -q -e "$spec" ${constraints[@]+"${constraints[@]}"}
fi

[ "$vllm" = 1 ] && GPU="$gpu" PYTHON="$python" bash scripts/install-vllm.sh
"$venv/bin/kvflow" --version
