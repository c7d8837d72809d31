"""Budgets that vary by layer and by head: the allocation mixins of kvflow evictors.

An evictor's `score()` says which tokens matter; its allocation says how many each
(layer, KV head) keeps. kvflow's default keeps `budget` everywhere. Two published
allocations are mixins here, combined with any scoring evictor by subclassing
(`class MyAdaEvictor(AdaptiveHeads, MyEvictor)`, Params likewise):

- `PyramidLayers` (PyramidKV, Cai et al. 2024, arXiv 2406.02069, "PyramidKV: Dynamic KV
  Cache Compression based on Pyramidal Information Funneling"): lower layers keep more,
  higher layers fewer, in an arithmetic sequence, the same total (`pyramid_budgets`).
- `AdaptiveHeads` (Ada-KV, Feng et al. 2024, arXiv 2407.11550, "Ada-KV: Optimizing KV Cache
  Eviction by Adaptive Budget Allocation for Efficient LLM Inference"): one budget per layer,
  `kv_heads x budget` tokens, spent across its heads by one ranking of their scores, so a
  head whose attention is concentrated keeps fewer tokens and a diffuse one more; a
  safeguard floor keeps at least `safeguard x budget` per head (`adaptive_keep`, defined in
  `kvflow.components.selection` beside the uniform rule and re-exported here). The
  scores must be comparable across heads: attention probabilities are (each head's sum to
  one), as with snapkv, rkv, h2o, tova.

The base class `Evictor.select()` still forces the window and the protected prompt per head
and keeps time order; the cache keeps per-(row, layer, head) lengths and masks attention to
each head's own slots (`kvflow.backends.hf.cache`, `kvflow.backends.sglang.in_worker.evict`).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from kvflow._lazy import torch
from kvflow.components.base import EvictorParams
from kvflow.components.selection import adaptive_keep, head_capacity, pyramid_budgets

__all__ = ["AdaptiveHeads", "AdaptiveParams", "PyramidLayers", "PyramidParams", "adaptive_keep", "head_capacity",
           "hole_index", "hole_mask", "pyramid_budgets"]


def hole_mask(start: "torch.Tensor", end, span: int) -> "torch.Tensor":
    """Which of a row's first `span` slots are each head's hole under a varying allocation
    (head h kept slots [0, start_h); the row's new tokens begin at `end`).
    start: [..., kv_heads] int64; end: [...] int64 or an int -> [..., kv_heads, span] bool."""
    key = torch.arange(span, device=start.device)
    end = torch.as_tensor(end, device=start.device)[..., None, None]
    return (key >= start[..., None]) & (key < end)


def hole_index(start: "torch.Tensor", end, n: int) -> "torch.Tensor":
    """The stored slot of each head's j-th resident token, its hole skipped (see `hole_mask`):
    [..., kv_heads, n] int64, j past a head's length running on past the row's end."""
    j = torch.arange(n, device=start.device)
    gap = torch.as_tensor(end, device=start.device)[..., None] - start  # [..., kv_heads]: hole sizes
    return j + (j >= start[..., None]) * gap[..., None]


# --------------------------------------------------------------------------- mixins


def _no_quantize(params):
    if getattr(params, "quantize", None) is not None:
        raise ValueError("quantize does not combine with budgets that vary by head yet (the quantized store "
                         "splits a layer's heads alike); use it with a per-layer allocation (pyramidkv) or a "
                         "uniform one (breadthkv)")
    return params


class PyramidParams(EvictorParams):
    beta: float = Field(20.0, ge=1.0, description="PyramidKV's β: the top layer keeps (budget - window) / β "
                                                  "besides the window, the first layer about twice the mean.")



class PyramidLayers:
    """Mixin: PyramidKV's per-layer budgets (see `pyramid_budgets`) with `beta` at the top level
    of the evictor's Params (`pyramidkv`). Any evictor takes the same allocation as
    `allocation: {kind: pyramid}` without a class of its own; this mixin is the older way."""

    def layer_budgets(self, num_layers: int) -> list[int]:
        p = self.params
        return pyramid_budgets(p.budget, p.window, num_layers, p.beta, self.trigger)


class AdaptiveParams(EvictorParams):
    safeguard: float = Field(0.2, ge=0.0, le=1.0, description="Ada-KV's safeguard α: every head keeps at least "
                                                              "α × the layer budget (0.2 in the paper's code).")
    head_cap: Optional[float] = Field(
        None, ge=1.0, description="Most tokens one head may keep, in multiples of the layer budget (the cache "
        "stores this many per head). null: as many as the safeguard leaves, kv_heads - (kv_heads - 1) α.")

    _uniform_storage = model_validator(mode="after")(_no_quantize)


class AdaptiveHeads:
    """Mixin: Ada-KV's head-adaptive allocation (see `adaptive_keep`) with its parameters at the
    top level of the evictor's Params (`ada-snapkv`). Any evictor takes the same allocation as
    `allocation: {kind: adakv}` without a class of its own; this mixin is the older way."""

    adaptive_heads = True

    def head_floor(self, layer_budget: int) -> int:
        return int(self.params.safeguard * layer_budget)

    def head_capacity(self, layer_budget: int, kv_heads: int) -> int:
        return head_capacity(layer_budget, kv_heads, self.params.safeguard, self.params.head_cap)
