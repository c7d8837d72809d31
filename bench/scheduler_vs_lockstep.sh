#!/usr/bin/env bash
# Wall time of one configuration under the old lockstep step loop and the new scheduler,
# side by side on the same machine (one torch thread each, started together), then the
# accuracy and whether every committed trajectory is identical (float32, greedy).
# Configuration: the study's best-of-N with random eviction B=64 (bench/reproduce_cpu.sh
# settings: pipelines/cpu, greedy N=1, float32, 400 committed tokens, batch 16, GSM8K-16).
#
# Usage: bench/scheduler_vs_lockstep.sh OLD_COMMIT [LIMIT]
#   OLD_COMMIT: a commit with the lockstep loop (kvflow.runtime.loop), checked out in a worktree.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: $0 OLD_COMMIT [LIMIT]}; limit=${2:-16}
work=${WORK:-/tmp/kvflow-lockstep-bench}
mkdir -p "$work"
[ -d "$work/tree" ] || git worktree add -q "$work/tree" "$old"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
ARGS=(run pipelines/cpu/baselines/best_of_n.yaml --set dataset.name=gsm8k --set dataset.shuffle=true
      --set dataset.limit="$limit" --set run.batch_problems=16 --set limits.max_tokens=400
      --set models.base.dtype=float32 --set models.helper.dtype=float32
      --set proposers.base.n=1 --set proposers.base.sampling.temperature=0 --set run.threads=1
      --set 'proposers.base.evictor={kind: random, budget: 64, buffer: 64, window: 16, protect_prompt: false}')
timed() {  # name, python path prefix
  local name=$1; shift
  local t0=$(date +%s.%N)
  (cd "$1" && PYTHONPATH="$1/src:$1/plugins" "$OLDPWD/.venv/bin/python" -m kvflow.cli "${ARGS[@]}" \
     --set run.output="$work/$name" > "$work/$name.log" 2>&1)
  echo "$name $(echo "$(date +%s.%N) - $t0" | bc) s" >> "$work/times.txt"
}
rm -f "$work/times.txt"
lscpu | grep -E "Model name|Flags" > "$work/machine.txt"; date -u >> "$work/machine.txt"
timed lockstep "$work/tree" & timed scheduler "$PWD" & wait
cat "$work/times.txt"
.venv/bin/python - "$work" <<'PY'
import json, sys, glob
work = sys.argv[1]
def load(name):
    (d,) = glob.glob(f"{work}/{name}/*/")
    recs = {json.loads(l)["id"]: json.loads(l) for l in open(d + "samples.jsonl")}
    return d, recs, json.load(open(d + "metrics.json"))
(do, old, mo), (dn, new, mn) = load("lockstep"), load("scheduler")
same = sum(old[k]["output"] == new[k]["output"] for k in old)
print(f"accuracy lockstep {mo['accuracy']:.3f}  scheduler {mn['accuracy']:.3f}; identical outputs {same}/{len(old)}")
print("occupancy:", mn.get("timing", {}).get("occupancy") or json.load(open(dn + "manifest.json")).get("occupancy"))
PY
