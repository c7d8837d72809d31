"""Compaction of `BudgetedCache` (`cache.py`): rows evicted in place down to exactly `budget`
tokens per (layer, KV head) by their evictor's `select`, and a quantized cache's oldest key
groups moved to its store. A mixin: the cache holds the state."""

from __future__ import annotations

from typing import Optional

import torch


class Compaction:
    """Eviction of `BudgetedCache` rows (see the module docstring)."""

    # ------------------------------------------------------------------ eviction

    def compact(self, rows: torch.Tensor) -> None:
        """Evict rows down to exactly `budget` tokens per (layer, KV head). A quantized cache
        is due when its full-precision region is full: until its quantized store is full, a
        row only moves its oldest key groups there, so eviction still happens at exactly
        `budget + buffer` resident tokens."""
        if self.quant and self.varies:
            return self._compact_quantized_layers(rows)
        if self.quant:  # rows whose quantized store is not full yet only quantize (same cadence as unquantized)
            full = self.rows.n_quantized.index_select(0, rows) >= self.quant_capacity
            for r in rows[~full].tolist():
                self._quantize_oldest(r)
            rows = rows[full]
            if not len(rows):
                return
        budget = self.evictor.params.budget
        lengths = self.rows.lengths.index_select(0, rows)
        n = int(lengths.max())
        dev_rows = rows.to(self.device)
        generators = [
            torch.Generator().manual_seed((k * 1_000_003 + c) % 2**63)  # host ints: no op per row
            for k, c in zip(self.rows.rng_keys[rows].tolist(), self.rows.compactions[rows].tolist())
        ]
        if self.varies:
            for layer_idx in range(len(self.layers)):
                self._compact_varying(layer_idx, rows, generators)
            self.rows.lengths[rows] = budget
            self.rows.compactions[rows] += 1
            return
        if self.quant:
            view_index = self.view_index(self.rows.n_quantized.index_select(0, rows), n).to(self.device)

        def read(layer_idx: int):
            layer = self.layers[layer_idx]
            if self.quant:
                keys, values = layer.logical(view_index, dev_rows)
            else:
                keys = layer.keys.index_select(0, dev_rows)[:, :, :n]
                values = layer.values.index_select(0, dev_rows)[:, :, :n]
            queries = layer.queries.index_select(0, dev_rows) if layer.queries is not None else None
            stats = layer.stats.index_select(0, dev_rows)[:, :, :n] if layer.stats is not None else None
            return keys, values, queries, stats

        for layer_idx, keep, (keys, values, _, stats) in self.evictor.select_layers(
                len(self.layers), read, lengths=lengths, n_protected=self.rows.n_protected.index_select(0, rows),
                generators=generators):  # keep: [rows, kv_heads, budget]
            layer = self.layers[layer_idx]
            idx = keep.to(self.device)[..., None]
            kept_keys = keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1]))  # [rows, kv_heads, budget, D]
            kept_values = values.gather(2, idx.expand(-1, -1, -1, values.shape[-1]))
            if self.quant:
                # already-quantized survivors are quantized again from their dequantized values:
                # a key group may have lost members (per-value error stays within the new scale / 2)
                nq = self.quant_capacity
                layer.qstore.write(dev_rows, 0, kept_keys[:, :, :nq], kept_values[:, :, :nq])
                layer.keys[dev_rows, :, : budget - nq] = kept_keys[:, :, nq:]
                layer.values[dev_rows, :, : budget - nq] = kept_values[:, :, nq:]
            else:
                layer.keys[dev_rows, :, :budget] = kept_keys
                layer.values[dev_rows, :, :budget] = kept_values
            if stats is not None:
                kept = stats.gather(2, keep.to(self.device))
                layer.stats[dev_rows] = torch.nn.functional.pad(kept, (0, layer.stats.shape[2] - budget))
        self.rows.lengths[rows] = budget
        self.rows.compactions[rows] += 1
        if self.quant:
            self.rows.n_quantized[rows] = self.quant_capacity

    def _quantize_oldest(self, row: int, layer_idx: Optional[int] = None) -> None:
        """A row whose full-precision region is full but whose quantized store is not: move its
        oldest whole key groups (all but at least `residual` tokens) into the store (every
        layer, or only `layer_idx` when the layers have budgets of their own)."""
        g = self.quant.group_size
        if layer_idx is None:
            nq, length = int(self.rows.n_quantized[row]), int(self.rows.lengths[row])
            budget, capacity, layers = self.evictor.params.budget, self.quant_capacity, self.layers
        else:
            nq = int(self.rows.n_quantized[row, layer_idx])
            length = int(self.rows.lengths[row] + self.rows.layer_offset[row, layer_idx])
            budget, capacity = self.budgets[layer_idx], self.quant_split(layer_idx)[0]
            layers = [self.layers[layer_idx]]
        residual = budget - capacity
        target = min(capacity, (length - residual) // g * g)
        moved, fp_len = target - nq, length - nq
        if moved <= 0:  # cannot happen while buffer >= group_size (EvictorParams checks it)
            raise RuntimeError("quantized cache: full-precision region full but no whole group to quantize")
        dev = torch.tensor([row], device=self.device)
        for layer in layers:
            layer.qstore.write(dev, nq, layer.keys[dev, :, :moved], layer.values[dev, :, :moved])
            layer.keys[row, :, : fp_len - moved] = layer.keys[row, :, moved:fp_len].clone()
            layer.values[row, :, : fp_len - moved] = layer.values[row, :, moved:fp_len].clone()
        if layer_idx is None:
            self.rows.n_quantized[row] = target
        else:
            self.rows.n_quantized[row, layer_idx] = target
