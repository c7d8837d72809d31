"""The engine thread of `kvflow serve`: requests as problems on one Session's step scheduler.

One thread runs `session.decode(source, on_done, ...)` for the life of the server (see
kvflow.runtime.core, "how a server plugs in"). `source` hands the scheduler the requests
waiting in a bounded queue as room frees up (None while the queue is empty and problems are
in flight; it blocks while nothing is); `on_tick`, called after every decode step, streams
each newly committed step to its request; `on_done` ends the answer. Requests from every
client thus decode together, one forward per token per engine, within the pipeline's
`run.batch_problems` / `run.live_problems` bounds; past `live_problems + serve.queue`
accepted requests, `submit` refuses with 429.

A request's answer may end before its trajectory does: at a `stop` string, at its own
`max_tokens`, when its client goes away, or when the grace period of a shutdown is over. The
trajectory is then cancelled (the scheduler's `cancelled=`): on an engine that can stop
proposals mid-step (`Engine.cancel`: hf) after the current decode step, elsewhere at its next
step boundary, its rows are released in every engine and its scorer state dropped, so engines
return to idle.
While a shutdown drains, the engine thread stops at once, mid-step, when no accepted request
has an answer still going (`_Drained`, checked after every decode step): the trajectories
left (on engines without `cancel`) are not decoded to their step boundary; those answered in
full are recorded as usual.
A request's rows are seeded by its `seed` (`seed_key=`: a request with `seed: i` is seeded as
`kvflow run` seeds the problem whose id is `<dataset.name>/<i>`, the i-th line of a
`dataset.path` file without an id field), so its committed steps do not depend on what else is
served beside it, and equal that run's for the same prompt.

Faults: the scorer's batched call, when it raises, is made again problem by problem, and a
request whose own problem makes it raise fails alone (500 naming the scorer; its trajectory
is cancelled, the others go on). Any other exception out of the scheduler is blamed on the
innermost pipeline component in its traceback (an evictor, a pruner, the scorer, the committer: named as in the pipeline
file). A component's fault fails the requests in flight with a 500 naming it, the engines
are reset (`Engine.reset()`) and serving goes on. An engine's fault (or one no component can
be blamed for) marks the server dead: every request in flight and queued ends with 503,
`/health` says why, and the server stops with a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import traceback
import uuid
from collections import deque
from typing import Callable, Optional

from kvflow.serve.metrics import Metrics
from kvflow.serve.protocol import ApiError, Request, step_facts, usage


class Job:
    """One accepted request: its events go to the asyncio side through `events`."""

    def __init__(self, req: Request, prompt: str, prompt_tokens: int, aloop: asyncio.AbstractEventLoop,
                 question: str) -> None:
        self.rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.req, self.prompt, self.prompt_tokens, self.question = req, prompt, prompt_tokens, question
        self.seed_key = self.rid  # a request without a seed: its own rows (see Loop.submit)
        self.aloop = aloop
        self.events: asyncio.Queue = asyncio.Queue()
        self.traj = None
        self.emitted = 0  # committed steps sent
        self.text = ""  # text sent
        self.tokens = 0  # completion tokens sent (base tokenizer)
        self.counts = ({}, {})  # candidates, pruned at the last step sent
        self.steps: list[dict] = []  # kvflow's facts of every step sent
        self.finish_reason: Optional[str] = None  # set once the answer has ended (or failed)
        self.gone = False  # the client went away
        self.arrived = time.perf_counter()
        self.first_step: Optional[float] = None

    def push(self, event: tuple) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def dataset_questions(loaded) -> dict[str, str]:
    """question -> problem id, over the pipeline's whole dataset (from `dataset.offset`, in
    the run's order); a question asked twice keeps its first problem."""
    from kvflow.runtime.core import load_dataset

    out: dict[str, str] = {}
    for problem in load_dataset(loaded, limit=None):
        out.setdefault(problem.question, problem.id)
    return out


