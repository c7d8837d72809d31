"""kvflow's whole step loop against plain `model.generate` (issue 7: framework overhead).

The kvflow side is the step scheduler (`kvflow.runtime.scheduler.run`) on the `hf` engine with one proposer, evictor `none`, greedy
sampling (temperature 0, n = 1), steps split on the delimiter ("\\n\\n", at most
`--max-step-tokens` tokens a step), the `likelihood` scorer on the candidates' own
log-probabilities (free) and the `best` committer: every step forks the cache, decodes to the
delimiter, scores, commits and adopts the candidate's cache, as a KV-Rescue round does. Both
sides decode exactly `--tokens` new tokens per row at batch `--batch` from the same prompts
(GSM8K questions under the qwen25-math-cot template and the model's chat template): EOS does
not stop either side (kvflow's runner gets no EOS ids, generate no `eos_token_id`), so the
token counts are equal by construction.

`generate` runs before and after kvflow in the same process (the drift shows how much the
load of a shared machine moved); the ratio is kvflow's throughput over generate's mean.

    python bench/step_loop_vs_generate.py --batch 4 --tokens 128 --threads 1
    python bench/step_loop_vs_generate.py --model tiny --tokens 32     # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import torch
from _common import machine_line  # noqa: E402 - bench/ is on sys.path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="catalog:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per row, both sides")
    ap.add_argument("--max-step-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def load(args):
    from kvflow.backends.hf.engine import HFRunner

    if args.model == "tiny":
        from kvflow.testing import tiny_runner

        return tiny_runner("qwen2", dtype=args.dtype, num_layers=4)
    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import load_model

    model, tok = load_model(ModelConfig(id=args.model, dtype=args.dtype, device="cpu"))
    return HFRunner(model, tok)


def prompts(runner, n):
    from kvflow.eval.datasets import load_problems
    from kvflow.eval.prompts import render_prompt

    return [render_prompt("qwen25-math-cot", p.question, runner.tokenizer) for p in load_problems("gsm8k", limit=n)]


def run_kvflow(runner, texts, args):
    from kvflow.backends.hf.decode import HFEngine
    from kvflow.components.base import ScorerContext, Trajectory
    from kvflow.components.engine import SamplingSpec
    from kvflow.config.schema import LimitsConfig
    from kvflow.registry import get_registry
    from kvflow.runtime.scheduler import Plan, Proposer, run

    reg = get_registry()
    none, scorer, committer = (reg.get("evictors", "none"), reg.get("scorers", "likelihood"),
                               reg.get("committers", "best"))
    spec = SamplingSpec(1, 0.0, 1.0, args.max_step_tokens, "\n\n")
    ctx = ScorerContext(load_session=None, proposers=["base"], seed=0)
    plan = Plan([Proposer("base", HFEngine(runner), none(none.Params()), spec)], scorer(scorer.Params(), ctx),
                committer(committer.Params(), ["base"]),
                LimitsConfig(max_tokens=args.tokens, max_steps=10_000, stop_on_answer=False), 0,
                batch_problems=args.batch)
    trajs = [Trajectory(f"p{i}", "", t) for i, t in enumerate(texts)]
    timings: dict = {}
    t = time.perf_counter()
    run(plan, trajs, lambda tr: None, timings=timings)
    seconds = time.perf_counter() - t
    assert all(tr.committed_tokens == args.tokens for tr in trajs), [tr.committed_tokens for tr in trajs]
    last = max(timings.values(), key=lambda x: x["wall"])  # the whole batch
    return seconds, trajs, last


def run_generate(runner, texts, args):
    import copy

    tok = runner.tokenizer
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    config = copy.deepcopy(runner.model.generation_config)
    config.eos_token_id = None  # no stopping: exactly --tokens new tokens per row
    config.do_sample = False
    config.temperature = config.top_p = config.top_k = None
    config.max_new_tokens = args.tokens
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    t = time.perf_counter()
    with torch.inference_mode():
        out = runner.model.generate(**enc, generation_config=config)
    seconds = time.perf_counter() - t
    new = out[:, enc["input_ids"].shape[1]:]
    assert new.shape[1] == args.tokens
    return seconds, new


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = load(args)
    runner.eos_ids = set()  # EOS does not end a kvflow step either
    texts = prompts(runner, args.batch)
    lens = [len(runner.encode(t)) for t in texts]
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{machine_line()}, {torch.get_num_threads()} torch threads",
           "load_before": os.getloadavg(), "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
           "batch": args.batch, "tokens": args.tokens, "prompt_tokens": lens, "max_step_tokens": args.max_step_tokens}
    print(f"# step loop vs generate: {args.model} ({args.dtype}), batch {args.batch}, {args.tokens} tokens, "
          f"prompts {min(lens)}-{max(lens)} tokens, {out['machine']}, load {out['load_before']}", file=sys.stderr)
    g1, gen = run_generate(runner, texts, args)
    print(f"  generate: {g1:.2f} s", file=sys.stderr)
    k, trajs, timing = run_kvflow(runner, texts, args)
    print(f"  kvflow step loop: {k:.2f} s", file=sys.stderr)
    g2, _ = run_generate(runner, texts, args)
    print(f"  generate: {g2:.2f} s", file=sys.stderr)
    g = (g1 + g2) / 2
    same = [runner.decode(gen[i].tolist()) == tr.text for i, tr in enumerate(trajs)]
    prefix = []
    for i, tr in enumerate(trajs):
        a, b = runner.decode(gen[i].tolist()), tr.text
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(round(n / max(len(a), 1), 3))
    phases = timing["phases"]
    forward = sum(v for key, v in phases.items() if "forward:" in key)
    out.update(generate_s=[round(g1, 2), round(g2, 2)], kvflow_s=round(k, 2),
               tok_per_s={"generate": round(args.batch * args.tokens / g, 2), "kvflow": round(args.batch * args.tokens / k, 2)},
               throughput_ratio=round(g / k, 3), steps=[len(tr.steps) for tr in trajs],
               same_text=same, same_prefix_fraction=prefix,
               kvflow_phases=phases, kvflow_forward_share=round(forward / timing["wall"], 3),
               load_after=os.getloadavg())
    print(f"\n| batch | new tokens / row | committed steps / row | generate s (before, after) | kvflow step loop s | "
          f"kvflow / generate throughput | model forwards in kvflow's time |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.batch} | {args.tokens} | {', '.join(map(str, out['steps']))} | {g1:.2f}, {g2:.2f} | {k:.2f} | "
          f"{out['throughput_ratio']} | {out['kvflow_forward_share']:.1%} |")
    print("\nkvflow phases (s): " + ", ".join(f"{key} {v:.2f}" for key, v in phases.items()))
    print(f"same text as generate: {same}; identical prefix (fraction of generate's text): {prefix}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
