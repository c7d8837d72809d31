"""What a worker's OpenMP wait policy and `Evictor.select_layers` cost a compaction on a CPU
(docs/benchmarks.md#openmp).

    python bench/openmp_compaction.py [--rows 1,4,16] [--evictor rkv] [--out docs/results/bench/openmp_compaction.json]

For each OpenMP wait (`passive`: OMP_WAIT_POLICY=PASSIVE, what kvflow's workers had;
`passive+spin`: GOMP_SPINCOUNT=10000 over it, kvflow's `openmp_spin` for a worker alone on the
CPU; `default`: libgomp's own, ~300,000 spins), one fresh process measures, with 2 torch threads:

- `op_us`: one elementwise product of 400,000 float32 (a parallel op, back to back);
- `idle_cpu_us`: CPU time the process burns after such an op while it then sleeps 5 ms (what an
  idle worker takes from engines beside it);
- `compaction_ms`: evicting `rows` requests from budget + buffer = 96 to 64 slots at SmolLM2-135M's
  shapes (30 layers, 3 KV heads, head_dim 64, bf16 keys in vLLM's CPU block layout, the query
  window W = 8): vLLM's `Paged.read_rows`, the evictor's `select` and the kept slots' write, with
  `select` called once per layer (`per_layer`, as before) and through `select_layers`
  (`stacked`, what every engine calls now). The best of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WAITS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
         "passive+spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"},
         "default": {}}
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, WINDOW, BLOCK = 30, 3, 9, 64, 8, 128


def measure(rows_list: list[int], evictor: str) -> dict:
    import resource

    import torch

    from kvflow.backends.vllm.in_worker.blocks import Paged
    from kvflow.registry import get_registry

    torch.set_num_threads(2)
    x = torch.rand(400_000)
    for _ in range(10):
        x * 2
    t = time.perf_counter()
    for _ in range(300):
        x * 2
    op_us = (time.perf_counter() - t) / 300 * 1e6

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0 = cpu()
    for _ in range(300):
        x * 2
    busy = cpu() - c0
    c0 = cpu()
    for _ in range(300):
        x * 2
        time.sleep(0.005)
    idle_cpu_us = (cpu() - c0 - busy) / 300 * 1e6

    cls = get_registry().get("evictors", evictor)
    ev = cls(cls.Params(budget=64, buffer=32))
    n, kept = ev.trigger, ev.params.budget
    slot, dim = torch.arange(BLOCK)[:, None], torch.arange(HEAD_DIM)[None, :]

    def tiles(t: int, p: int):  # a VNNI-like tiling of (slot, dim), as vLLM's AMX kernel lays keys out
        return (slot // t) * (t * HEAD_DIM) + (dim // p) * (t * p) + (slot % t) * p + dim % p

    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(64, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).bfloat16() for _ in range(LAYERS)]
    paged = Paged(caches, "cpu", BLOCK, (tiles(16, 2), tiles(32, 1)))
    ring = [torch.randn(max(rows_list), Q_HEADS, WINDOW, HEAD_DIM, generator=g).bfloat16() for _ in range(LAYERS)]
    out = {"op_us": round(op_us, 1), "idle_cpu_us": round(idle_cpu_us, 1), "compaction_ms": {}}
    for rows in rows_list:
        ids = torch.arange(rows)[:, None] * 2
        lengths, protected = torch.full((rows,), n), torch.zeros(rows, dtype=torch.long)
        gens = [torch.Generator() for _ in range(rows)]
        write = paged.row_writer(ids, kept)

        def read(layer: int):
            keys, values = paged.read_rows(layer, ids, n)
            return keys, values, ring[layer][:rows], None

        def kept_write(layer, keep, keys, values):
            idx = keep[..., None]
            write(layer, keys.gather(2, idx.expand(-1, -1, -1, HEAD_DIM)), values.gather(2, idx.expand(-1, -1, -1, HEAD_DIM)))

        def per_layer():
            for layer in range(LAYERS):
                keys, values, window, _ = read(layer)
                keep = ev.select(keys, values, window, layer_idx=layer, lengths=lengths, n_protected=protected,
                                 generators=gens)
                kept_write(layer, keep, keys, values)

        def stacked():
            for layer, keep, (keys, values, _, _) in ev.select_layers(LAYERS, read, lengths=lengths,
                                                                      n_protected=protected, generators=gens):
                kept_write(layer, keep, keys, values)

        result = {}
        for name, fn in (("per_layer", per_layer), ("stacked", stacked)):
            fn()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            result[name] = round(best * 1e3, 1)
        out["compaction_ms"][rows] = result
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--evictor", default="rkv")
    ap.add_argument("--out", default="docs/results/bench/openmp_compaction.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(rows, args.evictor)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import cpu_model, write_json

    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "cpu": cpu_model(),
           "load_before": os.getloadavg(), "evictor": args.evictor, "waits": {}}
    for name, extra in WAITS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(extra)
        done = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows, "--evictor", args.evictor],
                              env=env, capture_output=True, text=True, check=True)
        out["waits"][name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, out["waits"][name], flush=True)
    out["load_after"] = os.getloadavg()
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
