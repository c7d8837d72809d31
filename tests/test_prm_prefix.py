"""Prefix reuse on `hf` for `prm` and `llm_judge` (issue 26): scores with each problem's cached
prefix equal scores that re-encode every input (`prefix_reuse: false`) to 1e-4 in float32,
over several rounds of a growing trajectory, several problems at once, a rendering that
changes before its end (the judge's "(no steps yet)", a rewritten step), and after release;
and a round runs only the candidates' new tokens plus the newly committed step."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.components.base import Candidate, ScorerContext, ScoreRequest, Step, Trajectory
from kvflow.config.schema import ModelConfig
from kvflow.testing import tiny_runner
from kvflow_builtin.scorers.llm_judge import LLMJudgeScorer
from kvflow_builtin.scorers.prm import PRMScorer

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
COMMITTED = ["In May she sold 48 / 2 = 24 clips.\n\n", "Altogether she sold 48 + 24 = 72 clips.\n\n",
             "So the total is 72.\n\n", "Check: 72 - 48 = 24.\n\n"]
CANDIDATES = ["The answer is \\boxed{72}.", "She sold 1 clip.\n\n", "Step: 2 + 2 = 5", "  \n\n"]


def rounds(pid: str, committed=COMMITTED, question=QUESTION):
    """The score requests of each round of one problem whose trajectory grows by one step a round."""
    out = []
    for k in range(len(committed) + 1):
        traj = Trajectory(pid, question, "prompt", steps=[Step(s, "base", None, 1) for s in committed[:k]])
        out.append([ScoreRequest(traj, Candidate(0, "base", i, c, [1], [0.0], [0.0], "delimiter"))
                    for i, c in enumerate(CANDIDATES)])
    return out


def schedule():
    """Rounds of two problems at once (p1 a round behind), then p0 with a rewritten first step
    (a change before the end: the cache must crop), then p0 again after release."""
    a, b = rounds("p0"), rounds("p1", COMMITTED[::-1], "What is 2 + 2?")
    plan = [a[0], a[1] + b[0]] + [a[k] + b[k - 1] for k in range(2, len(a))]
    rewritten = rounds("p0", ["In May: 24 clips.\n\n"] + COMMITTED[1:])
    return plan + [rewritten[3], rewritten[2], "release p0", a[2]]


def run(scorer, plan) -> list[list[float]]:
    out = []
    for reqs in plan:
        if reqs == "release p0":
            scorer.release(["p0"])
            continue
        out.append(scorer.score(reqs))
    return out


def assert_same(got, want):
    for g_round, w_round in zip(got, want, strict=True):
        for g, w in zip(g_round, w_round, strict=True):
            assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, abs=1e-4), (got, want)


class _Session:
    def __init__(self, runner):
        self.runner = runner


def _ctx(runner=None, models=None):
    return ScorerContext(load_session=lambda key: _Session(runner), proposers=["base"], seed=0, models=models or {})


@pytest.fixture(scope="module")
def qwen_prm_dir(tmp_path_factory):
    from test_scorers import save_prm

    path = tmp_path_factory.mktemp("prm")
    save_prm(path, seed=4)
    return path


@pytest.mark.parametrize("how", ["last", "min"])
def test_qwen_prm_scores_with_and_without_prefix_reuse(qwen_prm_dir, how):
    models = {"prm": ModelConfig(id=str(qwen_prm_dir), dtype="float32", device="cpu")}
    make = lambda reuse: PRMScorer(PRMScorer.Params(model="prm", aggregate=how, prefix_reuse=reuse),  # noqa: E731
                                   _ctx(models=models))
    plan = schedule()
    reuse, plain = make(True), make(False)
    want = run(plain, plan)
    assert_same(run(reuse, plan), want)
    assert len({round(x, 6) for r in want for x in r if not math.isnan(x)}) > 10  # the scores do differ


def test_math_shepherd_scores_with_and_without_prefix_reuse():
    runner = tiny_runner("qwen2", seed=5)
    make = lambda reuse: PRMScorer(PRMScorer.Params(model="prm", protocol="math-shepherd",  # noqa: E731
                                                    aggregate="mean", prefix_reuse=reuse), _ctx(runner))
    plan = schedule()
    assert_same(run(make(True), plan), run(make(False), plan))


def test_llm_judge_scores_with_and_without_prefix_reuse():
    runner = tiny_runner("llama", seed=7)
    make = lambda reuse: LLMJudgeScorer(LLMJudgeScorer.Params(model="judge", prefix_reuse=reuse),  # noqa: E731
                                        _ctx(runner))
    plan = schedule()
    assert_same(run(make(True), plan), run(make(False), plan))


def test_a_round_runs_only_the_new_tokens(qwen_prm_dir):
    """After the first round, a round forwards the committed step once and each candidate's
    own tokens: the same number of tokens whatever the trajectory's length."""
    models = {"prm": ModelConfig(id=str(qwen_prm_dir), dtype="float32", device="cpu")}
    scorer = PRMScorer(PRMScorer.Params(model="prm"), _ctx(models=models))
    long = ["Step %d: x = %d + 1.\n\n" % (i, i) for i in range(40)]
    costs = []
    for k in (10, 11, 30, 31):  # p0 at 10 committed steps, then one more; p1 likewise at 30
        pid = "short" if k < 20 else "long"
        before = scorer.forward.tokens_run
        scorer.score(rounds(pid, long[: k + 1])[k])
        costs.append(scorer.forward.tokens_run - before)
    # a round after the first: the newly committed step + the candidates' tokens, not the trajectory
    assert costs[1] < costs[0] / 3 and costs[3] < costs[2] / 3
    assert abs(costs[3] - costs[1]) <= 4  # the same steps' lengths ("Step 10" vs "Step 30")


def test_prefix_forward_refuses_sliding_window_layers():
    from kvflow.backends.hf.scoring import PrefixForward

    body = torch.nn.Linear(2, 2)
    body.config = type("C", (), {"layer_types": ["full_attention", "sliding_attention"]})()
    with pytest.raises(ValueError, match="sliding-window"):
        PrefixForward(body, lambda h: h)
