"""Evicted vs full-context decoding on vLLM, beside SGLang, at an ample and a tight KV memory, one run
(docs/benchmarks.md, "Evicted proposers on vLLM").

    KVFLOW_VLLM_PYTHON=.venv-vllm/bin/python python bench/vllm_evicted.py
        [--model catalog:smollm2-135m-instruct] [--dtype bfloat16] [--n 4] [--lengths 128,256,512]
        [--evictor rkv] [--budget 64 --buffer 64] [--engines vllm,sglang] [--memory ample,tight]
        [--tight-tokens 1280] [--out docs/results/bench/vllm_evicted.json]

The scenario of `bench/sglang_evicted.py` (its `run`: one GSM8K prompt, one proposal of `n`
greedy candidates that meet neither a delimiter nor EOS, decoded to the longest length through
kvflow's engine protocol; cumulative tokens/s at each checkpoint), once per (engine, memory,
evictor or full context), one engine at a time, each started as `kvflow run` starts it. Memory:
`ample` is each engine's CPU default with a context of 1,024 tokens; `tight` holds
`--tight-tokens` tokens of KV in all (vLLM: `kv_cache_memory_bytes` of that many tokens of the
model; SGLang: `max_total_tokens`), fewer than the full-context candidates need together at the
longest length, so the engine preempts (vLLM: recompute) or retracts. Prints and writes one
JSON object, with each engine's evicted-over-full ratios per memory and length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

CONTEXT = 1024  # max_model_len on vLLM: its KV cache must hold one such request, tight or not


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="catalog:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lengths", default="128,256,512")
    ap.add_argument("--evictor", default="rkv")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--engines", default="vllm,sglang")
    ap.add_argument("--memory", default="ample,tight")
    ap.add_argument("--tight-tokens", type=int, default=1280)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/results/bench/vllm_evicted.json")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import sglang_evicted  # noqa: E402 - the same scenario
    from _common import cpu_model, dataset_prompts, never_stop_at_eos, write_json  # noqa: E402 - the same machine record

    from kvflow.backends.base import backend_named
    from kvflow.config.schema import ModelConfig
    from kvflow.registry import get_registry

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    reg = get_registry()
    cls = reg.get("evictors", args.evictor)
    evictor = cls(cls.Params(budget=args.budget, buffer=args.buffer))
    none = reg.get("evictors", "none")
    full = none(none.Params())
    kv_bytes_per_token = _kv_bytes_per_token(args.model, args.dtype)
    out: dict = {"model": args.model, "dtype": args.dtype, "n": args.n, "evictor": args.evictor,
                 "budget": args.budget, "buffer": args.buffer, "tight_tokens": args.tight_tokens,
                 "kv_bytes_per_token": kv_bytes_per_token, "cpu": cpu_model(), "machine": platform.machine(),
                 "threads": threads, "device": args.device, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                 "load_before": os.getloadavg(), "runs": {}}
    for backend in args.engines.split(","):
        for memory in args.memory.split(","):
            settings = _settings(backend, memory, args.tight_tokens, kv_bytes_per_token, max(lengths))
            entry = ModelConfig(backend=backend, id=args.model, dtype=args.dtype, device=args.device)
            if args.device == "cpu":  # as `kvflow run` starts a run's only engine (Backend.cpu_settings: alone)
                settings = {**backend_named(backend, reg).cpu_settings(entry, 1), **settings}
            cfg = entry.model_copy(update={"engine": settings})
            for label, ev in ((args.evictor, evictor), ("full", full)):
                evicting = label != "full"
                engine = backend_named(backend, reg).load(cfg, evicting=evicting,
                                                   evictors=[(type(ev), ev.params)] if evicting else [])
                try:
                    prompt = dataset_prompts(engine, 1)[0]
                    never_stop_at_eos(engine)
                    sglang_evicted.warm(engine, prompt, full)
                    result = sglang_evicted.run(engine, prompt, ev, args.n, lengths, held=_kv_held)  # vLLM has no pool query: SGLang's slots only
                    result["engine_settings"] = settings
                    getattr(engine, "drain", lambda: None)()  # every request's end counted
                    result["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))}
                except Exception as exc:  # noqa: BLE001 - a configuration that fails is a result too
                    result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                finally:
                    engine.worker.close()  # one engine at a time (memory, cores)
                key = f"{backend}/{memory}/{label}"
                out["runs"][key] = result
                print(json.dumps({key: result}), flush=True)
    for key, ev in out["runs"].items():
        backend, memory, label = key.split("/")
        fu = out["runs"].get(f"{backend}/{memory}/full")
        if label == "full" or not fu or "checkpoints" not in ev or "checkpoints" not in fu:
            continue
        ratios = out.setdefault("evicted_over_full", {}).setdefault(backend, {}).setdefault(memory, {})
        for a, b in zip(ev["checkpoints"], fu["checkpoints"]):
            ratios[a["tokens"]] = round(a["tok_per_s"] / b["tok_per_s"], 3)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    write_json(Path(args.out), out)


def _settings(backend: str, memory: str, tight_tokens: int, kv_bytes_per_token: int, longest: int) -> dict:
    if backend == "vllm":
        settings = {"max_model_len": max(CONTEXT, longest + 512)}  # the prompt and the +32 past the last checkpoint
        if memory == "tight":
            settings["kv_cache_memory_bytes"] = tight_tokens * kv_bytes_per_token
        return settings
    return {"max_total_tokens": tight_tokens} if memory == "tight" else {}


def _kv_bytes_per_token(model: str, dtype: str) -> int:
    """KV bytes one token takes in every layer (keys and values), from the model's config."""
    from transformers import AutoConfig

    from kvflow.config.schema import ModelConfig
    from kvflow.models.shapes import shape_from_config
    from kvflow.models.loading import model_directory

    path = model_directory(ModelConfig(id=model, dtype=dtype, device="cpu"))
    shape = shape_from_config(AutoConfig.from_pretrained(path).to_dict(), model)
    return 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * (4 if dtype == "float32" else 2)


def _kv_held(engine, done) -> dict:
    if engine.backend == "sglang":
        info = engine.server_state()
        return {"kv_slots_used": info["kv_slots_total"] - info["kv_slots_free"] - info["kv_slots_evictable"]}
    return {}


if __name__ == "__main__":
    main()
