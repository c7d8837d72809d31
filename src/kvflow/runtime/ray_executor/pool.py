"""The driver's pool of Ray workers: the jobs submitted to it (one run, or the points of a
sweep), each worker's scheduler kept fed with up to `live_problems` (+ a few ahead) of one
job, records appended to each job's results directory as they arrive, dead workers replaced
and their problems re-queued (the package's docstring says how). The driver writes every
file of a results directory itself, through the run core (kvflow.runtime.core).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvflow.errors import UserError
from kvflow.runtime.core import append_record, manifest, merge_occupancy
from kvflow.runtime.ray_executor.cluster import RayWorkerError, connect, worker_count, worker_gpus
from kvflow.runtime.ray_executor.worker import KvflowWorker

_HEARTBEAT_S = 10.0
_REPLACEMENTS = 2  # new workers a run may start for dead ones, per worker asked for
_PREFETCH_MIN = 2  # problems a worker holds beyond its scheduler's room, so it never waits for the driver


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
    progress: Any = None  # a kvflow.runtime.progress.Progress over its problems (a single run's)

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
        """A decode step (kvflow.runtime.core.Decode) for a sweep point (from its own thread): the
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
            self.fail(job, err)

    def _opened(self, job: Job, w: _Worker, info: dict) -> None:
        entry = {**(w.info or {}), "device": info["device"], "placement": info["placement"]}
        if not job.prepared:  # the results directory is created only once a worker has loaded the models
            import ray

            job.store.prepare(job.loaded.resolved, manifest(job.loaded, job.registry))
            job.store.update_manifest(
                device=info["device"], threads=info["threads"], kv_memory=info["kv_memory"], engines=info["engines"],
                engine_settings=info["engine_settings"], placement=info["placement"],
                executor={"kind": "ray", "ray": ray.__version__, "address": self.address,
                          "worker_gpus": self.gpus, "worker_cpus": self.cpus}, workers=[])
            job.prepared = True
        workers = [x for x in job.store.manifest().get("workers") or [] if x.get("worker") != w.index]
        job.store.update_manifest(workers=sorted(workers + [entry], key=lambda x: x["worker"]))

    def _record(self, job: Job, w: _Worker, record: dict) -> None:
        pid = record["id"]
        w.outstanding.pop(pid, None)
        if pid in job.recorded:  # ran twice (re-queued after a record had left): the first one stands
            return
        append_record(job.store, record)
        job.recorded.add(pid)
        w.records += 1
        job.correct += bool(record["correct"])
        self.last_news = time.time()
        n, total = len(job.recorded), len(job.todo)
        if job.progress is not None:
            job.progress.record(record)
            if job.progress.live:
                return  # the bar shows it
        if not job.quiet or job.label:
            prefix = f"{job.label}: " if job.label else ""
            figures = job.progress.tally.status() if job.progress is not None else \
                f"acc {job.correct}/{n} ({job.correct / n:.0%})"
            self.say(f"{prefix}[{n}/{total}] {pid}: {'correct' if record['correct'] else 'wrong'}, "
                     f"{len(record['steps'])} steps, {record['output_tokens']} tokens, {record['seconds']:.1f} s "
                     f"(worker {w.index}); {figures}")

    def _closed(self, job: Job, w: _Worker, summary: dict) -> None:
        job.opened_on.discard(w.index)
        job.occupancy = merge_occupancy(job.occupancy, summary.get("occupancy") or {})
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
                previous = job.store.manifest().get("occupancy")
                occupancy = merge_occupancy(previous, job.occupancy or {}) if job.occupancy else previous
                job.store.update_manifest(occupancy=occupancy,
                                          **({"engine_stats": job.engine_stats} if job.engine_stats else {}))
            job.done.set()

    def fail(self, job: Job, err: BaseException) -> None:
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
