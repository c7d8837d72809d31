"""Bookkeeping of the budgeted cache kept on the host: per-row state and per-forward write plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class RowState:
    """Per-row bookkeeping shared by every layer. Lives on the host: lengths are known
    without reading the device, so the decode loop never syncs to learn them."""

    lengths: torch.Tensor  # [rows] int64, resident tokens per (layer, KV head); varying allocations: nominal (budget + tokens since the last compaction)
    positions: torch.Tensor  # [rows] int64, logical position of the next token
    n_protected: torch.Tensor  # [rows] int64, leading slots that are never evicted
    n_queries: torch.Tensor  # [rows] int64, valid entries at the right end of the query buffer
    rng_keys: torch.Tensor  # [rows] int64, per-row seed of stochastic evictors
    compactions: torch.Tensor  # [rows] int64, how many times each row was compacted
    n_quantized: torch.Tensor  # [rows] int64, leading slots held quantized (0 without `quantize`); [rows, layers] when the allocation varies
    # varying allocations only (else [rows, 0] and [rows, 0, 0]), see the module docstring:
    layer_offset: torch.Tensor  # [rows, layers] int64, a layer's length minus the nominal length
    hole_start: torch.Tensor  # [rows, layers, kv_heads] int64, k_h: head h's kept tokens
    hole_end: torch.Tensor  # [rows, layers] int64, K_l: where the layer's new tokens start

    def select(self, rows: torch.Tensor) -> "RowState":
        return RowState(*(getattr(self, f).index_select(0, rows) for f in self.__dataclass_fields__))

    @staticmethod
    def cat(states: Sequence["RowState"]) -> "RowState":
        return RowState(*(torch.cat([getattr(s, f) for s in states]) for f in RowState.__dataclass_fields__))

    def with_allocation(self, layers: int, kv_heads: int) -> "RowState":
        """These rows with per-layer bookkeeping for a varying allocation (zeros where absent:
        no compaction yet, every head holds every token; `n_quantized` per layer)."""
        n = len(self.lengths)
        if self.layer_offset.shape[1:] == (layers,) and self.hole_start.shape[1:] == (layers, kv_heads):
            return self
        zeros = torch.zeros(n, layers, dtype=torch.long)
        return RowState(self.lengths, self.positions, self.n_protected, self.n_queries, self.rng_keys,
                        self.compactions, zeros.clone(), zeros, torch.zeros(n, layers, kv_heads, dtype=torch.long),
                        zeros.clone())


@dataclass
class WritePlan:
    """Where one forward's new tokens go, computed once on the host and shared by all layers."""

    slots: torch.Tensor  # [rows, T] slot of each new token (padding -> scratch slot)
    span: int  # slots the attention looks at
    contiguous_at: Optional[int]  # every row writes T real tokens at this same slot
    mask: Optional[torch.Tensor]  # [rows, 1, T, span] bool, None when plain causal is exact
    query_gather: Optional[torch.Tensor]  # [rows, W] int64
    observe_mask: Optional[torch.Tensor] = None  # [rows, T, span] bool, real (query, key) pairs (observing evictors)
    fp_slots: Optional[torch.Tensor] = None  # [rows, T] full-precision slot of each new token (quantized caches)
    view_index: Optional[torch.Tensor] = None  # [rows, span] logical -> stored slot (quantized caches, see view_index)


def new_rows(n: int, rng_keys: Sequence[int] | None = None) -> RowState:
    zeros = torch.zeros(n, dtype=torch.long)
    keys = torch.as_tensor(list(rng_keys) if rng_keys is not None else [0] * n, dtype=torch.long)
    return RowState(zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(), keys, zeros.clone(), zeros.clone(),
                    torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0, 0, dtype=torch.long),
                    torch.zeros(n, 0, dtype=torch.long))
