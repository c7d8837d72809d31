"""Scorers on tiny real models: the PRM protocols (tag positions, class read, batching,
refusals), the LLM judge against a manual computation, aggregation and step normalisation."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

from kvflow.components.base import Candidate, ScorerContext, ScoreRequest, Step, Trajectory
from kvflow.config.schema import ModelConfig
from kvflow.errors import UserError
from kvflow.testing import tiny_model, tiny_runner, tiny_tokenizer
from kvflow_builtin.scorers._steps import aggregate, normalise_step, steps_for
from kvflow_builtin.scorers.llm_judge import LLMJudgeScorer, judge_messages
from kvflow_builtin.scorers.prm import QWEN_SYSTEM, QWEN_TAG, PRMScorer, QwenPRMFormat, ShepherdFormat


QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
STEPS = ["In May she sold 48 / 2 = 24 clips.\n\n", "Altogether she sold 48 + 24 = 72 clips.\n\n"]
CANDIDATES = ["The answer is \\boxed{72}.", "She sold 1 clip.\n\n", "Step: 2 + 2 = 5"]


def traj(steps=STEPS, pid="p0"):
    return Trajectory(pid, QUESTION, "prompt", steps=[Step(s, "base", None, 1) for s in steps])


def cand(text, source="base", index=0):
    return Candidate(0, source, index, text, [1], [0.0], [0.0], "delimiter")


def requests():
    return [ScoreRequest(traj(), cand(c, index=i)) for i, c in enumerate(CANDIDATES)] + [
        ScoreRequest(traj([]), cand("First step: 48 / 2 = 24.\n\n", "helper")),
        ScoreRequest(traj(STEPS[:1], "p1"), cand("  \n\n", "helper", 1)),  # empty after normalisation
    ]


# what each request of requests() is scored on, written out by hand (not by the code under test)
S1, S2 = "In May she sold 48 / 2 = 24 clips.", "Altogether she sold 48 + 24 = 72 clips."
EXPECTED_STEPS = [[S1, S2, "The answer is \\boxed{72}."], [S1, S2, "She sold 1 clip."], [S1, S2, "Step: 2 + 2 = 5"],
                  ["First step: 48 / 2 = 24."], [S1]]
AGGREGATE = {"last": lambda xs: xs[-1], "min": min, "prod": math.prod, "mean": lambda xs: sum(xs) / len(xs)}


# --------------------------------------------------------------------------- helpers


def test_aggregate_functions():
    xs = [0.9, 0.5, 0.8]
    assert aggregate(xs, "last") == 0.8
    assert aggregate(xs, "min") == 0.5
    assert aggregate(xs, "prod") == pytest.approx(0.36)
    assert aggregate(xs, "mean") == pytest.approx(2.2 / 3)
    assert math.isnan(aggregate([], "last"))
    with pytest.raises(ValueError):
        aggregate(xs, "max")


def test_steps_are_normalised_before_tagging():
    assert normalise_step("  a = 1.\n\n\n\n") == "a = 1."
    assert normalise_step("x <step><step>", "<step>") == "x"
    t = traj(["a.\n\n", "\n\n", "b.\n\n"])
    assert steps_for(t, cand("c.\n\n")) == (["a.", "b.", "c."], True)
    assert steps_for(t, cand(" \n\n")) == (["a.", "b."], False)


# --------------------------------------------------------------------------- qwen25-math-prm


def prm_tokenizer():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": [QWEN_TAG]})
    return tok


def save_prm(path, *, head_bias=None, arch="Qwen2ForProcessRewardModel", drop_head=False, seed=0, head_dim=16):
    """A tiny Qwen2 PRM checkpoint (kvflow's rebuild of the architecture) under `path` (4 query
    heads of `head_dim`: vLLM's CPU attention takes 32 and up)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config

    from kvflow.backends.hf.prm import Qwen2ForProcessRewardModel

    tok = prm_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForProcessRewardModel(config).eval()
    with torch.no_grad():
        model.score[2].weight.mul_(20)  # spread the class-1 probabilities away from 0.5
        if head_bias is not None:  # a head whose output does not depend on the input
            model.score[2].weight.zero_()
            model.score[2].bias.copy_(torch.tensor(head_bias))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))
    if drop_head:
        sd = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.startswith("score.")}
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return model, tok


