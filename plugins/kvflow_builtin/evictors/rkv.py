"""`rkv`: R-KV, redundancy-aware eviction for reasoning models (Cai et al., 2025).

Paper: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv 2505.24133, 2025). Reference code: Zefan-Cai/R-KV, `rkv/compression/r1_kv.py`
(`R1KV._compute_scores`) and `rkv/utils.py` (`compute_attention_scores`, `cal_similarity`).

Per (row, layer, KV head), with K the cached keys (post-RoPE, L resident) and Q the last W
queries:

- importance: logits = Q·Kᵀ/√d; the g query heads of the KV head are reduced with **max on
  the raw logits, before the softmax**; softmax over the L - W older tokens (float32); mean
  over the W queries; max-pool (kernel 7, padding 3, stride 1). Same code path as `snapkv`.
- redundancy: K̂ = K / (‖K‖ + 1e-8); S = K̂K̂ᵀ with a zero diagonal; for each token i the
  newest j with S_ij > `threshold` gets S_ij = 0 (the newest copy of a repeated token is not
  penalised by its older twins); redundancy_j = softmax over j of the column mean
  (1/L)·Σ_i S_ij (sub-threshold similarities are not zeroed).
  As in the reference, a token i without any twin zeroes S_i0 instead (its "newest twin"
  index defaults to 0); kvflow keeps that behaviour so kept sets match the reference.
- score = λ·importance − (1 − λ)·redundancy over the older tokens; the top `budget - W`
  plus the last W survive.

λ (`mix_lambda`): default 0.1, the value of the R-KV README and its serving config (what
the paper's results used); the reference class defaults to 0.07; VaSE and Random Attention
ran 0.5 with a simplified redundancy and report 0.1 scored 7-9 points lower on Qwen3-4B.
Scores are computed in float32 (the reference casts the importance back to the model dtype).

Budget convention: kvflow's (METHODS §0), which is also R-KV's: `budget` includes the window
of W = 8; the reference compresses when the resident length reaches `budget + buffer`
(buffer 128) at buffer boundaries, i.e. every `buffer` tokens, as here. The old HF code
compressed every 128 tokens and did not protect the prompt (`protect_prompt: false`).

Shapes: keys [rows, kv_heads, N, head_dim], queries [rows, q_heads, W, head_dim] ->
scores [rows, kv_heads, N]. GQA: max over the group on raw logits (`gqa: mean` for the
per-head-softmax variant); keys are never expanded. Cost: the redundancy term is
O(N²·d) per (row, KV head) per compaction, with N = budget + buffer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import attention_signal, odd_kernel, valid_slots


class RKVParams(EvictorParams):
    window: int = Field(8, ge=1, description="Last W queries score the older tokens; the last W tokens are kept.")
    mix_lambda: float = Field(0.1, ge=0.0, le=1.0, description="λ in λ·importance − (1−λ)·redundancy (R-KV README: 0.1; "
                                                               "class default 0.07; VaSE/RA papers: 0.5).")
    threshold: float = Field(0.5, description="Cosine similarity above which two keys count as copies.")
    kernel: int = Field(7, ge=1, description="Max-pool kernel of the importance (odd).")
    pooling: Literal["max", "avg", "none"] = Field("max", description="Pooling of the importance.")
    gqa: Literal["max", "mean"] = Field("max", description="GQA reduction of the importance (R-KV: max on raw logits).")

    _odd_kernel = field_validator("kernel")(odd_kernel)


_SIM_BYTES = 256 << 20  # similarity matrices held at once; larger batches are scored in row chunks


def redundancy(keys, lengths, threshold: float):
    """R-KV's redundancy: [rows, kv_heads, N] float32, a softmax over each row's L tokens."""
    rows, kv_heads, n, _ = keys.shape
    chunk = max(1, _SIM_BYTES // (kv_heads * n * n * 4))
    if rows > chunk:
        return torch.cat([redundancy(keys[i: i + chunk], lengths[i: i + chunk], threshold)
                          for i in range(0, rows, chunk)])
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(k, k.transpose(-1, -2))  # [rows, kv, N, N]
    valid = valid_slots(lengths, n, keys.device)  # [rows, N]
    pair = valid[:, :, None] & valid[:, None, :]
    pair &= ~torch.eye(n, dtype=torch.bool, device=keys.device)
    sim = sim * pair[:, None]
    slot = torch.arange(n, device=keys.device)
    newest_twin = torch.where(sim > threshold, slot, 0).amax(dim=-1, keepdim=True)  # [rows, kv, N, 1]
    sim = sim.scatter(-1, newest_twin, 0.0)
    col_mean = sim.sum(dim=-2) / lengths.to(keys.device).clamp(min=1)[:, None, None].float()
    col_mean = col_mean.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.softmax(col_mean, dim=-1)


class RKVEvictor(Evictor):
    """R-KV: attention importance minus key redundancy (near-duplicate keys are evicted first)."""

    Params = RKVParams
    layer_invariant = True  # scores from the rows' tensors alone (Evictor.select_layers stacks layers)

    @property
    def query_window(self) -> int:
        return self.params.window

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        p = self.params
        importance = attention_signal(keys, queries, lengths, gqa=p.gqa, softmax_keys="older",
                                      pooling=p.pooling, kernel=p.kernel)
        return p.mix_lambda * importance - (1.0 - p.mix_lambda) * redundancy(keys, lengths, p.threshold)
