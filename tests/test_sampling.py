"""Nucleus sampling without a full sort equals the inverse CDF over a full stable sort."""

from __future__ import annotations

import pytest
import torch

from kvflow.backends.hf import sampling as decode


def reference(logits, temperature, top_p, uniforms):
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    cum = sorted_p.cumsum(-1)
    if top_p < 1.0:
        sorted_p = sorted_p.masked_fill(cum - sorted_p >= top_p, 0.0)
        cum = sorted_p.cumsum(-1)
    pick = torch.searchsorted(cum, uniforms[:, None] * cum[:, -1:]).clamp(max=cum.shape[-1] - 1)
    return order.gather(-1, pick).squeeze(-1)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 1.0])
def test_nucleus_sampling_equals_full_stable_sort(top_p):
    g = torch.Generator().manual_seed(0)
    vocab = 5000  # > _NUCLEUS_K: the fast path runs
    peaked = torch.randn(6, vocab, generator=g) * 4
    flat = torch.randn(4, vocab, generator=g) * 0.05  # nucleus far beyond the first K tokens
    logits = torch.cat([peaked, flat]).bfloat16().float()  # bf16 logits: many exact ties
    for _ in range(20):
        u = torch.rand(logits.shape[0], generator=g)
        tokens, logprobs, entropy, confidence = decode.sample(logits, 0.7, top_p, u)
        # DeepConf's token confidence, on the model's own (temperature-1) distribution
        top20 = torch.log_softmax(logits, -1).sort(dim=-1, descending=True).values[:, :20]
        assert torch.allclose(confidence, -top20.mean(-1), atol=1e-5)
        assert torch.equal(tokens, reference(logits, 0.7, top_p, u))
        assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_greedy_confidence_is_the_temperature_1_top20_and_caps_k_at_the_vocabulary():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 3000, generator=g) * 3
    _, _, _, confidence = decode.sample(logits, 0.0, 1.0, torch.zeros(3))
    want = -torch.log_softmax(logits, -1).sort(dim=-1, descending=True).values[:, :20].mean(-1)
    assert torch.allclose(confidence, want, atol=1e-5)
    small = torch.randn(2, 7, generator=g)  # a vocabulary smaller than k: all of it
    _, _, _, confidence = decode.sample(small, 0.0, 1.0, torch.zeros(2))
    assert torch.allclose(confidence, -torch.log_softmax(small, -1).mean(-1), atol=1e-6)
