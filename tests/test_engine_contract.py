"""Every registered backend's engine (built-in or installed plugin) passes kvflow's engine
contract (kvflow.testing.engine_contract), loaded the way `kvflow run` loads it."""

from __future__ import annotations

import pytest

from kvflow.config.schema import ModelConfig
from kvflow.registry import get_registry
from kvflow.testing.engine_contract import EngineContract

from conftest import require_sglang

NAMES = get_registry().names("backends")


def test_hf_is_registered():
    assert "hf" in NAMES


class TestRegisteredEngines(EngineContract):
    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_dir(cls, shared_tiny_qwen):
        return shared_tiny_qwen  # the SGLang tests share its engine

    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def engine_factory(cls, request):
        backend = request.param
        cls = get_registry().get("backends", backend)
        if backend == "sglang":
            require_sglang()

        def load(model_dir):
            cfg = ModelConfig(id=str(model_dir), backend=backend, dtype="float32", device="cpu")
            assert cls.check(cfg) is None
            return cls.load(cfg)

        return load
