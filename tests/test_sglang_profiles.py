"""An SGLang engine's decode hook is built from the evictors it serves (issue 33).

- every shipped evictor at every budget of the paper's grid (64..512) fits the profile built
  for it: nothing is refused mid-run by a fixed table size (PyramidKV at B >= 256, Ada-SnapKV
  at B >= 128 and H2O at B >= 384 were, with a global 512-slot span);
- what cannot run is refused before any weight loads: an evictor with its own observe() under
  decode graphs on a GPU, an evicting engine on a latent-attention or sliding-window hybrid;
- a full-context engine registers no kvflow hook (SGLang's own decode, untouched), and an
  engine built for R-KV reads no key or value in its hook, decodes hf's tokens, and refuses
  an evictor it was not built for before sending a request.
"""

from __future__ import annotations

import pytest

from kvflow.backends.sglang.in_worker.graph import Profile, observes_in_graph, profile_problem
from kvflow.backends.sglang.settings import check_evicting, kv_layout_problem
from kvflow.config.schema import ModelConfig
from kvflow.registry import get_registry

SHAPES = [(28, 4), (80, 2)]  # Qwen2.5-7B; 72B per rank at tp 4 (layers, KV heads)


def _bounded_kinds():
    reg = get_registry()
    return [k for k in reg.names("evictors") if getattr(reg.get("evictors", k), "bounded", True)]


@pytest.mark.parametrize("budget", [64, 128, 256, 384, 512])
@pytest.mark.parametrize("layers,kv_heads", SHAPES)
def test_every_evictor_at_every_budget_fits_the_profile_built_for_it(budget, layers, kv_heads):
    reg = get_registry()
    checked = 0
    for kind in _bounded_kinds():
        cls = reg.get("evictors", kind)
        try:
            ev = cls(cls.Params(budget=budget, buffer=128))
            ev.allocation(layers)
        except (ValueError, TypeError):  # parameters this evictor refuses for the shape (said at compile)
            continue
        profile = Profile.of([ev], layers, kv_heads)
        graphs = not (ev.observes_attention and not observes_in_graph(ev))
        assert profile_problem(profile, ev, layers, kv_heads, graphs=graphs) is None, (kind, budget)
        checked += 1
    assert checked >= 8


def test_the_old_global_span_would_have_refused_pyramidkv_at_256():
    cls = get_registry().get("evictors", "pyramidkv")
    ev = cls(cls.Params(budget=256, buffer=128))
    assert profile_problem(Profile.general(), ev, 28, 4, graphs=True) is not None
    assert profile_problem(Profile.of([ev], 28, 4), ev, 28, 4, graphs=True) is None


class OwnObserver(get_registry().get("evictors", "h2o")):
    """H2O's score with an observe() of its own (a third party's statistic)."""

    def observe(self, stats, query, keys, mask, *, layer_idx, scaling):
        super().observe(stats, query, keys, mask, layer_idx=layer_idx, scaling=scaling)


def test_an_own_observer_under_gpu_decode_graphs_is_refused_at_validation(tmp_path):
    params = OwnObserver.Params(budget=64, buffer=64)
    gpu = ModelConfig(backend="sglang", id=str(tmp_path), device="cuda:0")
    assert check_evicting(gpu, params, OwnObserver)[0] == "engine.disable_cuda_graph"
    off = gpu.model_copy(update={"engine": {"disable_cuda_graph": True}})
    assert check_evicting(off, params, OwnObserver) is None
    assert check_evicting(ModelConfig(backend="sglang", id=str(tmp_path), device="cpu"), params, OwnObserver) is None
    h2o = get_registry().get("evictors", "h2o")
    assert check_evicting(gpu, params, h2o) is None  # its statistic is kept in the graph


def test_models_whose_kv_pool_the_hooks_cannot_read_are_refused_for_evicting_engines(tmp_path):
    assert "latent" in kv_layout_problem({"model_type": "deepseek_v3", "kv_lora_rank": 512})
    assert "sliding" in kv_layout_problem({"model_type": "gemma3_text",
                                           "layer_types": ["sliding_attention", "full_attention"]})
    assert kv_layout_problem({"model_type": "qwen2", "use_sliding_window": False, "max_window_layers": 28,
                              "num_hidden_layers": 28}) is None
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v2", "kv_lora_rank": 512}')
    rkv = get_registry().get("evictors", "rkv")
    why = check_evicting(ModelConfig(backend="sglang", id=str(tmp_path), device="cpu"), rkv.Params(), rkv)
    assert why[0] == "id" and "latent" in why[1]


# ---------------------------------------------------------------------- engines (SGLang on the CPU)


