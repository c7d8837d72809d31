"""What kvflow's Ray driver costs per problem (issue 27): records per second through the driver,
and the driver's own CPU time per record, with workers that decode nothing (each problem's
record is made at once, of a chosen size), so that only the driver's work is measured: feeding
problems, receiving records, appending them to samples.jsonl, progress lines.

    .venv/bin/python bench/ray_driver.py [--problems 2000] [--workers 2] [--kb 10,300]

Prints one line per record size. The end-to-end comparison (a tiny pipeline locally and on Ray
workers) is the `time` lines in docs/benchmarks.md ("Ray").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from kvflow.runtime.ray_executor import Job, KvflowWorker, Pool


class InstantWorker(KvflowWorker):
    """A worker whose problems finish at once, each with a record of `KVFLOW_BENCH_KB` kB."""

    def _decode(self, key, loaded, first, jobs) -> None:
        size = int(os.environ.get("KVFLOW_BENCH_KB", "10")) * 1024
        self.outbox.put(("opened", key, {"device": "cpu", "threads": 1, "kv_memory": {}, "engines": {},
                                         "engine_settings": {}, "placement": None}))
        item = first
        while True:
            if item[0] == "end" and item[1] == key:
                break
            if item[0] == "problem":
                p = item[2]
                step = {"text": "x" * 200, "source": "base", "score": -0.5, "n_tokens": 60}
                steps = [step] * max(1, size // 260)
                self.outbox.put(("record", key, {
                    "id": p.id, "question": p.question, "prompt": p.question, "gold": p.gold, "prediction": "1",
                    "correct": True, "output": "", "steps": steps, "step_counts": {"base": len(steps)},
                    "output_tokens": 60 * len(steps), "tokens_generated": {"base": 100}, "candidates": {"base": 8},
                    "pruned": {}, "finish": "eos", "degenerate": False, "seconds": 0.0}))
            item = self.inbox.get()
        self.outbox.put(("closed", key, {"occupancy": {}, "engine_stats": {}}))


def main() -> None:
    import ray

    from kvflow.config.validate import load_pipeline
    from kvflow.eval.datasets import Problem
    from kvflow.registry import get_registry
    from kvflow.results.files import ResultsDir
    from kvflow.testing import tiny_pipeline

    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kb", default="10,300")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvflow-ray-bench-"))
    path = tiny_pipeline(root, problems=1)
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    for kb in [int(x) for x in args.kb.split(",")]:
        os.environ["KVFLOW_BENCH_KB"] = str(kb)
        loaded = load_pipeline(path, sets=["run.executor=ray", f"run.workers={args.workers}", f"run.output={root / str(kb)}"])
        store = ResultsDir(root / str(kb) / "run")
        todo = [Problem(f"p/{i}", "question " * 20, "1") for i in range(args.problems)]
        pool = Pool([loaded], say=lambda m: None, worker_class=InstantWorker)
        job = pool.submit(Job(loaded.hash, loaded, store, todo, quiet=True, registry=get_registry()))
        t0, c0 = time.perf_counter(), time.process_time()
        first = {}
        record = pool._record

        def timed_record(*a):
            first.setdefault("t", time.perf_counter())
            first.setdefault("cpu", time.process_time())
            record(*a)

        pool._record = timed_record
        pool.owned = False  # keep the cluster for the next size
        pool.serve(stop=job.done.is_set)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steady = wall - (first["t"] - t0)  # from the first record on: the workers are up
        steady_cpu = time.process_time() - first["cpu"]
        size = store.samples.stat().st_size / args.problems / 1024
        print(json.dumps({"record_kb": round(size, 1), "problems": args.problems, "workers": args.workers,
                          "wall_s": round(wall, 2), "first_record_s": round(first["t"] - t0, 2),
                          "records_per_s": round((args.problems - 1) / steady, 1),
                          "driver_cpu_ms_per_record": round(1000 * steady_cpu / (args.problems - 1), 3),
                          "driver_cpu_share": round(steady_cpu / steady, 2)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
