"""`run.executor: ray`: a run, or every point of a sweep, decoded by kvflow workers on a Ray
cluster (DESIGN.md §11; docs/cluster.md). A peer of the local executor around the run core
(kvflow.runtime.core), in four modules:

    cluster.py   Ray installed, the address reachable, the connection, workers' GPUs and CPUs
    worker.py    the worker, a Ray actor (KvflowWorker): a Session over the problems it is fed
    pool.py      the driver's pool of workers (Pool, Job): feeding, records in, dead workers
    driver.py    the entry points: `decoder` (one run), `run_sweep_points` (a sweep)

The driver (`kvflow run` on any machine that reaches the cluster) owns what it owns in a local
run: the dataset, the resume state and the results directory, whose every file it writes
itself (one writer: nothing duplicated). The workers are Ray actors, each a kvflow worker with
its own engines (a kvflow.runtime.session.Session: `compile.build_plan` on the GPUs Ray gives
it: `num_gpus` from the pipeline's models, `run.worker_gpus`), running the step scheduler over the problems it is handed
(continuous batching inside a worker) and streaming each finished problem's record back. A
problem's record does not depend on which worker ran it, nor on whether it ran twice: every
candidate draws from a generator keyed by (seed, problem, proposer, step, candidate).

Protocol (driver -> worker: `feed(items)`, in order; worker -> driver: `take(timeout)`):
    ("job", key, loaded)          a run (a sweep point) the worker may be given problems of
    ("problem", key, problem)     decode it; a worker runs one job at a time
    ("end", key)                  no more problems of that job: finish the ones in flight
    <- ("opened", key, info)      the job's engines are loaded (device, placement, settings)
    <- ("record", key, record)    a finished problem's samples.jsonl record
    <- ("closed", key, summary)   the job's session ended (decode occupancy, engine counters)
    <- ("error", key, kind, ...)  the job cannot run here (a UserError's problems, a message)

The driver keeps each worker's scheduler fed with up to `live_problems` (+ a few ahead) of one
job, and moves a worker to the next job with problems left when its own has none, so the
points of a sweep share one pool and a slow point does not idle it. A worker that dies (killed,
out of memory, its node lost: Ray raises on its pending calls) has its unfinished problems put
back at the head of their queue, for whichever worker is free next, and a new worker is started
in its place (at most `pool._REPLACEMENTS` x workers times in a run). A record that arrives for a
problem already recorded is dropped. A driver killed mid-run leaves an append-only
samples.jsonl (at most a torn last line, which the rerun cuts off): `kvflow run` again resumes.

Test hook: `KVFLOW_RAY_FAULT=sigkill:<worker>:<n>` makes that worker's first incarnation kill
its own process (SIGKILL) once it has finished `n` problems, before the n-th record leaves it.
"""

from __future__ import annotations

from kvflow.runtime.ray_executor.cluster import (RAY_HINT, RayWorkerError, check, connect, ray_address, unreachable,
                                                 worker_count, worker_gpus)
from kvflow.runtime.ray_executor.driver import decoder, run_sweep_points
from kvflow.runtime.ray_executor.pool import Job, Pool
from kvflow.runtime.ray_executor.worker import KvflowWorker

__all__ = ["RAY_HINT", "RayWorkerError", "check", "connect", "ray_address", "unreachable", "worker_count",
           "worker_gpus", "decoder", "run_sweep_points", "Job", "Pool", "KvflowWorker"]
