"""`ada-snapkv`: Ada-KV's head-adaptive allocation with SnapKV's scores (Ada-SnapKV).

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference" (arXiv 2407.11550, 2024). Reference code: FFY0/AdaKV; NVIDIA kvpress
ships it as `AdaKVPress` (around any scorer press). A layer's `kv_heads x budget` tokens are
spent across its KV heads by one ranking of SnapKV's scores (per-head attention
probabilities, so comparable across heads): a head whose window attention concentrates on a
few tokens keeps few, a diffuse head keeps more. Safeguard: every head keeps at least
α x budget (α = `safeguard`, 0.2 as in the paper's code and kvpress) besides its window and
protected prompt (`kvflow.components.allocation.adaptive_keep`).

Budget convention: kvflow's (METHODS §0) per layer: `budget` is the mean over a layer's KV
heads of the tokens kept, window included; the layer total is exact. Each head keeps its own
window (the last W tokens) and protected prompt. The cache stores `head_capacity` slots per
head (kv_heads x budget - (kv_heads - 1) x the floor, or `head_cap` x budget), so the memory
allocated per sequence is larger than the kept bytes; `kvflow explain` shows both.
Compactions happen for all heads at once, every `buffer` tokens.

Shapes: as `snapkv` (keys [rows, kv_heads, N, head_dim], queries [rows, q_heads, W,
head_dim] -> scores [rows, kv_heads, N]), but scored one KV head at a time: after the first
compaction the heads hold different lengths, and the base class calls `score()` per head
with that head's own length (kv_heads = 1, its g query heads). `select()` returns [rows,
kv_heads, head_capacity]: head h's kept slots ascending, then -1.
"""

from __future__ import annotations

from kvflow.components.allocation import AdaptiveHeads, AdaptiveParams
from kvflow_builtin.evictors.snapkv import SnapKVEvictor, SnapKVParams


class AdaSnapKVParams(AdaptiveParams, SnapKVParams):
    pass


class AdaSnapKVEvictor(AdaptiveHeads, SnapKVEvictor):
    """SnapKV's scores, Ada-KV's allocation across the heads of each layer."""

    Params = AdaSnapKVParams
