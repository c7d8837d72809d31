"""Full-context scoring on the `hf` backend: per-token log-probabilities of candidate steps
given the problem's committed trajectory.

A `ScoringSession` keeps one full-KV cache row per problem, holding the prompt and every
committed step (synced lazily from the trajectory text), so a round of scoring only runs
the candidates' own tokens. Used by the `likelihood` scorer; judge and PRM scorers build on
the same session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.base import Evictor, Trajectory

_POSITIONS_PER_CHUNK = 128  # bounds the [positions, vocab] logits held at once


@dataclass
class _ProblemState:
    cache: BudgetedCache  # one row: prompt + committed steps, last token pending
    pending: int
    n_steps: int


class ScoringSession:
    def __init__(self, runner: HFRunner, full_kv: Evictor) -> None:
        self.runner = runner
        self.full_kv = full_kv
        self._states: dict[str, _ProblemState] = {}

    def _sync(self, traj: Trajectory) -> _ProblemState:
        st = self._states.get(traj.problem_id)
        if st is None:
            cache = self.runner.new_cache(self.full_kv, 1)
            pending = int(self.runner.prefill(cache, [self.runner.encode(traj.prompt)])[0])
            st = self._states[traj.problem_id] = _ProblemState(cache, pending, 0)
        if st.n_steps < len(traj.steps):
            ids = self.runner.encode("".join(s.text for s in traj.steps[st.n_steps:]))
            if ids:
                self.runner.ingest(st.cache, [[st.pending] + ids[:-1]])
                st.pending = ids[-1]
            st.n_steps = len(traj.steps)
        return st

    @torch.inference_mode()
    def token_logprobs(self, trajectories: Sequence[Trajectory], texts: Sequence[str]) -> list[list[float]]:
        """log p(token | trajectory, earlier tokens of the text) for every token of each text."""
        states = [self._sync(t) for t in trajectories]
        ids = [self.runner.encode(x) for x in texts]
        batch = BudgetedCache.cat([s.cache.select([0]) for s in states])
        hidden = self.runner.forward(batch, [[s.pending] + x[:-1] for s, x in zip(states, ids)], logits="hidden")
        out = []
        for r, x in enumerate(ids):
            lps = []
            for start in range(0, len(x), _POSITIONS_PER_CHUNK):
                h = hidden[r, start : start + _POSITIONS_PER_CHUNK][: len(x) - start]
                logp = torch.log_softmax(self.runner.lm_head(h).float(), dim=-1)
                target = torch.as_tensor(x[start : start + len(h)], device=logp.device)
                lps.extend(logp.gather(-1, target[:, None]).squeeze(-1).tolist())
            out.append(lps)
        return out

    def release(self, problem_ids: Sequence[str]) -> None:
        for pid in problem_ids:
            self._states.pop(pid, None)
