"""Backends and engines describe themselves (kvflow.backends.base.Backend,
kvflow.components.engine.EngineBase): kvflow asks them, with the defaults of one that says
nothing, and never compares a backend's name."""

from __future__ import annotations

import pytest

from kvflow.backends.base import Backend, GpuLayout, as_backend, backend_named
from kvflow.components.engine import EngineBase, adopt_defaults, check_protocol
from kvflow.config.schema import ModelConfig


class OldStyle:
    """A third-party backend written before `Backend`: `load(model_cfg)` only, no other member."""

    loaded: list = []

    @staticmethod
    def check(model_cfg):
        return None

    @staticmethod
    def load(model_cfg):
        OldStyle.loaded.append(model_cfg)
        return "engine"

    @staticmethod
    def check_evictor(model_cfg, params):
        return ("params.budget", "too small") if params == "small" else None


def test_a_class_that_does_not_subclass_backend_gets_its_defaults_and_keeps_its_own():
    b = as_backend(OldStyle)
    assert issubclass(b, Backend) and as_backend(OldStyle) is b, "adapted once, the same class after"
    cfg = ModelConfig(id="x", device="cpu")
    assert b.load(cfg, evicting=True, evictors=[]) == "engine" and OldStyle.loaded[-1] is cfg
    assert b.check_evictor(cfg, "small", evictor_cls=object) == ("params.budget", "too small")
    assert b.evicts is True and b.serves_position_values is False and b.contract_arch == "qwen2"
    assert b.gpu_layout(cfg) == GpuLayout() and b.kv_pool_settings(cfg, 10**9, 100.0) is None
    assert b.placed_settings(cfg, 3, 0.5) == {} and b.position_value_settings(head=True) == {}
    settings, why = b.batch_invariant(cfg)
    assert settings is None and "does not declare batch-invariant decoding" in why


def test_an_instance_registered_as_a_backend_is_adapted_too():
    class Instance:
        def load(self, model_cfg):
            return ("loaded", model_cfg.id)

    b = as_backend(Instance())
    assert b.load(ModelConfig(id="y", device="cpu"), evicting=False, evictors=None) == ("loaded", "y")
    assert b.describe(ModelConfig(id="y", device="cpu"), evicted={}, full=["p"], scores=False) == []


def test_the_built_in_backends_say_what_differs():
    sglang, vllm, hf = backend_named("sglang"), backend_named("vllm"), backend_named("hf")
    cfg = ModelConfig(backend="sglang", id="x", device="cuda", engine={"tp_size": 2, "dp_size": 2,
                                                                          "mem_fraction_static": 0.4})
    layout = sglang.gpu_layout(cfg)
    assert (layout.gpu_count, layout.weight_shards, layout.fraction) == (4, 2, 0.4)
    assert layout.fraction_setting == "mem_fraction_static" and layout.first_gpu_setting == "base_gpu_id"
    assert sglang.placed_settings(cfg, 2, 0.3) == {"base_gpu_id": 2, "mem_fraction_static": 0.3}
    assert sglang.kv_pool_settings(cfg, 1000, 10.0) is None, "the entry sizes its pool itself"
    plain = ModelConfig(backend="sglang", id="x", device="cpu")
    assert sglang.kv_pool_settings(plain, 1000, 10.0) == {"max_total_tokens": 100}
    assert hf.gpu_layout(plain).fraction_setting is None and vllm.kv_pool_settings(plain, 1000, 10.0) is None
    assert sglang.serves_position_values and vllm.serves_position_values and not hf.serves_position_values
    assert vllm.position_value_settings(head=True)["runner"] == "pooling"
    assert sglang.position_value_settings(head=False) == {}


def test_an_engine_that_does_not_subclass_enginebase_gets_the_optional_members_at_load():
    class Bare:
        backend = "bare"
        protocol = "0.2"

        def stats(self):
            return {"own": 1}

    engine = Bare()
    check_protocol(engine)
    assert engine.stats() == {"own": 1}, "a member the engine has is kept"
    assert engine.settings() == {} and engine.streams is False and engine.cancel([object()]) == []
    assert engine.context_length() is None and engine.kv_pool_tokens() == 0 and engine.scores_prompts is False
    with pytest.raises(NotImplementedError, match="bare"):
        engine.reset()
    sub = type("Sub", (EngineBase,), {"backend": "sub"})()
    adopt_defaults(sub)
    assert "stats" not in vars(sub), "a subclass has the members already: nothing is set on it"
