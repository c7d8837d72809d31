"""`run.executor: ray`: a run, or every point of a sweep, decoded by kvflow workers on a Ray
cluster (DESIGN.md §11; docs/cluster.md).

The driver (`kvflow run` on any machine that reaches the cluster) owns what it owns in a local
run: the dataset, the resume state and the results directory, whose every file it writes
itself (one writer: nothing duplicated). The workers are Ray actors, each a kvflow worker with
its own engines (`compile.build_plan` on the GPUs Ray gives it: `num_gpus` from the pipeline's
models, `run.worker_gpus`), running the step scheduler over the problems it is handed
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
in its place (at most `_REPLACEMENTS` x workers times in a run). A record that arrives for a
problem already recorded is dropped. A driver killed mid-run leaves an append-only
samples.jsonl (at most a torn last line, which the rerun cuts off): `kvflow run` again resumes.

Test hook: `KVFLOW_RAY_FAULT=sigkill:<worker>:<n>` makes that worker's first incarnation kill
its own process (SIGKILL) once it has finished `n` problems, before the n-th record leaves it.
"""

from __future__ import annotations

import collections
import os
import platform
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvflow.errors import ConfigProblem, KvflowError, UserError

RAY_HINT = "install it with `pip install 'kvflow[ray]'` (or `scripts/install.sh ray`), or set run.executor: local"
_HEARTBEAT_S = 10.0
_REPLACEMENTS = 2  # new workers a run may start for dead ones, per worker asked for
_PREFETCH_MIN = 2  # problems a worker holds beyond its scheduler's room, so it never waits for the driver


class RayWorkerError(KvflowError):
    """The Ray workers could not decode the run (all died, or one failed outside a problem)."""


# --------------------------------------------------------------------------- checks and connection


def ray_address(flag: Optional[str]) -> tuple[Optional[str], str]:
    """(address, where it came from): `--ray-address`, else RAY_ADDRESS, else (None, "") for a
    local cluster started by this process."""
    if flag:
        return flag, "--ray-address"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env, "RAY_ADDRESS"
    return None, ""


