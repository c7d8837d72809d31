#!/usr/bin/env bash
# A separate virtual environment for the kvpress side of bench/kvpress_vs_kvflow.py:
# kvpress 0.5.5 pins transformers<5.3 while kvflow is on 5.24, so the two cannot share
# kvflow's .venv. Creates bench/kvpress/.venv (git-ignored) with the CPU build of torch 2.13.0
# (the same torch as kvflow's .venv; kvpress asks for torch>=2.3.1,<3) and
# transformers 5.2.0 (the newest release kvpress 0.5.5 accepts).
#   bash bench/kvpress/setup.sh            # then: bench/kvpress/.venv/bin/python bench/kvpress/run_kvpress.py --help
set -euo pipefail
cd "$(dirname "$0")"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip>=24"
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${KVFLOW_TORCH_INDEX:-}" ]; then
    "${pip[@]}" install -q "torch==2.13.0" --index-url "$KVFLOW_TORCH_INDEX"
  else
    "${pip[@]}" install -q "torch==2.13.0"
  fi
fi
"${pip[@]}" install -q "kvpress==0.5.5" "transformers==5.2.0"
.venv/bin/python -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)"