class Loop:
    """The engine thread over `session` (a kvflow.runtime.session.Session, entered)."""

    def __init__(self, session, metrics: Metrics, *, queue: int, record: Optional[Callable[[dict], None]] = None,
                 on_dead: Callable[[], None] = lambda: None) -> None:
        self.session, self.metrics, self.record, self.on_dead = session, metrics, record, on_dead
        plan = session.plan
        self.max_live = plan.room_in_problems()  # by count, or the most run.kv_memory can admit
        self.capacity = self.max_live + queue
        self.base = plan.proposers[0].engine
        self.tokenizers = {p.name: p.engine.tokenizer for p in plan.proposers}  # a step's tokens, by its source
        self.cv = threading.Condition()
        self.queue: deque[Job] = deque()
        self.jobs: dict[str, Job] = {}  # admitted, by request id (= problem id)
        self.calls: deque = deque()  # (fn, future): work for the engine thread between steps (`call`)
        self.queue_size = queue
        self.stopping = False
        self.deadline: Optional[float] = None
        self.dead: Optional[str] = None
        self.faults = 0
        self.names = _component_names(plan)
        plan.scorer = _GuardedScorer(plan.scorer, self._scorer_fault)  # a scorer's fault fails its request alone
        self.names[id(plan.scorer)] = ("scorer", False)
        self.thread = threading.Thread(target=self._run, name="kvflow-serve-engines", daemon=True)
        self.problem_ids = dataset_questions(session.loaded) if session.loaded.pipeline.serve.seed_by == "dataset" \
            else {}  # serve.seed_by: dataset: question -> the problem id `kvflow run` seeds it by

    # ------------------------------------------------------------------ the asyncio side

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if not self.session.fits_alone(job.prompt):  # it would never be admitted (tokenized outside the lock)
            raise ApiError(400, "this prompt's KV rows alone need more than the server's run.kv_memory",
                           code="kv_memory")
        with self.cv:
            if self.dead:
                raise ApiError(503, f"the server is stopping: {self.dead}", code="engine_dead")
            if self.stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            accepted = len(self.queue) + len(self.jobs)
            if accepted >= self.capacity:
                raise ApiError(429, f"the server is full: {accepted} requests accepted, as many as it takes "
                                    f"({self.max_live} decoding at once, run.live_problems, and {self.queue_size} "
                                    f"waiting, serve.queue); retry later", code="queue_full")
            if job.question in self.problem_ids:  # serve.seed_by: dataset, a question of the dataset
                job.seed_key = self.problem_ids[job.question]
                if job.req.seed is not None:  # its own seed is not honoured: the answer says so
                    job.req.ignored = sorted({*job.req.ignored, "seed"})
            elif job.req.seed is not None:  # seeded as `kvflow run` seeds the problem `<dataset.name>/<seed>`
                job.seed_key = f"{self.session.loaded.pipeline.dataset.name}/{job.req.seed}"
            self.queue.append(job)
            self.cv.notify_all()

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        """`fn()` run on the engine thread between two decode steps (or at once when idle), as an
        awaitable: a scoring request's forward uses the engines the scheduler uses."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if self.dead or self.stopping:
                raise ApiError(503, f"the server is stopping{': ' + self.dead if self.dead else ''}",
                               code="engine_dead" if self.dead else "shutting_down")
            self.calls.append((fn, future))
            self.cv.notify_all()
        return asyncio.wrap_future(future)

    def cancel(self, job: Job) -> None:
        """The client went away: its trajectory is cancelled (see the module docstring), or never admitted."""
        with self.cv:
            job.gone = True
            if job in self.queue:
                self.queue.remove(job)
                job.finish_reason = job.finish_reason or "cancelled"

    def drain(self, grace: float) -> None:
        """Stop accepting; what was accepted finishes within `grace` seconds, the rest is cancelled."""
        with self.cv:
            self.stopping = True
            deadline = time.monotonic() + grace
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            self.cv.notify_all()

    def join(self, timeout: Optional[float] = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def gauges(self) -> dict:
        with self.cv:
            in_flight, queued = len(self.jobs), len(self.queue)
        occ = self.session.occupancy.summary() if self.session.occupancy is not None else {}
        return {"in_flight": in_flight, "queued": queued, "dead": self.dead,
                "rows": {e.label or "engine": e.busy_rows() for e in self.session.plan.engines()},
                "occupancy": {k: v["occupancy"] for k, v in occ.items()}}

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        from kvflow.runtime.core import torch_run_settings

        # torch's thread settings (run.threads: OpenMP's are per thread) in this thread too
        with torch_run_settings(self.session.loaded.pipeline.run):
            self._serve()

    def _serve(self) -> None:
        while True:
            try:
                self.session.decode(self._source(), self._on_done, on_tick=self._on_tick,
                                    cancelled=self._cancelled, seed_key=self._seed_key)
                self._run_calls(refuse="the server shut down")
                return  # the source ended: a drained shutdown
            except _Drained:  # mid-step: every answer has ended, nothing more to decode
                for job in list(self.jobs.values()):
                    job.traj.finish = job.traj.finish or "cancelled"
                    self._on_done(job.traj)
                self._run_calls(refuse="the server shut down")
                return
            except BaseException as exc:  # noqa: BLE001 - every fault is answered, see the module docstring
                who, engine = self._blame(exc)
                message = f"{who} failed: {type(exc).__name__}: {exc}"
                if engine or not self._recover():
                    self._die(message, exc)
                    return
                self.faults += 1
                for job in list(self.jobs.values()):
                    self._fail(job, 500, message, "component_error")
                    self.session.forget(job.traj)
                self.jobs.clear()

    def _source(self):
        from kvflow.eval.datasets import Problem

        while True:
            with self.cv:
                while not self.queue:
                    self._check_deadline()
                    if self.stopping and not self.jobs:
                        return
                    if self.jobs or self.calls:
                        break
                    self.cv.wait(0.25)
                job = self.queue.popleft() if self.queue else None
                if job is not None:
                    self.jobs[job.rid] = job
            self._run_calls()
            if job is None:
                yield None
                continue
            job.traj = self.session.trajectory(Problem(job.rid, job.question, None), prompt=job.prompt)
            yield job.traj

    def _cancelled(self, traj) -> bool:
        job = self.jobs.get(traj.problem_id)
        return job is None or job.gone or job.finish_reason is not None

    def _seed_key(self, traj) -> str:
        job = self.jobs.get(traj.problem_id)
        return job.seed_key if job is not None else traj.problem_id

    def _on_tick(self, live: int) -> None:
        with self.cv:
            self._check_deadline()
            jobs = list(self.jobs.values())
        for job in jobs:
            self._emit(job)
        self._run_calls()
        with self.cv:
            if self.stopping and not self.queue and all(j.finish_reason is not None or j.gone
                                                        for j in self.jobs.values()):
                raise _Drained  # a shutdown with no answer left to give: stop decoding now

    def _run_calls(self, refuse: Optional[str] = None) -> None:
        """Run (or, with `refuse`, fail) the work `call` queued for this thread."""
        while True:
            with self.cv:
                if not self.calls:
                    return
                fn, future = self.calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if refuse is not None:
                future.set_exception(ApiError(503, refuse, code="shutting_down"))
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller's request fails, serving goes on
                future.set_exception(exc)

    def _on_done(self, traj) -> None:
        with self.cv:
            job = self.jobs.pop(traj.problem_id)
            self.cv.notify_all()
        self._emit(job)
        if job.finish_reason is None:
            self._end(job, "length" if traj.finish in ("cap_steps", "cap_tokens") else "stop")
        if job.finish_reason in ("stop", "length") and traj.finish in (None, "cancelled"):
            traj.finish = "stop_sequence" if job.finish_reason == "stop" else "max_tokens"
        self.metrics.finished(traj.tokens_generated, traj.pruned, cancelled=job.gone)
        if self.record is not None and job.finish_reason in ("stop", "length"):  # answered in full
            record = self.session.record(traj)
            record["request_id"] = job.rid
            record["served"] = {"endpoint": job.req.kind, "seed": job.req.seed, "max_tokens": job.req.max_tokens,
                                "stop": job.req.stop, "finish_reason": job.finish_reason,
                                "completion_tokens": job.tokens, "prompt_tokens": job.prompt_tokens}
            try:
                self.record(record)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop serving; it is said
                print(f"kvflow serve: could not record {job.rid}: {exc}", flush=True)
        else:
            self.session.forget(traj)

    def _emit(self, job: Job) -> None:
        """Send the steps committed since the last call, cut at a stop string or max_tokens."""
        traj = job.traj
        while job.emitted < len(traj.steps) and job.finish_reason is None and not job.gone:
            step = traj.steps[job.emitted]
            text, n_tokens, finish = step.text, step.n_tokens, None
            cut = _stop_at(job.text, text, job.req.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                n_tokens = len(self.base.encode(text)) if text else 0
            room = job.req.max_tokens - job.tokens
            if n_tokens >= room:
                if n_tokens > room:
                    text = self.base.tokenizer.decode(self.base.encode(text)[:room])
                n_tokens, finish = room, finish or "length"
            tokens = self._step_logprobs(step, text) if job.req.token_logprobs else []
            facts = step_facts(job.emitted, step, traj)
            facts["candidates"] = _delta(traj.candidates, job.counts[0])
            facts["pruned"] = _delta(traj.pruned, job.counts[1])
            job.counts = (dict(traj.candidates), dict(traj.pruned))
            job.emitted += 1
            job.text += text
            job.tokens += n_tokens
            job.steps.append(facts)
            if job.first_step is None:
                job.first_step = time.perf_counter() - job.arrived
            self.metrics.step(step.source, n_tokens)
            job.push(("step", text, facts, tokens))
            if finish:
                self._end(job, finish)

    def _step_logprobs(self, step, sent: str) -> list[tuple[str, float]]:
        """(text, log-probability) of the committed step's tokens whose text was sent: all of
        them, or, where a stop string or max_tokens cut the step to `sent`, the longest prefix
        of its tokens that decodes within it."""
        tok = self.tokenizers[step.source]
        ids = step.token_ids
        keep = len(ids)
        if len(sent) < len(step.text):
            keep = 0
            while keep < len(ids) and len(tok.decode(ids[:keep + 1])) <= len(sent):
                keep += 1
        return [(tok.decode([i]), float(v)) for i, v in zip(ids[:keep], step.logprobs[:keep])]

    def _end(self, job: Job, reason: str) -> None:
        job.finish_reason = reason
        job.push(("end", reason, usage(job.prompt_tokens, job.tokens, job.traj)))
        self.metrics.observe(job.first_step, time.perf_counter() - job.arrived)

    def _fail(self, job: Job, status: int, message: str, code: str) -> None:
        if job.finish_reason is None:
            job.finish_reason = "error"
            job.push(("error", status, message, code))

    def _scorer_fault(self, problem_id: str, exc: BaseException) -> None:
        job = self.jobs.get(problem_id)
        if job is not None:
            self._fail(job, 500, f"scorer failed: {type(exc).__name__}: {exc}", "component_error")

    def _check_deadline(self) -> None:
        """(cv held) Past a shutdown's grace period: every request still going ends with 503."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return
        for job in list(self.queue) + list(self.jobs.values()):
            self._fail(job, 503, "the server shut down before this request finished (grace period over)",
                       "shutting_down")
        self.queue.clear()

    def _recover(self) -> bool:
        """After a component's fault: every engine back to idle (False: one cannot be)."""
        try:
            for engine in self.session.plan.engines():
                engine.reset()  # NotImplementedError where an engine cannot: not recoverable
            self.session.plan.scorer.release(list(self.jobs))
            return all(e.busy_rows() == 0 for e in self.session.plan.engines())
        except Exception:  # noqa: BLE001 - cannot recover: the caller stops the server
            return False

    def _die(self, message: str, exc: BaseException) -> None:
        self._run_calls(refuse=f"the server is stopping: {message}")
        with self.cv:
            self.dead = message
            for job in list(self.queue) + list(self.jobs.values()):
                self._fail(job, 503, f"the server is stopping: {message}", "engine_dead")
            self.queue.clear()
            self.jobs.clear()
            self.cv.notify_all()
        print(f"kvflow serve: {message}; stopping\n" + "".join(traceback.format_exception(exc)), flush=True)
        self.on_dead()

    def _blame(self, exc: BaseException) -> tuple[str, bool]:
        """(what failed, whether it is an engine): the innermost frame whose `self` is a
        component or an engine of the plan."""
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self.names:
                return self.names[id(owner)]
        return "the step scheduler", True


