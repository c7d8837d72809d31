"""Engines that overlap (`run.overlap_engines`), one run (docs/benchmarks.md, "Engines that overlap").

    /path/to/venv/bin/python bench/overlap.py [--pipeline pipelines/quickstart.yaml]
        [--set models.base.backend=sglang ...] [--problems 4] [--out docs/results/bench/overlap.json]

Runs one pipeline's problems twice through kvflow's scheduler, with `run.overlap_engines`
off and then on (same engines, loaded once, reset in between), and reports per mode: wall
time, each engine's decode forwards, the committed trajectories (equal in both modes, or
the first difference), and for an SGLang engine the tokens it decoded past kvflow's stop
(`tokens_after_stop`: a pruned or delimited candidate decodes on until the abort lands, and
without overlap the stream is only read between hf forwards) per stopped candidate. Default:
the quickstart with the evicted base on SGLang and the full-context helper on hf (its forward
is what the SGLang stream waits for without overlap). Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", default="pipelines/quickstart.yaml")
    ap.add_argument("--set", action="append", default=None, dest="sets")
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--modes", default="off,on", help="run.overlap_engines per run, in order (e.g. off,on,off,on)")
    ap.add_argument("--tiny-base", action="store_true",
                    help="the base is a tiny random-weight Qwen2 (built here): its pruners fire within tens of tokens")
    ap.add_argument("--out", default="docs/results/bench/overlap.json")
    args = ap.parse_args()
    sets = args.sets if args.sets is not None else [
        "models.base.backend=sglang", "limits.max_tokens=192", "run.batch_problems=4", "run.threads=1"]

    import torch

    from kvflow.components.base import Trajectory
    from kvflow.config import load_pipeline
    from kvflow.eval.datasets import load_problems
    from kvflow.eval.prompts import render_prompt
    from kvflow.registry import get_registry
    from kvflow.runtime.compile import build_plan
    from kvflow.runtime.scheduler import Occupancy, run

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import cpu_model, write_json  # noqa: E402 - the same machine record

    if args.tiny_base:
        import tempfile

        from kvflow.testing import tiny_model_dir

        sets = sets + [f"models.base.id={tiny_model_dir(tempfile.mkdtemp(prefix='kvflow-overlap-'))}"]
    loaded = load_pipeline(Path(args.pipeline), sets=sets)
    pipe = loaded.pipeline
    torch.set_num_threads(pipe.run.threads or torch.get_num_threads())
    plan, engines = build_plan(loaded, get_registry())
    problems = load_problems(pipe.dataset.name, limit=args.problems)

    def trajectories():
        tok = plan.proposers[0].engine.tokenizer
        return [Trajectory(p.id, p.question, render_prompt(pipe.dataset.prompt, p.question, tok)) for p in problems]

    out = {"pipeline": args.pipeline, "sets": sets, "problems": len(problems), "machine": cpu_model(),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv)}
    committed, runs = {}, []
    for mode in args.modes.split(","):
        plan.overlap = mode
        for e in engines.values():
            if hasattr(e, "reset"):
                e.reset()
        before = {k: dict(getattr(e, "counters", {})) for k, e in engines.items()}
        occupancy, trajs, done = Occupancy(), trajectories(), []
        t0 = time.perf_counter()
        run(plan, trajs, done.append, occupancy=occupancy)
        wall = time.perf_counter() - t0
        committed.setdefault(mode, []).append({t.problem_id: [(s.source, s.text) for s in t.steps] for t in trajs})
        row = {"mode": mode, "wall_s": round(wall, 2), "occupancy": occupancy.summary(), "engines": {}}
        for key, e in engines.items():
            c = getattr(e, "counters", None)
            if c:
                delta = {k: c.get(k, 0) - before[key].get(k, 0) for k in c}
                stopped = delta.get("aborted", 0)
                row["engines"][key] = {**delta, "tokens_after_stop_per_abort":
                                       round(delta.get("tokens_after_stop", 0) / stopped, 2) if stopped else None}
        runs.append(row)
        print(json.dumps(row), flush=True)
    out["runs"] = runs
    # SGLang batches on its own clock, so even two runs in one mode may part at the last bit (bf16)
    first = committed[runs[0]["mode"]][0]
    out["same_trajectories"] = {f"{m}#{i}": c == first for m, cs in committed.items() for i, c in enumerate(cs)}
    mean = {m: sum(r["wall_s"] for r in runs if r["mode"] == m) / len(committed[m]) for m in committed}
    if "on" in mean and "off" in mean:
        out["wall_ratio_on_over_off"] = round(mean["on"] / mean["off"], 3)
    write_json(Path(args.out), out)
    print(json.dumps({k: out.get(k) for k in ("same_trajectories", "wall_ratio_on_over_off")}))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