def test_profiles_cover_what_they_serve():
    """A running engine whose hook covers a pipeline's evictors serves it (a sweep, a test
    session start one engine, not one per budget); one that lacks a part does not."""
    reg = get_registry()
    rkv, h2o, ada = (reg.get("evictors", k) for k in ("rkv", "h2o", "ada-snapkv"))
    small = Profile.of([rkv(rkv.Params(budget=64, buffer=64))], 28, 4)
    assert Profile.general().covers(small) and not small.covers(Profile.general())
    h = Profile.of([h2o(h2o.Params(budget=64, buffer=64))], 28, 4)
    assert not small.covers(h) and not h.covers(small)  # no ring / no statistic
    big = Profile.of([h2o(h2o.Params(budget=256, buffer=128))], 28, 4)
    assert big.covers(h) and not h.covers(big)  # a longer span serves shorter rows
    assert not big.covers(Profile.of([ada(ada.Params(budget=64, buffer=64))], 28, 4))  # no hole recompute


def test_an_engine_built_for_rkv_reads_no_kv_in_its_hook_and_keeps_hfs_tokens():
    """On a model of its own (so that no running engine of the session covers it), with R-KV's
    profile: no span, a ring of R-KV's window; hf's greedy tokens; H2O refused by the client."""
    from conftest import require_sglang

    require_sglang()
    from kvflow.backends.hf import HFBackend
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.testing.engine_parity import shared_model_dir

    reg = get_registry()
    rkv, h2o = reg.get("evictors", "rkv"), reg.get("evictors", "h2o")
    params = rkv.Params(budget=16, buffer=8, window=4)
    model = str(shared_model_dir("qwen2", seed=5))
    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=model, dtype="float32", device="cpu"),
                                evictors=[(rkv, params)])
    ev = rkv(params)
    try:
        _check_rkv_engine(engine, ev, h2o, HFBackend.load(ModelConfig(id=model, dtype="float32", device="cpu")))
    finally:
        engine.worker.close()


def _check_rkv_engine(engine, ev, h2o, hf_engine):
    from kvflow.errors import EngineError
    from kvflow.components.engine import StartRequest
    from kvflow.testing.engine_parity import greedy_steps

    got, state = greedy_steps(engine, ev)
    want, _ = greedy_steps(hf_engine, ev)
    assert [[(i, f) for i, f, _ in s] for s in got] == [[(i, f) for i, f, _ in s] for s in want]
    engine.release([state])
    info = engine.server_state()
    assert info["profile"]["span"] == 0 and info["profile"]["window"] == ev.query_window
    assert info["compactions"] >= 3 and info["observed_tokens"] > 0
    with pytest.raises(EngineError, match="observes attention"):
        engine.start([StartRequest("hello", h2o(h2o.Params(budget=16, buffer=8, window=4)), 1)])


@pytest.fixture(scope="module")
def full_context_engine(shared_tiny_qwen):
    """An engine for full-context proposers on the session's model (no kvflow hook), held by
    this module."""
    from conftest import require_sglang

    require_sglang()
    from kvflow.backends.sglang import SGLangBackend

    engine = SGLangBackend.load(ModelConfig(backend="sglang", id=str(shared_tiny_qwen), dtype="float32",
                                            device="cpu"), evicting=False)
    yield engine
    engine.close()


def test_the_same_entry_loaded_again_shares_its_worker_and_each_close_hands_one_back(
        sglang_engine, full_context_engine, shared_tiny_qwen):
    """Workers are shared per (arguments, profile): loading the same entry again hands out the
    running worker's engine (no start), one more holder; closing hands it back and the worker
    stays for the holders left. An evicting engine (kvflow's hook) is another worker. That an idle
    worker, of any backend, is closed before another starts and a held one is not is the served
    core's registry, tested with real worker processes in tests/test_served_core.py."""
    from kvflow.backends.sglang import SGLangBackend

    held = full_context_engine.worker.holders
    again = SGLangBackend.load(ModelConfig(backend="sglang", id=str(shared_tiny_qwen), dtype="float32",
                                           device="cpu"), evicting=False)
    assert again is full_context_engine and again.worker.holders == held + 1
    again.close()
    assert full_context_engine.worker.holders == held and full_context_engine.worker.proc.poll() is None
    assert sglang_engine.worker is not full_context_engine.worker, "a full-context engine shared the hooked worker"


def test_a_full_context_engine_runs_no_kvflow_hook(full_context_engine):
    from kvflow.errors import EngineError
    from kvflow.components.engine import StartRequest

    state = full_context_engine.server_state()
    assert state["evict_hooks"] is False and "profile" not in state and "observed_tokens" not in state
    rkv = get_registry().get("evictors", "rkv")
    with pytest.raises(EngineError, match="full-context"):
        full_context_engine.start([StartRequest("hello", rkv(rkv.Params(budget=16, buffer=8, window=4)), 1)])
