"""The contract every committer must pass, as a pytest suite.

Built-ins and third-party committers run the same tests. In a plugin's test suite:

    import pytest
    from kvflow.testing.committer_contract import CommitterContract
    from my_plugin import MyCommitter

    class TestMyCommitter(CommitterContract):
        @pytest.fixture(scope="class")
        @classmethod
        def committer_factory(cls):
            # proposers: the pipeline's proposer names in order (the first is the base)
            return lambda proposers, **params: MyCommitter(MyCommitter.Params(**params), proposers)

The factory is a class-scoped fixture written as a `@classmethod` under `@pytest.fixture`,
the form pytest 9 and 10 accept (pytest 9 deprecates class-scoped fixtures that are instance
methods; pytest 10 removes them); a parametrized factory takes `request` after `cls`.

The runtime calls `pick(candidates)` once per problem per round with that problem's scored
candidates in proposer order (scores may be None, for proposers the scorer does not score,
nan, or -inf). What is checked, over a few hundred random rounds (seeded):

- `pick()` returns an int index into the list, also for a single candidate, for candidates
  of one proposer only, and when no candidate has a score;
- it changes no candidate, and it is deterministic: the same instance twice and a fresh
  instance agree;
- monotone in the winner's score: raising the picked candidate's score keeps it picked
  (set `score_monotone = False` for a committer that is not score-based);
- any pipeline: one proposer, or three; and the proposers' names do not matter (the base is
  the first proposer, whatever it is called): renaming them consistently changes no pick;
- the checks of `kvflow.testing.component_contract` (frozen, described Params; docstrings).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, ClassVar

import pytest

from kvflow.components.base import CommitterParams
from kvflow.testing.component_contract import ComponentContract

PROPOSERS = ["base", "helper"]
ROUNDS = 300


def candidates(rng: random.Random, proposers=PROPOSERS) -> list:
    """One problem's candidates of a random round, in proposer order, with mixed scores."""
    from kvflow.components.base import Candidate

    out = []
    for source in proposers:
        for index in range(rng.randint(0, 3)):
            roll = rng.random()
            score = (None if roll < 0.1 else math.nan if roll < 0.15 else -math.inf if roll < 0.2
                     else round(rng.uniform(-2, 2), 1))  # rounded: ties happen
            text = f"Step {index} of {source}: {rng.randint(0, 99)} + 1.\n\n"
            finish = rng.choice(["delimiter", "delimiter", "eos", "max_step_tokens", "pruned:entropy"])
            out.append(Candidate(problem=0, source=source, index=index, text=text, token_ids=[1, 2, 3],
                                 logprobs=[-0.1] * 3, entropies=[0.5] * 3, finish=finish, score=score))
    if not out:
        return candidates(rng, proposers)
    return out


class CommitterContract(ComponentContract):
    """Subclass and override the `committer_factory` fixture (see the module docstring)."""

    #: parameters every test passes to the factory
    contract_params: ClassVar[dict] = {}
    #: whether raising the winner's score must keep it the winner
    score_monotone: ClassVar[bool] = True
    params_base = CommitterParams

    @pytest.fixture(scope="class")
    @classmethod
    def committer_factory(cls) -> Callable[..., Any]:
        """Return a callable `factory(proposers, **params) -> Committer`."""
        raise NotImplementedError("override the committer_factory fixture")

    @pytest.fixture
    def contract_component(self, committer_factory):
        return self.make(committer_factory)

    def make(self, factory, proposers=PROPOSERS):
        return factory(list(proposers), **self.contract_params)

    def rounds(self, seed: int = 0, proposers=PROPOSERS):
        rng = random.Random(seed)
        return [candidates(rng, proposers) for _ in range(ROUNDS)]

    @staticmethod
    def pick(committer, cands) -> int:
        i = committer.pick(cands)
        assert isinstance(i, int) and not isinstance(i, bool), f"pick() returned {i!r}, not an int"
        assert 0 <= i < len(cands), f"pick() returned {i} for {len(cands)} candidates"
        return i

    # ------------------------------------------------------------------ tests

    def test_pick_returns_an_index(self, committer_factory):
        committer = self.make(committer_factory)
        for cands in self.rounds():
            self.pick(committer, cands)

    def test_single_candidate_and_one_proposer(self, committer_factory):
        committer = self.make(committer_factory)
        for cands in self.rounds(1):
            for source in PROPOSERS:
                own = [c for c in cands if c.source == source]
                if own:
                    self.pick(committer, own)
            assert self.pick(committer, cands[:1]) == 0

    def test_unscored_candidates(self, committer_factory):
        committer = self.make(committer_factory)
        for cands in self.rounds(2):
            for c in cands:
                c.score = None
            self.pick(committer, cands)

    def test_deterministic_and_pure(self, committer_factory):
        first, again = self.make(committer_factory), self.make(committer_factory)
        for cands in self.rounds(3):
            before = copy.deepcopy(cands)
            i = self.pick(first, cands)
            assert cands == before or _same_with_nan(cands, before), "pick() changed the candidates"
            assert self.pick(first, cands) == i, "pick() twice on one round gave different winners"
            assert self.pick(again, cands) == i, "a fresh committer picked differently"

    def test_raising_the_winners_score_keeps_it(self, committer_factory):
        if not self.score_monotone:
            pytest.skip("score_monotone = False")
        committer = self.make(committer_factory)
        for cands in self.rounds(4):
            i = self.pick(committer, cands)
            finite = [c.score for c in cands if c.score is not None and math.isfinite(c.score)]
            cands[i].score = max(finite, default=0.0) + 1.0
            assert self.pick(committer, cands) == i, "the winner lost after its score was raised"


    def test_any_number_of_proposers(self, committer_factory):
        for proposers in (["base"], ["base", "helper", "third"]):
            try:
                committer = self.make(committer_factory, proposers)
                for cands in self.rounds(5, proposers):
                    self.pick(committer, cands)
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 — say which pipeline the committer cannot serve
                raise AssertionError(f"with proposers {proposers} the committer failed: {type(e).__name__}: {e} "
                                     "(a pipeline may have one proposer, or more than two)") from e

    def test_proposer_names_do_not_matter(self, committer_factory):
        """Renaming the proposers (the base is the first, whatever its name) changes no pick."""
        renamed = ["main", "assist"]
        plain, other = self.make(committer_factory), self.make(committer_factory, renamed)
        for cands in self.rounds(6):
            moved = copy.deepcopy(cands)
            for c in moved:
                c.source = renamed[PROPOSERS.index(c.source)]
            assert self.pick(other, moved) == self.pick(plain, cands), (
                f"renaming the proposers {PROPOSERS} to {renamed} changed the pick: take the base from the "
                "committer's `proposers` (the first), never from a proposer's name")


def _same_with_nan(a, b) -> bool:
    """Candidate lists equal, counting nan scores as equal (nan != nan)."""
    def key(c):
        return (c.source, c.index, c.text, c.finish, "nan" if c.score is not None and math.isnan(c.score) else c.score)
    return [key(c) for c in a] == [key(c) for c in b]
