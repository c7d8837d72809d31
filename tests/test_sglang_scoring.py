"""`prm` and `llm_judge` on SGLang (issue 26): the same scores as on `hf` (float32, tiny
random-weight models) to 1e-4, round after round of a growing trajectory, with SGLang's radix
cache serving each problem's committed prefix (a round runs only the candidates' tokens).

Engines: the session's shared tiny Qwen2 (conftest, judge and Math-Shepherd) and one tiny
Qwen2 PRM built here (kvflow's `Qwen2ForProcessRewardModel` registered in SGLang's model
registry by kvflow's plugin; a tokenizer with `<extra_0>` as one token)."""

from __future__ import annotations

import math

import pytest

from conftest import require_sglang
from kvflow.components.base import ScorerContext
from kvflow.config.schema import ModelConfig
from kvflow_builtin.scorers.llm_judge import LLMJudgeScorer
from kvflow_builtin.scorers.prm import PRMScorer
from test_prm_prefix import assert_same, rounds, run, schedule


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    from test_scorers import save_prm

    path = tmp_path_factory.mktemp("sglang-prm")
    save_prm(path, seed=4)
    return path


def sglang_context(model_dir, engine=None):
    from kvflow.backends.sglang import SGLangBackend

    cfg = ModelConfig(backend="sglang", id=str(model_dir), dtype="float32", device="cpu", engine=engine or {})
    return ScorerContext(load_session=lambda key: SGLangBackend.load(cfg, evicting=False).scoring_session(),
                         proposers=["base"], seed=0, models={"prm": cfg, "judge": cfg})


def hf_context(model_dir, runner=None):
    cfg = ModelConfig(id=str(model_dir), dtype="float32", device="cpu")
    return ScorerContext(load_session=lambda key: runner, proposers=["base"], seed=0, models={"prm": cfg, "judge": cfg})


def test_qwen_prm_on_sglang_equals_hf(prm_dir):
    require_sglang()
    params = dict(model="prm", aggregate="min")
    on_sglang = PRMScorer(PRMScorer.Params(**params),
                          sglang_context(prm_dir, PRMScorer.engine_settings(PRMScorer.Params(**params), "sglang")))
    on_hf = PRMScorer(PRMScorer.Params(**params, prefix_reuse=False), hf_context(prm_dir))
    plan = schedule()
    assert_same(run(on_sglang, plan), run(on_hf, plan))
    # a round at 30 committed steps runs about as many tokens as one at 10: the radix cache
    long = ["Step %d: x = %d + 1.\n\n" % (i, i) for i in range(40)]
    costs = []
    for k, pid in ((10, "a"), (11, "a"), (30, "b"), (31, "b")):
        before = on_sglang.forward.tokens_run
        on_sglang.score(rounds(pid, long[: k + 1])[k])
        costs.append(on_sglang.forward.tokens_run - before)
    assert costs[1] < costs[0] / 3 and costs[3] < costs[2] / 3, costs
    # a long new problem, 8 candidates at once (~10k tokens: more than SGLang's prefill chunk on
    # a CPU; the hidden states of a chunked prefill would come back for its last chunk only)
    from kvflow.components.base import Candidate, ScoreRequest, Step, Trajectory

    traj = Trajectory("c", "A long one: add 3k + 7 for k = 0..59.", "prompt",
                      steps=[Step(f"Step {i}: x{i} = {i} * 3 + 7 = {3 * i + 7}.\n\n", "base", None, 1) for i in range(60)])
    big = [ScoreRequest(traj, Candidate(0, "base", c, f"So x = {c}." + " Check." * c, [1], [0.0], [0.0], "delimiter"))
           for c in range(8)]
    assert_same([on_sglang.score(big)], [on_hf.score(big)])
    # a fresh scorer (nothing kept) on prefixes the engine has cached asks again, capped: same scores
    fresh = PRMScorer(PRMScorer.Params(**params),
                      sglang_context(prm_dir, PRMScorer.engine_settings(PRMScorer.Params(**params), "sglang")))
    assert_same(run(fresh, plan[:3]), run(on_hf, plan[:3]))


