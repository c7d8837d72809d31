"""Bytes of KV cache one sequence holds under an evictor: the accounting shared by the cache
(which allocates exactly this), `kvflow explain`, results and `budget_bytes` conversion.

Everything is per sequence, summed over layers and KV heads, from the model's shape and
dtype alone (no torch). With `quantize` (BreadthKV / KIVI style, `kvflow.backends.hf.quant`)
the `budget` kept tokens split into a quantized part of whole key groups and a
full-precision residual:

    n_quantized = floor((budget - residual) / group_size) * group_size
    per quantized token and KV head = 2 * bits * head_dim / 8            (packed K and V codes)
                                    + 2 * head_dim * s / group_size      (K scale+zero, per channel per group)
                                    + 2 * (head_dim / group_size) * s    (V scale+zero, per token per group)
    per full-precision token and KV head = 2 * head_dim * s              (K and V)

with s the bytes of the cache dtype (scales and zero points are stored in it). The peak adds
`buffer` full-precision tokens (appended between compactions) and one scratch slot that
padded batch writes land in.

Varying allocations (PyramidKV, Ada-KV; `Evictor.layer_widths`) keep the same total after a
compaction (layer budgets sum to budget x layers, a layer's heads to kv_heads x its budget),
but the dense cache stores each layer at its widest: `widths[l] + 1` slots per KV head. With
`quantize` (per-layer budgets only) each layer splits its own budget as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


@dataclass(frozen=True)
class KVLayout:
    """How one sequence's cache is laid out and what it costs."""

    budget: int  # tokens kept after a compaction (the mean per layer when layers have their own)
    n_quantized: int  # of which quantized (per layer; the first layer's when layers have their own)
    buffer: int
    kept_bytes: int  # bytes after a compaction (what budget_bytes bounds)
    peak_bytes: int  # bytes allocated per sequence (kept + buffer + scratch slot)
    layer_budgets: Optional[tuple[int, ...]] = None  # per layer, when the allocation varies

    @property
    def residual(self) -> int:
        return self.budget - self.n_quantized


def n_quantized(budget: int, quantize: Any) -> int:
    if quantize is None:
        return 0
    return max(0, (budget - quantize.residual) // quantize.group_size * quantize.group_size)


def full_token_bytes(head_dim: int, elem: int) -> int:
    """Keys and values of one token, one layer, one KV head, at full precision."""
    return 2 * head_dim * elem


def quantized_token_bytes(head_dim: int, elem: int, quantize: Any) -> float:
    """Keys and values of one quantized token, one layer, one KV head, scales included (the
    per-channel key scales of a group are shared by its `group_size` tokens)."""
    bits, g = quantize.bits, quantize.group_size
    codes = 2 * bits * head_dim / 8
    key_scales = 2 * head_dim * elem / g
    value_scales = 2 * (head_dim // g) * elem
    return codes + key_scales + value_scales


def layout(params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int,
           budget: Optional[int] = None, evictor: Any = None) -> KVLayout:
    """The layout of an evictor's params (`budget` overrides params.budget). `evictor`: the
    Evictor itself, for allocations that vary by layer or head (`Evictor.varies`): its
    per-layer budgets and widths (`layer_widths`) then give the bytes."""
    budget = params.budget if budget is None else budget
    q = getattr(params, "quantize", None)
    fp = full_token_bytes(head_dim, elem)
    quant = quantized_token_bytes(head_dim, elem, q) if q is not None else 0
    if evictor is not None and evictor.varies(n_layers):
        budgets = evictor.allocation(n_layers)
        widths = evictor.layer_widths(n_layers, n_kv_heads)
        kept = peak = 0.0
        for b, w in zip(budgets, widths):
            nq = n_quantized(b, q)
            kept += n_kv_heads * (nq * quant + (b - nq) * fp)
            peak += n_kv_heads * (nq * quant + (w - nq + 1) * fp)  # the layer's widest head + buffer + scratch
        return KVLayout(budget, n_quantized(budgets[0], q), params.buffer, int(round(kept)), int(round(peak)),
                        tuple(budgets))
    nq = n_quantized(budget, q)
    heads = n_layers * n_kv_heads
    kept = heads * (nq * quant + (budget - nq) * fp)
    peak = kept + heads * (params.buffer + 1) * fp
    return KVLayout(budget, nq, params.buffer, int(round(kept)), int(round(peak)))


def budget_for_bytes(params: Any, n_layers: int, n_kv_heads: int, head_dim: int, elem: int,
                     evictor_cls: Any = None) -> int:
    """The largest token budget whose kept bytes fit in params.budget_bytes (`evictor_cls`:
    the evictor's class, whose allocation may split a quantized budget per layer)."""
    target = params.budget_bytes
    fp_per_token = n_layers * n_kv_heads * full_token_bytes(head_dim, elem)
    hi = max(1, target // fp_per_token)
    if params.quantize is not None:  # quantized tokens are cheaper: search above the full-precision count
        per_q = n_layers * n_kv_heads * quantized_token_bytes(head_dim, elem, params.quantize)
        hi = max(hi, int(target // per_q) + 1)
    # not a binary search: with quantization the kept bytes are a sawtooth in the budget (one
    # more token can complete a key group and move group_size tokens to low precision)
    for budget in range(hi, 0, -1):
        evictor = None
        if evictor_cls is not None and params.quantize is not None:
            try:
                evictor = evictor_cls(params.with_budget(budget))
                evictor.varies(n_layers)
            except ValueError:  # a budget the other parameters (or the allocation) do not fit in
                continue
        if layout(params, n_layers, n_kv_heads, head_dim, elem, budget=budget, evictor=evictor).kept_bytes <= target:
            return budget
    raise ValueError(f"budget_bytes {target} holds less than one token ({fp_per_token} bytes per token)")
