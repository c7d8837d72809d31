"""The Ray executor's entry points: `decoder`, a run's decode step (kvflow.runtime.core.Decode)
on a pool of Ray workers, and `run_sweep_points`, the points of a sweep on one shared pool.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, Optional

from kvflow.runtime.core import results_path
from kvflow.runtime.progress import Progress
from kvflow.runtime.ray_executor.cluster import RayWorkerError
from kvflow.runtime.ray_executor.pool import Job, Pool


def _say(message: str) -> None:
    print(f"kvflow: {message}", file=sys.stderr, flush=True)


def decoder(flag: Optional[str]):
    """The decode step of one run on Ray (a kvflow.runtime.core.Decode)."""

    def decode(loaded, registry, store, todo, quiet: bool) -> None:
        say = (lambda m: None) if quiet else _say
        pool = Pool([loaded], flag=flag, say=say)
        say(f"decoding {len(todo)} problems on Ray workers ({loaded.pipeline.run.batch_problems} per decode batch "
            f"in each)")
        with Progress(len(todo), enabled=not quiet) as progress:
            job = pool.submit(Job(loaded.hash, loaded, store, list(todo), quiet=quiet, registry=registry,
                                  progress=progress))
            pool.serve(stop=lambda: job.done.is_set())
        if job.error is not None:
            raise job.error

    return decode


def run_sweep_points(points: list, total: int, *, run_point: Callable, flag: Optional[str],
                     say: Callable[[str], None]) -> dict:
    """Points of a sweep ([(number, point)]: the ones to run, numbered among `total`) on one pool
    of Ray workers: each point runs `run_point(point, decode)` in a thread of its own (the
    caller's run of it through the run core: resume, metrics as a local run) with `decode` a job
    of the pool. Returns {point index: status}; the first error stops them all."""
    pool = Pool([p.loaded for _, p in points], flag=flag, say=say)
    status: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int, point) -> None:
        path = results_path(point.loaded)
        try:
            say(f"sweep [{i}/{total}] {point.label}: running -> {path}")
            rc = run_point(point, lambda *a: pool.decode(*a, label=point.label))
            status[point.index] = "done" if not rc else f"failed (exit {rc})"
            say(f"sweep [{i}/{total}] {point.label}: {status[point.index]}")
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            status[point.index] = "failed"
            with pool.lock:
                for job in pool.jobs:
                    if not job.done.is_set():
                        pool.fail(job, RayWorkerError("stopped: another point of the sweep failed"))

    threads = [threading.Thread(target=one, args=(i, p), name=f"kvflow-sweep-{i}", daemon=True) for i, p in points]
    for t in threads:
        t.start()
    try:
        pool.serve(stop=lambda: not any(t.is_alive() for t in threads) or bool(errors))
    finally:
        with pool.lock:
            for job in pool.jobs:
                if not job.done.is_set():
                    pool.fail(job, RayWorkerError("stopped"))
        for t in threads:
            t.join(timeout=60)
    if errors:
        first = next((e for e in errors if not (isinstance(e, RayWorkerError) and str(e).startswith("stopped"))),
                     errors[0])
        raise first
    return status
