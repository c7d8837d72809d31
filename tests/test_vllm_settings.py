"""The `vllm` backend's refusals, said before any engine starts (no vLLM needed: the quick tier):
what it does not run yet (evicted proposers off a CPU, with graphs or quantized KV), the
engine settings kvflow sets or depends on, and a missing vLLM environment, each with exit code 2
naming the field, nothing written. The engine itself is tested in tests/test_vllm.py,
tests/test_vllm_evicted.py and tests/test_engine_contract.py."""

from __future__ import annotations

from kvflow.testing import tiny_pipeline


def _on_vllm(tmp_path, *keys: str, engine=None, **kw):
    """A tiny pipeline with models `keys` (default: the helper) on backend vllm (with `engine:` settings)."""
    models = {key: {"backend": "vllm", **({"engine": engine} if engine else {})} for key in keys or ("helper",)}
    return tiny_pipeline(tmp_path, problems=1, extra={"models": models}, **kw)


def test_an_evicted_proposer_on_vllm_validates_on_a_cpu(tmp_path, cli):
    path = _on_vllm(tmp_path, "base", evictor={"kind": "rkv", "budget": 16, "buffer": 8, "window": 4})
    result = cli("validate", path)
    assert result.exit_code == 0, result.output


def test_an_evicted_proposer_on_vllm_is_refused_where_it_cannot_run(tmp_path, cli):
    """Uniform budgets run in vLLM's blocks on any device, graphs on (R-KV and H2O on CUDA
    validate); budgets that vary by layer run beside them on a CPU, eagerly; H2O's statistic is
    kept for rows up to KVFLOW_VLLM_STAT_SPAN slots; quantized KV is hf's. Each refusal names
    the field. (An evictor's own observe() under graphs: the worker's refusal, below.)"""
    rkv = {"kind": "rkv", "budget": 16, "buffer": 8, "window": 4}
    pyramid = {"kind": "pyramidkv", "budget": 16, "buffer": 8, "window": 4}
    h2o = {"kind": "h2o", "budget": 16, "buffer": 8}
    cases = [({"device": "cuda"}, pyramid, "models.base.device", "on a CPU only"),
             ({"engine": {"enforce_eager": False}}, pyramid, "models.base.engine.enforce_eager", "enforce_eager: false"),
             ({}, {**h2o, "buffer": 600}, "proposers.base.evictor.buffer", "KVFLOW_VLLM_STAT_SPAN"),
             ({}, {"kind": "breadthkv", "budget": 64, "buffer": 32, "window": 4}, "proposers.base.evictor.quantize",
              "quantized KV")]
    for i, (entry, evictor, where, words) in enumerate(cases):
        path = tiny_pipeline(tmp_path / str(i), problems=1, evictor=evictor,
                             extra={"models": {"base": {"backend": "vllm", **entry}}})
        result = cli("validate", path)
        assert result.exit_code == 2, (where, result.output)
        assert where in result.output and words in result.output, result.output
        assert "Traceback" not in result.output
    for i, (entry, evictor) in enumerate([({"device": "cuda", "engine": {"enforce_eager": False}}, rkv),
                                          ({"device": "cuda", "engine": {"enforce_eager": False}}, h2o),
                                          ({}, pyramid)]):
        path = tiny_pipeline(tmp_path / f"ok{i}", problems=1, evictor=evictor,
                             extra={"models": {"base": {"backend": "vllm", **entry}}})
        result = cli("validate", path)
        assert result.exit_code == 0, (entry, evictor, result.output)


def test_prm_and_judge_on_vllm_validate_and_a_prm_engine_pools(tmp_path, cli):
    """prm and llm_judge run on vLLM (tests/test_vllm_scoring.py); `prefix_reuse: false` (hf's
    re-encoding) is refused naming the field; a Qwen2.5-Math-PRM's engine is vLLM's pooling
    runner with every position pooled, under the entry's own settings. No engine starts."""
    from kvflow.config import load_pipeline
    from kvflow.runtime.compile import scorer_engines

    for i, scorer in enumerate([{"kind": "prm", "model": "helper", "protocol": "math-shepherd"},
                                {"kind": "llm_judge", "model": "helper"}]):
        result = cli("validate", _on_vllm(tmp_path / str(i), scorer=scorer))
        assert result.exit_code == 0, result.output
        result = cli("validate", _on_vllm(tmp_path / f"{i}-no-reuse", scorer={**scorer, "prefix_reuse": False}))
        assert result.exit_code == 2, result.output
        assert "scorer.prefix_reuse" in result.output and "'vllm'" in result.output, result.output
    path = _on_vllm(tmp_path / "qwen", engine={"max_num_seqs": 8},
                    scorer={"kind": "prm", "model": "helper", "protocol": "qwen25-math-prm"})
    helper = scorer_engines(load_pipeline(path)).pipeline.models["helper"]
    assert helper.engine == {"runner": "pooling", "pooler_config": {"tok_pooling_type": "ALL"}, "max_num_seqs": 8}


