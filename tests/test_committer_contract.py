"""Every built-in committer passes kvflow's committer contract (installed plugins run the same suite
in their own tests, e.g. plugins/kvflow-example-*/tests)."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.committer_contract import CommitterContract

NAMES = [n for n in get_registry().names("committers") if get_registry().info("committers", n).plugin == "builtin"]


def test_builtins_registered():
    assert {"best", "margin"} <= set(NAMES)


class TestRegisteredCommitters(CommitterContract):
    @pytest.fixture(params=NAMES)
    def committer_factory(self, request):
        cls = get_registry().get("committers", request.param)
        return lambda proposers, **params: cls(cls.Params(**params), proposers)
