"""SGLang as users run it on GPUs, checked on a CPU: what kvflow sets, what SGLang resolves
for a CUDA device (its own resolution under a platform stand-in, `kvflow.testing.gpu_standin`),
what kvflow refuses, and the tripwire that stops an engine whose hooks missed a token.

docs/backends.md ("Running on GPUs") says what these pin down.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import committed_steps, require_sglang
from kvflow.config.schema import ModelConfig
from kvflow.testing import tiny_pipeline


def _kwargs(model_dir, evicting: bool, **engine) -> dict:
    from kvflow.backends.sglang.settings import engine_kwargs

    cfg = ModelConfig(backend="sglang", id=str(model_dir), dtype="bfloat16", device="cuda", engine=engine)
    return engine_kwargs(cfg, evicting)


#: the (gpu, evicting, plain, engine settings) cases the tests below read, resolved in one process
CASES = [("h100", False, True, {}), ("h100", False, False, {}), ("h100", True, False, {}),
         ("b200", True, False, {}), ("b200", False, False, {}), ("b200", True, False, {"attention_backend": "flashinfer"}),
         ("h100", True, False, {"kv_cache_dtype": "fp8_e4m3"})]


@pytest.fixture(scope="module")
def resolved_on(shared_tiny_qwen):
    """resolved_on(gpu, evicting, plain=False, **engine): SGLang's resolution of kvflow's
    engine arguments (or, plain=True, of the model alone, as SGLang would run it) on a GPU;
    every case of CASES resolved at once (SGLang's import is most of the time)."""
    require_sglang()
    from kvflow.testing.gpu_standin import resolve_many

    def kwargs(evicting: bool, plain: bool, engine: dict) -> dict:
        full = _kwargs(shared_tiny_qwen, evicting, **engine)
        return {k: full[k] for k in ("model_path", "dtype", "device")} | engine if plain else full

    resolved = resolve_many([(kwargs(ev, plain, engine), gpu) for gpu, ev, plain, engine in CASES])
    table = {(gpu, ev, plain, json.dumps(engine, sort_keys=True)): r
             for (gpu, ev, plain, engine), r in zip(CASES, resolved)}

    def get(gpu: str, evicting: bool = False, plain: bool = False, **engine):
        return table[(gpu, evicting, plain, json.dumps(engine, sort_keys=True))]

    return get


def test_sglang_picks_a_sampler_on_cuda_that_refuses_seeds_and_kvflow_sets_its_own(resolved_on):
    """The crash class of every sampled step on a GPU: left alone, SGLang resolves the
    `flashinfer` sampler on CUDA, whose sampler asserts `sampling_seed is None` under top-p;
    kvflow sets `pytorch` on every device and refuses the other."""
    from kvflow.backends.sglang.settings import refusal

    plain = resolved_on("h100", plain=True)
    assert plain["sampling_backend"] == "flashinfer"
    assert refusal(plain, evicting=False)[0] == "engine.sampling_backend"
    for evicting in (False, True):
        ours = resolved_on("h100", evicting)
        assert ours["sampling_backend"] == "pytorch"
        assert refusal(ours, evicting) is None, refusal(ours, evicting)


def test_evicting_engines_decode_with_graphs_and_prefill_without(resolved_on):
    """What SGLang resolved per forward phase (`cuda_graph_config`), not the input flag: an
    evicting engine replays full decode graphs (kvflow's decode hook is captured with them,
    tests/test_sglang_replay.py) and prefills eagerly (its extend hook is Python per row); a
    full-context engine gets SGLang's defaults, whose breakable prefill graphs are refused for
    an evicting one."""
    from kvflow.backends.sglang.settings import refusal

    evicting = resolved_on("h100", evicting=True)
    assert evicting["disable_cuda_graph"] is False
    assert evicting["cuda_graph_config"]["decode"]["backend"] == "full"
    assert evicting["cuda_graph_config"]["prefill"]["backend"] == "disabled"
    assert refusal(evicting, evicting=True) is None
    full = resolved_on("h100", evicting=False)
    assert full["cuda_graph_config"]["decode"]["backend"] == "full"  # SGLang's default on CUDA
    assert refusal(full, evicting=False) is None
    # SGLang's prefill default reads the real device (`is_cuda()`, not the stand-in): `breakable`
    # on a GPU, which an evicting engine refuses
    breakable = {**full, "cuda_graph_config": {**full["cuda_graph_config"], "prefill": {"backend": "breakable"}}}
    assert refusal(breakable, evicting=False) is None
    assert refusal(breakable, evicting=True)[0] == "engine.cuda_graph_config"


def test_what_sglang_resolves_on_blackwell_is_refused_for_an_evicting_engine(resolved_on):
    """On SM100 SGLang picks `trtllm_mha` and forces `page_size` 64: an evicting engine is
    refused after it starts (EngineSettingError, located by `kvflow run`); a full-context one runs."""
    from kvflow.backends.sglang.settings import check_resolved
    from kvflow.errors import EngineSettingError

    blackwell = resolved_on("b200", evicting=True)
    assert (blackwell["attention_backend"], blackwell["page_size"]) == ("trtllm_mha", 64)
    with pytest.raises(EngineSettingError) as err:
        check_resolved(blackwell, evicting=True)
    assert err.value.field in ("engine.page_size", "engine.attention_backend") and "SGLang resolved" in err.value.message
    check_resolved(resolved_on("b200", evicting=False), evicting=False)
    # the way out the message names: an attention backend kvflow's hooks read, one token per page
    fixed = resolved_on("b200", evicting=True, attention_backend="flashinfer")
    assert fixed["page_size"] == 1
    check_resolved(fixed, evicting=True)


def test_an_fp8_kv_cache_sglang_resolves_is_refused_for_evicting_engines_only(resolved_on):
    from kvflow.backends.sglang.settings import check_resolved
    from kvflow.errors import EngineSettingError

    fp8 = resolved_on("h100", evicting=True, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(EngineSettingError, match="raw bytes"):
        check_resolved(fp8, evicting=True)
    check_resolved(fp8, evicting=False)  # a full-context engine may quantize its KV


@pytest.mark.parametrize("engine, field", [
    ({"sampling_backend": "flashinfer"}, "models.helper.engine.sampling_backend"),
    ({"disable_overlap_schedule": False}, "models.helper.engine.disable_overlap_schedule"),
])
def test_settings_no_engine_can_run_under_are_refused_before_loading(tmp_path, cli, engine, field):
    require_sglang()
    path = tiny_pipeline(tmp_path, problems=1, extra={"models": {"helper": {"backend": "sglang", "engine": engine}}})
    result = cli("run", path)
    assert result.exit_code == 2 and field in result.output, result.output
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("engine, field", [
    ({"cuda_graph_config": {"prefill": {"backend": "breakable"}}}, "cuda_graph_config"),
    ({"enable_torch_compile": True}, "enable_torch_compile"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
    ({"enable_dp_attention": True}, "enable_dp_attention"),
    ({"attention_backend": "trtllm_mha"}, "attention_backend"),
    ({"decode_attention_backend": "trtllm_mha"}, "decode_attention_backend"),
])
def test_settings_an_evicted_proposer_cannot_run_under_are_refused_before_loading(tmp_path, cli, engine, field):
    require_sglang()
    path = tiny_pipeline(tmp_path, problems=1, evictor={"kind": "rkv", "budget": 16, "buffer": 16},
                         extra={"models": {"base": {"backend": "sglang", "engine": engine}}})
    result = cli("validate", path)
    assert result.exit_code == 2 and f"models.base.engine.{field}" in result.output, result.output
    # the same settings on a full-context engine are SGLang's business
    full = tiny_pipeline(tmp_path / "full", problems=1, extra={"models": {"helper": {"backend": "sglang",
                                                                                      "engine": engine}}})
    assert cli("validate", full).exit_code == 0


def _evicted_on_sglang(directory, model_dir, **engine):
    model = {"backend": "sglang", "id": str(model_dir), "engine": engine}
    return tiny_pipeline(directory, name="tripwire", problems=2, n=2, max_step_tokens=12, max_tokens=40,
                         evictor={"kind": "snapkv", "budget": 16, "buffer": 8, "window": 4}, helper=False,
                         extra={"models": {"base": model}, "run": {"batch_problems": 1}})


def test_a_decode_token_the_hooks_missed_stops_the_engine_and_the_rerun_resumes(tmp_path, cli, shared_tiny_qwen,
                                                                                 sglang_engine, monkeypatch):
    """A forward whose attention hooks did not run (what a replayed decode graph does; here
    forced by the plugin's fault injection on the 40th decode forward) stops the engine with
    the tripwire's message (exit 1), instead of compacting with stale query windows; the
    results directory keeps what finished, and the rerun (hooks running) resumes to the same
    trajectories as a run that never failed."""
    require_sglang()
    # the reference on the session's engine (held here: the run reuses it instead of starting one);
    # the faulty run on an engine of its own (a pool size that changes no token), so that the
    # fault reaches no other test
    reference = _evicted_on_sglang(tmp_path / "reference", shared_tiny_qwen)
    assert cli("run", reference).exit_code == 0
    engine = {"max_total_tokens": 60000}
    (ref_dir,) = (tmp_path / "reference" / "results").iterdir()

    from kvflow.backends.served.worker import _SHARED

    for worker in list(_SHARED.values()):  # the next run starts a worker that skips hooks once
        if ("max_total_tokens", "60000") in worker.key:
            worker.close()
    monkeypatch.setenv("KVFLOW_SGLANG_FAULT_SKIP_HOOKS", "40")
    path = _evicted_on_sglang(tmp_path / "faulty", shared_tiny_qwen, **engine)
    result = cli("run", path)
    assert result.exit_code == 1, result.output
    assert "kvflow tripwire: evicted request" in result.output and "disable_cuda_graph" in result.output, result.output
    assert "Traceback" not in result.output.split("end of the worker's log")[0]
    (run_dir,) = (tmp_path / "faulty" / "results").iterdir()
    samples = run_dir / "samples.jsonl"
    assert len(samples.read_text().splitlines() if samples.exists() else []) < 2

    monkeypatch.delenv("KVFLOW_SGLANG_FAULT_SKIP_HOOKS")
    assert cli("run", path).exit_code == 0
    assert committed_steps(run_dir) == committed_steps(ref_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    settings = manifest["engine_settings"]["base"]
    assert settings["sampling_backend"] == "pytorch" and settings["disable_cuda_graph"] is True
    assert settings["page_size"] == 1


def test_the_tripwire_counts_every_token_of_a_normal_run(sglang_engine):
    """The hooks observed as many tokens as the evicted requests wrote (the counter the
    tripwire checks), and the scheduler reports it."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.registry import get_registry
    from kvflow.testing.engine_contract import run_to_end
    from kvflow.testing.engine_parity import NEVER, chat_prompt

    before = sglang_engine.server_state()["observed_tokens"]
    cls = get_registry().get("evictors", "snapkv")
    ev = cls(cls.Params(budget=16, buffer=8, window=4))
    (state,) = sglang_engine.start([StartRequest(chat_prompt(sglang_engine), ev, 3)])
    props = run_to_end(sglang_engine, [ProposeRequest(state, "base", SamplingSpec(1, 0.0, 1.0, 40, NEVER), 0, 400)])
    sglang_engine.release([state], props)
    sglang_engine.drain()
    prompt = len(sglang_engine.encode(chat_prompt(sglang_engine)))
    # the prompt's ingest and the candidate's tokens (its first token is the prompt's pending one)
    assert sglang_engine.server_state()["observed_tokens"] - before >= prompt - 1 + 40 - 1


def test_a_users_decode_graph_settings_keep_kvflows_prefill_off(shared_tiny_qwen):
    """`engine: {cuda_graph_config: {decode: ...}}` merges per phase over kvflow's defaults, so
    the evicting engine still prefills without graphs; a prefill graph asked for is refused."""
    from kvflow.backends.sglang.settings import refusal

    ours = _kwargs(shared_tiny_qwen, True, cuda_graph_config={"decode": {"max_bs": 64}})["cuda_graph_config"]
    assert ours == {"decode": {"max_bs": 64}, "prefill": {"backend": "disabled"}}
    assert refusal({"cuda_graph_config": {"decode": {"max_bs": 64}}}, evicting=True) is None
    assert refusal({"cuda_graph_config": {"prefill": {"backend": "full"}}}, evicting=True)[0] == "engine.cuda_graph_config"


def test_separate_prefill_and_decode_backends_reach_kvflows_hook():
    """SGLang 0.5.23's HybridAttnBackend (separate prefill and decode backends) delegates
    `forward` to the chosen child's `forward`, and none of the backends kvflow serves overrides
    `forward`: the hooked `AttentionBackend.forward` runs for every layer, so an evicting engine
    may split them (each one a backend kvflow reads; refused only otherwise)."""
    import ast
    import inspect
    from pathlib import Path

    require_sglang()
    from sglang.srt.layers.attention import hybrid_attn_backend

    from kvflow.backends.sglang.settings import EVICTING_ATTENTION, refusal

    source = inspect.getsource(hybrid_attn_backend.HybridAttnBackend.forward)
    assert "backend.forward(" in source and "_select_backend" in source
    files = {"torch_native": "torch_native_backend.py", "triton": "triton_backend.py",
             "flashinfer": "flashinfer_backend.py", "fa3": "flashattention_backend.py"}
    assert set(files) == set(EVICTING_ATTENTION)
    folder = Path(hybrid_attn_backend.__file__).parent
    for name, file in files.items():
        tree = ast.parse((folder / file).read_text())
        backends = [c for c in tree.body if isinstance(c, ast.ClassDef)
                    and any(getattr(b, "id", None) == "AttentionBackend" for b in c.bases)]
        assert backends, name
        for cls in backends:
            assert not any(isinstance(f, ast.FunctionDef) and f.name == "forward" for f in cls.body), (name, cls.name)
    assert refusal({"prefill_attention_backend": "flashinfer", "decode_attention_backend": "triton"}, True) is None
    assert refusal({"decode_attention_backend": "trtllm_mha"}, True)[0] == "engine.decode_attention_backend"
