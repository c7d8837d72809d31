#!/usr/bin/env bash
# Download the wheels that bench/gpu_check.sh installs on the lent GPU machine, whose image has
# torch and transformers (5.17) but neither pydantic, pluggy nor (perhaps) pyyaml, and no
# package index: the session carries DIR with its working tree (the `run` tool's `carry`, 64 MiB
# in all) and gpu_check.sh installs from it (`KVFLOW_WHEELS=DIR` or `--wheels DIR`).
#   bash bench/gpu_wheels.sh bench/wheels      # bench/wheels/ is gitignored
# The image's Python version is unknown: the compiled wheels (pydantic-core, PyYAML) come for
# CPython 3.10-3.13 on manylinux2014 x86_64; the rest are pure Python. Versions are those kvflow's
# tests run on (scripts/constraints-gpu.txt). transformers is not carried: the hf engine is
# verified on the image's 5.17 (kvflow.backends.hf.compat.TRANSFORMERS_FLOOR).
set -euo pipefail
dir="${1:?usage: bash bench/gpu_wheels.sh DIR}"
mkdir -p "$dir"
pip=(${PYTHON:-python3} -m pip --disable-pip-version-check -q download --no-deps --only-binary=:all: -d "$dir")
pure=(pydantic==2.14.4 typing-extensions==4.16.0 annotated-types==0.8.0 typing-inspection==0.4.5 pluggy==1.7.0)
compiled=(pydantic-core==2.50.5 pyyaml==6.0.4)
"${pip[@]}" --python-version 3.10 "${pure[@]}"
for v in 3.10 3.11 3.12 3.13; do
  "${pip[@]}" --python-version "$v" --implementation cp --platform manylinux2014_x86_64 "${compiled[@]}"
done
ls -l "$dir"/*.whl | awk '{printf "%9d  %s\n", $5, $NF}'
total=$(cat "$dir"/*.whl | wc -c)
echo "total: $total bytes ($((total / 1024)) KiB) in $(ls "$dir"/*.whl | wc -l) wheels"
[ "$total" -lt $((50 * 1024 * 1024)) ] || { echo "gpu_wheels: over 50 MiB; the working tree carries 64 MiB in all" >&2; exit 1; }
