"""`expected_attention`: the attention future queries are expected to pay (ExpectedAttentionPress).

Method: Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution" (2025), https://arxiv.org/abs/2510.00636; NVIDIA kvpress's
`ExpectedAttentionPress`. Model the next `n_future_positions` queries as Gaussian: mean μ
and covariance Σ of recent queries before RoPE, rotated by the RoPE matrix averaged over the
future positions, R̄ = mean_p R_p. For a key k, E[exp(q·k/√d)] gives the logit
k·R̄μ/√d + kᵀ(R̄ΣR̄ᵀ)k / (2d); softmax over the keys, mean over the g query heads of a KV
head, times ‖v‖ (`use_vnorm`, plus `epsilon` first). The first `n_sink` slots score above
every other.

kvflow takes the statistics from the cache's query window: the last `n_queries` post-RoPE
queries of the row, whose RoPE positions are consecutive and end just before the row's next
position P. Rotating query i forward by its distance to P gives R_P q_i (RoPE rotations
compose by adding positions), so their mean and covariance are R_P μ and R_P Σ R_Pᵀ, and the
future rotation is the mean of R_t over t in [0, n_future_positions): together exactly the
pre-RoPE statistics rotated by the mean of R_p over p in [P, P + n). Only the RoPE
frequencies are needed, never a position or the model: `rope_theta` is read from the model's
config when the run starts (the plain RoPE of Llama / Qwen; a model with another RoPE type is
refused then, naming this evictor's field).

kvpress at decode time (`DecodingPress`) is off in two ways, kept out of kvflow: it drops
the first `n_sink` of its *buffered decode* hidden states as if they were sinks, and rotates
by future positions counted from the buffer's length instead of the sequence's (positions
[len(buffer), len(buffer) + n) for queries at the end of a sequence of any length), so its
R̄ is that of the wrong positions (docs/components.md, "kvpress at decode time"). At prefill
(hidden states of the whole sequence) kvpress and kvflow agree (tests/test_kvpress_golden.py).

Budget convention: kvflow's (METHODS §0); `window: 0` is kvpress's rule. Cadence: every
`buffer` tokens. Cost per compaction: a [d, d] covariance per query head and one
kᵀΣk per (query head, token): O(Hq·N·d²).

Shapes: keys, values [rows, kv_heads, N, head_dim]; queries [rows, q_heads, W, head_dim]
(W = n_queries, oldest first, post-RoPE) -> scores [rows, kv_heads, N] float32. GQA: one
softmax per query head, mean over the group; keys are never expanded.
"""

from __future__ import annotations

import math
from typing import Optional

from pydantic import Field, model_validator

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import valid_slots


DEFAULT_QUERIES = 32


class ExpectedAttentionParams(EvictorParams):
    n_future_positions: int = Field(512, ge=1, description="Future positions the RoPE rotation is averaged over.")
    n_sink: int = Field(4, ge=0, description="Leading slots always kept (scored above every other).")
    n_queries: Optional[int] = Field(
        None, ge=2, description="Recent queries whose mean and covariance model the future queries (kvpress: its "
                                "buffered decode hidden states); null: 32, or budget + buffer when that is fewer.")
    use_covariance: bool = Field(True, description="Add the covariance term kᵀΣk / 2d to the logits.")
    use_vnorm: bool = Field(True, description="Multiply the expected attention (+ epsilon) by the value norm.")
    epsilon: float = Field(0.0, ge=0.0, description="Added to the expected attention before the value norm.")
    rope_theta: Optional[float] = Field(
        None, gt=0, description="RoPE base of the model; null: read from the model's config when the run starts.")

    @model_validator(mode="after")
    def _queries_fit(self):
        if self.budget_bytes is None and self.n_queries is not None and self.n_queries > self.budget + self.buffer:
            raise ValueError(f"n_queries ({self.n_queries}) must not exceed budget + buffer "
                             f"({self.budget + self.buffer}): a row holds that many tokens at a compaction")
        return self


def rope_tables(theta: float, d: int, offsets, device):
    """cos, sin [len(offsets), d] of plain RoPE (rotate_half layout) at the given position offsets."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))  # [d/2]
    angles = offsets.to(device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, d]
    return angles.cos(), angles.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def mean_rotation(theta: float, d: int, n: int, device):
    """R̄ = mean over t in [0, n) of the RoPE matrix R_t: [d, d] float64 (R_t x = cos·x + sin·rotate_half(x))."""
    cos, sin = rope_tables(theta, d, torch.arange(n), device)
    c, s = cos.mean(dim=0), sin.mean(dim=0)  # [d]
    half = d // 2
    swap = torch.zeros(d, d, dtype=torch.float64, device=device)  # rotate_half as a matrix
    swap[half:, :half] = torch.eye(half, dtype=torch.float64, device=device)
    swap[:half, half:] = -torch.eye(half, dtype=torch.float64, device=device)
    return torch.diag(c) + torch.diag(s) @ swap


class ExpectedAttentionEvictor(Evictor):
    """Keep the tokens future queries are expected to attend to most (kvpress's ExpectedAttention)."""

    Params = ExpectedAttentionParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    @property
    def query_window(self) -> int:
        p = self.params
        return p.n_queries if p.n_queries is not None else min(DEFAULT_QUERIES, p.budget + p.buffer)

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        p = self.params
        if p.rope_theta is None:
            raise ValueError("expected_attention: rope_theta is unset (it is read from the model's config when a "
                             "run starts; give it when calling the evictor directly)")
        rows, kv_heads, n, d = keys.shape
        q_heads, w = queries.shape[1], queries.shape[2]
        g = q_heads // kv_heads
        # every window query rotated to the row's next position P: query i sits at P - w + i
        cos, sin = rope_tables(p.rope_theta, d, torch.arange(w, 0, -1), keys.device)  # [w, d]
        q = queries.double()
        q = q * cos + rotate_half(q) * sin  # [rows, Hq, w, d] = R_P q_pre
        mu = q.mean(dim=2)  # [rows, Hq, d]
        rbar = mean_rotation(p.rope_theta, d, p.n_future_positions, keys.device)  # [d, d]
        mu = mu @ rbar.T
        k = keys.double()
        logits = torch.matmul(mu.view(rows, kv_heads, g, d), k.transpose(-1, -2)) / math.sqrt(d)  # [rows, kv, g, N]
        if p.use_covariance:
            centred = q - q.mean(dim=2, keepdim=True)
            cov = centred.transpose(-1, -2) @ centred / w  # [rows, Hq, d, d]
            cov = rbar @ cov @ rbar.T
            kc = torch.matmul(k[:, :, None], cov.view(rows, kv_heads, g, d, d))  # [rows, kv, g, N, d]
            logits = logits + (kc * k[:, :, None]).sum(dim=-1) / d / 2
        slot = torch.arange(n, device=keys.device)[None, :]
        scored = valid_slots(lengths, n, keys.device) & (slot >= p.n_sink)  # [rows, N]
        probs = logits.masked_fill(~scored[:, None, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        scores = probs.mean(dim=2)  # [rows, kv, N]
        if p.use_vnorm:
            scores = (scores + p.epsilon) * values.double().norm(dim=-1)
        scores = scores.float() * scored[:, None, :]
        top = scores.amax(dim=-1, keepdim=True) + 1  # [rows, kv, 1]: sinks above every other, as kvpress
        sinks = (slot < p.n_sink)[:, None, :]
        return torch.where(sinks, top, scores)
