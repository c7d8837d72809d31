#!/usr/bin/env bash
# Create ./.venv (or $VENV) and install kvflow into it, editable, with optional extras.
#   scripts/install.sh            # kvflow only
#   scripts/install.sh dev,docs   # plus test and docs tools
# torch: with an NVIDIA GPU, PyPI's default (CUDA) build; without one, the CPU build of
# torch 2.13.0 (set KVFLOW_TORCH_INDEX to a CPU wheel index where PyPI would give CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip>=24"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
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

spec="."
[ -n "$extras" ] && spec=".[${extras}]"
"${pip[@]}" install -q -e "$spec"
"$venv/bin/kvflow" --version
