"""What the token confidence costs on the `hf` engine's CPU decode step (issue 34).

`kvflow.backends.hf.sampling.sample` computes, for every row of a decode step, DeepConf's
token confidence (minus the mean of the top-20 temperature-1 log-probabilities; one unsorted
`topk` over the row's log-softmax, which sampling computes anyway). This bench times that
call inside real `HFEngine.step()`s (the function is wrapped with a timer, nothing else
changes) and reports its share of the step, and its cost per token (per row and step).

Model: random weights with Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151936: the CPU reproduction's helper), built from a config; the
vocabulary is what the confidence pays for. Rows: `--problems` proposals of `--n` candidates
each, sampled (temperature 0.7, top-p 0.95), full KV after a `--prompt`-token prompt.

    python bench/confidence_cost.py                      # 4 and 16 rows, 32 steps each
    python bench/confidence_cost.py --rows 4 --steps 8   # quick

Prints one JSON line per batch size; numbers go to docs/benchmarks.md ("Token confidence").
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch


from _common import StandInTokenizer, cpu_model  # noqa: E402 - bench/ is on sys.path


def build(dtype, layers: int):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, num_hidden_layers=layers, max_position_embeddings=32768,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def measure(runner, rows: int, n: int, steps: int, prompt: int) -> dict:
    from kvflow.backends.hf import sampling
    from kvflow.backends.hf.decode import HFEngine
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow_builtin.evictors.none import NoEviction

    spent: list[float] = []
    original = sampling.confidence

    def timed(logp, *a, **k):
        t = time.perf_counter()
        out = original(logp, *a, **k)
        spent.append(time.perf_counter() - t)
        return out

    engine = HFEngine(runner)
    problems = rows // n
    states = engine.start([StartRequest("a" * prompt, NoEviction(NoEviction.Params()), i) for i in range(problems)])
    spec = SamplingSpec(n, 0.7, 0.95, steps, "\n\n")
    engine.submit([ProposeRequest(s, "base", spec, i, steps) for i, s in enumerate(states)])
    step_s: list[float] = []
    sampling.confidence = timed
    try:
        while engine.busy_rows():
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
    finally:
        sampling.confidence = original
    warm = 2  # the first steps lay out pools and tables
    step, conf = sum(step_s[warm:]), sum(spent[warm:])
    return {"rows": rows, "steps_timed": len(step_s) - warm, "step_ms": round(1e3 * step / (len(step_s) - warm), 2),
            "confidence_ms_per_step": round(1e3 * conf / (len(spent) - warm), 3),
            "confidence_us_per_token": round(1e6 * conf / (len(spent) - warm) / rows, 1),
            "share_of_step": round(conf / step, 4)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="4,16", help="rows per decode step (comma-separated)")
    ap.add_argument("--n", type=int, default=4, help="candidates per proposal")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per problem")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: bfloat16 where the CPU has avx512_bf16 or AMX, else float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvflow.backends.hf.engine import HFRunner

    dtype = args.dtype
    if dtype == "auto":
        flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
        dtype = "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    runner = HFRunner(build(getattr(torch, dtype), args.layers), StandInTokenizer())
    runner.eos_ids = set()
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "dtype": dtype, "layers": args.layers, "vocab": 151936,
            "torch": torch.__version__}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            print(json.dumps({**meta, **measure(runner, rows, min(args.n, rows), args.steps, args.prompt)}), flush=True)


if __name__ == "__main__":
    main()
