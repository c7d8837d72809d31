"""Overhead of kvflow's evictors and decode loop (issue 3; DESIGN.md §9).

Three measurements, printed as markdown tables (and optionally saved as JSON):

A. decode throughput per evictor and budget vs `none`: greedy decoding of `--tokens` tokens
   for `--batch` rows through `HFRunner.forward`, every configuration advancing one step in
   turn (so load from other processes hits all alike), with the compaction time split out
   (compaction ms per event, decode step ms without compactions), the peak resident KV bytes
   per sequence, the KV bytes allocated per sequence, and the evictor's own state (query
   buffer, H2O statistic) per sequence;
B. compaction cost at the real model's shapes without running the model: a cache of
   `--batch` rows at `budget + buffer` tokens filled with random keys/values/queries, one
   `compact()` of every row timed (median of `--repeat`), next to a decode step of A;
C. kvflow's loop with `none` vs plain `model.generate` at `--generate-batch` rows and
   `--generate-tokens` new tokens, same prompts, same process (ratio > 1: kvflow slower).

    python bench/evictor_overhead.py                              # the issue's sizes
    python bench/evictor_overhead.py --tokens 128 --batch 4 --budgets 32,64 --buffer 32
    python bench/evictor_overhead.py --model tiny --tokens 24     # smoke run, seconds

`--model` takes a catalog id / hub id / path (loaded with kvflow.models.loading) or `tiny`
(kvflow.testing's random Qwen2). Numbers from a run go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
from _common import machine_line  # noqa: E402 - bench/ is on sys.path

TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step. "
    "In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips. "
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Weng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned "
    "0.2 x 50 = $10. Betty is saving money for a new wallet which costs $100. "
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="catalog:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="decode steps per measurement in A")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--buffer", type=int, default=128)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--evictors", default="none,random,streaming,snapkv,rkv,h2o,vase")
    ap.add_argument("--repeat", type=int, default=3, help="compactions timed per point in B")
    ap.add_argument("--b-budgets", default=None, help="budgets of B (default: --budgets)")
    ap.add_argument("--b-buffer", type=int, default=None, help="buffer of B (default: --buffer)")
    ap.add_argument("--generate-batch", type=int, default=8)
    ap.add_argument("--generate-tokens", type=int, default=None, help="default: --tokens")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: A,B,C")
    ap.add_argument("--json", default=None, help="write all numbers here")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- setup


def load_runner(args):
    from kvflow.backends.hf.engine import HFRunner

    if args.model == "tiny":
        from kvflow.testing import tiny_runner

        return tiny_runner("qwen2", dtype=args.dtype, num_layers=4)
    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import load_model

    model, tok = load_model(ModelConfig(id=args.model, dtype=args.dtype, device=args.device))
    return HFRunner(model, tok)


def make_prompts(runner, n, length):
    ids = runner.encode(TEXT * (1 + (n * 7 + length) // 40))
    assert len(ids) >= n * 7 + length, "prompt text too short"
    return [ids[7 * r: 7 * r + length] for r in range(n)]


def make_evictor(name, budget, args, buffer=None):
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", name)
    if name == "none":
        return cls(cls.Params())
    return cls(cls.Params(budget=budget, buffer=buffer or args.buffer, window=args.window))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_shape(model):
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, heads, cfg.num_key_value_heads, head_dim


def state_bytes(cache) -> int:
    """Query buffers and per-token statistics held for the evictor (all rows, all layers)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.queries, layer.stats):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------- A. decode throughput


def start_run(runner, evictor, prompts):
    """A prefilled cache whose compactions are timed: (cache, pending, {"n", "s"})."""
    cache = runner.new_cache(evictor, len(prompts), list(range(len(prompts))))
    with torch.inference_mode():
        pending = runner.prefill(cache, prompts)
    comp = {"n": 0, "s": 0.0}
    original = cache.compact

    def timed_compact(rows):
        sync(runner.device)
        t = time.perf_counter()
        original(rows)
        sync(runner.device)
        comp["n"] += 1
        comp["s"] += time.perf_counter() - t

    cache.compact = timed_compact
    return cache, pending, comp


