"""Every registered committer (built-in or installed plugin, DESIGN.md §10) passes kvflow's committer contract."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.committer_contract import CommitterContract

NAMES = get_registry().names("committers")


def test_builtins_registered():
    assert {"best", "margin"} <= set(NAMES)


class TestRegisteredCommitters(CommitterContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def committer_factory(cls, request):
        cls = get_registry().get("committers", request.param)
        return lambda proposers, **params: cls(cls.Params(**params), proposers)
