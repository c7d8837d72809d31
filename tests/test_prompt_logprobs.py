"""`prompt_logprobs` of the hf engine (what `kvflow serve` answers an echo + logprobs
completion with): every token of a sequence scored with a full cache equals a plain
transformers forward over the whole sequence, for each architecture of the tiny models."""

from __future__ import annotations

import pytest
import torch

from kvflow.testing.models import tiny_engine

IDS = [5, 17, 3, 99, 42, 7, 7, 61, 18, 250, 4, 33]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_prompt_logprobs_equal_a_plain_forward(arch):
    engine = tiny_engine(arch)
    got = engine.prompt_logprobs(IDS, top=3)
    with torch.inference_mode():
        logits = engine.runner.model(torch.as_tensor([IDS])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    assert got.logprobs[0] is None and got.top[0] is None
    assert len(got.logprobs) == len(got.top) == len(IDS)
    for i in range(1, len(IDS)):
        assert got.logprobs[i] == pytest.approx(float(logp[i - 1, IDS[i]]), abs=1e-4)
        values, indices = logp[i - 1].topk(3)
        assert [t for t, _ in got.top[i]] == indices.tolist()
        assert [v for _, v in got.top[i]] == pytest.approx(values.tolist(), abs=1e-4)
    assert got.next[0][0] == int(logp[-1].argmax())
    assert got.next[0][1] == pytest.approx(float(logp[-1].max()), abs=1e-4)


def test_prompt_logprobs_of_one_token_is_only_the_next():
    got = tiny_engine().prompt_logprobs([5], top=1)
    assert got.logprobs == [None] and got.top == [None] and len(got.next) == 1