def part_a(runner, args, out):
    """All configurations decode in lockstep (one step of each in turn), so that a busy machine
    slows them alike and the ratios stay meaningful."""
    layers, _, kv_heads, head_dim = kv_shape(runner.model)
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    per_token = layers * kv_heads * head_dim * 2 * elem
    prompts = make_prompts(runner, args.batch, args.prompt_tokens)
    runs = []
    for name in args.evictors:
        for budget in ([None] if name == "none" else args.budgets):
            cache, pending, comp = start_run(runner, make_evictor(name, budget, args), prompts)
            runs.append(dict(name=name, budget=budget, cache=cache, pending=pending, comp=comp, s=0.0, peak=0))
    print(f"  A: {len(runs)} caches prefilled", file=sys.stderr)
    with torch.inference_mode():
        for step in range(args.tokens):
            for run in runs:
                cache = run["cache"]
                run["peak"] = max(run["peak"], int(cache.rows.lengths.max()) + 1)
                sync(runner.device)
                t = time.perf_counter()
                run["pending"] = runner.forward(cache, run["pending"][:, None]).argmax(-1)
                sync(runner.device)
                run["s"] += time.perf_counter() - t
            if (step + 1) % 16 == 0:
                print(f"  A: step {step + 1}/{args.tokens}", file=sys.stderr)
    rows = []
    base_tps = None
    for run in runs:
        total, comp, cache = run["s"], run["comp"], run["cache"]
        tps = args.batch * args.tokens / total
        if run["name"] == "none":
            base_tps = tps
        rows.append(dict(
            evictor=run["name"], budget=run["budget"], decode_s=round(total, 2), tok_per_s=round(tps, 2),
            vs_none=round(tps / base_tps, 3) if base_tps else None,
            step_ms_no_compaction=round((total - comp["s"]) / args.tokens * 1e3, 1), compactions=comp["n"],
            compaction_ms=round(comp["s"] / comp["n"] * 1e3, 1) if comp["n"] else None,
            compaction_share=round(comp["s"] / total, 3),
            peak_tokens=run["peak"], peak_kv_bytes_per_seq=run["peak"] * per_token,
            allocated_kv_bytes_per_seq=cache.resident_bytes() // args.batch,
            evictor_state_bytes_per_seq=state_bytes(cache) // args.batch,
        ))
    out["A"] = rows
    print(f"\n### A. Decode throughput ({args.batch} rows x {args.tokens} tokens, prompt {args.prompt_tokens}, "
          f"buffer {args.buffer}, window {args.window}; all configurations in lockstep)\n")
    print("| evictor | budget | tok/s | vs none | step ms (no compaction) | compactions | ms / compaction "
          "| peak KV / seq | allocated KV / seq | evictor state / seq |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['evictor']} | {r['budget'] or '-'} | {r['tok_per_s']} | {r['vs_none']} | "
              f"{r['step_ms_no_compaction']} | {r['compactions']} | {r['compaction_ms'] or '-'} | "
              f"{_kib(r['peak_kv_bytes_per_seq'])} | {_kib(r['allocated_kv_bytes_per_seq'])} | "
              f"{_kib(r['evictor_state_bytes_per_seq'])} |")


def _kib(n):
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


# --------------------------------------------------------------------------- B. compaction microbench


def part_b(runner, args, out):
    from kvflow.backends.hf.cache import BudgetedCache
    from kvflow.backends.hf.rows import new_rows

    layers, q_heads, kv_heads, head_dim = kv_shape(runner.model)
    dtype = getattr(torch, args.dtype)
    dev = runner.device
    step_ms = None
    for r in out.get("A", []):
        if r["evictor"] == "none":
            step_ms = r["step_ms_no_compaction"]
    buffer = args.b_buffer or args.buffer
    rows = []
    for name in args.evictors:
        if name == "none":
            continue
        for budget in args.b_budgets:
            ev = make_evictor(name, budget, args, buffer)
            n = ev.trigger
            gen = torch.Generator().manual_seed(0)
            cache = BudgetedCache(ev, layers, new_rows(args.batch, range(args.batch)), dev)
            for layer in cache.layers:
                layer.keys = torch.randn(args.batch, kv_heads, n + 1, head_dim, generator=gen).to(dev, dtype)
                layer.values = torch.randn(args.batch, kv_heads, n + 1, head_dim, generator=gen).to(dev, dtype)
                layer.is_initialized = True
                if ev.query_window:
                    layer.queries = torch.randn(args.batch, q_heads, ev.query_window, head_dim,
                                                generator=gen).to(dev, dtype)
                if ev.observes_attention:
                    layer.stats = torch.rand(args.batch, kv_heads, n + 1, generator=gen).to(dev)
            times = []
            all_rows = torch.arange(args.batch)
            with torch.inference_mode():
                for _ in range(args.repeat):
                    cache.rows.lengths = torch.full((args.batch,), n, dtype=torch.long)
                    sync(dev)
                    t = time.perf_counter()
                    cache.compact(all_rows)
                    sync(dev)
                    times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            rows.append(dict(evictor=name, budget=budget, resident=n, compaction_ms=round(ms, 1),
                             per_token_ms=round(ms / buffer, 2),
                             vs_decode_step=round(ms / step_ms, 2) if step_ms else None))
            print(f"  B {name:9s} budget={budget}: {ms:.1f} ms", file=sys.stderr)
    out["B"] = rows
    print(f"\n### B. One compaction of {args.batch} rows at budget + buffer ({layers} layers, {q_heads} query / "
          f"{kv_heads} KV heads, head dim {head_dim}, {args.dtype}, median of {args.repeat})\n")
    print(f"Decode step without compaction (A, `none`, same batch): {step_ms} ms. Buffer {buffer}.\n")
    print("| evictor | budget | resident N | ms / compaction | amortised ms / token (÷ buffer) | vs a decode step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['evictor']} | {r['budget']} | {r['resident']} | {r['compaction_ms']} | {r['per_token_ms']} | "
              f"{r['vs_decode_step'] if r['vs_decode_step'] is not None else '-'} |")


