"""kvpress's score presses ported as built-in evictors, and scorers under the allocation
wrappers, pass kvflow's evictor contract on every engine (a file apart from
tests/test_evictor_contract.py so that `make test`'s two workers share the engine axes)."""

from __future__ import annotations

import pytest

from kvflow.registry import get_registry
from kvflow.testing.evictor_contract import EvictorContract
from test_evictor_contract import KVPRESS_PORTS, registered_factory


def test_the_kvpress_ports_are_registered():
    assert set(KVPRESS_PORTS) <= set(get_registry().names("evictors"))


class TestKvpressPorts(EvictorContract):
    @pytest.fixture(scope="class", params=KVPRESS_PORTS)
    @classmethod
    def evictor_factory(cls, request):
        return registered_factory(request.param)


class TestWrappedScorers(EvictorContract):
    """Any scorer under kvpress-style wrappers (`allocation: {kind: adakv}` / `{kind: pyramid}`),
    with no class of its own, passes the same contract on every engine."""

    @pytest.fixture(scope="class", params=[("keydiff", "adakv"), ("knorm", "pyramid")], ids=lambda p: "+".join(p))
    @classmethod
    def evictor_factory(cls, request):
        kind, wrapper = request.param
        cls = get_registry().get("evictors", kind)
        return lambda **params: cls(cls.Params(allocation={"kind": wrapper}, **params))
