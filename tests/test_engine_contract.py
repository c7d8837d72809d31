"""Every registered backend's engine (built-in or installed plugin) passes kvflow's engine
contract (kvflow.testing.engine_contract), loaded the way `kvflow run` loads it, on the tiny
model the backend's kernels serve (`kvflow.testing.engine_parity.backend_model_dir`: the SGLang
tests' `shared_tiny_qwen` for hf and sglang, a head_dim-32 Qwen2 for vllm)."""

from __future__ import annotations

import pytest

from kvflow.config.schema import ModelConfig
from kvflow.registry import get_registry
from kvflow.testing.engine_contract import EngineContract

from conftest import require_sglang, require_vllm

NAMES = get_registry().names("backends")


def test_hf_is_registered():
    assert "hf" in NAMES


class TestRegisteredEngines(EngineContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def backend(cls, request):
        return request.param

    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_dir(cls, backend, shared_tiny_qwen):
        from kvflow.testing.engine_parity import backend_model_dir

        return backend_model_dir(backend)  # shared_tiny_qwen for hf and sglang: the SGLang tests share its engine

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls, backend):
        loader = get_registry().get("backends", backend)
        if backend == "sglang":
            require_sglang()
        if backend == "vllm":
            require_vllm()

        def load(model_dir):
            cfg = ModelConfig(id=str(model_dir), backend=backend, dtype="float32", device="cpu")
            assert loader.check(cfg) is None
            return loader.load(cfg)

        return load