# --------------------------------------------------------------------------- C. kvflow vs generate


def part_c(runner, args, out):
    from kvflow_builtin.evictors.none import NoEviction

    b, steps = args.generate_batch, args.generate_tokens or args.tokens
    prompts = make_prompts(runner, b, args.prompt_tokens)
    ids = torch.tensor(prompts, device=runner.device)
    model = runner.model
    res = {}
    for rep in range(2):  # generate twice around kvflow, to see the drift of a busy machine
        if rep == 1:
            cache = runner.new_cache(NoEviction(NoEviction.Params()), b)
            sync(runner.device)
            t = time.perf_counter()
            with torch.inference_mode():
                pending = runner.prefill(cache, prompts)
                toks = []
                for _ in range(steps):
                    pending = runner.forward(cache, pending[:, None]).argmax(-1)
                    toks.append(pending)
            sync(runner.device)
            res["kvflow_s"] = time.perf_counter() - t
            kv_tokens = torch.stack(toks, 1).cpu()
        sync(runner.device)
        t = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, pad_token_id=0)
        sync(runner.device)
        res.setdefault("generate_s", []).append(time.perf_counter() - t)
    gen_tokens = gen[:, ids.shape[1]:].cpu()
    g = min(res["generate_s"])
    same = float((gen_tokens == kv_tokens).float().mean())
    out["C"] = dict(batch=b, new_tokens=steps, prompt_tokens=args.prompt_tokens, kvflow_s=round(res["kvflow_s"], 2),
                    generate_s=[round(x, 2) for x in res["generate_s"]],
                    ratio=round(res["kvflow_s"] / g, 3), same_tokens=round(same, 3))
    print(f"\n### C. kvflow loop (`none`) vs `model.generate` ({b} rows, prompt {args.prompt_tokens}, "
          f"{steps} new tokens, greedy, prefill included)\n")
    print("| kvflow s | generate s (before, after) | kvflow / generate | same tokens |")
    print("|---|---|---|---|")
    c = out["C"]
    print(f"| {c['kvflow_s']} | {c['generate_s'][0]}, {c['generate_s'][1]} | {c['ratio']} | {c['same_tokens']:.1%} |")


def main(argv=None):
    args = parse_args(argv)
    args.budgets = [int(x) for x in args.budgets.split(",") if x]
    args.b_budgets = [int(x) for x in args.b_budgets.split(",") if x] if args.b_budgets else args.budgets
    args.evictors = [x for x in args.evictors.split(",") if x]
    skip = {x.strip().upper() for x in args.skip.split(",") if x.strip()}
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    runner = load_runner(args)
    out = {
        "command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{machine_line()}, {torch.get_num_threads()} torch threads, device {runner.device}",
        "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
    }
    print(f"# evictor overhead: {args.model} ({args.dtype}) on {out['machine']}, {out['date']}")
    if "A" not in skip:
        part_a(runner, args, out)
    if "B" not in skip:
        part_b(runner, args, out)
    if "C" not in skip:
        part_c(runner, args, out)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"\n(total {out['wall_s']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
