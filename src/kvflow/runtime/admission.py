"""Admission: which problems of the source go in flight next, by count (`Plan.max_live`) and,
with `run.kv_memory` (`Plan.kv_budget`), by the KV bytes their rows can grow to; and the
occupancy the scheduler reports (rows per forward against the plan's bound, KV peaks).
The scheduler (`scheduler.py`) owns the loop; this module its admission bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from kvflow.components.base import Trajectory
from kvflow.components.engine import Proposal, ProposeRequest
from kvflow.kv_memory import human_bytes

from kvflow.runtime.plan import Plan


@dataclass
class Occupancy:
    """Decode rows per forward, per engine, against the plan's bound (filled by `run`)."""

    forwards: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    bound: dict[str, int] = field(default_factory=dict)
    overlapped: dict[str, int] = field(default_factory=dict)  # steps run while another engine ran too
    # run.kv_memory: the bound, and the peaks of the bytes reserved, problems and candidate rows in flight
    kv: dict[str, int] = field(default_factory=dict)

    def admitted(self, reserved: int, problems: int, rows: int) -> None:
        kv = self.kv
        kv["peak_bytes"] = max(kv.get("peak_bytes", 0), reserved)
        kv["peak_problems"] = max(kv.get("peak_problems", 0), problems)
        kv["peak_rows"] = max(kv.get("peak_rows", 0), rows)

    def summary(self) -> dict:
        return {name: {"forwards": f, "mean_rows": round(self.rows[name] / f, 3) if f else 0.0,
                       "bound": self.bound[name],
                       "occupancy": round(self.rows[name] / f / self.bound[name], 4) if f else 0.0,
                       **({"overlapped_steps": self.overlapped[name]} if self.overlapped.get(name) else {})}
                for name, f in self.forwards.items()}


class Problem:
    """A problem in flight: its trajectory, states, proposals and the KV bytes it reserves."""

    def __init__(self, traj: Trajectory, clock, kv_bytes: int = 0) -> None:
        self.traj = traj
        self.kv_bytes = kv_bytes  # what it reserves of run.kv_memory while in flight
        self.states: dict[str, object] = {}
        self.proposals: dict[str, Proposal] = {}
        self.requests: dict[str, ProposeRequest] = {}  # proposals decoding, by proposer (for `cancel`)
        self.waiting: set[str] = set()
        self.admit(clock)

    def admit(self, clock) -> None:
        self.admitted = time.perf_counter()
        self.phases_at_admission = clock.snapshot()


class ProblemTooLarge(ValueError):
    """A problem whose rows alone need more than run.kv_memory (refused before the run starts
    by `kvflow.runtime.kv_budget.refuse_unfitting_prompts`; this is the scheduler's backstop)."""


class Admission:
    """Which problems of the source go in flight next: by count (`Plan.max_live`) and, with
    `Plan.kv_budget`, by the KV bytes their rows reserve. A problem taken from the source that
    does not fit yet is held (sources are consumed lazily and cannot take one back) and
    admitted first once enough problems have ended."""

    def __init__(self, plan: Plan, source, clock, occupancy: Occupancy, cancelled) -> None:
        self.plan, self.source, self.clock, self.occupancy = plan, source, clock, occupancy
        self.cancelled = cancelled
        self.max_live = plan.max_live()
        self.held: Optional[Problem] = None
        self.exhausted = False
        self.reserved = 0  # bytes of run.kv_memory reserved by the problems in flight

    def next(self, live: list) -> tuple[list, list]:
        """(problems to start now, problems cancelled before they started)."""
        admitted, dropped = [], []
        while self.max_live is None or len(live) + len(admitted) < self.max_live:
            if self.held is None:
                if self.exhausted:
                    break
                traj = next(self.source, _END)
                if traj is _END:
                    self.exhausted = True
                    break
                if traj is None:  # nothing ready yet: decode on, ask again after the next step
                    break
                self.held = Problem(traj, self.clock, self._bytes(traj))
            p = self.held
            if self.cancelled is not None and self.cancelled(p.traj):  # gone while it waited for room
                self.held = None
                dropped.append(p)
                continue
            if self.plan.kv_budget is not None and self.reserved + p.kv_bytes > self.plan.kv_budget.bound:
                if not live and not admitted:
                    raise ProblemTooLarge(f"problem {p.traj.problem_id} needs {p.kv_bytes} bytes of KV alone, more "
                                          f"than run.kv_memory {self.plan.kv_budget.bound}")
                break
            self.held = None
            p.admit(self.clock)
            self.reserved += p.kv_bytes
            admitted.append(p)
        if admitted and self.plan.kv_budget is not None:
            problems = len(live) + len(admitted)
            self.occupancy.admitted(self.reserved, problems,
                                    problems * sum(p.spec.n for p in self.plan.proposers))
        return admitted, dropped

    def ended(self, problems) -> None:
        for p in problems:
            self.reserved -= p.kv_bytes

    @property
    def done(self) -> bool:
        return self.exhausted and self.held is None

    def _bytes(self, traj: Trajectory) -> int:
        budget = self.plan.kv_budget
        return 0 if budget is None else budget.problem_bytes(prompt_tokens(self.plan, traj.prompt))


_END = object()


def prompt_tokens(plan: Plan, prompt: str) -> dict[str, int]:
    """A prompt's length in each proposer's tokens (what its full-context rows start from)."""
    lengths: dict[int, int] = {}
    out = {}
    for p in plan.proposers:
        if id(p.engine) not in lengths:
            lengths[id(p.engine)] = len(p.engine.encode(prompt))
        out[p.name] = lengths[id(p.engine)]
    return out


def describe_admission(plan: Plan) -> str:
    """How problems are admitted, in words (the run's first progress line)."""
    count = plan.max_live()
    if plan.kv_budget is None:
        return f"{plan.batch_problems} per decode batch, {count} in flight"
    text = f"in flight while their KV fits run.kv_memory {human_bytes(plan.kv_budget.bound)}"
    if plan.batch_problems is not None:
        text += f", {plan.batch_problems} per decode batch"
    return text + (f", at most {count}" if count is not None else "")
