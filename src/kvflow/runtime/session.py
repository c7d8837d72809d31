"""A Session: one pipeline's engines loaded in this process, and the step scheduler over them.

Every executor that decodes in its own process holds one: the local executor
(`kvflow.runtime.local`) for a run, a Ray worker (`kvflow.runtime.ray_executor.worker`) for
each job it is given, and a server for its whole life. A session turns problems into
trajectories (the prompt rendered with the dataset's template), decodes them on the step
scheduler (`decode(source, on_done)`, problems admitted as room frees up, each handed to
`on_done` as it finishes), and turns a finished trajectory into its graded samples.jsonl
record (`record(traj)`, built by `kvflow.runtime.core.record`). It writes nothing: where
records go is its holder's business (see kvflow.runtime.core).

    with Session(loaded, registry) as session:
        store.update_manifest(**session.facts())
        session.decode((session.trajectory(p) for p in problems),
                       lambda traj: append_record(store, session.record(traj)))
        store.update_manifest(**session.summary())   # occupancy, engine counters
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Callable, Iterable, Optional

from kvflow.runtime import compile as compile_, kv_budget
from kvflow.runtime.core import record as make_record, torch_run_settings


class Session:
    """Engines of `loaded` in this process (built on entry, under the run's torch settings and
    seed; the grader's worker started), for as many `decode` calls as its holder makes."""

    def __init__(self, loaded, registry, on_load: Callable[[str], None] = lambda key: None) -> None:
        self.loaded, self.registry, self.on_load = loaded, registry, on_load
        self._stack = ExitStack()
        self.problems: dict = {}  # problem id -> problem, from `trajectory` until `record`
        self.started: dict[str, float] = {}
        self.timings: dict[str, dict] = {}  # filled by the scheduler just before on_done
        self.plan = self.engines = self.base = self.grader = self.occupancy = None

    def __enter__(self) -> "Session":
        import torch

        from kvflow.eval.grading import Grader
        from kvflow.runtime.admission import Occupancy

        pipe = self.loaded.pipeline
        self._stack.enter_context(torch_run_settings(pipe.run))
        try:
            torch.manual_seed(pipe.run.seed)
            self.plan, self.engines = compile_.build_plan(self.loaded, self.registry, on_load=self.on_load)
            self._stack.callback(compile_.close_engines, self.engines)
            self.base = self.plan.proposers[0].engine
            self.occupancy = Occupancy()
            self.grader = self._stack.enter_context(Grader(timeout=pipe.run.grade_timeout))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def facts(self) -> dict:
        """What manifest.json records of the loaded engines (threads, device, KV memory,
        settings, placement)."""
        import torch

        return {"threads": torch.get_num_threads(), **compile_.engine_facts(self.plan, self.engines)}

    def check_kv_memory(self, problems) -> None:
        """Each problem fits `run.kv_memory` by itself (its prompt rendered and tokenized), else
        a UserError naming the field: called before anything is written."""
        from kvflow.eval.prompts import render_prompt

        template = self.loaded.pipeline.dataset.prompt
        kv_budget.refuse_unfitting_prompts(self.loaded, self.plan, {
            p.id: render_prompt(template, p.question, self.base.tokenizer) for p in problems})

    def fits_alone(self, prompt: str) -> bool:
        """Whether a problem with this prompt fits `run.kv_memory` by itself (always, without it)."""
        from kvflow.runtime.admission import prompt_tokens

        budget = self.plan.kv_budget
        return budget is None or budget.problem_bytes(prompt_tokens(self.plan, prompt)) <= budget.bound

    def trajectory(self, problem, prompt: Optional[str] = None):
        """A problem as the scheduler takes it: its prompt rendered (or `prompt`, the exact text
        for the base model, as a server renders a request), its clock started (call it when the
        problem is admitted: sources are consumed lazily)."""
        from kvflow.components.base import Trajectory
        from kvflow.eval.prompts import render_prompt

        self.problems[problem.id] = problem
        self.started[problem.id] = time.time()
        if prompt is None:
            prompt = render_prompt(self.loaded.pipeline.dataset.prompt, problem.question, self.base.tokenizer)
        return Trajectory(problem.id, problem.question, prompt)

    def decode(self, source: Iterable, on_done: Callable, on_tick: Optional[Callable[[int], None]] = None,
               cancelled: Optional[Callable] = None, seed_key: Optional[Callable] = None) -> None:
        """Decode every trajectory `source` yields (None: nothing ready yet) to its end, handing
        each to `on_done` as it finishes (kvflow.runtime.scheduler.run; `cancelled` and
        `seed_key` as there: a server's cancelled requests and request seeds)."""
        from kvflow.runtime.scheduler import run

        run(self.plan, source, on_done, timings=self.timings, occupancy=self.occupancy, on_tick=on_tick,
            cancelled=cancelled, seed_key=seed_key)

    def forget(self, traj) -> None:
        """Drop what `trajectory` kept of a problem that will not be recorded (a served request
        without --record, or a cancelled one)."""
        self.problems.pop(traj.problem_id, None)
        self.started.pop(traj.problem_id, None)
        self.timings.pop(traj.problem_id, None)

    def record(self, traj) -> dict:
        """A finished trajectory's samples.jsonl record: its answer extracted and graded
        against the problem's gold answer, its wall time and its phases."""
        from kvflow.eval.answer import extract_answer

        problem = self.problems.pop(traj.problem_id)
        prediction = extract_answer(traj.text)
        correct = bool(prediction is not None and self.grader.grade(prediction, problem.gold))
        return make_record(traj, problem, prediction, correct, time.time() - self.started.pop(traj.problem_id),
                           self.plan, self.timings.pop(traj.problem_id, None))

    def engine_stats(self) -> dict:
        """Engines that count their own work (SGLang: prefix-cache hits, tokens after a stop)."""
        return {e.label: stats for e in self.plan.engines() if (stats := e.stats()) is not None}

    def summary(self) -> dict:
        """This session's decode occupancy and engine counters (and, with run.kv_memory, its
        bound and the peaks of the bytes reserved, problems and candidate rows in flight)."""
        return {"occupancy": self.occupancy.summary(), "engine_stats": self.engine_stats(),
                **({"kv_admission": dict(self.occupancy.kv)} if self.occupancy.kv else {})}
