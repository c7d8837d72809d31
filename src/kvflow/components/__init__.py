"""Component protocols: the interfaces built-in and third-party evictors, pruners, scorers and
committers implement. Implementations live in plugins (see `kvflow_builtin`)."""

from kvflow.components.base import (
    Candidate,
    Committer,
    CommitterParams,
    Evictor,
    EvictorParams,
    Params,
    Pruner,
    PrunerParams,
    Scorer,
    ScorerContext,
    ScorerParams,
    ScoreRequest,
    Step,
    StepTrace,
    Trajectory,
)

__all__ = [
    "Candidate", "Committer", "CommitterParams", "Evictor", "EvictorParams", "Params", "Pruner",
    "PrunerParams", "Scorer", "ScorerContext", "ScorerParams", "ScoreRequest", "Step", "StepTrace",
    "Trajectory",
]
