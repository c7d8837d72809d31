"""From scores to kept slots: the selection rules every evictor shares.

`Evictor.select()` (`kvflow.components.base`) scores a layer's cached tokens, forces the
window and the protected prompt (+inf) and rules out padding (-inf), then keeps slots by one
of the two rules here:

- `keep_top`: the same count for every (row, KV head), the default allocation;
- `adaptive_keep`: Ada-KV's ranking across the KV heads of a layer (the `AdaptiveHeads`
  mixin of `kvflow.components.allocation`).

Ties. Both rules break ties between equal scores by position: the earlier slot wins (and, across
heads, the lower head). That is a rule of kvflow's own, chosen so that the kept set is a
function of the scores alone: `torch.topk`, which the reference implementations use (R-KV,
kvpress's `ScorerPress`), leaves the order of equal values unspecified, and it varies with
the tensor's shape, the device and the torch version. The two therefore differ only where
scores are exactly equal (docs/components.md, "Ties", lists what was measured). A stable sort
costs the same as `topk` at kvflow's sizes.

This module imports nothing from the rest of kvflow but the lazy torch proxy, so that the
component protocols (`base`) and the allocation mixins (`allocation`) both build on it.
"""

from __future__ import annotations

import math
from typing import Optional

from kvflow._lazy import torch


def keep_top(scores: "torch.Tensor", budget: int) -> "torch.Tensor":
    """The `budget` highest scores per (row, KV head), as slot indices in time order.

    scores:  [rows, kv_heads, N] float32 (+inf on forced slots, -inf on padding)
    returns: [rows, kv_heads, budget] int64, ascending. Equal scores: the earlier slot is kept.
    """
    keep = scores.sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    return keep.sort(dim=-1).values


def adaptive_keep(scores: "torch.Tensor", total: int, capacity: int, floor: int) -> "torch.Tensor":
    """Ada-KV's selection over the heads of one layer.

    scores:   [rows, kv_heads, N] float32, +inf on forced slots (window, protected prompt),
              -inf on padding (each head's own slots >= its length)
    total:    tokens the layer keeps per row over all its heads (kv_heads x layer budget)
    capacity: most tokens one head may keep (the cache's width per head)
    floor:    tokens every head keeps at least (Ada-KV's safeguard), besides its forced ones
    returns:  [rows, kv_heads, capacity] int64: head h's k_h kept slots ascending, then -1;
              sum_h k_h = total for every row.

    Each head first keeps its own top max(floor, forced) slots; the rest of `total` goes to
    the highest remaining scores of the whole layer (one ranking over all heads; equal
    scores: the lower head, then the earlier slot), a head never past `capacity`.
    """
    rows, heads, n = scores.shape
    order = scores.sort(dim=-1, descending=True, stable=True)  # per head, best first
    ranked, slots = order.values, order.indices  # [rows, heads, N]
    rank = torch.arange(n, device=scores.device)[None, None, :]
    valid = (ranked > float("-inf")).sum(-1, keepdim=True)  # [rows, heads, 1] each head's length
    forced = (ranked == float("inf")).sum(-1, keepdim=True)
    reserved = torch.minimum(torch.clamp(forced, min=floor), torch.clamp(valid, max=capacity))  # [rows, heads, 1]
    open_ = (rank >= reserved) & (rank < torch.clamp(valid, max=capacity))  # may still be kept
    rest = total - reserved.sum(dim=(1, 2))  # [rows]
    pool = ranked.masked_fill(~open_, float("-inf")).reshape(rows, heads * n)
    pool_rank = torch.empty_like(pool, dtype=torch.long)
    pool_rank.scatter_(1, pool.sort(dim=-1, descending=True, stable=True).indices,
                       torch.arange(heads * n, device=scores.device).expand(rows, -1))
    taken = (pool_rank < rest[:, None]).reshape(rows, heads, n) & open_
    keep_mask = (rank < reserved) | taken  # a prefix of each head's ranking
    kept = slots.masked_fill(~keep_mask, n).sort(dim=-1).values[..., :capacity]  # ascending, n past the kept
    kept = kept.masked_fill(kept >= n, -1)
    if kept.shape[-1] < capacity:  # fewer slots than a head may keep: pad to the cache's width
        kept = torch.nn.functional.pad(kept, (0, capacity - kept.shape[-1]), value=-1)
    return kept


def pyramid_budgets(budget: int, window: int, num_layers: int, beta: float, held: int) -> list[int]:
    """PyramidKV's per-layer budgets, summing to exactly `budget x num_layers`.

    With B = budget and W = window (both counted as in kvflow: B includes W), the paper's
    code gives layer l (0 = the first) W + max - l (max - min) / (L - 1) with
    min = (B - W) / beta and max = 2 (B - W) - min: a linear decrease whose mean is B. When
    max exceeds what a layer holds at a compaction (`held - W`), max becomes that and min
    rises to keep the mean (the reference's rule for short prompts). Rounding: floors, then
    the remainder one token each to the largest fractional parts (ties: lower layers).
    """
    if num_layers == 1:
        return [budget]
    spare = budget - window
    low = spare / beta
    high = 2 * spare - low
    if high > held - window:
        high = held - window
        low = 2 * spare - high
    step = (high - low) / (num_layers - 1)
    real = [window + high - l * step for l in range(num_layers)]
    out = [math.floor(x + 1e-9) for x in real]
    rest = budget * num_layers - sum(out)
    by_fraction = sorted(range(num_layers), key=lambda l: (-(real[l] - out[l]), l))
    for l in by_fraction[:rest]:
        out[l] += 1
    return out


def head_capacity(layer_budget: int, kv_heads: int, safeguard: float, head_cap: Optional[float]) -> int:
    """Most tokens one KV head may keep under Ada-KV with this safeguard: all the layer's
    tokens but the other heads' floors, or `head_cap x layer_budget` (never below the budget)."""
    most = kv_heads * layer_budget - (kv_heads - 1) * int(safeguard * layer_budget)
    return most if head_cap is None else max(layer_budget, min(most, math.floor(head_cap * layer_budget)))
