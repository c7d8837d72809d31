"""The `sglang` engine against `hf` on one real checkpoint, one run (docs/benchmarks.md, "SGLang").

    .venv/bin/python bench/sglang_engine.py [--model catalog:qwen2.5-coder-0.5b-instruct] [--problems 8]

Measures, on GSM8K prompts, through kvflow's engine protocol (what a proposer does):
1. greedy parity: step proposals (delimiter "\\n\\n", up to 96 tokens, 3 committed steps)
   token for token, hf vs sglang, float32;
2. the entropy estimate (top-20 logprobs) against hf's exact entropies, at temperature 1
   (greedy) and 0.7 (sampling: exact values from an hf forward over the SGLang candidate);
3. the prefix-cache hit rate over those steps;
4. early exit: a pruner that stops candidates at 8 tokens of a 256-token cap, tokens the
   engine produced after the stop;
5. throughput of one proposal round: problems x 4 candidates, 64 tokens, temperature 0.7.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from _common import cpu_model, dataset_prompts, machine_line  # noqa: E402 - bench/ is on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="catalog:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import torch

    from kvflow.backends.hf import HFBackend
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.components.base import Pruner, PrunerParams
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest, SyncRequest
    from kvflow.config.schema import ModelConfig
    from kvflow.testing.engine_contract import run_to_end
    from kvflow_builtin.evictors.none import NoEviction, NoEvictionParams

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    full = NoEviction(NoEvictionParams())
    cfg = dict(id=args.model, dtype=args.dtype, device="cpu")
    t0 = time.perf_counter()
    sg = SGLangBackend.load(ModelConfig(backend="sglang", **cfg))
    sg_start = time.perf_counter() - t0
    hf = HFBackend.load(ModelConfig(**cfg))
    problems = dataset_prompts(hf, args.problems)
    out: dict = {"model": args.model, "dtype": args.dtype, "machine": machine_line(),
                 "cpu": cpu_model(), "threads": threads, "date": time.strftime("%Y-%m-%d"), "sglang_start_s": round(sg_start, 1),
                 "command": " ".join(sys.argv)}

    # 1-3: greedy steps, parity, prefix cache
    spec = SamplingSpec(1, 0.0, 1.0, 96, "\n\n")
    steps = {}
    for engine in (hf, sg):
        states = engine.start([StartRequest(p, full, 1) for p in problems])
        got = [[] for _ in problems]
        for _ in range(3):
            props = run_to_end(engine, [ProposeRequest(s, "helper", spec, 0, 400) for s in states])
            for g, p in zip(got, props):
                g.append(p.candidates[0])
            states = engine.sync([SyncRequest(s, p, 0, p.candidates[0].text) for s, p in zip(states, props)])
        steps[engine.backend] = got
    pairs = [(a, b) for ga, gb in zip(steps["hf"], steps["sglang"]) for a, b in zip(ga, gb)]
    same = [a.token_ids == b.token_ids for a, b in pairs]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None) for a, b in pairs]
    out["greedy_steps"] = len(pairs)
    out["greedy_steps_identical"] = sum(same)
    out["greedy_first_divergence"] = [d for d in first_diff if d is not None]
    lp = [abs(x - y) for (a, b), s in zip(pairs, same) if s for x, y in zip(a.logprobs, b.logprobs)]
    out["greedy_max_abs_logprob_diff"] = max(lp) if lp else None
    err = [abs(x - y) for (a, b), s in zip(pairs, same) if s for x, y in zip(a.entropies, b.entropies)]
    exact = [x for (a, b), s in zip(pairs, same) if s for x in a.entropies]
    out["entropy_t1"] = _errors(err, exact)
    out["prefix_cache"] = sg.stats()

    # 2 at T = 0.7: the estimate on SGLang's sampled tokens vs exact from an hf forward
    hot = SamplingSpec(2, 0.7, 0.95, 64, "\x00\x01")
    states = sg.start([StartRequest(p, full, 1) for p in problems[:4]])
    props = run_to_end(sg, [ProposeRequest(s, "base", hot, 11 + i, 400) for i, s in enumerate(states)])
    errs, exacts = [], []
    for st, p in zip(states, props):
        for c in p.candidates:
            ids = torch.tensor([st.ids + c.token_ids])
            with torch.inference_mode():
                logits = hf.runner.model(ids).logits[0, len(st.ids) - 1 : -1].float()
            logp = torch.log_softmax(logits / 0.7, dim=-1)
            h = (-(logp.exp() * logp).nan_to_num().sum(-1)).tolist()
            errs += [abs(x - y) for x, y in zip(h, c.entropies)]
            exacts += h
    out["entropy_t0.7"] = _errors(errs, exacts)

    # 4: early exit
    class StopAt(Pruner):
        Params = PrunerParams
        needs_text = False

        def signal(self, trace):
            return trace.n_tokens.float()

        def check(self, trace):
            return trace.n_tokens >= 8

    before = dict(sg.counters)
    prune = SamplingSpec(4, 0.7, 0.95, 256, "\x00\x01", pruners=(("stop8", StopAt(PrunerParams(threshold=8))),))
    states = sg.start([StartRequest(p, full, 1) for p in problems])
    props = run_to_end(sg, [ProposeRequest(s, "base", prune, 21 + i, 400) for i, s in enumerate(states)])
    deadline = time.monotonic() + 60
    while sg._used and time.monotonic() < deadline:
        sg.step()
    n = sum(len(p.candidates) for p in props)
    after = sg.counters["tokens_after_stop"] - before["tokens_after_stop"]
    out["early_exit"] = {"candidates": n, "kept_tokens_each": 8, "cap": 256,
                         "tokens_after_stop_per_candidate": round(after / n, 2),
                         "share_of_cap_saved": round(1 - (8 + after / n) / 256, 4)}

    # 5: throughput of one proposal round
    thr = SamplingSpec(4, 0.7, 0.95, 64, "\x00\x01")
    for engine in (hf, sg):
        states = engine.start([StartRequest(p, full, 1) for p in problems])
        t = time.perf_counter()
        props = run_to_end(engine, [ProposeRequest(s, "base", thr, 31 + i, 400) for i, s in enumerate(states)])
        wall = time.perf_counter() - t
        tokens = sum(c.n_tokens for p in props for c in p.candidates)
        out[f"round_{engine.backend}"] = {"rows": 4 * len(problems), "tokens": tokens, "wall_s": round(wall, 2),
                                          "tok_per_s": round(tokens / wall, 1)}
    out["sglang_vs_hf_tok_per_s"] = round(out["round_sglang"]["tok_per_s"] / out["round_hf"]["tok_per_s"], 3)
    print(json.dumps(out, indent=1))


def _errors(err: list[float], exact: list[float]) -> dict:
    if not err:
        return {}
    err_sorted = sorted(err)
    return {"tokens": len(err), "mean_abs": round(sum(err) / len(err), 5), "p95_abs": round(err_sorted[int(0.95 * (len(err) - 1))], 5),
            "max_abs": round(err_sorted[-1], 5), "mean_exact": round(sum(exact) / len(exact), 4),
            "mean_rel": round(sum(e / max(x, 1e-6) for e, x in zip(err, exact)) / len(err), 5)}


if __name__ == "__main__":
    main()
