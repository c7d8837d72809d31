"""Operators dispatched per decode step in SGLang's scheduler, kvflow's old (per-row) and new
(capturable) hooks, at 16, 64 and 256 evicted rows (issue 25: a CPU proxy for GPU kernel launches).

A tiny random-weight Qwen2 (hidden 64, 4 query / 2 KV heads, `--layers` layers) on SGLang's CPU
path (torch_native attention, float32), one prompt, one proposal of R greedy candidates of an
evicted proposer (B = 16, buffer 8, window 4: every row compacts every 8 tokens), 24 tokens
each. The scheduler counts, per decode forward (`KVFLOW_SGLANG_COUNT_OPS=1`; a TorchDispatchMode:
every aten operator dispatched, after composite ops are decomposed, i.e. about one kernel each
on a GPU):

- `hook`: inside kvflow's attention hook (all layers): what a decode graph must capture;
- `forward`: the whole `ModelRunner.forward` (model, SGLang's attention, kvflow's hook). On the
  CPU, SGLang's `torch_native` attention itself loops over requests in Python (~10 operators
  per request and layer): its count grows with rows whatever kvflow does; SGLang's GPU backends
  launch one kernel per layer;
- `plan`: kvflow's positions before the forward (`ForwardBatch.init_new`), `host`: its tripwire
  and compactions after it (eager, between forwards; compactions only in steps where rows are due).

Steps are the decode forwards with all R rows in the batch; the median over them is reported
(`host`: the mean, compactions amortized; `host_steady`: the median of steps without one).

    python bench/sglang_ops_per_step.py [--rows 16,64,256] [--layers 4] [--evictors rkv,h2o,ada-snapkv]

Prints one JSON line per (hooks, evictor, rows) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from _common import machine_line  # noqa: E402 - bench/ is on sys.path


def model_dir(layers: int) -> Path:
    from kvflow.testing.models import tiny_model, tiny_tokenizer

    path = Path(tempfile.mkdtemp(prefix="kvflow-ops-")) / f"tiny-qwen2-{layers}l"
    tok = tiny_tokenizer()
    tiny_model("qwen2", seed=3, num_layers=layers, vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def measure(hooks: str, path: Path, evictors: list[str], rows: list[int], tokens: int) -> list[dict]:
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.config.schema import ModelConfig
    from kvflow.registry import get_registry
    from kvflow.testing.engine_contract import run_to_end
    from kvflow.testing.engine_parity import NEVER, chat_prompt

    os.environ["KVFLOW_SGLANG_HOOKS"] = hooks
    os.environ["KVFLOW_SGLANG_COUNT_OPS"] = "1"
    os.environ["KVFLOW_SGLANG_REPLAY_PROXY"] = "0"  # the ops themselves, not the proxy's tracing
    os.environ["KVFLOW_SGLANG_GRAPH_ROWS"] = str(max(rows))
    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=str(path), dtype="float32", device="cpu",
                                            engine={"max_total_tokens": 60000 + (hooks == "eager"),
                                                    "max_running_requests": max(rows)}))
    out = []
    try:
        prompt = chat_prompt(engine)
        for kind in evictors:
            cls = get_registry().get("evictors", kind)
            ev = cls(cls.Params(budget=16, buffer=8, window=4))
            for r in rows:
                before = max([c["forward"] for c in engine.server_state()["op_counts"]], default=-1)
                (state,) = engine.start([StartRequest(prompt, ev, 1)])
                props = run_to_end(engine, [ProposeRequest(state, "base", SamplingSpec(r, 0.0, 1.0, tokens, NEVER),
                                                           0, 10_000)])
                engine.release([state], props)
                steps = [c for c in engine.server_state()["op_counts"] if c["evicted_rows"] == r and c["forward"] > before]
                steady = [c for c in steps if c.get("host_ops", 0) < r]  # no compaction in that step

                def med(key, among=steps):
                    return statistics.median(c.get(key, 0) for c in among) if among else None

                def mean(key):  # compactions come every `buffer` steps: per step, amortized
                    return round(statistics.mean(c.get(key, 0) for c in steps), 1) if steps else None

                rec = {"hooks": hooks, "evictor": kind, "rows": r, "steps": len(steps), "hook": med("hook_ops"),
                       "forward": med("ops"), "plan": med("plan_ops"), "host": mean("host_ops"),
                       "host_steady": med("host_ops", steady)}
                print(json.dumps(rec), flush=True)
                out.append(rec)
    finally:
        engine.worker.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--evictors", default="rkv,h2o,ada-snapkv")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--hooks", default="eager,graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    evictors = args.evictors.split(",")
    path = model_dir(args.layers)
    results = []
    for hooks in args.hooks.split(","):
        results += measure(hooks, path, evictors, rows, args.tokens)
    print(f"\nlayers {args.layers}; {machine_line()}; {time.strftime('%Y-%m-%d')}; "
          f"{' '.join(sys.argv)}\n")
    print("| evictor | rows | hook ops, old | hook ops, new | forward ops, old | forward ops, new "
          "| plan ops, old / new | host ops per step (mean), old / new |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["hooks"], r["evictor"], r["rows"]): r for r in results}
    for kind in evictors:
        for r in rows:
            old, new = by.get(("eager", kind, r), {}), by.get(("graph", kind, r), {})
            print(f"| {kind} | {r} | {old.get('hook')} | {new.get('hook')} | {old.get('forward')} | "
                  f"{new.get('forward')} | {old.get('plan')} / {new.get('plan')} | "
                  f"{old.get('host')} / {new.get('host')} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "date": time.strftime("%Y-%m-%d"),
                                              "command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
