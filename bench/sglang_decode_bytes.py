"""Bytes per decode step of kvflow's SGLang decode hook, counted on meta tensors (no GPU needed).

For each evictor (rkv, snapkv, h2o, ada-snapkv at the paper's B = 64, buffer 128), model
shape (Qwen2.5-7B; 1.5B; 72B per rank at tp 4) and batch, the bytes `graph.decode_step`
reads and writes in one decode step (all layers), and the ratio to one pass of SGLang's own
decode attention over the same rows (each row's keys and values read once). With
`--old-src DIR` it also counts the hook of another checkout (a `git worktree` of an older
commit: `DIR/src/kvflow/backends/sglang/in_worker/graph.py`), which had one shape for every evictor.

    python bench/sglang_decode_bytes.py [--old-src /tmp/kvflow-old] [--json out.json]
    python bench/sglang_decode_bytes.py --wall [--old-src DIR]   # CPU wall per decode step too

`--wall` also times the hook on this CPU with real tensors at Qwen2.5-Coder-0.5B's shape (24
layers, 14 query / 2 KV heads, head_dim 64, bf16), 64 rows at their longest, per evictor (and
the old checkout's hook), interleaved, median of `--repeats` steps: the CPU counterpart of
the byte counts (one run, compare ratios only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from kvflow.backends.sglang.in_worker.graph import Profile, row_width
from kvflow.backends.sglang.in_worker.traffic import ByteCounter, attention_pass_bytes, hook_bytes
from _common import machine_line  # noqa: E402 - bench/ is on sys.path

SHAPES = {"qwen2.5-7b": (28, 28, 4, 128), "qwen2.5-1.5b": (28, 12, 2, 128), "qwen2.5-72b-tp4": (80, 16, 2, 128)}
EVICTORS = ("rkv", "snapkv", "h2o", "ada-snapkv")


def old_hook_bytes(path: str, *, batch, seq_len, q_heads, kv_heads, head_dim, layers) -> int:
    """One layer of an older checkout's `decode_step` (one fixed shape for every evictor)."""
    spec = importlib.util.spec_from_file_location("kvflow_old_graph", f"{path}/src/kvflow/backends/sglang/in_worker/graph.py")
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


def _wall_step(graph_mod, tables, *, batch, seq_len, q_heads, kv_heads, head_dim, layers, repeats):
    """Median seconds of one decode step (every layer) of `graph_mod.decode_step` on the CPU."""
    import statistics
    import time

    g = torch.Generator().manual_seed(0)
    pool = batch * seq_len + 64
    kb = torch.randn(pool, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    vb = torch.randn(pool, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    rt = torch.zeros(batch + 1, 4096, dtype=torch.int32)  # the context width the tables were made for
    rt[1:, :seq_len] = torch.arange(batch * seq_len, dtype=torch.int32).view(batch, seq_len)
    rows = [tables.assign(observing=True) for _ in range(batch)]
    for i, r in enumerate(rows):
        tables.row_of[i + 1] = r
    for lid in range(layers):
        tables.ensure(lid, q_heads, kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(batch, q_heads * head_dim, generator=g).to(torch.bfloat16)
    rpi, lens = torch.arange(1, batch + 1), torch.full((batch,), seq_len)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for lid in range(layers):
            graph_mod.decode_step(tables, q, q, kb, vb, rt, rpi, lens, lid=lid, scaling=head_dim ** -0.5,
                                  q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=head_dim)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall(args, reg) -> list:
    from kvflow.backends.sglang.in_worker import graph

    layers, q_heads, kv_heads, d, batch = 24, 14, 2, 64, 64
    old = None
    if args.old_src:
        spec = importlib.util.spec_from_file_location("kvflow_old_graph", f"{args.old_src}/src/kvflow/backends/sglang/in_worker/graph.py")
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    rows = []
    for kind in args.evictors.split(","):
        cls = reg.get("evictors", kind)
        ev = cls(cls.Params(budget=64, buffer=128))
        width = row_width(ev, layers, kv_heads) - 1
        kw = dict(batch=batch, seq_len=width, q_heads=q_heads, kv_heads=kv_heads, head_dim=d, layers=layers,
                  repeats=args.repeats)
        rt = torch.zeros(batch + 1, 4096, dtype=torch.int32)
        new_s = _wall_step(graph, graph.Tables(rt, layers, Profile.of([ev], layers, kv_heads)), **kw)
        row = {"evictor": kind, "rows": batch, "rows_slots": width, "new_ms": round(new_s * 1e3, 2)}
        if old is not None:
            old_s = _wall_step(old, old.Tables(torch.zeros(batch + 1, 4096, dtype=torch.int32), layers), **kw)
            row.update(old_ms=round(old_s * 1e3, 2), old_over_new=round(old_s / new_s, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-src", help="an older checkout to count too")
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--wall", action="store_true", help="also time the hook on this CPU (0.5B shape, 64 rows)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--evictors", default=",".join(EVICTORS),
                    help="comma-separated evictor kinds (e.g. the kvpress ports: knorm,keydiff,lagkv,tova,cur,"
                         "expected-attention)")
    args = ap.parse_args()
    from kvflow.registry import get_registry

    torch.set_num_threads(1)

    rows = []
    print(f"{'evictor':11} {'shape':16} {'batch':>5} {'pass GB':>8} {'hook GB':>8} {'ratio':>6}"
          + (f" {'old GB':>8} {'old ratio':>9}" if args.old_src else ""))
    for kind in args.evictors.split(","):
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
    walls = wall(args, get_registry()) if args.wall else None
    if args.json:
        import time as _time

        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": _time.strftime("%Y-%m-%d"), "machine": machine_line(),
                       "rows": rows, "cpu_wall": walls}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
