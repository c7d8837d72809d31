"""`prm` and `llm_judge` on vLLM (issue 41): the same scores as on `hf` (float32, tiny
random-weight models) to 1e-4, round after round of a growing trajectory.

Engines: a tiny Qwen2 PRM built here (vLLM's own `Qwen2ForProcessRewardModel` on its pooling
runner, every position's logits), and the head_dim-32 tiny Qwen2 the other vLLM tests run for
the judge and Math-Shepherd (label log-probabilities, one one-token request per tag position,
reading vLLM's prefix cache)."""

from __future__ import annotations

import math

import pytest

from conftest import require_vllm
from kvflow.components.base import ScorerContext
from kvflow.config.schema import ModelConfig
from kvflow.testing.engine_parity import backend_model_dir, load_engine
from kvflow_builtin.scorers.llm_judge import LLMJudgeScorer
from kvflow_builtin.scorers.prm import PRMScorer
from test_prm_prefix import assert_same, run, schedule
from test_sglang_scoring import hf_context


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    from test_scorers import save_prm

    path = tmp_path_factory.mktemp("vllm-prm")
    save_prm(path, seed=4, head_dim=32)
    return path


def vllm_context(model_dir, engine=None):
    from kvflow.backends.vllm import VLLMBackend

    cfg = ModelConfig(backend="vllm", id=str(model_dir), dtype="float32", device="cpu", engine=engine or {})
    return ScorerContext(load_session=lambda key: VLLMBackend.load(cfg).scoring_session(),
                         proposers=["base"], seed=0, models={"prm": cfg, "judge": cfg})


def test_qwen_prm_on_vllm_equals_hf(prm_dir):
    require_vllm()
    params = PRMScorer.Params(model="prm", aggregate="min")
    settings = PRMScorer.engine_settings(params, "vllm")
    assert settings["runner"] == "pooling"
    on_vllm = PRMScorer(params, vllm_context(prm_dir, settings))
    on_hf = PRMScorer(PRMScorer.Params(model="prm", aggregate="min", prefix_reuse=False), hf_context(prm_dir))
    try:
        plan = schedule()
        got, want = run(on_vllm, plan), run(on_hf, plan)
        assert_same(got, want)
        assert len({round(x, 6) for r in want for x in r if not math.isnan(x)}) > 5
        assert on_vllm.forward.requests > 0
    finally:
        on_vllm.forward.engine.close()


@pytest.mark.parametrize("scorer", ["judge", "math-shepherd"])
def test_causal_lm_scorers_on_vllm_equal_hf(scorer, causal_engines):
    on_vllm_session, hf_engine, model_dir = causal_engines
    if scorer == "judge":
        make = lambda ctx, **kw: LLMJudgeScorer(LLMJudgeScorer.Params(model="judge", **kw), ctx)  # noqa: E731
    else:
        make = lambda ctx, **kw: PRMScorer(PRMScorer.Params(model="prm", protocol="math-shepherd",  # noqa: E731
                                                            aggregate="prod", **kw), ctx)
    cfg = ModelConfig(backend="vllm", id=str(model_dir), dtype="float32", device="cpu")
    on_vllm = make(ScorerContext(load_session=lambda key: on_vllm_session, proposers=["base"], seed=0,
                                 models={"prm": cfg, "judge": cfg}))
    on_hf = make(hf_context(model_dir, hf_engine.scoring_session()), prefix_reuse=False)
    plan = schedule()
    got, want = run(on_vllm, plan), run(on_hf, plan)
    assert_same(got, want)
    assert len({round(x, 6) for r in want for x in r if not math.isnan(x)}) > 5


@pytest.fixture(scope="module")
def causal_engines():
    require_vllm()
    engine = load_engine("vllm")
    yield engine.scoring_session(), load_engine("hf", backend_model_dir("vllm")), backend_model_dir("vllm")
    engine.close()


def test_qwen_prm_on_vllm_refuses_a_causal_lm():
    from kvflow.errors import UserError

    with pytest.raises(UserError, match="not a process reward model"):
        PRMScorer(PRMScorer.Params(model="prm"), vllm_context(backend_model_dir("vllm")))


def test_a_long_trajectory_on_vllm_equals_hf(prm_dir, causal_engines):
    """Math-Shepherd over a trajectory of 60 steps (past several of vLLM's 128-token blocks): the
    first round asks every tag, the next only the newly committed step's and the candidates' (the
    committed tags' values are kept), reading the trajectory from vLLM's prefix cache."""
    from kvflow.components.base import Candidate, ScoreRequest, Step, Trajectory

    on_vllm_session, hf_engine, model_dir = causal_engines
    cfg = ModelConfig(backend="vllm", id=str(model_dir), dtype="float32", device="cpu")
    params = dict(model="prm", protocol="math-shepherd", aggregate="min")
    on_vllm = PRMScorer(PRMScorer.Params(**params), ScorerContext(
        load_session=lambda key: on_vllm_session, proposers=["base"], seed=0, models={"prm": cfg}))
    on_hf = PRMScorer(PRMScorer.Params(**params, prefix_reuse=False), hf_context(model_dir, hf_engine.scoring_session()))
    steps = [Step(f"Step {i}: x{i} = {i} * 3 + 7 = {3 * i + 7}.\n\n", "base", None, 1) for i in range(60)]
    asked = []
    for k in (59, 60):
        traj = Trajectory("c", "A long one: add 3k + 7 for k = 0..59.", "prompt", steps=steps[:k])
        reqs = [ScoreRequest(traj, Candidate(0, "base", c, f"So x = {c}.", [1], [0.0], [0.0], "delimiter"))
                for c in range(4)]
        before, cached = on_vllm.forward.tokens_run, on_vllm_session.engine.counters["cached_tokens"]
        assert_same([on_vllm.score(reqs)], [on_hf.score(reqs)])
        asked.append(on_vllm.forward.tokens_run - before)
        assert on_vllm_session.engine.counters["cached_tokens"] > cached  # whole 128-token blocks
    assert asked[1] < asked[0] / 10, asked
