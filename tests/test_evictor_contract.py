"""Every registered evictor (built-in or installed plugin, DESIGN.md §10) passes kvflow's evictor contract."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.evictor_contract import EvictorContract

NAMES = get_registry().names("evictors")
TINY_ROPE_THETA = 10000.0  # the RoPE base of kvflow.testing.models' tiny configs (transformers' default)


def test_builtins_registered():
    assert {"none", "random", "streaming", "snapkv", "rkv", "h2o", "vase"} <= set(NAMES)


class TestRegisteredEvictors(EvictorContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def evictor_factory(cls, request):
        cls = get_registry().get("evictors", request.param)
        # the contract is about which tokens an evictor keeps; quantized storage (breadthkv's
        # default) has its own tests in tests/test_quant.py
        params_off = {"quantize": None} if "quantize" in cls.Params.model_fields else {}
        if "rope_theta" in cls.Params.model_fields:  # resolved from the model's config by a run
            params_off["rope_theta"] = TINY_ROPE_THETA
        return lambda **params: cls(cls.Params(**params_off, **{k: v for k, v in params.items()
                                                                if k in cls.Params.model_fields}))


class TestThirdPartyKeyNorm(EvictorContract):
    """An evictor written as a plugin author would (keep the smallest key norms): its scores
    tie in exact arithmetic on repeated tokens, which the forward's batch noise breaks
    differently batched and alone; the contract must pass it all the same."""

    @pytest.fixture(scope="class")
    @classmethod
    def evictor_factory(cls):
        from kvflow.testing.third_party import KeyNormEvictor

        return lambda **params: KeyNormEvictor(KeyNormEvictor.Params(**params))


class TestWrappedScorers(EvictorContract):
    """Any scorer under kvpress-style wrappers (`allocation: {kind: adakv}` / `{kind: pyramid}`),
    with no class of its own, passes the same contract on every engine."""

    @pytest.fixture(scope="class", params=[("keydiff", "adakv"), ("knorm", "pyramid")], ids=lambda p: "+".join(p))
    @classmethod
    def evictor_factory(cls, request):
        kind, wrapper = request.param
        cls = get_registry().get("evictors", kind)
        return lambda **params: cls(cls.Params(allocation={"kind": wrapper}, **params))
