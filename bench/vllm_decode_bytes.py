"""Bytes per decode step of kvflow's part of vLLM's attention, counted on meta tensors (no GPU needed).

For evicted requests in vLLM's blocks (`kvflow.backends.vllm.in_worker.blocks`), vLLM's own
kernel attends every row; kvflow adds, inside the forward, the query ring write
(`InBlocks.write_ring`: each token's post-RoPE query into its request's ring row) and, for H2O,
its statistic (`statistic.StatTable.accumulate`: every row's slots read, softmaxed and summed,
as a replayed graph runs it: one entry per token of the batch over S = budget + buffer slots,
the smallest `KVFLOW_VLLM_STAT_SPAN` that serves it). Per
evictor (rkv, snapkv, h2o at the paper's B = 64, buffer 128), model shape (Qwen2.5-7B; 1.5B;
72B per rank at tp 4) and batch, this counts the bytes those ops read and write in one decode
step (all layers; `kvflow.backends.sglang.in_worker.traffic.ByteCounter`'s rules) against one
pass of the attention kernel over the same rows (each row's keys and values read once), with
the rows at their longest (`budget + buffer` slots, as bench/sglang_decode_bytes.py counts)
and at their mean over a compaction cycle (budget + buffer / 2). The host-side work between
forwards (metadata, compaction) is not on the forward's path and is not counted.

    python bench/vllm_decode_bytes.py [--batches 8,64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvflow.backends.sglang.in_worker.traffic import ByteCounter, attention_pass_bytes
from kvflow.backends.vllm.in_worker.blocks import InBlocks, Paged, Resident
from kvflow.backends.vllm.settings import kept_in_table
from _common import machine_line  # noqa: E402 - bench/ is on sys.path

SHAPES = {"qwen2.5-7b": (28, 28, 4, 128), "qwen2.5-1.5b": (28, 12, 2, 128), "qwen2.5-72b-tp4": (80, 16, 2, 128)}
EVICTORS = ("rkv", "snapkv", "h2o")
BLOCK = 16  # FLASH_ATTN's block size on a GPU


class _Impl:
    def __init__(self, q_heads, head_dim):
        self.num_heads, self.head_size, self.scale = q_heads, head_dim, head_dim ** -0.5


def hook_bytes(ev, *, batch: int, phys: int, q_heads: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> int:
    """One layer's `InBlocks.attended` for `batch` evicted decode rows holding `phys` slots each, on meta tensors."""
    meta = torch.device("meta")
    b = InBlocks(window=32, rows=batch, span=ev.trigger if ev.observes_attention else 0)
    b.ensure_tables(1, q_heads, kv_heads, head_dim, dtype, meta)
    b.table.fixed = True  # as a replayed graph: every entry
    per_row = -(-(phys + 1) // BLOCK)
    cache = torch.empty(batch * per_row + 1, kv_heads, BLOCK, 2 * head_dim, dtype=dtype, device=meta)
    b.paged, b.block_size = Paged([cache], "split", BLOCK), BLOCK

    class _Group:  # each row's block ids (the manager's req_to_blocks)
        req_to_blocks = {str(i): [type("B", (), {"block_id": 1 + i * per_row + j})() for j in range(per_row)]
                         for i in range(batch)}

    b.group = _Group
    for i in range(batch):
        r = Resident(ev, 0, 0, None, i + 1, next=1000, phys=phys, in_table=kept_in_table(ev))  # as `admit` makes it
        b.live[str(i)] = r
        b.plan.append((str(i), r, i, i + 1, phys))
    q = torch.empty(batch, q_heads * head_dim, dtype=dtype, device=meta)
    counter = ByteCounter()
    with counter:
        b.attended(_Impl(q_heads, head_dim), 0, q, 1)
    return counter.total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--evictors", default=",".join(EVICTORS))
    args = ap.parse_args()
    from kvflow.registry import get_registry

    rows = []
    print(f"{'evictor':8} {'shape':16} {'batch':>5} {'slots':>5} {'pass GB':>8} {'hook GB':>8} {'ratio':>6}")
    for kind in args.evictors.split(","):
        cls = get_registry().get("evictors", kind)
        ev = cls(cls.Params(budget=64, buffer=128))
        longest, mean = ev.trigger - 1, ev.params.budget + ev.params.buffer // 2  # attended slots, decode step
        for name, (layers, q_heads, kv_heads, d) in SHAPES.items():
            for batch in map(int, args.batches.split(",")):
                for label, phys in (("longest", longest), ("cycle mean", mean)):
                    hook = hook_bytes(ev, batch=batch, phys=phys, q_heads=q_heads, kv_heads=kv_heads, head_dim=d) * layers
                    one_pass = attention_pass_bytes([phys + 1] * batch, kv_heads, d, d, 2) * layers
                    row = {"evictor": kind, "shape": name, "batch": batch, "rows": label, "slots": phys + 1,
                           "attention_pass_bytes": one_pass, "hook_bytes": hook, "ratio": round(hook / one_pass, 4)}
                    rows.append(row)
                    print(f"{kind:8} {name:16} {batch:5d} {phys + 1:5d} {one_pass / 1e9:8.3f} {hook / 1e9:8.3f} "
                          f"{row['ratio']:6.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "machine": machine_line(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
