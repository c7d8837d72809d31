#!/usr/bin/env bash
# What run.deterministic (batch-invariant forwards on hf) costs on the quickstart: the same
# pipeline (Qwen2.5-Coder-0.5B base evicted + helper, bf16, GSM8K) run with the mode off, then
# on, one after the other on one machine; tokens generated per second of each run's wall time,
# and whether the two runs' answers agree (docs/benchmarks.md#batch-invariant-hf). Resumable
# (rerun the same command: finished runs are kept).
#   bash bench/deterministic_cost.sh [OUT] [PROBLEMS]     # default docs/results/deterministic_cost, 4
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/results/deterministic_cost}"
problems="${2:-4}"
kvflow="${KVFLOW:-.venv/bin/kvflow}"
for mode in false true; do
  "$kvflow" run pipelines/quickstart.yaml --set run.output="$out" --set dataset.limit="$problems" \
    --set run.batch_problems="$problems" --set run.deterministic=$mode --set name=quickstart_deterministic_$mode
done
.venv/bin/python - "$out" <<'PY' | tee "$out/summary.json"
import datetime as dt, json, sys
from pathlib import Path
runs = {}
for mode in ("false", "true"):
    (d,) = Path(sys.argv[1]).glob(f"quickstart_deterministic_{mode}__*")
    m, x = json.loads((d / "manifest.json").read_text()), json.loads((d / "metrics.json").read_text())
    wall = (dt.datetime.fromisoformat(m["finished"]) - dt.datetime.fromisoformat(m["started"])).total_seconds()
    tokens = x["n_problems"] * sum(x["tokens_generated"].values())
    recs = {r["id"]: r["output"] for r in map(json.loads, (d / "samples.jsonl").read_text().splitlines())}
    runs[mode] = {"dir": str(d), "wall_s": wall, "tokens_generated": tokens, "tok_s": round(tokens / wall, 2),
                  "accuracy": x["accuracy"], "cpu": m.get("cpu"), "outputs": recs}
same = sum(runs["false"]["outputs"][k] == runs["true"]["outputs"].get(k) for k in runs["false"]["outputs"])
print(json.dumps({"deterministic_vs_default_tok_s": round(runs["true"]["tok_s"] / runs["false"]["tok_s"], 3),
                  "same_outputs": f"{same} of {len(runs['false']['outputs'])}",
                  **{f"run.deterministic={k}": {kk: v for kk, v in r.items() if kk != "outputs"} for k, r in runs.items()}},
                 indent=1))
PY
