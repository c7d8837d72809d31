"""`run.deterministic`: batch-invariant decoding on every backend that has it, refused where not.

Each backend says what it takes (`Backend.batch_invariant(model_cfg)`). On `hf` torch's
deterministic algorithms and kvflow's batch-invariant forwards (recorded in the manifest's
engine settings; tests/test_batch_invariant.py checks the bits); on SGLang its
`enable_deterministic_inference` and on vLLM its `VLLM_BATCH_INVARIANT` mode, both on a GPU:
refused on a CPU, naming the field.
"""

from __future__ import annotations

import json

import pytest

from conftest import committed_steps, require_sglang
from kvflow.config.validate import load_pipeline
from kvflow.runtime.compile import deterministic_engines
from kvflow.testing import tiny_pipeline


def test_hf_runs_with_deterministic_algorithms_and_the_same_trajectories(tmp_path, cli):
    import torch

    runs = {}
    for flag in (False, True):
        path = tiny_pipeline(tmp_path / str(flag), problems=2, extra={"run": {"deterministic": flag}})
        result = cli("run", path)
        assert result.exit_code == 0, result.output
        (run_dir,) = (tmp_path / str(flag) / "results").iterdir()
        runs[flag] = committed_steps(run_dir)
        settings = json.loads((run_dir / "manifest.json").read_text())["engine_settings"]
        assert {s["deterministic_algorithms"] for s in settings.values()} == {flag}
        assert {s["batch_invariant"] for s in settings.values()} == {flag}
    assert runs[True] == runs[False]  # float32 tiny models: the last bits do not flip a token here
    assert not torch.are_deterministic_algorithms_enabled()  # restored for the caller


def test_gpu_engines_ask_for_their_batch_invariant_modes(tmp_path):
    from kvflow.backends.vllm.settings import engine_kwargs, worker_env

    for backend, settings in (("sglang", {"enable_deterministic_inference": True}), ("vllm", {"batch_invariant": True})):
        path = tiny_pipeline(tmp_path / backend, problems=1, extra={
            "run": {"deterministic": True}, "models": {"helper": {"backend": backend, "device": "cuda"}}})
        models = deterministic_engines(load_pipeline(path)).pipeline.models
        assert models["helper"].engine == settings
        assert not models["base"].engine  # hf: torch's settings and kvflow's forwards, no engine arguments
    kwargs = engine_kwargs(models["helper"])
    assert worker_env(kwargs)["VLLM_BATCH_INVARIANT"] == "1" and kwargs["batch_invariant"] is True
    assert "VLLM_BATCH_INVARIANT" not in worker_env(engine_kwargs(models["base"].model_copy(update={"backend": "vllm"})))


def test_a_user_cannot_set_vllms_batch_invariant_setting_themselves(tmp_path, cli):
    path = tiny_pipeline(tmp_path, problems=1, extra={
        "models": {"helper": {"backend": "vllm", "engine": {"batch_invariant": True}}}})
    result = cli("run", path)
    assert result.exit_code == 2 and "models.helper.engine.batch_invariant" in result.output
    assert "run.deterministic" in result.output and not (tmp_path / "results").exists()


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_deterministic_on_a_cpu_engine_without_a_mode_is_refused_before_anything_loads(tmp_path, backend):
    from kvflow.errors import UserError
    from kvflow.runtime.compile import deterministic_problems

    path = tiny_pipeline(tmp_path, problems=1, extra={"run": {"deterministic": True},
                                                        "models": {"helper": {"backend": backend, "device": "cpu"}}})
    problems = deterministic_problems(load_pipeline(path))
    assert len(problems) == 1
    text = str(UserError(problems))
    assert "run.deterministic" in text and "models.helper" in text and "GPU" in text


def test_deterministic_sglang_on_a_cpu_is_refused_naming_the_field(tmp_path, cli):
    require_sglang()
    path = tiny_pipeline(tmp_path, problems=1, extra={"run": {"deterministic": True},
                                                        "models": {"helper": {"backend": "sglang", "device": "cpu"}}})
    result = cli("run", path)
    assert result.exit_code == 2 and "run.deterministic" in result.output and "models.helper" in result.output
    assert not (tmp_path / "results").exists()
