"""`breadthkv`: decode-time SnapKV eviction with the kept cache quantized (BreadthKV, 2026; docs/memory.md).

Paper: "Precision for breadth" (BreadthKV, 2026; no public code). A fixed *byte* budget is
better spent on more tokens at lower precision: eviction picks the kept tokens (decode-time
SnapKV, `snapkv`'s R-KV defaults here) and the kept tokens but the newest `residual` are
stored KIVI-style (Liu et al., 2024, arXiv:2402.02750): keys per channel over groups of
`group_size` tokens, values per token over groups of `group_size` channels, packed integers
with a scale and zero point per group. The paper picks `bits` per (model, budget) by an
end-to-end calibration on 60 problems (`kvflow calibrate-bits`), because offline attention
error did not predict accuracy.

This evictor is `snapkv` with `quantize` on by default: any evictor takes the same
`quantize:` block (and `budget_bytes:`), so `{kind: rkv, quantize: {bits: 4}}` is the same
idea with R-KV's selection. Compare with eviction alone at equal memory by giving both the
same `budget_bytes` (the quantized one then keeps more tokens).

Choices where the paper is silent (each a parameter): bits 4, group_size 32, residual 16 by
default; scales and zero points in the cache dtype; survivors of an eviction are quantized
again from their dequantized values (a key group may have lost members), so a key's error
is bounded by half of its latest group's scale; tokens enter the quantized store a whole key
group at a time (`kvflow.backends.hf.cache`).

Shapes: as `snapkv` (scores [rows, kv_heads, N] from the last W queries); the selection sees
the dequantized keys.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from kvflow.components.base import QuantizeParams
from kvflow_builtin.evictors.snapkv import SnapKVEvictor, SnapKVParams


class BreadthKVParams(SnapKVParams):
    quantize: Optional[QuantizeParams] = Field(
        default_factory=QuantizeParams,
        description="Quantization of the kept tokens (bits, group_size, residual); null is plain `snapkv`.")


class BreadthKVEvictor(SnapKVEvictor):
    """Decode-time SnapKV plus KIVI-style quantization of the kept cache."""

    Params = BreadthKVParams
