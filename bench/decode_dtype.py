"""Decode-step time of a catalog model in bfloat16 vs float32 weights, by batch size.

Plain transformers (no kvflow): prefill `--prompt` random tokens per row, then time
`--steps` one-token decode forwards with the model's own cache and report the median.
Run each setting in its own process (one torch thread by default) so they do not compete:

    OMP_NUM_THREADS=1 python bench/decode_dtype.py qwen2.5-coder-0.5b-instruct --dtype float32 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="catalog name, e.g. qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=40, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed (the first 2 are warm-up)")
    args = ap.parse_args()

    from kvflow.config.schema import ModelConfig
    from kvflow.models.loading import load_model

    model, _ = load_model(ModelConfig(id=f"catalog:{args.model}", dtype=args.dtype))
    ids = torch.randint(100, 10000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, ids[:, -1:]
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            times.append(time.perf_counter() - t0)
    step = statistics.median(times[2:])
    print(f"{args.model} {args.dtype} batch={args.batch} threads={torch.get_num_threads()} "
          f"step={step * 1000:.0f} ms tokens/s={args.batch / step:.1f}")


if __name__ == "__main__":
    main()
