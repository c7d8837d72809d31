"""The contract suites of `kvflow.testing` fail on components with the bugs they are meant to
catch (a suite that passes everything would protect nobody)."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ConfigDict, Field

from kvflow.components.base import (
    Committer, CommitterParams, Pruner, PrunerParams, Scorer, ScorerContext, ScorerParams,
)
from kvflow.testing.committer_contract import CommitterContract
from kvflow.testing.pruner_contract import PrunerContract
from kvflow.testing.scorer_contract import ScorerContract


class LengthParams(PrunerParams):
    threshold: float = Field(60, description="Tokens after which a candidate is stopped.")
    min_tokens: int = Field(0, description="No check before this many tokens.")


class LengthPruner(Pruner):
    """Stops every candidate longer than `threshold` tokens."""

    Params = LengthParams

    def check(self, trace):
        return trace.n_tokens > self.params.threshold


class CountingPruner(LengthPruner):
    """Stops a row once it has been checked `threshold` times: state kept across calls."""

    def __init__(self, params):
        super().__init__(params)
        self.calls = 0

    def check(self, trace):
        self.calls += 1
        return torch.full((len(trace.texts),), self.calls > 3)


class BatchSizePruner(LengthPruner):
    """Stops every row of a batch of three or more: verdicts depend on the batch."""

    def check(self, trace):
        return torch.full((len(trace.texts),), len(trace.texts) >= 3)


class ListPruner(LengthPruner):
    """Returns a list instead of a tensor."""

    def check(self, trace):
        return [False] * len(trace.texts)


def pruner_suite():
    return PrunerContract()


@pytest.mark.parametrize("cls,test,message", [
    (CountingPruner, "test_no_hidden_history", "twice|fresh pruner"),
    (BatchSizePruner, "test_rows_are_independent", "depends on the batch"),
    (ListPruner, "test_check_returns_one_bool_per_row", "bool tensor"),
    (LengthPruner, "test_healthy_candidates_are_never_stopped", "stopped a coherent candidate"),
])
def test_pruner_contract_catches(cls, test, message):
    factory = lambda **params: cls(cls.Params(**params))  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(pruner_suite(), test)(factory)


def test_pruner_contract_catches_flags_before_min_tokens():
    factory = lambda **params: LengthPruner(LengthPruner.Params(threshold=5, min_tokens=20, **params))  # noqa: E731
    with pytest.raises(AssertionError, match="before min_tokens"):
        pruner_suite().test_min_tokens_is_respected(factory)


class MutableParams(PrunerParams):
    model_config = ConfigDict(frozen=False, extra="forbid")
    threshold: float = Field(1.0, description="Unused.")


class MutablePruner(LengthPruner):
    """A pruner whose Params can be changed in place."""

    Params = MutableParams


class UndocumentedPruner(LengthPruner):
    pass


def test_component_contract_catches_mutable_params_and_missing_docstrings():
    suite = pruner_suite()
    with pytest.raises(BaseException, match="DID NOT RAISE"):
        suite.test_params_model_is_frozen_and_strict(MutablePruner(MutableParams()))
    with pytest.raises(AssertionError, match="no description"):
        suite.test_every_parameter_is_described(LengthPruner(PrunerParams(threshold=1)))
    with pytest.raises(AssertionError, match="no docstring of its own"):
        suite.test_documented(UndocumentedPruner(LengthParams()))


# --------------------------------------------------------------------------- committers


class OutOfRangeCommitter(Committer):
    """Returns one past the last candidate."""

    def pick(self, candidates):
        return len(candidates)


class CoinCommitter(Committer):
    """Picks at random (unseeded)."""

    def pick(self, candidates):
        return random.randrange(len(candidates))


class LowestCommitter(Committer):
    """Picks the lowest score (not monotone)."""

    def pick(self, candidates):
        scores = [c.score if c.score is not None and c.score == c.score else 0.0 for c in candidates]
        return min(range(len(candidates)), key=scores.__getitem__)


@pytest.mark.parametrize("cls,test,message", [
    (OutOfRangeCommitter, "test_pick_returns_an_index", "for .* candidates"),
    (CoinCommitter, "test_deterministic_and_pure", "different winners|picked differently"),
    (LowestCommitter, "test_raising_the_winners_score_keeps_it", "lost after its score was raised"),
])
def test_committer_contract_catches(cls, test, message):
    factory = lambda proposers, **params: cls(CommitterParams(**params), proposers)  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(CommitterContract(), test)(factory)


# --------------------------------------------------------------------------- scorers


class BatchScorer(Scorer):
    """Scores a candidate by its length, divided by the number of requests in the batch."""

    Params = ScorerParams

    def score(self, requests):
        return [len(r.candidate.text) / len(requests) for r in requests]


class ShortScorer(BatchScorer):
    """Forgets the last request."""

    def score(self, requests):
        return [float(len(r.candidate.text)) for r in requests][:-1]


class MutatingScorer(BatchScorer):
    """Writes its score into the candidate."""

    def score(self, requests):
        for r in requests:
            r.candidate.score = 1.0
        return [1.0] * len(requests)


@pytest.mark.parametrize("cls,test,message", [
    (BatchScorer, "test_batch_and_order_do_not_matter", "alone vs in a batch"),
    (ShortScorer, "test_one_float_per_request", "5 scores for 6 requests"),
    (MutatingScorer, "test_requests_are_not_changed", "changed its requests"),
])
def test_scorer_contract_catches(cls, test, message):
    factory = lambda context, **params: cls(ScorerParams(**params), context)  # noqa: E731
    context = lambda: ScorerContext(load_session=None, proposers=["base", "helper"], seed=0)  # noqa: E731
    with pytest.raises(AssertionError, match=message):
        getattr(ScorerContract(), test)(factory, context)
