"""`run.deterministic`: deterministic kernels where the engine has them, refused where not.

On `hf` it turns on torch's deterministic algorithms (recorded in the manifest's engine
settings; on this CPU the trajectories equal the default run's); on SGLang it asks for
SGLang's batch-invariant inference, which needs a GPU: refused on a CPU, naming the field.
"""

from __future__ import annotations

import json

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
    assert runs[True] == runs[False]
    assert not torch.are_deterministic_algorithms_enabled()  # restored for the caller


def test_sglang_engines_ask_for_batch_invariant_inference(tmp_path):
    path = tiny_pipeline(tmp_path, problems=1, extra={"run": {"deterministic": True},
                                                        "models": {"helper": {"backend": "sglang"}}})
    models = deterministic_engines(load_pipeline(path)).pipeline.models
    assert models["helper"].engine == {"enable_deterministic_inference": True}
    assert not models["base"].engine  # hf: torch's settings, no engine arguments


def test_deterministic_sglang_on_a_cpu_is_refused_naming_the_field(tmp_path, cli):
    require_sglang()
    path = tiny_pipeline(tmp_path, problems=1, extra={"run": {"deterministic": True},
                                                        "models": {"helper": {"backend": "sglang", "device": "cpu"}}})
    result = cli("run", path)
    assert result.exit_code == 2 and "run.deterministic" in result.output and "models.helper" in result.output
    assert not (tmp_path / "results").exists()
