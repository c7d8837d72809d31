"""The extend path of evicted requests (prefill, ingested text; every forward with
`KVFLOW_SGLANG_HOOKS=eager`): kvflow's part of a layer's attention, row by row in Python, after
the backend wrote the new keys. A mixin of `evict.Runtime`; it cannot run under a replayed
graph (the decode path, `decode.py`, can).

- `attended`: the tripwire's count, the query ring and (observing evictors) the statistic;
- `masked_attention`: rows whose heads keep different numbers of tokens (PyramidKV, Ada-KV):
  their attention again, each head over its own slots, written over SGLang's output.
"""

from __future__ import annotations

import torch

from kvflow.components.allocation import hole_mask


class Extend:
    """The per-row path of `evict.Runtime`."""

    def masked_attention(self, q, out, layer) -> None:
        """Rows with holes (varying allocations): their attention again, each head over its
        own slots only, written over SGLang's output. q: [tokens, q_heads * D];
        out: [tokens, q_heads * Dv]."""
        lid = layer.layer_id
        head_dim = layer.qk_head_dim if hasattr(layer, "qk_head_dim") else layer.head_dim
        q = q.reshape(q.shape[0], -1, head_dim)  # [tokens, q_heads, D]
        flat = out.view(out.shape[0], -1)
        req_to_token = self.req_to_token_pool.req_to_token
        for _, start, count, live, pool_idx in self.rows:
            if not live.has_holes() or not bool((live.holes[lid] < live.hole_end).any()):
                continue  # this layer of the row has no hole (PyramidKV's widest layer, say): SGLang's output stands
            span = live.resident + count
            slots = req_to_token[pool_idx, :span].long()
            keys = self.kv.get_key_buffer(lid)[slots].transpose(0, 1)  # [kv_heads, span, D]
            values = self.kv.get_value_buffer(lid)[slots].transpose(0, 1)
            kv_heads, q_heads = keys.shape[0], q.shape[1]
            key = torch.arange(span, device=keys.device)
            t = torch.arange(count, device=keys.device)
            causal = key[None, :] <= (live.resident + t)[:, None]  # [T, span]
            hole = hole_mask(live.holes[lid].to(keys.device), live.hole_end, span)  # [H, span]
            mask = (causal[None] & ~hole[:, None]).repeat_interleave(q_heads // kv_heads, dim=0)  # [Hq, T, span]
            g = q_heads // kv_heads
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start : start + count].transpose(0, 1)[None].to(keys.dtype),
                keys.repeat_interleave(g, dim=0)[None], values.repeat_interleave(g, dim=0)[None],
                attn_mask=mask[None], scale=layer.scaling)  # [1, Hq, T, Dv]
            flat[start : start + count] = o[0].transpose(0, 1).reshape(count, -1).to(flat.dtype)

    def attended(self, q, layer, forward_batch) -> None:
        """The per-row path (extend forwards; every forward in `eager` mode), after a layer's
        attention wrote its keys: the tripwire's count, the query ring and H2O's statistic,
        row by row in Python (it cannot run under a replayed graph)."""
        rows = self.rows
        lid = layer.layer_id
        head_dim = layer.qk_head_dim if hasattr(layer, "qk_head_dim") else layer.head_dim
        q = q.reshape(q.shape[0], -1, head_dim)  # [tokens, q_heads, D]
        t = self.tables
        last = lid == t.layers - 1
        for _, start, count, live, pool_idx in rows:
            t.seen[live.row] += 1
            ev = live.evictor
            if ev.query_window:
                m = min(count, t.window)
                new = q[start + count - m : start + count]  # [m, q_heads, D]
                pos = (live.written + count - m + torch.arange(m)) % t.window
                t.queries[lid][live.row, pos.to(t.device)] = new.to(t.queries[lid].dtype)
            if last:
                t.tokens[live.row] = live.written + count  # where `decode_step` writes next
            if ev.observes_attention:
                self.observe_rows(q, layer, [(None, start, count, live, pool_idx)], shaped=True)
