"""Every built-in pruner passes kvflow's pruner contract (installed plugins run the same suite
in their own tests, e.g. plugins/kvflow-example-*/tests)."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.pruner_contract import PrunerContract

NAMES = [n for n in get_registry().names("pruners") if get_registry().info("pruners", n).plugin == "builtin"]


def test_builtins_registered():
    assert {"entropy", "gzip"} <= set(NAMES)


class TestRegisteredPruners(PrunerContract):
    @pytest.fixture(params=NAMES)
    def pruner_factory(self, request):
        cls = get_registry().get("pruners", request.param)
        return lambda **params: cls(cls.Params(**params))
