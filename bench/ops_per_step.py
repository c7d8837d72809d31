"""Operators dispatched per decode step of the `hf` engine (issue 25: a CPU proxy for GPU
kernel launches).

A tiny random-weight Qwen2-like model (hidden 64, 4 query / 2 KV heads, `--layers` layers),
P problems x N candidates of an evicted proposer (R-KV, B = 16, buffer 16, window 4: every
state is past its budget, so every row is an evicted row), states from a real prefill. After
`--warm` decode steps, `--steps` more are profiled one by one with the torch profiler; for
each step it counts the `aten::` events

- inside `HFRunner.decode_step` (the model forward with kvflow's cache and attention: what
  runs on the device on a GPU; `forward`), its leaf events (no `aten::` child: closest to
  kernels; `forward_leaf`), and
- in the whole `HFEngine.step` (forward, sampling, stop rules, bookkeeping; the row table
  lives on the host, so on a GPU most of the rest is host work; `step`).

Steps in which rows compact (every `buffer` tokens here) are reported apart (`compacting`):
a compaction is per batch of due rows, not per step. The table gives the median steady step.

    python bench/ops_per_step.py                      # 16, 64 and 256 rows (2/8/32 problems x N = 8)
    python bench/ops_per_step.py --problems 2,8 --layers 4

Prints one JSON line per row count and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone

import torch
from _common import machine_line  # noqa: E402 - bench/ is on sys.path


def _count(prof, inside: str | None = None) -> tuple[int, int]:
    """(aten events, leaf aten events) of a profile, or of the events nested in the ranges
    named `inside` (a record_function label)."""
    events = prof.events()
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == inside] if inside else None
    total = leaf = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        if ranges is not None and not any(a <= e.time_range.start and e.time_range.end <= b for a, b in ranges):
            continue
        total += 1
        leaf += not any(c.name.startswith("aten::") for c in e.cpu_children)
    return total, leaf


def measure(problems: int, n: int, layers: int, warm: int, steps: int, evictor_kind: str) -> dict:
    from kvflow.backends.hf.engine import HFRunner
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.registry import get_registry
    from kvflow.testing import tiny_engine

    engine = tiny_engine("qwen2", num_layers=layers, seed=0)
    engine.runner.eos_ids = set()  # no row ends early: every step has all P x N rows live
    engine._eos = torch.zeros(0, dtype=torch.long)  # (the engine reads its EOS ids when built)
    reg = get_registry()
    cls = reg.get("evictors", evictor_kind)
    ev = cls(cls.Params(budget=16, buffer=16, window=4)) if evictor_kind != "none" else cls(cls.Params())
    prompt = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 2
    states = engine.start([StartRequest(prompt + str(i), ev, i) for i in range(problems)])
    spec = SamplingSpec(n, 0.7, 0.95, warm + steps + 4, "\x00\x01")  # a delimiter that never comes
    engine.submit([ProposeRequest(s, "base", spec, i, 10_000) for i, s in enumerate(states)])
    for _ in range(warm):
        engine.step()

    original = HFRunner.decode_step

    def labelled(self, parts, tokens):
        with torch.profiler.record_function("decode_step"):
            return original(self, parts, tokens)

    HFRunner.decode_step = labelled
    plain, compacting = [], []
    try:
        for _ in range(steps):
            before = sum(int(r.cache.rows.compactions.sum()) for r in engine.running)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
            after = sum(int(r.cache.rows.compactions.sum()) for r in engine.running)
            fwd, fwd_leaf = _count(prof, "decode_step")
            step, _ = _count(prof)
            (compacting if after != before else plain).append(
                {"forward": fwd, "forward_leaf": fwd_leaf, "step": step, "wall_ms_profiled": round(wall * 1e3, 1)})
    finally:
        HFRunner.decode_step = original
    live = sum(len(r.live) for r in engine.running)
    return {"problems": problems, "n": n, "rows": problems * n, "live_rows_after": live, "layers": layers,
            "evictor": evictor_kind, "steps": plain, "compacting_steps": compacting}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="2,8,32")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="profiled steps (16: one compaction per row among them)")
    ap.add_argument("--evictor", default="rkv")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {machine_line()} torch {torch.__version__} "
          f"{torch.get_num_threads()} threads")
    rows = []
    for p in [int(x) for x in args.problems.split(",")]:
        r = measure(p, args.n, args.layers, args.warm, args.steps, args.evictor)
        print(json.dumps(r))
        rows.append(r)
    print(f"\n| rows (problems x N) | layers | aten ops in the forward (leaf) | aten ops in engine.step | "
          f"forward of a compacting step | ms / step (profiled, median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        s = sorted(r["steps"], key=lambda x: x["forward"])[len(r["steps"]) // 2] if r["steps"] else None
        c = r["compacting_steps"][0]["forward"] if r["compacting_steps"] else "-"
        walls = sorted(x["wall_ms_profiled"] for x in r["steps"] + r["compacting_steps"])
        print(f"| {r['rows']} ({r['problems']} x {r['n']}) | {r['layers']} | {s['forward']} ({s['forward_leaf']}) "
              f"| {s['step']} | {c} | {walls[len(walls) // 2]} |")


if __name__ == "__main__":
    main()
