"""Every registered pruner (built-in or installed plugin, DESIGN.md §10) passes kvflow's pruner contract."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.pruner_contract import PrunerContract

NAMES = get_registry().names("pruners")


def test_builtins_registered():
    assert {"entropy", "gzip"} <= set(NAMES)


class TestRegisteredPruners(PrunerContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def pruner_factory(cls, request):
        cls = get_registry().get("pruners", request.param)
        return lambda **params: cls(cls.Params(**params))
