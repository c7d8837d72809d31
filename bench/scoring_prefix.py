"""PRM scoring time per round against trajectory length, without and with prefix reuse
(docs/benchmarks.md, "PRM scoring: prefix reuse"; issue 26).

    .venv/bin/python bench/scoring_prefix.py [--lengths 10,50,100,200] [--candidates 8]
        [--engines hf-reencode,hf-reuse,sglang] [--hidden 256] [--layers 4] [--repeats 3]

A random-weight Qwen2 PRM (kvflow's `Qwen2ForProcessRewardModel`: the Qwen2.5-Math-PRM
architecture at a CPU size, float32) with the tiny byte-level tokenizer plus `<extra_0>`
scores, protocol qwen25-math-prm, one problem whose trajectory has L committed steps of ~19
tokens each, and 8 candidate steps. For every L, the round at L - 1 steps runs first (not
timed: it leaves each engine's cache as a run would), then the round at L steps is timed: it
holds the newly committed step and the 8 candidates. Engines:
- hf-reencode: `prefix_reuse: false` (PositionForward: every input from its first token);
- hf-reuse:    `prefix_reuse: true` (PrefixForward: the problem's cached prefix);
- sglang:      the PRM served by SGLang (kvflow's PRM class; the radix cache holds the prefix).
Prints one JSON object: seconds per round (median of `repeats` problems) and tokens run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from _common import machine_line  # noqa: E402 - bench/ is on sys.path


def tiny_prm(directory: Path, hidden: int, layers: int) -> Path:
    """A random-weight Qwen2 PRM checkpoint + the tiny tokenizer with `<extra_0>`."""
    import copy

    import torch
    from transformers import Qwen2Config

    from kvflow.backends.hf.prm import Qwen2ForProcessRewardModel
    from kvflow.testing import tiny_tokenizer

    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16384, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForProcessRewardModel(config).eval()
    model.config.architectures = ["Qwen2ForProcessRewardModel"]
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def requests(pid: str, n_steps: int, n_candidates: int):
    from kvflow.components.base import Candidate, ScoreRequest, Step, Trajectory

    question = "Compute x_k = 3k + 7 for every k, step by step, and add them up."
    steps = [Step(f"Step {i}: x{i} = {i} * 3 + 7 = {3 * i + 7}.\n\n", "base", None, 19) for i in range(n_steps)]
    traj = Trajectory(pid, question, "prompt", steps=steps)
    cands = [f"Step {n_steps}: x{n_steps} = {n_steps} * 3 + 7 = {3 * n_steps + 7 + c}." + " Check." * (c % 3)
             for c in range(n_candidates)]
    return [ScoreRequest(traj, Candidate(0, "base", c, t, [1], [0.0], [0.0], "delimiter")) for c, t in enumerate(cands)]


def scorer_for(engine: str, directory: Path):
    from kvflow.components.base import ScorerContext
    from kvflow.config.schema import ModelConfig
    from kvflow_builtin.scorers.prm import PRMScorer

    if engine == "sglang":
        from kvflow.backends.sglang import SGLangBackend

        cfg = ModelConfig(backend="sglang", id=str(directory), dtype="float32", device="cpu",
                          engine=PRMScorer.engine_settings(PRMScorer.Params(model="prm"), "sglang"))
        ctx = ScorerContext(load_session=lambda key: SGLangBackend.load(cfg, evicting=False).scoring_session(),
                            proposers=["base"], seed=0, models={"prm": cfg})
        return PRMScorer(PRMScorer.Params(model="prm"), ctx)
    cfg = ModelConfig(id=str(directory), dtype="float32", device="cpu")
    ctx = ScorerContext(load_session=None, proposers=["base"], seed=0, models={"prm": cfg})
    return PRMScorer(PRMScorer.Params(model="prm", prefix_reuse=engine == "hf-reuse"), ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="10,50,100,200")
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--engines", default="hf-reencode,hf-reuse,sglang")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    lengths = [int(x) for x in args.lengths.split(",")]
    directory = tiny_prm(Path(tempfile.mkdtemp(prefix="kvflow-bench-prm-")), args.hidden, args.layers)
    out = {"machine": machine_line(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "model": f"random Qwen2 PRM, hidden {args.hidden}, {args.layers} layers, float32",
           "candidates": args.candidates, "results": {}}
    for engine in args.engines.split(","):
        scorer = scorer_for(engine, directory)
        rows = {}
        for n in lengths:
            secs, tokens, input_tokens = [], [], 0
            for rep in range(args.repeats):
                pid = f"{engine}-{n}-{rep}"
                scorer.score(requests(pid, n - 1, args.candidates))  # the round before (not timed)
                before = getattr(scorer.forward, "tokens_run", 0)
                reqs = requests(pid, n, args.candidates)
                t0 = time.perf_counter()
                scores = scorer.score(reqs)
                secs.append(time.perf_counter() - t0)
                tokens.append(getattr(scorer.forward, "tokens_run", 0) - before)
                input_tokens = sum(len(scorer.format.build(r.trajectory.question, [s.text.strip() for s in r.trajectory.steps]
                                                           + [r.candidate.text])[0]) for r in reqs)
                assert all(0 <= s <= 1 for s in scores)
                scorer.release([pid])
            rows[n] = {"seconds": round(statistics.median(secs), 4), "tokens_run": tokens[0] if engine != "hf-reencode"
                       else input_tokens, "input_tokens": input_tokens}
            print(engine, n, rows[n], file=sys.stderr, flush=True)
        out["results"][engine] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
