"""Bytes per decode step of kvflow's SGLang decode hook, counted on meta tensors (no GPU needed).

For each evictor (rkv, snapkv, h2o, ada-snapkv at the paper's B = 64, buffer 128), model
shape (Qwen2.5-7B; 1.5B; 72B per rank at tp 4) and batch, the bytes `graph.decode_step`
reads and writes in one decode step (all layers), and the ratio to one pass of SGLang's own
decode attention over the same rows (each row's keys and values read once). With
`--old-src DIR` it also counts the hook of another checkout (a `git worktree` of an older
commit: `DIR/src/kvflow/backends/sglang/graph.py`), which had one shape for every evictor.

    python bench/sglang_decode_bytes.py [--old-src /tmp/kvflow-old] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from kvflow.backends.sglang.graph import Profile, row_width
from kvflow.backends.sglang.traffic import ByteCounter, attention_pass_bytes, hook_bytes

SHAPES = {"qwen2.5-7b": (28, 28, 4, 128), "qwen2.5-1.5b": (28, 12, 2, 128), "qwen2.5-72b-tp4": (80, 16, 2, 128)}
EVICTORS = ("rkv", "snapkv", "h2o", "ada-snapkv")


def old_hook_bytes(path: str, *, batch, seq_len, q_heads, kv_heads, head_dim, layers) -> int:
    """One layer of an older checkout's `decode_step` (one fixed shape for every evictor)."""
    spec = importlib.util.spec_from_file_location("kvflow_old_graph", f"{path}/src/kvflow/backends/sglang/graph.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    meta = torch.device("meta")
    req_to_token = torch.zeros(batch + 1, 4096, dtype=torch.int32, device=meta)
    t = old.Tables(req_to_token, layers)
    lid = layers - 1
    t.ensure(lid, q_heads, kv_heads, head_dim, torch.bfloat16)
    kb = torch.empty(1 << 20, kv_heads, head_dim, dtype=torch.bfloat16, device=meta)
    vb = torch.empty(1 << 20, kv_heads, head_dim, dtype=torch.bfloat16, device=meta)
    q = torch.empty(batch, q_heads * head_dim, dtype=torch.bfloat16, device=meta)
    counter = ByteCounter()
    with counter:
        old.decode_step(t, q, q.clone(), kb, vb, req_to_token, torch.arange(1, batch + 1, device=meta),
                        torch.full((batch,), seq_len, device=meta), lid=lid, scaling=head_dim ** -0.5,
                        q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=head_dim)
    return counter.total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-src", help="an older checkout to count too")
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    from kvflow.registry import get_registry

    rows = []
    print(f"{'evictor':11} {'shape':16} {'batch':>5} {'pass GB':>8} {'hook GB':>8} {'ratio':>6}"
          + (f" {'old GB':>8} {'old ratio':>9}" if args.old_src else ""))
    for kind in EVICTORS:
        cls = get_registry().get("evictors", kind)
        ev = cls(cls.Params(budget=64, buffer=128))
        for name, (layers, q_heads, kv_heads, d) in SHAPES.items():
            profile = Profile.of([ev], layers, kv_heads)
            width = row_width(ev, layers, kv_heads) - 1  # the rows at their longest
            for batch in map(int, args.batches.split(",")):
                kw = dict(batch=batch, seq_len=width, q_heads=q_heads, kv_heads=kv_heads, head_dim=d, layers=layers)
                hook = hook_bytes(profile, **kw).total * layers
                one_pass = attention_pass_bytes([width] * batch, kv_heads, d, d, 2) * layers
                row = {"evictor": kind, "shape": name, "batch": batch, "rows_slots": width,
                       "attention_pass_bytes": one_pass, "hook_bytes": hook, "ratio": round(hook / one_pass, 4)}
                line = f"{kind:11} {name:16} {batch:5d} {one_pass / 1e9:8.3f} {hook / 1e9:8.3f} {row['ratio']:6.3f}"
                if args.old_src:
                    old = old_hook_bytes(args.old_src, **kw) * layers
                    row.update(old_hook_bytes=old, old_ratio=round(old / one_pass, 4))
                    line += f" {old / 1e9:8.3f} {row['old_ratio']:9.3f}"
                rows.append(row)
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
