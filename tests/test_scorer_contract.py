"""Every registered scorer (built-in or installed plugin, DESIGN.md §10) passes kvflow's scorer contract.

A scorer that needs a model gets the contract's tiny one (`model: tiny`); `prm` is checked
with its causal-LM protocol (`math-shepherd`), since a tiny Qwen2.5-Math-PRM checkpoint is
tests/test_scorers.py's business. `likelihood` runs both ways: with a model, and on the
candidates' own log-probabilities.
"""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.scorer_contract import MODEL_KEY, ScorerContract

NAMES = get_registry().names("scorers")
NEEDS_A_MODEL = {"prm": {"model": MODEL_KEY, "protocol": "math-shepherd"}, "llm_judge": {"model": MODEL_KEY}}
CASES = [(name, NEEDS_A_MODEL.get(name, {})) for name in NAMES] + [("likelihood", {"model": MODEL_KEY})]


def test_builtins_registered():
    assert {"likelihood", "llm_judge", "prm", "random"} <= set(NAMES)


class TestRegisteredScorers(ScorerContract):
    @pytest.fixture(scope="class", params=CASES,
                    ids=[f"{n}-{'-'.join(map(str, p.values())) or 'defaults'}" for n, p in CASES])
    @classmethod
    def scorer_factory(cls, request):
        name, extra = request.param
        cls = get_registry().get("scorers", name)
        return lambda context, **params: cls(cls.Params(**{**params, **extra}), context)