def prm_scorer(path, **params):
    models = {"prm": ModelConfig(id=str(path), dtype="float32", device="cpu")}
    ctx = ScorerContext(load_session=None, proposers=["base", "helper"], seed=0, models=models)
    return PRMScorer(PRMScorer.Params(model="prm", **params), ctx)


def manual_qwen(model, tok, steps):
    messages = [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": QWEN_TAG.join(steps) + QWEN_TAG}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])), dim=-1)[0, :, 1]
    tag = tok.convert_tokens_to_ids(QWEN_TAG)
    return [float(probs[i]) for i, t in enumerate(ids) if t == tag]


def test_qwen_prm_tags_every_step_once(tmp_path):
    _, tok = save_prm(tmp_path)
    fmt = QwenPRMFormat(tok)
    steps = ["a = 1.", "b = 2.", "c = 3."]
    ids, positions = fmt.build("Q <extra_0> ?", steps)
    assert len(positions) == 3 and all(ids[p] == fmt.tag_id for p in positions)
    text = tok.decode(ids)
    assert text.count(QWEN_TAG) == 3  # the literal tag in the question was removed
    assert tok.decode(ids[: positions[0]]).endswith("a = 1.")
    assert tok.decode(ids[positions[0] + 1 : positions[1]]) == "b = 2."
    assert tok.decode(ids[positions[2] + 1:]).startswith("<|im_end|>")  # trailing tag, then the turn ends


def test_qwen_prm_reads_class_1_at_the_tags(tmp_path):
    save_prm(tmp_path, head_bias=[0.0, 2.0])  # P(class 1) = sigmoid(2) whatever the input
    scorer = prm_scorer(tmp_path)
    scores = scorer.score(requests())
    assert scores == pytest.approx([1 / (1 + math.exp(-2.0))] * len(scores), abs=1e-6)


def test_qwen_prm_batched_scores_match_a_manual_forward(tmp_path):
    model, _ = save_prm(tmp_path, seed=3)
    reqs = requests()
    for how in ("last", "min", "prod", "mean"):
        scorer = prm_scorer(tmp_path, aggregate=how, batch_tokens=300)  # several chunks
        tok = scorer.format.tokenizer  # as reloaded from the checkpoint directory
        got = scorer.score(reqs)
        for steps, g in zip(EXPECTED_STEPS, got):
            want = AGGREGATE[how](manual_qwen(model, tok, steps))
            assert g == pytest.approx(want, abs=1e-5), how
    per_step = scorer.step_scores([QUESTION], [["x = 1.", "y = 2."]])[0]
    assert len(per_step) == 2 and len(set(round(s, 6) for s in got)) > 2  # scores differ by input


def test_qwen_prm_empty_candidate_scores_the_trajectory_without_it(tmp_path):
    model, _ = save_prm(tmp_path, seed=1)
    scorer = prm_scorer(tmp_path)
    got = scorer.score([ScoreRequest(traj(), cand("\n\n")), ScoreRequest(traj([]), cand(" "))])
    want = manual_qwen(model, scorer.format.tokenizer, [s.strip() for s in STEPS])[-1]
    assert got[0] == pytest.approx(want, abs=1e-5)
    assert math.isnan(got[1])  # nothing to score at all


def test_qwen_prm_refuses_a_causal_lm_checkpoint(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    prm_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UserError, match="not a process reward model"):
        prm_scorer(tmp_path)


def test_qwen_prm_refuses_a_checkpoint_without_its_head(tmp_path):
    save_prm(tmp_path, drop_head=True)
    with pytest.raises(UserError, match="lacks PRM weights"):
        prm_scorer(tmp_path)


def test_qwen_prm_refuses_gguf_sources():
    with pytest.raises(UserError, match="GGUF"):
        prm_scorer("catalog:smollm2-135m-instruct")


# --------------------------------------------------------------------------- math-shepherd


class _Session:
    def __init__(self, runner):
        self.runner = runner


def shepherd_scorer(runner, **params):
    ctx = ScorerContext(load_session=lambda key: _Session(runner), proposers=["base", "helper"], seed=0)
    return PRMScorer(PRMScorer.Params(model="prm", protocol="math-shepherd", **params), ctx)


def test_math_shepherd_tag_positions_on_a_byte_level_tokenizer():
    tok = tiny_tokenizer()
    fmt = ShepherdFormat(tok)
    steps = ["a = 1.", "b = 2 ки x.", "c = 3."]  # a literal tag inside a step is not a position
    ids, positions = fmt.build(QUESTION, steps)
    assert len(positions) == 3
    # the tag is split into several byte-level tokens; the position is the last one of it
    for p, step in zip(positions, steps):
        assert tok.decode(ids[: p + 1]).endswith(step + " ки")
        assert not tok.decode(ids[: p]).endswith(" ки")
    assert tok.decode(ids) == QUESTION + " a = 1. ки\nb = 2 ки x. ки\nc = 3. ки"
    assert fmt.label_ids == tok("+ -", add_special_tokens=False)["input_ids"]


def test_math_shepherd_scores_match_a_manual_forward():
    runner = tiny_runner("qwen2", seed=5)
    scorer = shepherd_scorer(runner, aggregate="min", batch_tokens=200)
    reqs = requests()
    got = scorer.score(reqs)
    tok = runner.tokenizer
    plus, minus = tok("+ -", add_special_tokens=False)["input_ids"] if len(tok("+ -", add_special_tokens=False)[
        "input_ids"]) == 2 else [tok(x, add_special_tokens=False)["input_ids"][-1] for x in "+-"]
    for steps, g in zip(EXPECTED_STEPS, got):
        # the Math-Shepherd format by hand: question, space, each step + " ки", one per line
        text = QUESTION + " " + "\n".join(x + " ки" for x in steps)
        enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
        ends = [m.end() - 1 for m in re.finditer(" ки", text)]
        positions = [max(j for j, (a, b) in enumerate(enc["offset_mapping"]) if a <= e < b) for e in ends]
        with torch.no_grad():
            logits = runner.model(torch.tensor([enc["input_ids"]])).logits[0]
        p_plus = [float(torch.softmax(logits[p, [plus, minus]], -1)[0]) for p in positions]
        assert g == pytest.approx(min(p_plus), abs=1e-5)


# --------------------------------------------------------------------------- llm_judge


def judge(runner, **params):
    ctx = ScorerContext(load_session=lambda key: _Session(runner), proposers=["base", "helper"], seed=0)
    return LLMJudgeScorer(LLMJudgeScorer.Params(model="judge", **params), ctx)


def test_llm_judge_p_yes_matches_a_manual_computation():
    runner = tiny_runner("llama", seed=7)
    tok = runner.tokenizer
    scorer = judge(runner, batch_tokens=256)
    reqs = requests()
    got = scorer.score(reqs)
    yes, no = tok("Yes", add_special_tokens=False)["input_ids"][0], tok("No", add_special_tokens=False)["input_ids"][0]
    assert scorer.answer_ids == [yes, no]
    for r, g in zip(reqs, got):
        previous = [s.text.strip() for s in r.trajectory.steps if s.text.strip()]
        messages = judge_messages(QUESTION, previous, r.candidate.text.strip())
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and "Is the new step correct? Answer Yes or No." in text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            last = runner.model(torch.tensor([ids])).logits[0, -1]
        want = float(torch.softmax(last[[yes, no]], -1)[0])
        assert g == pytest.approx(want, abs=1e-5)
    assert "(the solution ends here)" in judge_messages("q", [], "")[1]["content"]
    assert "(no steps yet)" in judge_messages("q", [], "x")[1]["content"]


def test_llm_judge_has_no_aggregate():
    with pytest.raises(Exception):
        LLMJudgeScorer.Params(model="judge", aggregate="last")


# --------------------------------------------------------------------------- can_score


def test_scorers_score_only_the_proposers_they_list():
    runner = tiny_runner("qwen2")
    scorer = judge(runner, proposers=["helper"])
    assert scorer.can_score("helper") and not scorer.can_score("base")
    assert judge(runner).can_score("base")
    with pytest.raises(UserError, match="unknown proposer"):
        judge(runner, proposers=["helpr"])


def test_new_components_are_registered_and_validate():
    from kvflow.registry import get_registry

    reg = get_registry()
    assert {"prm", "llm_judge", "likelihood", "random"} <= set(reg.names("scorers"))
    assert {"best", "margin"} <= set(reg.names("committers"))
    params = reg.get("scorers", "prm").Params(model="prm", protocol="math-shepherd", aggregate="prod")
    assert params.proposers is None
    with pytest.raises(Exception):
        reg.get("scorers", "prm").Params(model="prm", protocol="qwen")


REMOTE_CODE = '''
from torch import nn
from transformers import Qwen2Model
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel

{broken}

class RemotePRM(Qwen2PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        h = config.hidden_size
        self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 2))
        self.post_init()
'''


@pytest.mark.parametrize("broken", [False, True])
def test_qwen_prm_remote_code_when_allowed_else_the_rebuild(tmp_path, broken, caplog):
    from kvflow.backends.hf.prm import Qwen2ForProcessRewardModel

    save_prm(tmp_path, head_bias=[0.0, 1.0])
    (tmp_path / "modeling_prm.py").write_text(REMOTE_CODE.format(broken="raise ImportError('old transformers API')"
                                                                 if broken else ""))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "modeling_prm.RemotePRM"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    models = {"prm": ModelConfig(id=str(tmp_path), dtype="float32", device="cpu", trust_remote_code=True)}
    scorer = PRMScorer(PRMScorer.Params(model="prm"), ScorerContext(None, ["base"], 0, models=models))
    assert scorer.score([ScoreRequest(traj(), cand("x = 1."))]) == pytest.approx([1 / (1 + math.exp(-1.0))])
    if broken:
        assert type(scorer.prm_model) is Qwen2ForProcessRewardModel
        assert "using kvflow's Qwen2 PRM rebuild" in caplog.text
    else:
        assert type(scorer.prm_model).__name__ == "RemotePRM"
    # without trust_remote_code the checkpoint's code never runs
    assert type(prm_scorer(tmp_path).prm_model) is Qwen2ForProcessRewardModel


def test_scoring_session_log_probs_match_a_full_forward_across_rounds():
    """`ScoringSession` (used by `likelihood`) prefills new problems together and ingests the
    steps committed since its last call together; its log-probabilities must equal a plain
    forward over prompt + committed steps + candidate, whatever the problems' lengths."""
    from kvflow.backends.hf.scoring import ScoringSession
    from kvflow.registry import get_registry

    runner = tiny_runner()
    none = get_registry().get("evictors", "none")
    session = ScoringSession(runner, none(none.Params()))

    def manual(t: Trajectory, text: str) -> list[float]:
        context = runner.encode(t.prompt) + [i for s in t.steps for i in runner.encode(s.text)]  # step by step
        ids = runner.encode(text)
        with torch.no_grad():
            logits = runner.model(torch.tensor([context + ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
        return logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()

    a = Trajectory("a", QUESTION, "Question: " + QUESTION + "\nAnswer:")
    b = Trajectory("b", "q", "A much shorter prompt:")
    for rnd, (steps_a, steps_b) in enumerate([([], []), (STEPS[:1], []), (STEPS, STEPS[:1]), (STEPS, STEPS)]):
        a.steps = [Step(s, "base", None, 1) for s in steps_a]
        b.steps = [Step(s, "base", None, 1) for s in steps_b]
        trajs, texts = [a, b, a], [CANDIDATES[0], CANDIDATES[1], CANDIDATES[2]]
        got = session.token_logprobs(trajs, texts)
        for t, text, lps in zip(trajs, texts, got):
            assert lps == pytest.approx(manual(t, text), abs=1e-4), (rnd, t.problem_id)
    session.release(["a"])
    assert set(session._states) == {"b"}
