"""Evicted vs full-context decoding on SGLang and on `hf`, at growing output lengths, one run
(docs/benchmarks.md, "Evicted proposers on SGLang").

    /path/to/venv/bin/python bench/sglang_evicted.py [--model catalog:qwen2.5-coder-0.5b-instruct]
        [--dtype bfloat16] [--n 4] [--lengths 128,256,512,768] [--evictor rkv[,snapkv,...]]
        [--budget 64 --buffer 64] [--engines sglang,hf] [--out docs/results/bench/sglang_evicted.json]

One GSM8K prompt, one proposal of `n` greedy candidates that never meet a delimiter (nor EOS:
switched off for the benchmark), decoded to the longest length through kvflow's engine protocol (what a proposer does), once per
(engine, evictor or full context; `--evictor` may list several, e.g. the allocations
snapkv,pyramidkv,ada-snapkv). At each checkpoint length: wall time since the proposal
was submitted (tokens/s = n x length / time, cumulative; and over the last stretch), and the
KV memory held: SGLang's pool slots in use (read from the scheduler, `server_state()`), the
`hf` cache's resident tokens. Prints and writes one JSON object.

On SGLang, as `kvflow run` starts them (`--engine-per-run`, the default): each evictor on an
engine built for it (its decode hook specialised: `graph.Profile`) and the full-context run on
an engine without kvflow's hooks (SGLang as shipped), one engine at a time. `--hooks graph,eager`
repeats the SGLang runs with each hook mode (`KVFLOW_SGLANG_HOOKS`) in the same process, so
their evicted-over-full ratios come from one run. `--shared-engine` runs every configuration on
one general engine (kvflow before issue 33: every part of the hook, evicted and plain rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="catalog:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lengths", default="128,256,512,768")
    ap.add_argument("--evictor", default="rkv")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--engines", default="sglang,hf")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/results/bench/sglang_evicted.json")
    ap.add_argument("--hooks", default="graph", help="SGLang hook modes to run, e.g. graph,eager")
    ap.add_argument("--shared-engine", action="store_true", help="one general SGLang engine for every run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every run, the order reversed each round; the best tok/s of each checkpoint counts "
                         "(the least disturbed by other load on a shared machine)")
    args = ap.parse_args()

    import torch

    from kvflow.config.schema import ModelConfig
    from kvflow.registry import get_registry

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import cpu_model, dataset_prompts, never_stop_at_eos, write_json  # noqa: E402 - the same machine record

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    reg = get_registry()
    if "hf" not in reg.names("backends"):  # a plain checkout on PYTHONPATH (the lent GPU machine): built-ins only
        import kvflow_builtin
        from kvflow.registry import Registry

        reg = Registry.from_plugins([("builtin", kvflow_builtin)])
    evictors = {}
    for kind in args.evictor.split(","):
        cls = reg.get("evictors", kind)
        evictors[kind] = cls(cls.Params(budget=args.budget, buffer=args.buffer))
    full = reg.get("evictors", "none")(reg.get("evictors", "none").Params())
    out: dict = {"model": args.model, "dtype": args.dtype, "n": args.n, "evictor": args.evictor,
                 "budget": args.budget, "buffer": args.buffer, "cpu": cpu_model(), "machine": platform.machine(),
                 "threads": threads, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "runs": {}}
    cfg = lambda backend: ModelConfig(backend=backend, id=args.model, dtype=args.dtype, device=args.device)  # noqa: E731
    labels = []
    plan = []  # (backend, mode, tag, label, evictor) in run order
    for backend in args.engines.split(","):
        modes = args.hooks.split(",") if backend == "sglang" else [None]
        for mode in modes:
            tag = backend if mode in (None, "graph") else f"{backend}-{mode}"
            labels.append(tag)
            plan += [(backend, mode, tag, label, ev) for label, ev in (*evictors.items(), ("full", full))]
    for r in range(args.rounds):
        for backend, mode, tag, label, ev in (plan if r % 2 == 0 else plan[::-1]):
            if mode:
                os.environ["KVFLOW_SGLANG_HOOKS"] = mode  # read by the worker processes started below
            loader = reg.get("backends", backend)
            if backend == "sglang" and not args.shared_engine:  # as `kvflow run` starts it
                engine = loader.load(cfg(backend), evicting=label != "full",
                                     evictors=[(type(ev), ev.params)] if label != "full" else [])
            else:
                engine = loader.load(cfg(backend))
            prompt = dataset_prompts(engine, 1)[0]
            never_stop_at_eos(engine)
            warm(engine, prompt, full if label == "full" or backend != "sglang" or args.shared_engine else ev)
            result = run(engine, prompt, ev, args.n, lengths)
            out.setdefault("rounds", []).append({"round": r, "run": f"{tag}/{label}", **result})
            best = out["runs"].get(f"{tag}/{label}")
            if best is not None:  # the best tok/s of each checkpoint over the rounds
                for b, c in zip(best["checkpoints"], result["checkpoints"]):
                    if c["tok_per_s"] > b["tok_per_s"]:
                        b.update(c)
            else:
                out["runs"][f"{tag}/{label}"] = result
            print(json.dumps({f"{tag}/{label}": result, "round": r}), flush=True)
            if backend == "sglang" and not args.shared_engine:
                engine.worker.close()  # one SGLang engine at a time (memory, cores)
    for length in lengths:
        for backend in labels:
            for kind in evictors:
                ev, fu = out["runs"].get(f"{backend}/{kind}"), out["runs"].get(f"{backend}/full")
                if ev and fu:
                    a = next(c for c in ev["checkpoints"] if c["tokens"] == length)
                    b = next(c for c in fu["checkpoints"] if c["tokens"] == length)
                    ratios = out.setdefault("evicted_over_full", {}).setdefault(backend, {}).setdefault(kind, {})
                    ratios[length] = round(a["tok_per_s"] / b["tok_per_s"], 3)
    print(json.dumps(out, indent=1))
    write_json(Path(args.out), out)


def run(engine, prompt: str, evictor, n: int, lengths: list[int], held=None) -> dict:
    """One proposal of `n` greedy rows read at each length of `lengths`: tok/s and the KV held
    (`held(engine, done)`, `kv_held` by default) at each."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest

    held = held or kv_held

    spec = SamplingSpec(n, 0.0, 1.0, max(lengths) + 32, "\x00\x01")  # +32: the last checkpoint is read while decoding
    (state,) = engine.start([StartRequest(prompt, evictor, 1)])
    engine.submit([ProposeRequest(state, "base", spec, 0, 10**6)])
    t0 = time.perf_counter()
    todo, points, done, last = list(lengths), [], [], (0, t0)
    while not done:
        done = engine.step()
        made = _tokens_so_far(engine, done)
        while todo and made >= todo[0]:
            now = time.perf_counter()
            length = todo.pop(0)
            point = {"tokens": length, "s": round(now - t0, 2), "tok_per_s": round(n * length / (now - t0), 2),
                     "stretch_tok_per_s": round(n * (length - last[0]) / max(1e-9, now - last[1]), 2)}
            point.update(held(engine, done))
            points.append(point)
            last = (length, time.perf_counter())
    engine.release([state], done)
    return {"checkpoints": points, "finish": sorted({c.finish for c in done[0].candidates})}


