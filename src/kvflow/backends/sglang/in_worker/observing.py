"""Observing evicted rows with their evictor's own `observe()` (H2O and third parties): the
attention each resident key receives from the new queries, added to the row's statistic
(`graph.Tables.stats`), host-side and row by row. A mixin of `evict.Runtime`: it runs on the
extend path, and after `decode_step` for evictors whose statistic the decode graph does not
keep (only where no decode graph was captured: `graph.profile_problem` refuses them there).
"""

from __future__ import annotations

import torch

from kvflow.components.allocation import hole_mask


class Observing:
    """Host-side observation of `evict.Runtime`."""

    def observe_rows(self, q, layer, rows, shaped: bool = False) -> None:
        """The attention each resident key of these rows receives from their new queries, added
        to their statistic by their evictor's own `observe()` (host-side, row by row)."""
        lid = layer.layer_id
        if not shaped:
            head_dim = layer.qk_head_dim if hasattr(layer, "qk_head_dim") else layer.head_dim
            q = q.reshape(q.shape[0], -1, head_dim)  # [tokens, q_heads, D]
        req_to_token = self.req_to_token_pool.req_to_token
        kv, t = self.kv, self.tables
        for _, start, count, live, pool_idx in rows:
            ev = live.evictor
            span = live.resident + count
            if span > t.span:
                raise ValueError(f"kvflow: an evicted row of {span} slots is past the engine's span {t.span}")
            slots = req_to_token[pool_idx, :span].long()
            keys = kv.get_key_buffer(lid)[slots].transpose(0, 1)[None]  # [1, kv_heads, span, D]
            tk = torch.arange(count, device=keys.device)
            key = torch.arange(span, device=keys.device)
            mask = (key[None, :] <= (live.resident + tk)[:, None])[None]  # [1, T, span]
            if live.has_holes():  # each head's evicted slots below the row's longest head
                hole = hole_mask(live.holes[lid].to(keys.device), live.hole_end, span)  # [H, span]
                mask = mask[:, None] & ~hole[None, :, None]  # [1, H, T, span]
            new = q[start : start + count].transpose(0, 1)  # [q_heads, T, D]
            ev.observe(t.stats[lid][live.row, :, :span][None], new[None].to(keys.dtype), keys, mask,
                       layer_idx=lid, scaling=layer.scaling)  # a view: updated in place
