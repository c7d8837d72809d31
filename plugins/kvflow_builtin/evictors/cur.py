"""`cur`: CurDKV's leverage scores of keys and values (kvpress's CURPress).

Paper: Sengupta et al., "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition" (2025), https://arxiv.org/abs/2509.15038. A token's leverage is the squared
norm of its key (k2) and of its value (v2), each optionally normalised within local blocks
of `local_window_size` slots; the score combines them (`leverage_type`: the product by
default), normalised over the row, and the first `num_sinks` slots score 1 (kept first).

kvpress: `CURPress` with the same parameters and defaults. kvflow's blocks start at slot 0
of each row and stop at the row's own length (its padding slots count as zero, as kvpress's
zero padding of the last block), so a row scores the same alone as in a batch. With
`use_random_leverage` keys and values are first projected by a Gaussian [head_dim, 20]
matrix divided by sqrt(20); kvpress draws one unseeded matrix per call, kvflow one per row
from the row's generator (reproducible, batch-independent). Budget convention: kvflow's
(METHODS §0); `window: 0` is kvpress's rule. Cadence: every `buffer` tokens.

Shapes: keys, values [rows, kv_heads, N, head_dim] -> scores [rows, kv_heads, N] float32.
GQA: not applicable (keys and values only, per KV head).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from kvflow._lazy import torch
from kvflow.components.base import Evictor, EvictorParams
from kvflow_builtin.evictors._common import valid_slots

RANDOM_RANK = 20  # kvpress's projection width


class CURParams(EvictorParams):
    num_sinks: int = Field(4, ge=0, description="Leading slots scored 1.0, above every leverage (kvpress's num_sinks).")
    leverage_type: Literal["key", "value", "kv_avg", "kv_product"] = Field(
        "kv_product", description="k2, v2, their mean or their product (kvpress's default).")
    use_random_leverage: bool = Field(False, description="Project keys and values on a random [head_dim, 20] "
                                                         "Gaussian matrix first (one per row, seeded).")
    use_local_approximation: bool = Field(True, description="Normalise k2 and v2 within blocks of "
                                                            "local_window_size slots.")
    local_window_size: int = Field(16, ge=1, description="Block width of the local normalisation.")


def _local(x, lengths, w: int):
    """x [rows, heads, N] (zero past each row's length) -> normalised within blocks of w slots."""
    rows, heads, n = x.shape
    pad = (w - n % w) % w
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(rows, heads, -1, w)
    return (blocks / blocks.sum(dim=-1, keepdim=True)).nan_to_num(0.0).reshape(rows, heads, -1)[:, :, :n]


class CUREvictor(Evictor):
    """Keep the tokens of highest key x value leverage (CurDKV, Sengupta et al. 2025)."""

    Params = CURParams

    @property
    def layer_invariant(self) -> bool:  # the random projection draws from the rows' generators
        return not self.params.use_random_leverage

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):
        p = self.params
        k, v = keys.float(), values.float()
        if p.use_random_leverage:
            proj = torch.stack([torch.randn(k.shape[-1], RANDOM_RANK, generator=g) for g in generators])
            proj = proj.to(k.device)[:, None] / math.sqrt(RANDOM_RANK)  # [rows, 1, head_dim, 20]
            k, v = k @ proj, v @ proj
        valid = valid_slots(lengths, k.shape[2], k.device)[:, None, :]  # [rows, 1, N]
        k2 = (k**2).sum(dim=-1) * valid  # [rows, kv_heads, N]
        v2 = (v**2).sum(dim=-1) * valid
        if p.use_local_approximation:
            k2, v2 = _local(k2, lengths, p.local_window_size), _local(v2, lengths, p.local_window_size)
        scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[p.leverage_type]
        scores = (scores / scores.sum(dim=-1, keepdim=True)).nan_to_num(0.0)
        scores[:, :, : p.num_sinks] = 1.0
        return scores