def _tokens_so_far(engine, done) -> int:
    """Tokens every candidate has made so far (the slowest row), read from the engine's tables."""
    if done:
        return min(c.n_tokens for c in done[0].candidates)
    if engine.backend == "hf":
        r = engine.running[0]
        return int(engine.table.count[r.rows].min())
    return min(len(row.tokens) for row in engine.running[0].rows)


def kv_held(engine, done) -> dict:
    """The KV a checkpoint reports: SGLang's slots in use, or hf's resident tokens and bytes."""
    if engine.backend == "sglang":
        info = engine.server_state()
        return {"kv_slots_used": info["kv_slots_total"] - info["kv_slots_free"] - info["kv_slots_evictable"]}
    caches = [r.cache for r in engine.running] + [p.handle for p in done]
    if not caches:
        return {"kv_tokens_per_row": None, "kv_bytes": 0}
    longest = max(int(c.head_lengths(i).max()) for c in caches for i in range(len(c.layers)))
    return {"kv_tokens_per_row": longest, "kv_bytes": sum(c.resident_bytes() for c in caches)}


def warm(engine, prompt: str, full) -> None:
    """One short full-context proposal, so that the measured run does not pay first-call costs."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.testing.engine_contract import run_to_end

    (state,) = engine.start([StartRequest(prompt, full, 0)])
    props = run_to_end(engine, [ProposeRequest(state, "base", SamplingSpec(2, 0.0, 1.0, 8, "\x00\x01"), 0, 100)])
    engine.release([state], props)


if __name__ == "__main__":
    main()
