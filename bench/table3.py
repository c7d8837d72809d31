"""What eviction buys at a fixed KV memory: the paper's Table 3 at CPU scale (docs/benchmarks.md).

Three pipelines over the same GSM8K problems, each admitted by `run.kv_memory` (the step
scheduler admits a problem while the KV bytes its rows can grow to fit beside the others'):

- `full`: full-KV best-of-N (the base, evictor `none`, n candidates, likelihood-scored);
- `evicted`: the same at an R-KV budget B (`--budget`, `--buffer`);
- `kv_rescue`: the evicted base with the entropy and gzip pruners + a full-context helper
  with half the base's layers (half its KV per token, as the paper's 1.5B helper has half the
  7B base's), both n candidates, scored by the helper's likelihood.

each at a tight memory (`--tight`: full KV fits `--tight` problems at once) and an ample one
(`--ample`: every problem fits at once whatever the method), all in one process, one after
another. The models are random-weight ones with real shapes (`--shape`: SmolLM2-135M's
layers, heads and widths by default; the tiny test tokenizer, so the embedding and LM head are
small), built from a config (no download), so every method does the same work per token; a
random model rarely ends a step at the delimiter or EOS, so trajectories run to
`limits.max_tokens` in steps of `max_step_tokens`. Measured per (memory, method): problems
per minute over the decode (models loaded and warmed up on one problem first), committed and
generated tokens per second, problems per CPU-minute of this process (less sensitive to
other jobs on a shared machine than wall time), and the peak KV bytes reserved, problems and candidate rows in
flight (manifest.json's `kv_admission`).

    python bench/table3.py [--problems 8] [--n 4] [--max-tokens 256] [--budget 64 --buffer 32]
        [--tight 1 --ample 8] [--threads 1] [--engine hf|sglang|vllm] [--modes default,deterministic]

`--modes default,deterministic` runs each method also with `run.deterministic` (hf's
batch-invariant forwards), as `<method>+deterministic`, with its tokens/s over the default's
(`vs_default`), in the same process (docs/benchmarks.md#batch-invariant-hf).

Prints one JSON object (and writes it to `--out`). `--engine sglang` runs the same pipelines
on SGLang (each model's worker pool sized from run.kv_memory by
kvflow.runtime.kv_budget.kv_memory_engines; CPU time is then not measured: it is the worker's).
`--engine vllm` runs them on vLLM: kvflow's admission bounds the KV by `run.kv_memory` (vLLM's
own pool keeps its default size; evicted rows live in vLLM's blocks, compacted in place:
docs/backends.md#vllm-evicted); CPU time is the worker's too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml
from _common import write_json  # noqa: E402 - bench/ is on sys.path

#: (layers, hidden, heads, KV heads, intermediate) of the random-weight base (the helper: half the layers)
SHAPES = {"smollm2-135m": (30, 576, 9, 3, 1536), "qwen2.5-0.5b": (24, 896, 14, 2, 4864)}


def build_models(cache: Path, shape: str) -> tuple[Path, Path]:
    """Random-weight Llama-architecture base and helper directories (bfloat16) with the tiny
    tokenizer; built once under `cache`."""
    import torch
    import transformers

    from kvflow.testing.models import tiny_tokenizer

    layers, hidden, heads, kv_heads, inter = SHAPES[shape]
    out = []
    for name, n_layers in (("base", layers), ("helper", layers // 2)):
        path = cache / f"{shape}-{name}"
        if not (path / "config.json").is_file():
            tok = tiny_tokenizer()
            config = transformers.LlamaConfig(
                vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n_layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=None)
            torch.manual_seed(0 if name == "base" else 1)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(path)
            tok.save_pretrained(path)
        out.append(path)
    return out[0], out[1]


def pipelines(base: Path, helper: Path, args) -> dict[str, dict]:
    sampling = {"temperature": 0.7, "top_p": 0.95, "max_step_tokens": args.step_tokens}
    models = {"base": {"backend": args.engine, "id": str(base), "dtype": "bfloat16", "device": "cpu"},
              "helper": {"backend": args.engine, "id": str(helper), "dtype": "bfloat16", "device": "cpu"}}
    rkv = {"kind": "rkv", "budget": args.budget, "buffer": args.buffer, "window": 8, "protect_prompt": False}
    common = {"kvflow": 1, "dataset": {"name": "gsm8k", "limit": args.problems},
              "committer": {"kind": "best"}, "limits": {"max_steps": 256, "max_tokens": args.max_tokens},
              "run": {"seed": 0, "threads": args.threads}}
    full = {"model": "base", "n": args.n, "sampling": sampling}
    return {
        "full": {**common, "name": "t3_full", "models": {"base": models["base"]}, "proposers": {"base": full},
                 "scorer": {"kind": "likelihood", "model": "base"}},
        "evicted": {**common, "name": "t3_evicted", "models": {"base": models["base"]},
                    "proposers": {"base": {**full, "evictor": rkv}}, "scorer": {"kind": "likelihood", "model": "base"}},
        "kv_rescue": {**common, "name": "t3_kv_rescue", "models": models,
                      "proposers": {"base": {**full, "evictor": rkv,
                                             "pruners": [{"kind": "entropy", "threshold": 2.5, "window": 32},
                                                         {"kind": "gzip", "threshold": 0.35, "window": 256}]},
                                    "helper": {"model": "helper", "n": args.n, "sampling": sampling}},
                      "scorer": {"kind": "likelihood", "model": "helper"}},
    }


def problem_bytes(loaded, registry) -> int:
    """KV bytes one problem of this pipeline reserves at the longest prompt of its dataset
    (from the models' configs, as `kvflow explain` counts them; the prompt in the base's tokens)."""
    from kvflow.runtime.kv_budget import static_row_costs
    from kvflow.kv_memory import KVBudget
    from kvflow.runtime.core import load_dataset
    from kvflow.eval.prompts import render_prompt
    from kvflow.testing.models import tiny_tokenizer

    costs, unknown = static_row_costs(loaded)
    assert not unknown, unknown
    tok = tiny_tokenizer()
    longest = max(len(tok(render_prompt(loaded.pipeline.dataset.prompt, p.question, tok),
                          add_special_tokens=False)["input_ids"]) for p in load_dataset(loaded))
    return KVBudget(1, tuple(costs), loaded.pipeline.limits.max_tokens).problem_bytes(
        {c.name: longest for c in costs})


def measure(doc: dict, kv_memory: int, directory: Path) -> dict:
    """Decode the pipeline's problems under `kv_memory` bytes in this process (records not
    written); models loaded and warmed up on one problem first."""
    from kvflow.config.validate import load_pipeline
    from kvflow.registry import get_registry
    from kvflow.runtime.core import load_dataset
    from kvflow.runtime.scheduler import Occupancy
    from kvflow.runtime.session import Session

    doc = {**doc, "run": {**doc["run"], "kv_memory": kv_memory, "output": str(directory / "results")}}
    path = directory / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    loaded = load_pipeline(path)
    problems = load_dataset(loaded)
    with Session(loaded, get_registry()) as session:
        session.check_kv_memory(problems)
        session.decode([session.trajectory(problems[0])], lambda traj: session.forget(traj))  # warm-up
        session.occupancy = Occupancy()
        done = []

        def on_done(traj) -> None:
            done.append((traj.committed_tokens, sum(traj.tokens_generated.values()), len(traj.steps), traj.finish))
            session.forget(traj)

        t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
        session.decode((session.trajectory(p) for p in problems), on_done)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        kv = dict(session.occupancy.kv)
        occupancy = session.occupancy.summary()
        for engine in session.engines.values():
            getattr(engine, "drain", lambda: None)()  # every request's end counted
        counters = {key: {k: v for k, v in (engine.stats() or {}).items() if isinstance(v, (int, float))}
                    for key, engine in session.engines.items() if callable(getattr(engine, "stats", None))}
    in_process = all(m["backend"] == "hf" for m in doc["models"].values())  # SGLang decodes in its worker
    return {"problems": len(done), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2) if in_process else None,
            "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
            "problems_per_min": round(len(done) / wall * 60, 2),
            "problems_per_cpu_min": round(len(done) / cpu * 60, 2) if in_process else None,
            "committed_tok_s": round(sum(d[0] for d in done) / wall, 1),
            "generated_tok_s": round(sum(d[1] for d in done) / wall, 1),
            "mean_steps": round(sum(d[2] for d in done) / len(done), 1),
            "peak_kv_bytes": kv.get("peak_bytes"), "peak_kv_mib": round(kv.get("peak_bytes", 0) / 2**20, 1),
            "peak_problems": kv.get("peak_problems"), "peak_rows": kv.get("peak_rows"),
            "mean_rows_per_forward": {k: v["mean_rows"] for k, v in occupancy.items()},
            "engine_stats": counters}  # warm-up included


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="candidates per proposer per step")
    ap.add_argument("--max-tokens", type=int, default=256, help="limits.max_tokens")
    ap.add_argument("--step-tokens", type=int, default=64, help="sampling.max_step_tokens")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=32)
    ap.add_argument("--tight", type=int, default=1, help="problems full KV fits at once at the tight memory")
    ap.add_argument("--ample", type=int, default=None, help="problems full KV fits at the ample memory (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="run.threads (one is fastest on a small shared CPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--engine", choices=("hf", "sglang", "vllm"), default="hf")
    ap.add_argument("--methods", default="full,evicted,kv_rescue")
    ap.add_argument("--modes", default="default", help="default and/or deterministic (run.deterministic), comma-separated")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvflow-bench-table3"))
    ap.add_argument("--out", default="docs/results/bench/table3.json")
    args = ap.parse_args()

    from kvflow.config.validate import load_pipeline
    from kvflow.registry import get_registry
    from kvflow.versions import cpu

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    base, helper = build_models(cache / "models", args.shape)
    docs = pipelines(base, helper, args)
    work = cache / "runs"
    work.mkdir(exist_ok=True)
    probe = work / "probe.yaml"
    probe.write_text(yaml.safe_dump({**docs["full"], "run": {"kv_memory": "auto"}}, sort_keys=False))
    full_problem = problem_bytes(load_pipeline(probe), get_registry())
    memories = {"tight": full_problem * args.tight, "ample": full_problem * (args.ample or args.problems)}
    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
           "machine": cpu(), "load_before": os.getloadavg(),
           "shape": args.shape, "engine": args.engine, "problems": args.problems, "n": args.n,
           "max_tokens": args.max_tokens, "step_tokens": args.step_tokens, "budget": args.budget,
           "buffer": args.buffer, "full_problem_bytes": full_problem, "memories": memories, "runs": {}}
    for label, memory in memories.items():
        for method in args.methods.split(","):
            for mode in args.modes.split(","):
                doc, name = docs[method], method
                if mode == "deterministic":
                    doc = {**doc, "name": doc["name"] + "_det", "run": {**doc["run"], "deterministic": True}}
                    name = f"{method}+deterministic"
                r = measure(doc, memory, work)
                out["runs"].setdefault(label, {})[name] = r
                print(f"{label} ({memory / 2**20:.1f} MiB) {name}: {r}", flush=True)
        runs = out["runs"][label]
        for name, r in runs.items():
            default = runs.get(name.removesuffix("+deterministic"))
            if name.endswith("+deterministic") and default:
                r["vs_default"] = round(r["generated_tok_s"] / default["generated_tok_s"], 3)
        if "full" in runs:
            for method, r in runs.items():
                r["vs_full"] = round(r["problems_per_min"] / runs["full"]["problems_per_min"], 3)
                if r["problems_per_cpu_min"] is not None:
                    r["vs_full_cpu"] = round(r["problems_per_cpu_min"] / runs["full"]["problems_per_cpu_min"], 3)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
