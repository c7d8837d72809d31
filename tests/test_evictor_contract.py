"""Every registered evictor (built-in or installed plugin, DESIGN.md §10) passes kvflow's evictor contract."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.evictor_contract import EvictorContract

NAMES = get_registry().names("evictors")


def test_builtins_registered():
    assert {"none", "random", "streaming", "snapkv", "rkv", "h2o", "vase"} <= set(NAMES)


class TestRegisteredEvictors(EvictorContract):
    @pytest.fixture(params=NAMES)
    def evictor_factory(self, request):
        cls = get_registry().get("evictors", request.param)
        # the contract is about which tokens an evictor keeps; quantized storage (breadthkv's
        # default) has its own tests in tests/test_quant.py
        params_off = {"quantize": None} if "quantize" in cls.Params.model_fields else {}
        return lambda **params: cls(cls.Params(**params_off, **{k: v for k, v in params.items()
                                                                if k in cls.Params.model_fields}))