def check(loaded, flag: Optional[str] = None) -> None:
    """What can be known before anything is written: Ray is installed, and the cluster address
    (if any) is reachable. A UserError naming `run.executor`, RAY_ADDRESS or `--ray-address`."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UserError(loaded.problem("run.executor", "`executor: ray` needs Ray, which is not installed in this "
                                       "environment", RAY_HINT))
    address, source = ray_address(flag)
    if address:
        why = unreachable(address)
        if why:
            raise UserError(ConfigProblem(f"<{source}>", 0, "", f"no Ray cluster at {address!r}: {why}",
                                          "start one (`ray start --head`) and give its address (host:6379), "
                                          f"or unset {source} to start a local cluster (docs/cluster.md)"))


def unreachable(address: str) -> Optional[str]:
    """Why a Ray address cannot be used, or None. `auto`/`local` are Ray's own words (checked
    by `ray.init`); `ray://host:port` is Ray Client; `host:port` is a cluster's GCS, tried
    with one TCP connection (Ray itself would retry for minutes)."""
    if address in ("auto", "local"):
        return None
    target = address.split("://", 1)[1] if "://" in address else address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return "not host:port (e.g. 10.0.0.1:6379), `auto`, or ray://host:10001"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return None
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e})"


def connect(flag: Optional[str] = None) -> tuple[bool, str]:
    """ray.init (unless this process is connected already). Returns (whether this call
    started the connection, and so must end it; the address in words)."""
    import ray

    if ray.is_initialized():
        return False, "this process's Ray"
    address, source = ray_address(flag)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    if address:
        kwargs["address"] = address
    else:
        kwargs["include_dashboard"] = False
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(ConfigProblem(f"<{source or 'ray.init'}>", 0, "", f"cannot connect to Ray: {e}",
                                      "check the address (docs/cluster.md)")) from None
    return True, address or "a local cluster"


# --------------------------------------------------------------------------- worker resources


def worker_gpus(loaded, cluster_gpus: float) -> int:
    """GPUs each worker asks Ray for: `run.worker_gpus`, else 0 on a cluster without GPUs, else
    one per GPU the used model entries occupy on their own (kvflow.placement: an SGLang engine
    tp_size x dp_size x pp_size, any other entry 1; entries on `cpu` none)."""
    run = loaded.pipeline.run
    if run.worker_gpus is not None:
        return run.worker_gpus
    if cluster_gpus <= 0:
        return 0
    from kvflow.placement import pipeline_demands
    from kvflow.runtime.compile import used_models

    return sum(d.gpu_count for d in pipeline_demands(loaded.pipeline.models, used_models(loaded)))


def worker_count(loaded, resources: dict, gpus: int, cpus: int) -> int:
    """`run.workers`, else as many as the cluster's GPUs (or, with none asked, CPUs) hold."""
    if loaded.pipeline.run.workers is not None:
        return loaded.pipeline.run.workers
    if gpus > 0:
        return max(1, int(resources.get("GPU", 0) // gpus))
    return max(1, int(resources.get("CPU", 1) // max(1, cpus)))


# --------------------------------------------------------------------------- the worker (a Ray actor)


class KvflowWorker:
    """A kvflow worker: one job's engines at a time, the step scheduler over the problems it is
    fed, records out as problems finish (see the module docstring). Runs in a Ray actor."""

    def __init__(self, index: int, cwd: Optional[str] = None, fault: Optional[int] = None) -> None:
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)  # relative model and dataset paths, as on the driver (a shared filesystem)
        self.index, self.fault = index, fault
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._main, name="kvflow-worker", daemon=True)
        self.thread.start()

    def describe(self) -> dict:
        import ray

        return {"worker": self.index, "host": platform.node(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def feed(self, items: list) -> int:
        for item in items:
            self.inbox.put(item)
        return len(items)

    def take(self, timeout: float) -> list:
        out = []
        try:
            out.append(self.outbox.get(timeout=timeout))
            while True:
                out.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        return out

    # ---------------------------------------------------------------- inside the actor

    def _main(self) -> None:
        jobs: dict[str, Any] = {}
        while True:
            item = self.inbox.get()
            if item[0] == "job":
                jobs[item[1]] = item[2]
            elif item[0] == "problem":
                self._session(jobs, item)
            # ("end", key) with nothing running here: nothing to do

    def _session(self, jobs: dict, first: tuple) -> None:
        key = first[1]
        try:
            self._decode(key, jobs[key], first, jobs)
        except UserError as e:
            self.outbox.put(("error", key, "user", e.problems))
        except KvflowError as e:
            self.outbox.put(("error", key, "kvflow", str(e), e.exit_code))
        except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the run
            self.outbox.put(("error", key, "internal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            import gc

            gc.collect()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the next job's engines load into this worker's GPUs
            except Exception:  # noqa: BLE001
                pass

    def _decode(self, key: str, loaded, first: tuple, jobs: dict) -> None:
        import torch

        from kvflow.components.base import Trajectory
        from kvflow.eval.answer import extract_answer
        from kvflow.eval.grading import Grader
        from kvflow.eval.prompts import render_prompt
        from kvflow.registry import get_registry
        from kvflow.runtime import compile as compile_
        from kvflow.runtime.runner import _record, torch_run_settings
        from kvflow.runtime.scheduler import Occupancy, run

        pipe = loaded.pipeline
        with torch_run_settings(pipe.run):
            torch.manual_seed(pipe.run.seed)
            plan, engines = compile_.build_plan(loaded, get_registry())
            base = plan.proposers[0].engine
            self.outbox.put(("opened", key, {"threads": torch.get_num_threads(),
                                             **compile_.engine_facts(plan, engines)}))
            occupancy, timings = Occupancy(), {}
            started: dict[str, float] = {}
            problems: dict[str, Any] = {}
            count = {"in": 0, "out": 0}

            def source():
                item = first
                while True:
                    if item is None:
                        try:  # block only when nothing is in flight (the scheduler has nothing to decode)
                            item = self.inbox.get() if count["in"] == count["out"] else self.inbox.get_nowait()
                        except queue.Empty:
                            yield None
                            continue
                    kind, item_key = item[0], item[1]
                    if kind == "job":
                        jobs[item_key] = item[2]
                    elif kind == "end" and item_key == key:
                        return
                    elif kind == "problem":
                        p = item[2]
                        problems[p.id] = p
                        started[p.id] = time.time()
                        count["in"] += 1
                        yield Trajectory(p.id, p.question, render_prompt(pipe.dataset.prompt, p.question, base.tokenizer))
                    item = None

            with Grader(timeout=pipe.run.grade_timeout) as grader:
                def on_done(traj) -> None:
                    problem = problems.pop(traj.problem_id)
                    prediction = extract_answer(traj.text)
                    correct = bool(prediction is not None and grader.grade(prediction, problem.gold))
                    record = _record(traj, problem, prediction, correct, time.time() - started.pop(traj.problem_id),
                                     plan, timings.pop(traj.problem_id, None))
                    count["out"] += 1
                    if self.fault is not None and count["out"] >= self.fault:
                        os.kill(os.getpid(), signal.SIGKILL)  # KVFLOW_RAY_FAULT: a worker lost mid-run
                    self.outbox.put(("record", key, record))

                run(plan, source(), on_done, timings=timings, occupancy=occupancy)
            stats = {e.label: e.stats() for e in plan.engines() if callable(getattr(e, "stats", None))}
            self.outbox.put(("closed", key, {"occupancy": occupancy.summary(), "engine_stats": stats}))


# --------------------------------------------------------------------------- the driver


@dataclass
class Job:
    """One run on the pool: its problems to do, its results directory, its tallies."""

    key: str
    loaded: Any
    store: Any
    todo: list
    label: str = ""
    quiet: bool = False
    queue: collections.deque = field(default_factory=collections.deque)
    recorded: set = field(default_factory=set)
    correct: int = 0
    prepared: bool = False
    occupancy: Optional[dict] = None
    engine_stats: dict = field(default_factory=dict)
    opened_on: set = field(default_factory=set)  # workers whose session of this job has not closed
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)
    registry: Any = None

    def __post_init__(self) -> None:
        self.queue.extend(self.todo)

    @property
    def room(self) -> int:
        run = self.loaded.pipeline.run
        live = run.live_problems or 2 * run.batch_problems
        return live + max(_PREFETCH_MIN, live // 4)

    @property
    def complete(self) -> bool:
        return len(self.recorded) >= len(self.todo)


@dataclass
class _Worker:
    index: int
    handle: Any
    ready_ref: Any
    info: Optional[dict] = None
    take_ref: Any = None
    job: Optional[str] = None  # the job its current session runs (None: none)
    sent_jobs: set = field(default_factory=set)
    outstanding: dict = field(default_factory=dict)  # problem id -> (job key, problem), fed and not recorded
    records: int = 0
    alive: bool = True


class Pool:
    """Ray workers shared by every job submitted to it (one run, or the points of a sweep)."""

    def __init__(self, loaded_list: list, *, flag: Optional[str] = None, say: Callable[[str], None],
                 worker_class: type = KvflowWorker) -> None:
        import ray

        self.ray, self.say = ray, say
        self.owned, where = connect(flag)
        resources = ray.cluster_resources()
        self.gpus = max(worker_gpus(lp, resources.get("GPU", 0)) for lp in loaded_list)
        self.cpus = max(lp.pipeline.run.threads or 1 for lp in loaded_list)
        self.target = max(worker_count(lp, resources, self.gpus, self.cpus) for lp in loaded_list)
        self.address = where
        say(f"ray {ray.__version__}: {where} ({resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs); "
            f"up to {self.target} workers of {self.gpus} GPU(s) and {self.cpus} CPU(s) each")
        self.jobs: list[Job] = []
        self.lock = threading.Lock()
        self.workers: dict[int, _Worker] = {}
        self.started = 0
        self.fault = _fault()
        self.cls = ray.remote(max_concurrency=4, max_restarts=0)(worker_class)  # another: bench/ray_driver.py
        env = {k: v for k, v in os.environ.items() if k.startswith(("KVFLOW_", "HF_", "TRANSFORMERS_"))
               and k != "KVFLOW_RAY_FAULT"}
        self.options = {"num_cpus": self.cpus, "num_gpus": self.gpus,
                        **({"runtime_env": {"env_vars": env}} if env else {})}
        self.last_news = time.time()
        self.t0 = time.time()

    # ---------------------------------------------------------------- jobs

    def submit(self, job: Job) -> Job:
        with self.lock:
            self.jobs.append(job)
        return job

    def decode(self, loaded, registry, store, todo, quiet: bool, label: str = "") -> None:
        """A `runner.run_pipeline` decode step for a sweep point (from its own thread): the
        job goes to the pool, this returns once all its problems are recorded."""
        job = self.submit(Job(loaded.hash + str(store.path), loaded, store, list(todo), label=label, quiet=quiet,
                              registry=registry))
        job.done.wait()
        if job.error is not None:
            raise job.error

    def _active(self) -> list[Job]:
        with self.lock:
            return [j for j in self.jobs if not j.done.is_set()]

    # ---------------------------------------------------------------- serving

    def serve(self, stop: Callable[[], bool]) -> None:
        """Decode the submitted jobs until `stop()` holds and none is left."""
        ray = self.ray
        try:
            while True:
                jobs = self._active()
                if not jobs and stop():
                    return
                self._grow(jobs)
                self._assign(jobs)
                refs = {}
                for w in self.workers.values():
                    if not w.alive:
                        continue
                    if w.info is None:
                        refs[w.ready_ref] = (w, "ready")
                    else:
                        if w.take_ref is None:
                            w.take_ref = w.handle.take.remote(0.5)
                        refs[w.take_ref] = (w, "take")
                if not refs:
                    time.sleep(0.05)
                    self._check_alive(jobs)
                    continue
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
                if ready:
                    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in ready:
                    w, what = refs[ref]
                    try:
                        value = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        self._lost(w, e)
                        continue
                    if what == "ready":
                        w.info = value
                        self.say(f"worker {w.index} ready: {value['host']} pid {value['pid']}"
                                 + (f", GPUs {','.join(value['gpu_ids'])}" if value["gpu_ids"] else ""))
                    else:
                        w.take_ref = None
                        for msg in value:
                            self._handle(w, msg)
                self._finish(jobs)
                self._heartbeat(jobs)
        finally:
            self.close()

    def _grow(self, jobs: list[Job]) -> None:
        """Start workers up to the target, no more than there are problems left to decode."""
        alive = [w for w in self.workers.values() if w.alive]
        left = sum(len(j.queue) for j in jobs) + sum(len(w.outstanding) for w in alive)
        while len(alive) < min(self.target, left):
            if self.started >= self.target * (1 + _REPLACEMENTS):
                if not alive:
                    raise RayWorkerError(f"every Ray worker died ({self.started} started); the finished problems "
                                         "are recorded: rerun to resume (Ray's logs: /tmp/ray/session_latest/logs)")
                return
            index = self.started
            self.started += 1
            fault = self.fault[1] if self.fault and self.fault[0] == index else None
            handle = self.cls.options(**self.options).remote(index, os.getcwd(), fault)
            w = _Worker(index, handle, handle.describe.remote())
            self.workers[index] = w
            alive.append(w)

    def _assign(self, jobs: list[Job]) -> None:
        for w in self.workers.values():
            if not w.alive or w.info is None:
                continue
            items: list = []
            job = self._job(w.job) if w.job else None
            if job is None or not job.queue or job.error:
                nxt = next((j for j in jobs if j.queue and not j.error), None)
                if nxt is None:
                    continue
                if w.job is not None:
                    items.append(("end", w.job))
                job, w.job = nxt, nxt.key
            # its scheduler's room and a few ahead, but no more than its share of what is left
            # (workers still starting count: a run's first problems do not all go to the first)
            alive = [x for x in self.workers.values() if x.alive]
            left = len(job.queue) + sum(1 for x in alive for key, _ in x.outstanding.values() if key == job.key)
            share = -(-left // max(1, len(alive)))
            room = min(job.room, share) - len(w.outstanding)
            room = min(room, len(job.queue))
            if room > 0:
                if job.key not in w.sent_jobs:
                    items.append(("job", job.key, job.loaded))
                    w.sent_jobs.add(job.key)
                for _ in range(room):
                    p = job.queue.popleft()
                    items.append(("problem", job.key, p))
                    w.outstanding[p.id] = (job.key, p)
                job.opened_on.add(w.index)
            if items:
                self._feed(w, items)

    def _feed(self, w: _Worker, items: list) -> None:
        try:  # waited for: items of one worker arrive in order
            self.ray.get(w.handle.feed.remote(items), timeout=120)
        except self.ray.exceptions.RayError as e:
            self._lost(w, e)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError and the like: the worker is not answering
            self._lost(w, e)

    def _job(self, key: str) -> Optional[Job]:
        with self.lock:
            return next((j for j in self.jobs if j.key == key), None)

    def _handle(self, w: _Worker, msg: tuple) -> None:
        kind, key = msg[0], msg[1]
        job = self._job(key)
        if job is None:
            return
        if kind == "opened":
            self._opened(job, w, msg[2])
        elif kind == "record":
            self._record(job, w, msg[2])
        elif kind == "closed":
            self._closed(job, w, msg[2])
        elif kind == "error":
            if msg[2] == "user":
                err: BaseException = UserError(msg[3])
            elif msg[2] == "kvflow":
                err = RayWorkerError(f"worker {w.index}: {msg[3]}")
                err.exit_code = msg[4]
            else:
                err = RayWorkerError(f"worker {w.index} failed: {msg[3]}")
            self._fail(job, err)

    def _opened(self, job: Job, w: _Worker, info: dict) -> None:
        from kvflow.runtime.runner import _manifest

        entry = {**(w.info or {}), "device": info["device"], "placement": info["placement"]}
        if not job.prepared:  # the results directory is created only once a worker has loaded the models
            import ray

            job.store.prepare(job.loaded.resolved, _manifest(job.loaded, job.registry))
            job.store.update_manifest(
                device=info["device"], threads=info["threads"], kv_memory=info["kv_memory"], engines=info["engines"],
                engine_settings=info["engine_settings"], placement=info["placement"],
                executor={"kind": "ray", "ray": ray.__version__, "address": self.address,
                          "worker_gpus": self.gpus, "worker_cpus": self.cpus}, workers=[])
            job.prepared = True
        workers = [x for x in job.store.manifest().get("workers") or [] if x.get("worker") != w.index]
        job.store.update_manifest(workers=sorted(workers + [entry], key=lambda x: x["worker"]))

    def _record(self, job: Job, w: _Worker, record: dict) -> None:
        from kvflow.runtime.runner import _sigint_deferred

        pid = record["id"]
        w.outstanding.pop(pid, None)
        if pid in job.recorded:  # ran twice (re-queued after a record had left): the first one stands
            return
        with _sigint_deferred():
            job.store.append(record)
        job.recorded.add(pid)
        w.records += 1
        job.correct += bool(record["correct"])
        self.last_news = time.time()
        n, total = len(job.recorded), len(job.todo)
        if not job.quiet or job.label:
            prefix = f"{job.label}: " if job.label else ""
            self.say(f"{prefix}[{n}/{total}] {pid}: {'correct' if record['correct'] else 'wrong'}, "
                     f"{len(record['steps'])} steps, {record['output_tokens']} tokens, {record['seconds']:.1f} s "
                     f"(worker {w.index}); acc {job.correct}/{n} ({job.correct / n:.0%})")

    def _closed(self, job: Job, w: _Worker, summary: dict) -> None:
        from kvflow.runtime.runner import _merge_occupancy

        job.opened_on.discard(w.index)
        job.occupancy = _merge_occupancy(job.occupancy, summary.get("occupancy") or {})
        for label, stats in (summary.get("engine_stats") or {}).items():
            total = job.engine_stats.setdefault(label, {})
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "prefix_cache_hit_rate":
                    total[k] = total.get(k, 0) + v
        if job.prepared:
            workers = job.store.manifest().get("workers") or []
            for entry in workers:
                if entry.get("worker") == w.index:
                    entry["problems"] = entry.get("problems", 0) + w.records
                    entry["engine_stats"] = summary.get("engine_stats") or {}
            job.store.update_manifest(workers=workers)
        w.records = 0

    def _finish(self, jobs: list[Job]) -> None:
        """A job whose problems are all recorded: its workers' sessions end; once each has
        reported (or died), its occupancy goes into the manifest and its thread goes on."""
        for job in jobs:
            if job.error is not None or not job.complete:
                continue
            for w in self.workers.values():
                if w.alive and w.job == job.key and w.info is not None:
                    w.job = None
                    self._feed(w, [("end", job.key)])
            job.opened_on &= {w.index for w in self.workers.values() if w.alive}
            if job.opened_on:
                continue
            if job.prepared:
                from kvflow.runtime.runner import _merge_occupancy

                previous = job.store.manifest().get("occupancy")
                occupancy = _merge_occupancy(previous, job.occupancy or {}) if job.occupancy else previous
                job.store.update_manifest(occupancy=occupancy,
                                          **({"engine_stats": job.engine_stats} if job.engine_stats else {}))
            job.done.set()

    def _fail(self, job: Job, err: BaseException) -> None:
        job.error = err
        job.queue.clear()
        job.done.set()

    def _lost(self, w: _Worker, err: BaseException) -> None:
        """A dead worker: its unfinished problems go back to the head of their queues."""
        if not w.alive:
            return
        w.alive = False
        try:
            self.ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - dead already
            pass
        back: dict[str, list] = {}
        for pid, (key, p) in w.outstanding.items():
            back.setdefault(key, []).append(p)
        for key, problems in back.items():
            job = self._job(key)
            if job is not None and not job.error:
                job.queue.extendleft(reversed([p for p in problems if p.id not in job.recorded]))
        where = f"{w.info['host']} pid {w.info['pid']}" if w.info else "not started"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.say(f"worker {w.index} ({where}) lost: {reason}; {len(w.outstanding)} unfinished problem(s) re-queued")
        w.outstanding.clear()
        self.last_news = time.time()

    def _check_alive(self, jobs: list[Job]) -> None:
        if jobs and not any(w.alive for w in self.workers.values()) and self.started >= self.target * (1 + _REPLACEMENTS):
            raise RayWorkerError("every Ray worker died; the finished problems are recorded: rerun to resume")

    def _heartbeat(self, jobs: list[Job]) -> None:
        now = time.time()
        if now - self.last_news < _HEARTBEAT_S:
            return
        self.last_news = now
        alive = [w for w in self.workers.values() if w.alive]
        starting = sum(1 for w in alive if w.info is None)
        done = sum(len(j.recorded) for j in jobs)
        total = sum(len(j.todo) for j in jobs)
        self.say(f"[{done}/{total}] {len(alive) - starting} workers decoding {sum(len(w.outstanding) for w in alive)} "
                 f"problems" + (f", {starting} starting (waiting for Ray to place them: {self.gpus} GPU(s), "
                                f"{self.cpus} CPU(s) each)" if starting else "") + f", {now - self.t0:.0f} s")

    def close(self) -> None:
        for w in self.workers.values():
            if w.alive:
                try:
                    self.ray.kill(w.handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
                w.alive = False
        if self.owned:
            self.ray.shutdown()
            self.owned = False


def _fault() -> Optional[tuple[int, int]]:
    spec = os.environ.get("KVFLOW_RAY_FAULT", "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == "sigkill" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), max(1, int(parts[2]))
    return None


# --------------------------------------------------------------------------- entry points


def _say(message: str) -> None:
    print(f"kvflow: {message}", file=sys.stderr, flush=True)


def decoder(flag: Optional[str]):
    """The decode step of one run on Ray (`runner.run_pipeline`'s `decode`)."""

    def decode(loaded, registry, store, todo, quiet: bool) -> None:
        say = (lambda m: None) if quiet else _say
        pool = Pool([loaded], flag=flag, say=say)
        job = pool.submit(Job(loaded.hash, loaded, store, list(todo), quiet=quiet, registry=registry))
        say(f"decoding {len(todo)} problems on Ray workers ({loaded.pipeline.run.batch_problems} per decode batch "
            f"in each)")
        pool.serve(stop=lambda: job.done.is_set())
        if job.error is not None:
            raise job.error

    return decode


def run_sweep_points(points: list, total: int, *, force: bool, registry, flag: Optional[str],
                     say: Callable[[str], None]) -> dict:
    """Points of a sweep ([(number, point)]: the ones to run, numbered among `total`) on one pool
    of Ray workers: each point runs `run_pipeline` in a thread of its own (resume, metrics as a
    local run), and its decode step is a job of the pool. Returns {point index: status}; the
    first error stops them all."""
    from kvflow.runtime import runner

    pool = Pool([p.loaded for _, p in points], flag=flag, say=say)
    status: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int, point) -> None:
        path = runner.results_path(point.loaded)
        try:
            say(f"sweep [{i}/{total}] {point.label}: running -> {path}")
            rc = runner.run_pipeline(point.loaded, force=force, registry=registry, quiet=True,
                                     decode=lambda *a: pool.decode(*a, label=point.label))
            status[point.index] = "done" if not rc else f"failed (exit {rc})"
            say(f"sweep [{i}/{total}] {point.label}: {status[point.index]}")
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            status[point.index] = "failed"
            with pool.lock:
                for job in pool.jobs:
                    if not job.done.is_set():
                        pool._fail(job, RayWorkerError("stopped: another point of the sweep failed"))

    threads = [threading.Thread(target=one, args=(i, p), name=f"kvflow-sweep-{i}", daemon=True) for i, p in points]
    for t in threads:
        t.start()
    try:
        pool.serve(stop=lambda: not any(t.is_alive() for t in threads) or bool(errors))
    finally:
        with pool.lock:
            for job in pool.jobs:
                if not job.done.is_set():
                    pool._fail(job, RayWorkerError("stopped"))
        for t in threads:
            t.join(timeout=60)
    if errors:
        first = next((e for e in errors if not (isinstance(e, RayWorkerError) and str(e).startswith("stopped"))),
                     errors[0])
        raise first
    return status
