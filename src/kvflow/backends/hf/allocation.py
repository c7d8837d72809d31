"""The part of the budgeted cache that budgets varying by layer or head need (PyramidKV,
Ada-KV: `kvflow.components.allocation`), mixed into `BudgetedCache`.

Per row and layer (`RowState`): `layer_offset` (the layer's length minus the row's nominal
length), `hole_start` [kv_heads] (k_h, the tokens head h kept) and `hole_end` (K_l, the
longest head, where the layer's new tokens start). Head h's valid slots are [0, k_h) and
[K_l, length): `_layer_plan` masks the hole of every head in that layer's attention,
`_compact_varying` gathers each head's tokens contiguously for the evictor and writes back
what it keeps. With `quantize` (per-layer budgets only) each layer splits its own budget.
"""

from __future__ import annotations

import torch

from kvflow.backends.hf.rows import WritePlan
from kvflow.components.allocation import hole_mask


class LayerAllocation:
    """Methods of `BudgetedCache` for allocations that vary (`self.varies`)."""

    def _layer_plan(self, layer_idx: int, step_lens: torch.Tensor, width: int) -> WritePlan:
        """A varying allocation's plan for one layer: the layer's own lengths, and each head's
        hole [k_h, K_l) masked (mask [rows, kv_heads, T, span] once any row has a hole)."""
        r = self.rows
        lengths = r.lengths + r.layer_offset[:, layer_idx]  # [rows]
        scratch = self.layer_capacity(layer_idx) - 1
        t = torch.arange(width)
        slots = torch.where(t[None, :] < step_lens[:, None], lengths[:, None] + t[None, :], scratch)
        span = int((lengths + step_lens).max())
        key = torch.arange(span)
        causal = key[None, None, :] <= (lengths[:, None, None] + t[None, :, None])  # [rows, T, span]
        real = causal & (t[None, :, None] < step_lens[:, None, None])  # the pairs an observer counts
        start, end = r.hole_start[:, layer_idx], r.hole_end[:, layer_idx]  # [rows, H], [rows]
        if bool((end[:, None] > start).any()):
            hole = hole_mask(start, end, span)  # [rows, H, span]
            mask = causal[:, None] & ~hole[:, :, None]  # [rows, H, T, span]
            real = real[:, None] & ~hole[:, :, None]
        else:
            mask = causal[:, None]
        query_gather = None
        if self.query_window:
            query_gather = (step_lens[:, None] + torch.arange(self.query_window)[None, :]).to(self.device)
        fp_slots = view_index = None
        if self.quant:
            nq = self.layer_quantized(layer_idx)
            fp = self.quant_split(layer_idx)[1]
            fp_slots = torch.where(slots == scratch, fp - 1, slots - nq[:, None]).to(self.device)
            if bool((nq > 0).any()):
                view_index = self.view_index(nq, span, layer_idx).to(self.device)
        observe_mask = real.to(self.device) if self.observes else None  # [rows, (H,) T, span]
        return WritePlan(slots.to(self.device), span, None, mask.to(self.device), query_gather, observe_mask,
                         fp_slots, view_index)

    def _compact_varying(self, layer_idx: int, rows: torch.Tensor, generators) -> None:
        """One layer of a varying allocation: each head's tokens gathered contiguously, the
        evictor's kept slots (k_h per head) written to slots [0, k_h), the hole recorded."""
        layer, r = self.layers[layer_idx], self.rows
        keys, values, heads = self.resident(layer_idx, rows)  # [R, H, N, D], [R, H]
        dev_rows = rows.to(self.device)
        queries = layer.queries.index_select(0, dev_rows) if layer.queries is not None else None
        stats = None
        if layer.stats is not None:  # gathered like the keys: each head's tokens in time order
            stats = layer.stats.index_select(0, dev_rows).gather(
                2, self.head_index(layer_idx, rows, keys.shape[2]).to(self.device))
        extra = {"head_lengths": heads} if self.evictor.adaptive_heads else {}
        keep = self.evictor.select(
            keys, values, queries, layer_idx=layer_idx, lengths=heads.max(-1).values,
            n_protected=r.n_protected.index_select(0, rows), generators=generators, stats=stats,
            budget=self.budgets[layer_idx], **extra,
        )  # [R, H, K]; adaptive: -1 past a head's k_h
        keep = keep.to(self.device)
        if stats is not None:
            kept = stats.gather(2, keep.clamp(min=0)).masked_fill(keep < 0, 0.0)
            layer.stats[dev_rows] = torch.nn.functional.pad(kept, (0, layer.stats.shape[2] - kept.shape[2]))
        idx = keep.clamp(min=0)[..., None]
        unused = (keep < 0)[..., None]
        kept_keys = keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1])).masked_fill(unused, 0)
        kept_values = values.gather(2, idx.expand(-1, -1, -1, values.shape[-1])).masked_fill(unused, 0)
        width = keep.shape[-1]
        if self.quant:  # the layer's first whole key groups quantized, the rest at full precision
            quantized = self.quant_split(layer_idx)[0]
            if quantized:  # a layer whose budget holds no whole key group beyond the residual: all full precision
                layer.qstore.write(dev_rows, 0, kept_keys[:, :, :quantized], kept_values[:, :, :quantized])
            layer.keys[dev_rows, :, : width - quantized] = kept_keys[:, :, quantized:]
            layer.values[dev_rows, :, : width - quantized] = kept_values[:, :, quantized:]
            r.n_quantized[rows, layer_idx] = quantized
        else:
            layer.keys[dev_rows, :, :width] = kept_keys
            layer.values[dev_rows, :, :width] = kept_values
        counts = (keep >= 0).sum(-1).cpu()  # [R, H]
        longest = counts.max(-1).values  # [R]
        r.hole_start[rows, layer_idx] = counts
        r.hole_end[rows, layer_idx] = longest
        r.layer_offset[rows, layer_idx] = longest - self.evictor.params.budget

    def _compact_quantized_layers(self, rows: torch.Tensor) -> None:
        """A quantized cache whose layers have their own budgets: a row at the nominal
        `budget + buffer` is evicted (every layer); before that, a layer whose
        full-precision part is full moves its oldest key groups into its quantized store."""
        budget = self.evictor.params.budget
        due = self.rows.lengths.index_select(0, rows) >= self.evictor.trigger
        for row in rows[~due].tolist():
            for layer_idx in range(len(self.layers)):
                quantized, fp = self.quant_split(layer_idx)
                length = int(self.rows.lengths[row] + self.rows.layer_offset[row, layer_idx])
                nq = int(self.rows.n_quantized[row, layer_idx])
                if length - nq >= fp - 1 and nq < quantized:
                    self._quantize_oldest(row, layer_idx)
        rows = rows[due]
        if not len(rows):
            return
        generators = [
            torch.Generator().manual_seed((k * 1_000_003 + c) % 2**63)  # host ints: no op per row
            for k, c in zip(self.rows.rng_keys[rows].tolist(), self.rows.compactions[rows].tolist())
        ]
        for layer_idx in range(len(self.layers)):
            self._compact_varying(layer_idx, rows, generators)
        self.rows.lengths[rows] = budget
        self.rows.compactions[rows] += 1
