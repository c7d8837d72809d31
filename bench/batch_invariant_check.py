"""Batch-invariant forwards on `hf` (`run.deterministic`, kvflow.backends.hf.invariant): are a
row's logits the same bits alone and in a batch, and what does the mode cost? On any device.

A random-weight model of a real shape (`--shape`, Llama architecture, bf16 by default), rows
prefilled with prompts of different lengths (`--prompt` tokens + 7 x row), then `--steps`
greedy decode steps, evicted (R-KV, `--budget` + `--buffer`) or full KV (`--evictor none`):

- bits: for each batch size b of `--batches`, rows 0..b-1 decoded together against each row
  decoded alone; the number of rows whose logits differ at any step, mode off (the control)
  and on;
- cost: decode tokens/s of the largest batch, mode off and on, in this process, alternating
  (`--repeats` rounds each), and the prefill time.

    python bench/batch_invariant_check.py [--shape qwen2.5-0.5b] [--device cpu|cuda] [--batches 1,4,8]

Prints one JSON object (and writes it to `--out`). `bench/gpu_check.sh batchinv` runs it on
a lent GPU (cuBLAS and CUDA's sdpa under the same tiles and row-by-row attention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from _common import write_json  # noqa: E402 - bench/ is on sys.path

SHAPES = {"smollm2-135m": (30, 576, 9, 3, 1536), "qwen2.5-0.5b": (24, 896, 14, 2, 4864),
          "qwen2.5-1.5b": (28, 1536, 12, 2, 8960), "qwen2.5-7b": (28, 3584, 28, 4, 18944)}


def build(shape: str, layers: int | None, device: str, dtype: str):
    import torch
    import transformers

    from kvflow.backends.hf.engine import HFRunner
    from kvflow.testing.models import tiny_tokenizer

    n_layers, hidden, heads, kv_heads, inter = SHAPES[shape]
    tok = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or n_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
    return HFRunner(model, tok)


def evictor(kind: str, budget: int, buffer: int):
    from kvflow_builtin.evictors.none import NoEviction
    from kvflow_builtin.evictors.rkv import RKVEvictor

    return NoEviction(NoEviction.Params()) if kind == "none" else RKVEvictor(RKVEvictor.Params(budget=budget,
                                                                                              buffer=buffer))


def decode(runner, rows: list[int], args, timed: bool = False):
    """Logits [rows, steps, vocab] (on the CPU) of rows `rows` decoded together; with `timed`,
    also (prefill s, decode s)."""
    import torch

    g = torch.Generator().manual_seed(1)
    vocab = len(runner.tokenizer) - 2
    ids = [torch.randint(5, vocab, (args.prompt + 7 * r,), generator=g).tolist() for r in range(max(rows) + 1)]
    cache = runner.new_cache(evictor(args.evictor, args.budget, args.buffer), len(rows), rng_keys=rows)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tokens = runner.prefill(cache, [ids[r] for r in rows])
    sync()
    t1 = time.perf_counter()
    live = torch.arange(len(rows))
    out = []
    for _ in range(args.steps):
        logits = runner.decode_step([(cache, live)], tokens)
        out.append(logits.cpu())
        tokens = logits.argmax(-1).cpu()
    sync()
    t2 = time.perf_counter()
    return torch.stack(out, 1), (t1 - t0, t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape's (a quicker check)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--evictor", choices=("rkv", "none"), default="rkv")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--buffer", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=80, help="tokens of row 0's prompt (row r: + 7 r)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "batch_invariant_check.json"))
    args = ap.parse_args()
    import torch

    from kvflow.versions import cpu

    if args.threads:
        torch.set_num_threads(args.threads)
    runner = build(args.shape, args.layers, args.device, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    out = {"bench": "batch_invariant_check", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python"] + sys.argv), "machine": cpu(), "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "load_before": os.getloadavg(),
           "args": vars(args), "bits": {}, "cost": {}}
    for mode in (False, True):
        torch.use_deterministic_algorithms(mode)
        try:
            alone = [decode(runner, [r], args)[0][0] for r in range(max(batches))]
            out["bits"]["on" if mode else "off"] = {
                b: sum(not torch.equal(decode(runner, list(range(b)), args)[0][r], alone[r]) for r in range(b))
                for b in batches}
        finally:
            torch.use_deterministic_algorithms(False)
        print(json.dumps({"mode": mode, "rows_differing_by_batch": out["bits"]["on" if mode else "off"]}), flush=True)
    rows = list(range(max(batches)))
    times: dict[str, list] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            try:
                times["on" if mode else "off"].append(decode(runner, rows, args, timed=True)[1])
            finally:
                torch.use_deterministic_algorithms(False)
    for mode, ts in times.items():
        prefill, dec = min(t[0] for t in ts), min(t[1] for t in ts)
        out["cost"][mode] = {"rows": len(rows), "prefill_s": round(prefill, 3), "decode_s": round(dec, 3),
                             "decode_tok_s": round(len(rows) * args.steps / dec, 1)}
    out["cost"]["decode_on_vs_off"] = round(out["cost"]["on"]["decode_tok_s"] / out["cost"]["off"]["decode_tok_s"], 3)
    out["cost"]["prefill_on_vs_off"] = round(out["cost"]["on"]["prefill_s"] / out["cost"]["off"]["prefill_s"], 3)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    write_json(Path(args.out), out)
    bad = any(out["bits"]["on"].values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
