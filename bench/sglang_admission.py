"""How many candidates SGLang decodes at once in a fixed KV pool, evicted vs full context, one
run (docs/benchmarks.md, "Evicted proposers on SGLang").

    /path/to/venv/bin/python bench/sglang_admission.py [--model DIR] [--pool 2048] [--n 32]
        [--tokens 300] [--budget 16 --buffer 8]

One proposal of `n` greedy candidates (no delimiter, no EOS) decoded to `tokens` tokens by an
SGLang engine whose pool holds `--pool` tokens (`max_total_tokens`), once with R-KV at
`budget + buffer` and once with the full cache. Reads the scheduler's running batch size
while decoding (`server_state()`): its peak and mean, and the wall time. SGLang's admission
control reserves each request's remaining `max_new_tokens`; kvflow's plugin has it reserve
an evicted request's room to its next compaction instead, so the memory eviction frees
admits more candidates. Defaults run on the tiny random-weight test model in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory (default: kvflow's tiny test Qwen2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--buffer", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/results/bench/sglang_admission.json")
    args = ap.parse_args()

    from kvflow.backends.sglang import SGLangBackend
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.config.schema import ModelConfig
    from kvflow.registry import get_registry
    from kvflow.testing.engine_parity import shared_model_dir

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import dataset_prompts, never_stop_at_eos  # noqa: E402 - the same prompt and EOS rule

    model = args.model or str(shared_model_dir())
    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=model, dtype=args.dtype, device=args.device,
                                            engine={"max_total_tokens": args.pool}))
    never_stop_at_eos(engine)
    reg = get_registry()
    rkv = reg.get("evictors", "rkv")
    none = reg.get("evictors", "none")
    runs = {}
    for label, ev in (("rkv", rkv(rkv.Params(budget=args.budget, buffer=args.buffer, window=4))),
                      ("full", none(none.Params()))):
        (state,) = engine.start([StartRequest(dataset_prompts(engine, 1)[0], ev, 1)])
        engine.submit([ProposeRequest(state, "base", SamplingSpec(args.n, 0.0, 1.0, args.tokens, "\x00\x01"), 0,
                                      10**6)])
        t0, done, sizes = time.perf_counter(), [], []
        while not done:
            done = engine.step()
            sizes.append(engine.server_state()["running_requests"])
        wall = time.perf_counter() - t0
        engine.release([state], done)
        runs[label] = {"peak_running": max(sizes), "mean_running": round(sum(sizes) / len(sizes), 1),
                       "wall_s": round(wall, 2), "tok_per_s": round(args.n * args.tokens / wall, 1)}
        print(label, runs[label], flush=True)
    out = {"model": model, "dtype": args.dtype, "pool_tokens": args.pool, "n": args.n, "tokens": args.tokens,
           "budget": args.budget, "buffer": args.buffer, "prompt_tokens": len(engine.encode(dataset_prompts(engine, 1)[0])),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "runs": runs,
           "peak_batch_ratio": round(runs["rkv"]["peak_running"] / runs["full"]["peak_running"], 2)}
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
