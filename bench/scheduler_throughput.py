"""The step scheduler at the paper's shapes: tokens/s, occupancy, peak memory, time by phase.

Random-weight Qwen2 models with the paper's configs (Qwen2.5-Math-7B base with random
eviction B=64, Qwen2.5-Math-1.5B full-KV helper; `--layers` to shrink them), N candidates per
proposer, `--problems` problems in flight, the `random` scorer and `best` committer, sampled
at temperature 0.7 / top-p 0.95, synthetic prompts of `--prompt-tokens` tokens. Everything is
built from configs: no download. For a GPU (bench/gpu_check.sh) and, with small settings, a
CPU smoke run:

    python bench/scheduler_throughput.py --device cuda --problems 64 --n 8
    python bench/scheduler_throughput.py --device cpu --layers 1 --problems 4 --n 2 --steps 2 --vocab 4096
    python bench/scheduler_throughput.py --device cuda --problems 32 --n 8 --overlap on   # base and helper
                                                                 # on threads of their own, one GPU

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch
from _common import cpu_model  # noqa: E402 - bench/ is on sys.path

SHAPES = {  # hidden, heads, kv_heads, intermediate, layers (the real configs)
    "7b": (3584, 28, 4, 18944, 28),
    "1.5b": (1536, 12, 2, 8960, 28),
}


def model(shape, layers, vocab, dtype, device):
    import transformers

    hidden, heads, kv, inter, full_layers = SHAPES[shape]
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=inter,
                                   num_hidden_layers=layers or full_layers, max_position_embeddings=32768,
                                   tie_word_embeddings=False, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return m.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the real 28)")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--problems", type=int, default=64, help="decode room, in problems (run.batch_problems)")
    ap.add_argument("--n", type=int, default=8, help="candidates per proposer")
    ap.add_argument("--steps", type=int, default=4, help="committed steps per problem")
    ap.add_argument("--step-tokens", type=int, default=64, help="max_step_tokens")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--pipeline", default="rescue", choices=["rescue", "full-bon", "evicted-bon"],
                    help="rescue: evicted base + full-KV helper; full-bon / evicted-bon: the base alone, N candidates")
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                    help="run.overlap_engines: base and helper on threads of their own (auto: distinct GPUs only)")
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES), help="with --save-model")
    ap.add_argument("--save-model", metavar="DIR", help="only write a random-weight checkpoint of --shape "
                    "(with kvflow's tiny tokenizer and its vocabulary) to DIR, for engines that load from disk")
    args = ap.parse_args()
    if args.save_model:
        from kvflow.testing import tiny_tokenizer

        tok = tiny_tokenizer()
        m = model(args.shape, args.layers, len(tok), getattr(torch, args.dtype), args.device)
        m.save_pretrained(args.save_model)
        tok.save_pretrained(args.save_model)
        print(args.save_model)
        return

    from kvflow.backends.hf.decode import HFEngine
    from kvflow.backends.hf.engine import HFRunner
    from kvflow.components.base import ScorerContext, Trajectory
    from kvflow.components.engine import SamplingSpec
    from kvflow.config.schema import LimitsConfig
    from kvflow.registry import Registry
    from kvflow.results.files import timing_summary
    from kvflow.runtime.scheduler import Occupancy, Plan, Proposer, run
    from kvflow.testing import tiny_tokenizer

    dtype = getattr(torch, args.dtype)
    tok = tiny_tokenizer()  # prompts only: the models sample from their own (larger) vocabulary
    import kvflow_builtin

    reg = Registry.from_plugins([("builtin", kvflow_builtin)])  # works without kvflow installed (PYTHONPATH)
    rnd, none = reg.get("evictors", "random"), reg.get("evictors", "none")
    t_load = time.perf_counter()
    shapes = ["7b", "1.5b"] if args.pipeline == "rescue" else ["7b"]  # best-of-N: the base alone
    runners = {k: HFRunner(model(k, args.layers, args.vocab, dtype, args.device), tok) for k in shapes}
    for r in runners.values():  # steps end at the delimiter or max_step_tokens only
        r.eos_ids = set()
    engines = {k: HFEngine(r) for k, r in runners.items()}
    t_load = time.perf_counter() - t_load
    spec = SamplingSpec(args.n, 0.7, 0.95, args.step_tokens, "\n\n")
    evicted = rnd(rnd.Params(budget=64, buffer=128, window=8))
    # Table 3's rows: KV-Rescue, and best-of-N of the base alone with full or evicted KV
    proposers = [Proposer("base", engines["7b"], none(none.Params()) if args.pipeline == "full-bon" else evicted, spec)]
    if args.pipeline == "rescue":
        proposers.append(Proposer("helper", engines["1.5b"], none(none.Params()), spec))
    names = [p.name for p in proposers]
    scorer_cls, committer_cls = reg.get("scorers", "random"), reg.get("committers", "best")
    plan = Plan(proposers, scorer_cls(scorer_cls.Params(), ScorerContext(None, names, 0)),
                committer_cls(committer_cls.Params(), names),
                LimitsConfig(max_steps=args.steps, max_tokens=10**6, stop_on_answer=False), 0,
                batch_problems=args.problems, overlap=args.overlap)
    words = "Natalia sold 48 clips in April and half as many in May ".split()
    text = " ".join(words[i % len(words)] for i in range(args.prompt_tokens))
    trajs = [Trajectory(f"p{i}", "", f"{i} {text}") for i in range(2 * args.problems)]
    timings, occupancy = {}, Occupancy()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run(plan, trajs, lambda t: None, timings=timings, occupancy=occupancy)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = sum(sum(t.tokens_generated.values()) for t in trajs)
    summary = timing_summary([{"timing": t} for t in timings.values()])
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_model(),
        "torch": torch.__version__, "args": vars(args), "load_s": round(t_load, 1), "wall_s": round(wall, 2),
        "problems": len(trajs), "problems_per_min": round(len(trajs) / wall * 60, 2),
        "tokens_generated": generated, "tokens_per_s": round(generated / wall, 1),
        "occupancy": occupancy.summary(),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device.startswith("cuda") else None,
        "time_share": {k: round(v, 3) for k, v in summary.get("share", {}).items()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