def test_engine_settings_kvflow_sets_or_needs_are_refused_before_loading(tmp_path, cli):
    cases = [({"model": "/elsewhere"}, "models.helper.engine.model", "set by kvflow from the model entry's `id`"),
             ({"logprobs_mode": "processed_logprobs"}, "models.helper.engine.logprobs_mode", "raw_logprobs"),
             ({"max_logprobs": 5}, "models.helper.engine.max_logprobs", "top 20")]
    for i, (engine, where, words) in enumerate(cases):
        path = _on_vllm(tmp_path / str(i), engine=engine)
        result = cli("run", path)
        assert result.exit_code == 2, (where, result.output)
        assert where in result.output and words in result.output, result.output
        assert not (tmp_path / str(i) / "results").exists()  # nothing written


def test_a_missing_vllm_environment_says_how_to_make_it(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("KVFLOW_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    path = _on_vllm(tmp_path)
    result = cli("run", path)
    assert result.exit_code == 2, result.output
    assert "models.helper.id" in result.output and "KVFLOW_VLLM_PYTHON" in result.output, result.output
    assert "scripts/install.sh vllm" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_vllm_is_found_by_its_environment_variable_or_beside_kvflow(tmp_path, monkeypatch):
    from kvflow.backends.vllm import settings

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setenv(settings.PYTHON_ENV, str(python))
    assert settings.vllm_python() == python
    monkeypatch.setenv(settings.PYTHON_ENV, str(tmp_path / "missing"))
    assert settings.vllm_python() is None  # a named interpreter that is not there is not replaced by a guess
    monkeypatch.delenv(settings.PYTHON_ENV)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert settings.vllm_python() == tmp_path / ".venv-vllm" / "bin" / "python"


def test_run_deterministic_with_a_model_on_vllm_is_refused(tmp_path, cli):
    path = tiny_pipeline(tmp_path, problems=1, extra={"models": {"helper": {"backend": "vllm"}},
                                                      "run": {"deterministic": True}})
    result = cli("run", path)
    assert result.exit_code == 2, result.output
    assert "run.deterministic" in result.output and "models.helper runs on vLLM" in result.output, result.output


def test_explain_says_how_vllm_serves_the_model(tmp_path, cli):
    path = tiny_pipeline(tmp_path, problems=1, extra={"models": {"helper": {"backend": "vllm"}},
                                                      "scorer": {"kind": "likelihood", "model": "helper"}})
    result = cli("explain", path)
    assert result.exit_code == 0, result.output
    assert "models helper [vllm]: helper" in result.output and "scorer likelihood" in result.output
    assert "vLLM in a worker process" in result.output and "logprobs_mode=raw_logprobs" in result.output


def test_the_worker_says_why_an_engine_cannot_run_evicted_requests():
    """What the vLLM worker answers an evicted request on an engine kvflow's hooks do not cover
    (`evict.Runtime.refusal`), from what vLLM resolved: hooks not installed, a varying budget
    where it cannot run beside vLLM's blocks (graphs, another device), a query window past the
    ring's, an evictor observing with its own observe() under replayed graphs, H2O past the
    statistic's table."""
    from kvflow.backends.vllm.in_worker.evict import Runtime
    from kvflow.registry import get_registry
    from kvflow.testing.third_party import OwnObserveH2O

    def evictor(kind, **params):
        cls = get_registry().get("evictors", kind)
        return cls(cls.Params(**params))

    rkv = evictor("rkv", budget=16, buffer=8, window=4)
    pyramid = evictor("pyramidkv", budget=16, buffer=8, window=4)
    h2o = evictor("h2o", budget=16, buffer=8)
    runtime = Runtime()
    runtime.layers = 4
    assert "hooks were not installed" in runtime.refusal(rkv)
    runtime.installed, runtime.backend = True, "CPU_ATTN"
    assert runtime.refusal(rkv) is None and runtime.refusal(pyramid) is None and runtime.refusal(h2o) is None
    assert "window 64 is past" in runtime.refusal(evictor("rkv", budget=128, buffer=8, window=64))
    assert "KVFLOW_VLLM_STAT_SPAN" in runtime.refusal(evictor("h2o", budget=500, buffer=100))
    own = OwnObserveH2O(OwnObserveH2O.Params(budget=16, buffer=8))
    assert runtime.refusal(own) is None
    runtime.graphs = True
    assert "observe()" in runtime.refusal(own) and runtime.refusal(h2o) is None and runtime.refusal(rkv) is None
    runtime.mixed_graphs = True
    assert "cudagraph_mode FULL" in runtime.refusal(h2o) and runtime.refusal(rkv) is None
    runtime.mixed_graphs = False
    assert "eager" in runtime.refusal(pyramid)
    runtime.graphs, runtime.backend, runtime.device = False, "FLASH_ATTN", "cuda"
    assert runtime.refusal(rkv) is None and "CPU" in runtime.refusal(pyramid)
    runtime.problem = "several KV cache groups"
    assert runtime.refusal(rkv) == "several KV cache groups"


def test_a_vllm_worker_alone_on_the_cpu_waits_actively_and_one_beside_others_takes_its_share(tmp_path, monkeypatch):
    """`Backend.cpu_settings`: the run's only engine on the CPU (base and helper on one vLLM
    model entry) gets `openmp_spin` (its idle OpenMP threads spin ~0.4 ms before sleeping:
    GOMP_SPINCOUNT in the worker's environment); beside another engine (a second vLLM entry, an
    `hf` one) it gets its share of the cores (`openmp_threads`: OMP_NUM_THREADS) and waits
    passively; Ray workers are left as they are; the entry's own setting and the caller's
    environment win."""
    from kvflow.backends.served import settings
    from kvflow.backends.served.settings import OPENMP_SPIN_COUNT
    from kvflow.backends.vllm.settings import engine_kwargs, worker_env
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.compile import cpu_engines

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(settings, "usable_cores", lambda: 4)
    on_vllm = {"models": {"base": {"backend": "vllm"}, "helper": {"backend": "vllm"}}}

    def engines(name: str, extra: dict) -> dict:
        path = tiny_pipeline(tmp_path / name, problems=1, extra=extra)
        models = cpu_engines(load_pipeline(path)).pipeline.models
        return {key: models[key].engine or {} for key in ("base", "helper")}

    alone = engines("alone", {**on_vllm, "proposers": {"helper": {"model": "base"}}})
    assert alone == {"base": {"openmp_spin": True}, "helper": {}}  # helper: unused
    env = worker_env(engine_kwargs(load_pipeline(tmp_path / "alone" / "tiny.yaml").pipeline.models["base"]
                                   .model_copy(update={"engine": alone["base"]})))
    assert env["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_NUM_THREADS" not in env
    assert engines("two", on_vllm) == {"base": {"openmp_threads": 2}, "helper": {"openmp_threads": 2}}
    assert engines("beside_hf", {"models": {"base": {"backend": "vllm"}}}) == {"base": {"openmp_threads": 2},
                                                                                 "helper": {}}
    env = worker_env({"openmp_threads": 2})
    assert env["OMP_NUM_THREADS"] == "2" and "GOMP_SPINCOUNT" not in env
    assert engines("ray", {**on_vllm, "proposers": {"helper": {"model": "base"}},
                           "run": {"executor": "ray"}})["base"] == {}
    own = engines("own", {"models": {"base": {"backend": "vllm", "engine": {"openmp_spin": False}},
                                     "helper": {"backend": "vllm"}}, "proposers": {"helper": {"model": "base"}}})
    assert own["base"] == {"openmp_spin": False}
    assert "GOMP_SPINCOUNT" not in worker_env({"openmp_spin": False})
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert worker_env({"openmp_spin": True})["GOMP_SPINCOUNT"] == "0"
    from kvflow.backends.base import backend_named

    sglang = backend_named("sglang")  # its cores are SGLang's own binding: only the wait is kvflow's
    assert sglang.cpu_settings(None, 1) == {"openmp_spin": True} and sglang.cpu_settings(None, 2) == {}
