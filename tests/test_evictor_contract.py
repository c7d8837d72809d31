"""Every registered evictor (built-in or installed plugin, DESIGN.md §10) passes kvflow's evictor contract."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.evictor_contract import EvictorContract

#: kvpress's score presses ported as built-ins: their contract runs in tests/test_evictor_contract_kvpress.py
#: (a file of its own, so that `make test`'s two workers share the engine axes)
KVPRESS_PORTS = ("knorm", "keydiff", "lagkv", "tova", "cur", "expected-attention")
NAMES = [n for n in get_registry().names("evictors") if n not in KVPRESS_PORTS]
TINY_ROPE_THETA = 10000.0  # the RoPE base of kvflow.testing.models' tiny configs (transformers' default)


def test_builtins_registered():
    assert {"none", "random", "streaming", "snapkv", "rkv", "h2o", "vase"} <= set(NAMES)


def registered_factory(name: str):
    """`factory(**params)` of a registered evictor, as the contract calls it."""
    cls = get_registry().get("evictors", name)
    # the contract is about which tokens an evictor keeps; quantized storage (breadthkv's
    # default) has its own tests in tests/test_quant.py
    params_off = {"quantize": None} if "quantize" in cls.Params.model_fields else {}
    if "rope_theta" in cls.Params.model_fields:  # resolved from the model's config by a run
        params_off["rope_theta"] = TINY_ROPE_THETA
    return lambda **params: cls(cls.Params(**params_off, **{k: v for k, v in params.items()
                                                            if k in cls.Params.model_fields}))


class TestRegisteredEvictors(EvictorContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def evictor_factory(cls, request):
        return registered_factory(request.param)


class TestThirdPartyKeyNorm(EvictorContract):
    """An evictor written as a plugin author would (keep the smallest key norms): its scores
    tie in exact arithmetic on repeated tokens, which the forward's batch noise breaks
    differently batched and alone; the contract must pass it all the same."""

    @pytest.fixture(scope="class")
    @classmethod
    def evictor_factory(cls):
        from kvflow.testing.third_party import KeyNormEvictor

        return lambda **params: KeyNormEvictor(KeyNormEvictor.Params(**params))

