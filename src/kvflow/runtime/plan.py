"""What the scheduler runs (`Plan`): the compiled proposers over their engines, the scorer, the
committer, the limits and the admission bounds; built by `kvflow.runtime.compile`, run by
`kvflow.runtime.scheduler.run`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvflow.components.base import Committer, Evictor, Scorer
from kvflow.components.engine import Engine, SamplingSpec
from kvflow.config.schema import LimitsConfig
from kvflow.kv_memory import KVBudget


@dataclass
class Proposer:
    """A compiled proposer: the engine of its model, its evictor, and how it samples."""

    name: str
    engine: Engine
    evictor: Evictor
    spec: SamplingSpec


@dataclass
class Plan:
    """Everything the scheduler needs, built by `kvflow.runtime.compile`."""

    proposers: list[Proposer]
    scorer: Scorer
    committer: Committer
    limits: LimitsConfig
    seed: int
    batch_problems: Optional[int] = 16  # decode room per engine, in problems (None: memory decides, kv_budget)
    live_problems: Optional[int] = None  # problems in flight; None = 2 x batch_problems (no bound: kv_budget)
    record_candidates: bool = False  # keep every candidate of every step on the trajectory (run.record_candidates)
    placement: Optional[object] = None  # kvflow.planning.placement.Placement of the models on GPUs (None: no GPU)
    overlap: str = "auto"  # run.overlap_engines: auto | on | off (kvflow.runtime.scheduler's docstring)
    kv_budget: Optional[KVBudget] = None  # run.kv_memory: admission by KV bytes (kvflow.runtime.scheduler's docstring)

    def engines(self) -> list[Engine]:
        return list({id(p.engine): p.engine for p in self.proposers}.values())

    def max_live(self) -> Optional[int]:
        """Most problems in flight by count (None: only `kv_budget` bounds them)."""
        if self.live_problems is not None:
            return self.live_problems
        if self.batch_problems is None:
            return None
        return 2 * self.batch_problems

    def room_in_problems(self) -> int:
        """Problems in flight at most: the count bound, or (memory alone) how many problems
        with an empty prompt `kv_budget` holds, the most it can ever admit."""
        count = self.max_live()
        if self.kv_budget is None:
            return count
        memory = max(1, self.kv_budget.problems_that_fit())
        return memory if count is None else min(count, memory)

    def row_bound(self, engine: Engine) -> Optional[int]:
        """Most candidate rows `engine` decodes per forward (None: as many as are admitted)."""
        if self.batch_problems is None:
            return None
        return self.batch_problems * sum(p.spec.n for p in self.proposers if p.engine is engine)

    def rows_per_problem(self, engine: Engine) -> int:
        return sum(p.spec.n for p in self.proposers if p.engine is engine)