class _Drained(Exception):
    """Out of the scheduler, from `_on_tick`: a draining server has no answer left to give, so
    the trajectories still decoding (answers ended at a stop string or max_tokens, cancelled,
    or failed at the grace period's end) are not decoded to their step boundary."""


class _GuardedScorer:
    """The plan's scorer, whose batched `score` (requests of several problems) that raises is
    called again problem by problem: a problem whose own call raises is reported to `on_fault`
    (its request fails with a 500, its trajectory is cancelled at the step boundary) and its
    candidates get NaN (no score); the other problems' scores stand."""

    def __init__(self, inner, on_fault: Callable[[str, BaseException], None]) -> None:
        self.inner, self.on_fault = inner, on_fault

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def score(self, requests):
        try:
            return self.inner.score(requests)
        except Exception:  # noqa: BLE001 - found out below, problem by problem
            pass
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.trajectory.problem_id, []).append(i)
        out = [float("nan")] * len(requests)
        for pid, idx in groups.items():
            try:
                for i, v in zip(idx, self.inner.score([requests[i] for i in idx])):
                    out[i] = v
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self.on_fault(pid, exc)
        return out


def logprobs_problem(plan) -> Optional[str]:
    """Why this pipeline's answers cannot carry their tokens' log-probabilities, or None. Every
    committed step keeps its candidate's tokens and their log-probabilities (kvflow.components.
    records.Step), in its proposer's tokenizer: the answer is one sequence of tokens only where
    every proposer tokenizes as the base model does."""
    base = plan.proposers[0]
    vocab = base.engine.tokenizer.get_vocab()
    for p in plan.proposers[1:]:
        if p.engine.tokenizer.get_vocab() != vocab:
            return (f"proposer `{p.name}`'s model has another tokenizer than the base model's "
                    f"(proposer `{base.name}`): a step it commits is not in the base model's tokens")
    return None


def _component_names(plan) -> dict[int, tuple[str, bool]]:
    names: dict[int, tuple[str, bool]] = {}
    for e in plan.engines():
        names[id(e)] = (f"engine {e.label or e.backend}", True)
    for p in plan.proposers:
        names.setdefault(id(p.evictor), (f"proposers.{p.name}.evictor", False))
        for pname, pruner in p.spec.pruners:
            names.setdefault(id(pruner), (f"pruner {pname} (proposers.{p.name}.pruners)", False))
    names[id(plan.scorer)] = ("scorer", False)
    names[id(plan.committer)] = ("committer", False)
    return names


def _stop_at(sent: str, text: str, stops: list[str]) -> Optional[int]:
    """Where in `text` (following `sent`) the first stop string starts, or None."""
    if not stops:
        return None
    keep = max(len(s) for s in stops) - 1
    head = sent[-keep:] if keep else ""
    hits = [i for i in (((head + text).find(s)) for s in stops) if i >= 0]
    if not hits:
        return None
    return max(0, min(hits) - len(head))


def _delta(now: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in now.items()}
