"""Helpers shared by the step-level scorers (`prm`, `llm_judge`, ...).

- `StepScorerParams` / `StepScorer`: the `proposers` parameter and `can_score()`: a scorer
  scores only the candidates of the proposers it lists (default: every proposer); the
  others keep no score and rank below every scored candidate in the committers.
- `steps_for()`: the trajectory's committed steps plus the candidate, normalised before a
  scorer tags them: surrounding whitespace and trailing delimiters are stripped, and steps
  that are then empty are dropped (a known bug elsewhere scores an empty last step).
- `aggregate()`: last | min | prod | mean over a trajectory's step scores.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pydantic import Field

from kvflow.components.base import Candidate, Scorer, ScorerParams, Trajectory
from kvflow.errors import UserError


class StepScorerParams(ScorerParams):
    proposers: Optional[list[str]] = Field(
        None, description="Proposers whose candidates this scorer scores (default: all); the rest stay unscored.")


class StepScorer(Scorer):
    """A scorer with the `proposers` filter (checked against the pipeline's proposers)."""

    Params = StepScorerParams

    def __init__(self, params, context) -> None:
        super().__init__(params, context)
        wanted = getattr(params, "proposers", None) or []
        unknown = [p for p in wanted if p not in context.proposers]
        if unknown:
            raise UserError(f"scorer.proposers: unknown proposer(s) {unknown}",
                            hint=f"proposers of this pipeline: {', '.join(context.proposers)}")

    def can_score(self, proposer: str) -> bool:
        wanted = getattr(self.params, "proposers", None)
        return wanted is None or proposer in wanted


def normalise_step(text: str, delimiter: str = "\n\n") -> str:
    """`text` without surrounding whitespace and trailing delimiters ("" if nothing is left)."""
    text = text.strip()
    while delimiter and delimiter.strip() and text.endswith(delimiter.strip()):
        text = text[: -len(delimiter.strip())].rstrip()
    return text


def steps_for(traj: Trajectory, candidate: Optional[Candidate], delimiter: str = "\n\n") -> tuple[list[str], bool]:
    """(normalised non-empty steps of the trajectory followed by the candidate, whether the
    candidate itself is among them, i.e. was not empty)."""
    steps = [s for s in (normalise_step(x.text, delimiter) for x in traj.steps) if s]
    new = normalise_step(candidate.text, delimiter) if candidate is not None else ""
    if new:
        steps.append(new)
    return steps, bool(new)


def aggregate(scores: Sequence[float], how: str) -> float:
    """Combine per-step scores: the last, the minimum, the product or the mean (nan if none)."""
    if not scores:
        return math.nan
    if how == "last":
        return float(scores[-1])
    if how == "min":
        return float(min(scores))
    if how == "prod":
        return float(math.prod(scores))
    if how == "mean":
        return float(sum(scores) / len(scores))
    raise ValueError(f"unknown aggregate {how!r}")
