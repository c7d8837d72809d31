"""Per-decode-step cost of proposing at GPU-scale batch shapes, on the CPU (issue 13's audit).

64 problems x 8 candidates = 512 candidate rows per proposer, random-weight models with the
paper's real hidden sizes, head counts and head_dim (Qwen2.5-Math-7B base, Qwen2.5-Math-1.5B
helper) but `--layers` decoder layers and a `--vocab` LM head, so that a step fits a 2-core
CPU. Problem states are fabricated (random post-RoPE keys at the given lengths, no prefill):
the evicted base at `budget + buffer` slots, the full-KV helper at `--context` tokens. Each
problem's token room differs (1..8), so rows end at different steps, as steps do.

Cases:
  paper   base (7B shape, random eviction B=64, buffer 128) and helper (1.5B shape, full KV),
          two models, one proposal round each;
  shared  an evicted base and a full-KV helper on one 1.5B-shape model (the CPU study's
          second pairing), decoded in one forward per step.

Runs either kvflow's current engine (`--impl engine`) or the lockstep decode of an older
commit (`--impl lockstep`, run with that commit's src/ and plugins/ first on PYTHONPATH):

    python bench/hot_path.py --impl engine
    PYTHONPATH=/tmp/old/src:/tmp/old/plugins python bench/hot_path.py --impl lockstep

Prints one JSON line: seconds per decode step (one token for every live row of both
proposers, the mean over the round), of which model forwards, and peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from _common import StandInTokenizer  # noqa: E402 - bench/ is on sys.path

SHAPES = {  # hidden, heads, kv_heads, intermediate (Qwen2.5-Math-7B / -1.5B configs)
    "7b": (3584, 28, 4, 18944),
    "1.5b": (1536, 12, 2, 8960),
}


def model(shape: str, layers: int, vocab: int, dtype):
    import transformers

    hidden, heads, kv, inter = SHAPES[shape]
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=inter, num_hidden_layers=layers,
                                   max_position_embeddings=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def make_cache(runner, evictor, n_rows: int, length: int, dtype):
    """A BudgetedCache (same layout in both versions) whose rows hold `length` random cached
    tokens each; an unbounded one has room for a round's tokens without growing."""
    cache = runner.new_cache(evictor, n_rows, list(range(n_rows)))
    _, kv_heads, dim, _ = runner.kv_shape()
    if not evictor.bounded:
        cache.capacity = length + 256
    for layer in cache.layers:
        layer.keys = torch.randn(n_rows, kv_heads, cache.capacity, dim, dtype=dtype)
        layer.values = torch.randn(n_rows, kv_heads, cache.capacity, dim, dtype=dtype)
        layer.is_initialized = True
    cache.rows.lengths[:] = length
    cache.rows.positions[:] = length
    return cache


def evictors():
    from kvflow.registry import get_registry

    reg = get_registry()
    rnd, none = reg.get("evictors", "random"), reg.get("evictors", "none")
    return rnd(rnd.Params(budget=64, buffer=128, window=8)), none(none.Params())


def count_forwards(runner, seconds: list):
    for name in ("forward", "decode_joint", "decode_step"):
        f = getattr(runner, name, None)
        if f is None:
            continue

        def timed(*a, _f=f, **k):
            t = time.perf_counter()
            out = _f(*a, **k)
            seconds.append(time.perf_counter() - t)
            return out
        setattr(runner, name, timed)


def run_case(case: str, impl: str, args) -> dict:
    from kvflow.backends.hf.engine import HFRunner

    dtype = getattr(torch, args.dtype)
    problems, n = args.problems, args.n
    evicted, full = evictors()
    if case == "paper":
        runners = {"base": HFRunner(model("7b", args.layers, args.vocab, dtype), StandInTokenizer()),
                   "helper": HFRunner(model("1.5b", args.layers, args.vocab, dtype), StandInTokenizer())}
    else:
        shared = HFRunner(model("1.5b", args.layers, args.vocab, dtype), StandInTokenizer())
        runners = {"base": shared, "helper": shared}
    for r in runners.values():
        r.eos_ids = set()
    lengths = {"base": 64 + 127, "helper": args.context}
    evs = {"base": evicted, "helper": full}
    rooms = [1 + (p % 8) for p in range(problems)]
    forward_s: list[float] = []
    for r in set(runners.values()):
        count_forwards(r, forward_s)
    steps = 0
    t0 = time.perf_counter()
    if impl == "lockstep":
        from kvflow.backends.hf import decode

        groups = {}
        for name in ("base", "helper"):
            cache = make_cache(runners[name], evs[name], problems, lengths[name], dtype)
            state = decode.ProposerState(cache, torch.full((problems,), 5, dtype=torch.long))
            spec = decode.DecodeSpec(name, n, 0.7, 0.95, 8, "\n\n")
            groups.setdefault(id(runners[name]), []).append((state, spec, rooms, list(range(problems))))
        t0 = time.perf_counter()
        for name in ("base", "helper") if case == "paper" else ("base",):
            jobs = groups[id(runners[name])]
            decode.propose_together(runners[name], jobs)
        steps = max(rooms)
    else:
        from kvflow.backends.hf.decode import HFEngine, HFState
        from kvflow.components.engine import ProposeRequest, SamplingSpec

        engines = {}
        for r in runners.values():
            engines.setdefault(id(r), HFEngine(r))
        states = {}
        for name in ("base", "helper"):
            cache = make_cache(runners[name], evs[name], problems, lengths[name], dtype)
            states[name] = [HFState(cache.select([i]), 5) for i in range(problems)]
        t0 = time.perf_counter()
        for name in ("base", "helper"):
            spec = SamplingSpec(n, 0.7, 0.95, 8, "\n\n")
            engines[id(runners[name])].submit([ProposeRequest(s, name, spec, i, rooms[i])
                                               for i, s in enumerate(states[name])])
        for e in engines.values():
            while e.busy_rows():
                e.step()
        steps = max(rooms)
    seconds = time.perf_counter() - t0
    # a step: one token for every live row of both proposers
    return {"case": case, "impl": impl, "rows_per_proposer": problems * n, "context_helper": args.context,
            "steps": steps, "s_per_step": round(seconds / steps, 3),
            "forward_s_per_step": round(sum(forward_s) / steps, 3),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=["engine", "lockstep"], required=True)
    ap.add_argument("--case", choices=["paper", "shared"], default="paper")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="helper's cached tokens per problem")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    with torch.inference_mode():
        print(json.dumps(run_case(args.case, args.impl, args)))


if __name__ == "__main__":
    main()
