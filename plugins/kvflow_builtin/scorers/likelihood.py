"""`likelihood`: mean token log-probability of a candidate step.

With `model` set, the candidate is scored under that model with the full context (prompt
and every committed step), through a full-KV scoring session; without it, the candidate's
own sampling log-probabilities are used (free, but the proposer's partial view of the
context is then part of the score). A cheap, label-free signal; beware that a model rates
its own samples highly, so score with a model that proposes both kinds of candidates or none.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from kvflow_builtin.scorers._steps import StepScorer, StepScorerParams


class LikelihoodParams(StepScorerParams):
    model: Optional[str] = Field(None, description="Key of `models` to score with (full context); None = own logprobs.")


class LikelihoodScorer(StepScorer):
    """Mean token log-probability of the step, under `model` with full context."""

    Params = LikelihoodParams

    @classmethod
    def models_needed(cls, params):
        return [params.model] if params.model else []

    def __init__(self, params, context):
        super().__init__(params, context)
        self._session = context.load_session(params.model) if params.model else None

    def score(self, requests):
        if not requests:
            return []
        if self._session is None:
            lps = [r.candidate.logprobs for r in requests]
        else:
            lps = self._session.token_logprobs([r.trajectory for r in requests], [r.candidate.text for r in requests])
        return [sum(x) / len(x) if x else float("-inf") for x in lps]

    def release(self, problem_ids):
        if self._session is not None:
            self._session.release(problem_ids)
