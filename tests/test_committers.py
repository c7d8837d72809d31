"""Committer rules: `best` (ties to the base, unscored candidates last) and `margin`."""

from __future__ import annotations

import math

import pytest

from kvflow.components.base import Candidate, CommitterParams
from kvflow.errors import UserError
from kvflow_builtin.committers.best import BestCommitter
from kvflow_builtin.committers.margin import MarginCommitter

PROPOSERS = ["base", "helper"]


def cands(*specs):
    """specs: (source, index, score) -> candidates in proposer order, as the loop gives them."""
    return [Candidate(0, src, i, f"{src}{i}", [1], [0.0], [0.0], "delimiter", score) for src, i, score in specs]


def best(cs):
    return BestCommitter(CommitterParams(), PROPOSERS).pick(cs)


def margin(cs, **params):
    return MarginCommitter(MarginCommitter.Params(**params), PROPOSERS).pick(cs)


# --------------------------------------------------------------------------- best


def test_best_picks_the_highest_score():
    assert best(cands(("base", 0, 0.2), ("base", 1, 0.4), ("helper", 0, 0.9))) == 2
    assert best(cands(("base", 0, 0.5), ("helper", 0, 0.3))) == 0


def test_best_ties_go_to_the_base_then_the_lower_index():
    assert best(cands(("base", 0, 0.1), ("base", 1, 0.7), ("helper", 0, 0.7))) == 1
    assert best(cands(("helper", 0, 0.7), ("base", 1, 0.7), ("base", 0, 0.7))) == 2  # order given does not matter
    assert best(cands(("helper", 1, 0.7), ("helper", 0, 0.7))) == 1


def test_best_ranks_unscored_candidates_last():
    assert best(cands(("base", 0, None), ("helper", 0, -5.0))) == 1
    assert best(cands(("base", 0, math.nan), ("helper", 0, -math.inf))) == 1  # scored, even at -inf
    assert best(cands(("base", 0, None), ("base", 1, None), ("helper", 0, None))) == 0  # all unscored: base first


# --------------------------------------------------------------------------- margin


def test_margin_commits_a_helper_step_only_beyond_delta():
    cs = cands(("base", 0, 0.50), ("base", 1, 0.60), ("helper", 0, 0.75), ("helper", 1, 0.65))
    assert margin(cs, delta=0.1) == 2  # 0.75 > 0.60 + 0.1
    assert margin(cs, delta=0.2) == 1  # not enough: the best base step
    assert margin(cands(("base", 0, 0.5), ("helper", 0, 0.75)), delta=0.25) == 0  # exactly delta: base (strict)
    assert margin(cs) == 2  # delta 0 = best, ties to base
    assert margin(cands(("base", 0, 0.6), ("helper", 0, 0.6))) == 0


def test_margin_with_unscored_candidates():
    assert margin(cands(("base", 0, None), ("helper", 0, 0.1)), delta=0.5) == 1  # unscored base loses
    assert margin(cands(("base", 0, 0.1), ("helper", 0, None)), delta=0.0) == 0  # unscored helper never wins
    assert margin(cands(("base", 0, None), ("helper", 0, math.nan))) == 0
    assert margin(cands(("base", 0, None), ("base", 1, 0.2), ("helper", 0, 0.25)), delta=0.1) == 1


def test_margin_without_base_or_helper_candidates():
    assert margin(cands(("helper", 0, 0.1), ("helper", 1, 0.3)), delta=1.0) == 1  # every base candidate pruned
    assert margin(cands(("base", 0, 0.1), ("base", 1, 0.3)), delta=1.0) == 1


def test_margin_base_parameter():
    cs = cands(("base", 0, 0.9), ("helper", 0, 0.5))
    assert margin(cs, delta=0.5, base="helper") == 1  # the helper is now the one kept unless beaten by 0.5
    assert margin(cs, delta=0.3, base="helper") == 0
    with pytest.raises(UserError, match="unknown proposer"):
        MarginCommitter(MarginCommitter.Params(base="nope"), PROPOSERS)


def test_margin_validates_in_a_pipeline():
    from kvflow.config.validate import load_pipeline
    from conftest import REPO

    loaded = load_pipeline(REPO / "pipelines/kv_rescue.yaml", sets=["committer={kind: margin, delta: 0.05}"])
    assert loaded.components.committer.cls is MarginCommitter
    assert loaded.components.committer.params.delta == 0.05


def test_margin_ranks_an_unscored_candidate_below_one_scored_minus_infinity():
    """The docstring's rule: unscored (None or nan) ranks below every scored candidate, -inf
    included. Breaking it (unscored keyed as -inf) makes base0 and base1 tie, and the lower
    index, the unscored one, wins."""
    for unscored in (None, math.nan):
        cs = cands(("base", 0, unscored), ("base", 1, -math.inf))
        assert margin(cs) == 1
        cs = cands(("helper", 0, unscored), ("helper", 1, -math.inf))
        assert margin(cs) == 1
