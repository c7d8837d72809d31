"""Every registered scorer (built-in or installed plugin, DESIGN.md §10) passes kvflow's scorer contract.

A scorer that needs a model gets the contract's tiny one (`model: tiny`); `prm` is checked
with its causal-LM protocol (`math-shepherd`), since a tiny Qwen2.5-Math-PRM checkpoint is
tests/test_scorers.py's business. `likelihood` runs both ways: with a model, and on the
candidates' own log-probabilities. Every scorer that declares backend `sglang` runs the suite
again with its model on SGLang (one engine, the SGLang tests' shared tiny Qwen2), and every one
that declares `vllm` on vLLM (the vLLM tests' head_dim-32 tiny Qwen2).
"""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.scorer_contract import MODEL_KEY, ScorerContract

NAMES = get_registry().names("scorers")
NEEDS_A_MODEL = {"prm": {"model": MODEL_KEY, "protocol": "math-shepherd"}, "llm_judge": {"model": MODEL_KEY}}
CASES = [(name, NEEDS_A_MODEL.get(name, {})) for name in NAMES] + [("likelihood", {"model": MODEL_KEY})]


def _factory(name: str, extra: dict):
    """The contract's scorer factory for registered scorer `name`, with `extra` params on top."""
    cls = get_registry().get("scorers", name)
    return lambda context, **params: cls(cls.Params(**{**params, **extra}), context)


def _ids(cases) -> list[str]:
    return [f"{n}-{'-'.join(map(str, p.values())) or 'defaults'}" for n, p in cases]


def test_builtins_registered():
    assert {"likelihood", "llm_judge", "prm", "random"} <= set(NAMES)


class TestRegisteredScorers(ScorerContract):
    @pytest.fixture(scope="class", params=CASES,
                    ids=_ids(CASES))
    @classmethod
    def scorer_factory(cls, request):
        return _factory(*request.param)


def _declares(name: str, backend: str) -> bool:
    allowed = getattr(get_registry().get("scorers", name), "backends", None)  # None: any engine
    return allowed is None or backend in allowed


SGLANG_CASES = [(n, p) for n, p in CASES if p.get("model") and _declares(n, "sglang")]
VLLM_CASES = [(n, p) for n, p in CASES if p.get("model") and _declares(n, "vllm")]


def test_scorers_on_sglang_are_covered():
    assert {n for n, _ in SGLANG_CASES} >= {"prm", "llm_judge", "likelihood"}


class TestRegisteredScorersOnSGLang(ScorerContract):
    contract_backend = "sglang"

    @pytest.fixture(scope="class", params=SGLANG_CASES,
                    ids=_ids(SGLANG_CASES))
    @classmethod
    def scorer_factory(cls, request):
        return _factory(*request.param)


def test_scorers_on_vllm_are_covered():
    assert {n for n, _ in VLLM_CASES} >= {"likelihood"}


class TestRegisteredScorersOnVLLM(ScorerContract):
    contract_backend = "vllm"

    @pytest.fixture(scope="class", params=VLLM_CASES,
                    ids=_ids(VLLM_CASES))
    @classmethod
    def scorer_factory(cls, request):
        from conftest import require_vllm

        require_vllm()
        return _factory(*request.param)
