"""Compaction of evicted requests in SGLang's pool: the eager, between-forwards half of kvflow's hooks.

A mixin of `evict.Runtime` (`requests.py` holds `Live`). When a running row's nominal length reaches `budget + buffer`
(checked after each forward, `Runtime.forwarded`), its kept tokens per (layer, KV head) are
chosen by the request's evictor exactly as the `hf` cache chooses them, gathered into the row's
first slots, and the rest go back to SGLang's allocator; the per-slot tables (`graph.Tables`:
offset, holes, H2O's statistic) follow. Rows of one uniform-budget evictor and one length
(the candidates of a fork come due together) compact at once: `select` over their rows, a
few layers per call where the evictor allows (`Evictor.select_layers`); varying allocations
(per-head holes) row by row. A request that ends with `save_as` has a copy of its state
compacted here too (`_compacted`, from `Runtime.released`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from kvflow.components.allocation import hole_index

if TYPE_CHECKING:  # pragma: no cover
    from kvflow.backends.sglang.in_worker.requests import Live


class Compaction:
    """Compaction methods of `evict.Runtime` (its `tables`, `compactions` and `Live` rows)."""

    def _compact_rows(self, processor, batch, group: list) -> None:
        """Compact rows of one uniform-budget evictor and one length together: their rows
        selected together (`Evictor.select_layers`, as the hf cache calls it), one gather and
        one write per layer. group: [(batch index, req, live)]."""
        pool = processor.req_to_token_pool
        kv = processor.token_to_kv_pool_allocator.get_kvcache()
        t = self.tables
        lives = [live for _, _, live in group]
        ev, n, g = lives[0].evictor, lives[0].resident, len(group)
        pool_idx = torch.tensor([req.kv.req_pool_idx for _, req, _ in group], device=pool.req_to_token.device)
        rows = torch.tensor([live.row for live in lives], device=t.device)
        slots = pool.req_to_token[pool_idx, :n].long()  # [G, n]
        gens = [torch.Generator().manual_seed((live.rng_key * 1_000_003 + live.compactions) % 2**63) for live in lives]
        protected = torch.tensor([live.n_protected for live in lives])
        lengths = torch.full((g,), n)
        w = ev.query_window
        if w:
            pos = (torch.tensor([live.written for live in lives])[:, None] - w + torch.arange(w)) % t.window  # [G, w]
            pos = pos.to(t.device)
        kept = ev.params.budget

        def read(layer: int):
            k = kv.k_buffer[layer][slots].transpose(1, 2)  # [G, kv_heads, n, D]
            v = kv.v_buffer[layer][slots].transpose(1, 2)
            queries = t.queries[layer][rows[:, None], pos].transpose(1, 2) if w else None  # [G, q_heads, w, D]
            stats = t.stats[layer][rows, :, :n] if ev.observes_attention else None  # [G, kv_heads, n]
            return k, v, queries, stats

        for layer, keep, (k, v, _, stats) in ev.select_layers(t.layers, read, lengths=lengths, n_protected=protected,
                                                              generators=gens):
            keep = keep.to(k.device)  # [G, kv_heads, K]
            idx = keep[..., None]
            kv.k_buffer[layer][slots[:, :kept]] = k.gather(2, idx.expand(-1, -1, -1, k.shape[-1])).transpose(1, 2)
            kv.v_buffer[layer][slots[:, :kept]] = v.gather(2, idx.expand(-1, -1, -1, v.shape[-1])).transpose(1, 2)
            if stats is not None:
                new = torch.zeros_like(t.stats[layer][rows])
                new[:, :, :kept] = stats.gather(2, keep)
                t.stats[layer][rows] = new
        for (i, req, live) in group:  # SGLang's and kvflow's bookkeeping of each row (host side)
            processor.tree_cache.free_kv_row(req.kv, [(kept, n)])
            req.kv.kv_committed_len = req.kv.kv_allocated_len = kept
            batch.seq_lens_cpu[i] = kept
            live.offset += n - kept
            live.resident = kept
            live.compactions += 1
            self.compactions += 1
        index = torch.tensor([i for i, _, _ in group], device=batch.seq_lens.device)
        batch.seq_lens[index] = kept
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens[index] = kept
        batch.seq_lens_sum = None
        t.offset_of[pool_idx] = torch.tensor([live.offset for live in lives], device=t.device)

    def _compact_row(self, processor, batch, i: int, req, live: Live) -> None:
        pool = processor.req_to_token_pool
        kv = processor.token_to_kv_pool_allocator.get_kvcache()
        n = live.resident
        slots = pool.req_to_token[req.kv.req_pool_idx, :n].long()
        keys, values = self._read(kv, slots)
        keys, values, stats, holes = self._compacted(live, keys, values)
        kept = keys.shape[2]  # the budget, or the longest (layer, head) of a varying allocation
        for layer in range(keys.shape[0]):
            kv.k_buffer[layer][slots[:kept]] = keys[layer].transpose(0, 1)
            kv.v_buffer[layer][slots[:kept]] = values[layer].transpose(0, 1)
        processor.tree_cache.free_kv_row(req.kv, [(kept, n)])
        req.kv.kv_committed_len = req.kv.kv_allocated_len = kept
        batch.seq_lens[i] = kept
        batch.seq_lens_cpu[i] = kept
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens[i] = kept
        batch.seq_lens_sum = None
        live.offset += n - kept
        live.resident = kept
        live.holes, live.base = holes, kept - live.evictor.params.budget
        live.compactions += 1
        self.compactions += 1
        t = self.tables
        t.offset_of[req.kv.req_pool_idx] = live.offset
        t.set_holes(live.row, holes, live.hole_end)
        if stats is not None:
            for layer, s in enumerate(stats):
                t.stats[layer][live.row].zero_()
                t.stats[layer][live.row, :, :kept] = s

    @staticmethod
    def _read(kv, slots: torch.Tensor):
        keys = torch.stack([kv.k_buffer[l][slots].transpose(0, 1) for l in range(len(kv.k_buffer))])
        values = torch.stack([kv.v_buffer[l][slots].transpose(0, 1) for l in range(len(kv.v_buffer))])
        return keys, values  # [layers, kv_heads, n, D]

    def _compacted(self, live: Live, keys: torch.Tensor, values: torch.Tensor):
        """The evictor's kept tokens per (layer, head), exactly as the `hf` cache keeps them.
        keys, values: [layers, kv_heads, n, D] (the row's slots) -> kept [layers, kv_heads, K, D]
        (K = budget; varying allocations: the longest (layer, head), zeros past each head's
        own), the H2O statistic, and the holes ([layers, kv_heads] kept counts, or None)."""
        ev = live.evictor
        n = keys.shape[2]
        layers = keys.shape[0]
        varies = ev.varies(layers)
        budgets = ev.allocation(layers) if varies else None
        gen = torch.Generator().manual_seed((live.rng_key * 1_000_003 + live.compactions) % 2**63)
        protected = torch.tensor([live.n_protected])
        kept_k, kept_v, kept_s, counts = [], [], [], []
        for layer in range(layers):
            queries = self._window(live, layer)
            queries = queries[None] if queries is not None else None
            k, v, heads, idx = self._head_view(live, keys[layer], values[layer], layer)  # [H, N, D], [H]
            stats = None
            if ev.observes_attention:  # gathered like the keys
                row_stats = self.tables.stats[layer][live.row, :, :n]
                stats = (row_stats if idx is None else row_stats.gather(1, idx[..., 0]))[None]
            extra = {"budget": budgets[layer]} if varies else {}
            if ev.adaptive_heads:
                extra["head_lengths"] = heads[None]
            keep = ev.select(k[None], v[None], queries, layer_idx=layer, lengths=heads.max()[None],
                             n_protected=protected, generators=[gen], stats=stats, **extra)[0]  # [kv_heads, K]
            idx = keep.clamp(min=0).to(keys.device)[..., None]
            unused = (keep < 0).to(keys.device)[..., None]
            kept_k.append(k.gather(1, idx.expand(-1, -1, k.shape[-1])).masked_fill(unused, 0))
            kept_v.append(v.gather(1, idx.expand(-1, -1, v.shape[-1])).masked_fill(unused, 0))
            counts.append((keep >= 0).sum(-1))
            if stats is not None:
                kept_s.append(stats[0].gather(1, keep.clamp(min=0).to(keys.device)).masked_fill(unused[..., 0], 0.0))
        if not varies:
            return torch.stack(kept_k), torch.stack(kept_v), (kept_s or None), None
        holes = torch.stack(counts).cpu()  # [layers, kv_heads]
        width = int(holes.max())

        def fit(x):  # [H, K_l, D] -> [H, width, D]: zeros past the layer's own width
            x = x[:, :width]
            return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1]))

        def fit_stats(x):  # [H, K_l] -> [H, width]
            x = x[:, :width]
            return torch.nn.functional.pad(x, (0, width - x.shape[1]))

        return (torch.stack([fit(x) for x in kept_k]), torch.stack([fit(x) for x in kept_v]),
                [fit_stats(x) for x in kept_s] or None, holes)  # the query window stays as it is

    def _window(self, live: Live, layer: int) -> Optional[torch.Tensor]:
        """The request's query window of a layer, [q_heads, W, D], or None (no window)."""
        w = live.evictor.query_window
        return self.tables.window_of(live.row, layer, live.written, w) if w else None

    @staticmethod
    def _head_view(live: Live, keys: torch.Tensor, values: torch.Tensor, layer: int):
        """One layer's row gathered per head in time order, skipping the head's hole:
        keys, values [kv_heads, n, D] -> ([kv_heads, N, D], [kv_heads, N, Dv], lengths [kv_heads],
        the gather index [kv_heads, N, 1] or None)."""
        heads, n = keys.shape[0], keys.shape[1]
        if live.holes is None:
            return keys, values, torch.full((heads,), n), None
        start = live.holes[layer]  # [H]
        lengths = n - (live.hole_end - start)
        idx = hole_index(start, live.hole_end, int(lengths.max())).clamp(max=n - 1).to(keys.device)[..., None]
        return (keys.gather(1, idx.expand(-1, -1, keys.shape[-1])),
                values.gather(1, idx.expand(-1, -1, values.shape[-1])), lengths, idx)