@pytest.mark.parametrize("scorer", ["judge", "math-shepherd"])
def test_causal_lm_scorers_on_sglang_equal_hf(scorer, shared_tiny_qwen, sglang_engine, hf_engine):
    if scorer == "judge":
        make = lambda ctx, **kw: LLMJudgeScorer(LLMJudgeScorer.Params(model="judge", **kw), ctx)  # noqa: E731
    else:
        make = lambda ctx, **kw: PRMScorer(PRMScorer.Params(model="prm", protocol="math-shepherd",  # noqa: E731
                                                            aggregate="prod", **kw), ctx)
    on_sglang = make(sglang_context(shared_tiny_qwen))
    on_hf = make(hf_context(shared_tiny_qwen, hf_engine.scoring_session()), prefix_reuse=False)
    plan = schedule()
    got, want = run(on_sglang, plan), run(on_hf, plan)
    assert_same(got, want)
    assert len({round(x, 6) for r in want for x in r if not math.isnan(x)}) > 5


def test_qwen_prm_on_sglang_refuses_a_causal_lm(shared_tiny_qwen):
    from kvflow.errors import UserError

    with pytest.raises(UserError, match="not a process reward model"):
        PRMScorer(PRMScorer.Params(model="prm"), sglang_context(shared_tiny_qwen))


def test_a_prm_engine_on_sglang_gets_hidden_states_and_keeps_its_own_settings():
    """compile.scorer_engines: the PRM's SGLang engine is asked for enable_return_hidden_states
    (the head's outputs come back that way), under the entry's own settings; hf entries and
    causal-LM protocols are left alone. No engine starts."""
    from conftest import REPO
    from kvflow.config import load_pipeline
    from kvflow.runtime.compile import scorer_engines

    loaded = load_pipeline(REPO / "pipelines" / "sglang" / "kv_rescue.yaml")
    prm = scorer_engines(loaded).pipeline.models["prm"]
    assert prm.engine == {"enable_return_hidden_states": True, "chunked_prefill_size": -1,
                          "mem_fraction_static": 0.3}
    assert scorer_engines(loaded).pipeline.models["helper"] == loaded.pipeline.models["helper"]
    on_hf = load_pipeline(REPO / "pipelines" / "kv_rescue.yaml")
    assert scorer_engines(on_hf).pipeline.models["prm"].engine == on_hf.pipeline.models["prm"].engine
    assert PRMScorer.engine_settings(PRMScorer.Params(model="m", protocol="math-shepherd"), "sglang") == {}


def test_prefix_reuse_false_on_sglang_is_refused_naming_the_field(write, cli):
    """At validate time, with the file and line (no engine needed)."""
    from conftest import REPO

    for kind in ("prm", "llm_judge"):
        path = write(f"{kind}.yaml", f"""
            include: {REPO / "pipelines" / "sglang" / "kv_rescue.yaml"}
            scorer: {{kind: {kind}, model: prm, prefix_reuse: false}}
            """)
        if kind == "llm_judge":
            path.write_text(path.read_text().replace("model: prm, prefix_reuse", "model: helper, prefix_reuse"))
        result = cli("validate", path)
        assert result.exit_code == 2, result.output
        assert f"{kind}.yaml:2: scorer.prefix_reuse" in result.output and ".backend" in result.output, result.output


def test_new_queries_only_equals_sglangs_extend_attention():
    """kvflow's extend attention for PRM engines (new queries only) == SGLang's torch_native
    one (a query for every position) on random rows with cached prefixes of several lengths."""
    require_sglang()
    import torch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from kvflow.backends.sglang.in_worker.prm_model import new_queries_only

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    prefix, new = torch.tensor([0, 5, 17]), torch.tensor([6, 3, 9])
    lengths = prefix + new
    slots = 96
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    req_to_token = torch.randperm(slots)[: 3 * 30].reshape(3, 30)
    query = torch.randn(int(new.sum()), heads, dim)
    args = (k_cache, v_cache, req_to_token, torch.arange(3), lengths, prefix, new, None)
    kw = dict(scaling=dim ** -0.5, enable_gqa=True, causal=True)
    want = TorchNativeAttnBackend._run_sdpa_forward_extend(None, query, torch.zeros_like(query), *args, **kw)
    got = new_queries_only(None, None, query, torch.zeros_like(query), *args, **kw)
    assert torch.allclose(got, want, atol=1e-5)
