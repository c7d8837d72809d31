"""The per-token work of evicted requests as fixed-shape tensor ops: what a decode graph captures.

A CUDA graph replays the kernels its capture launched, on the buffers it captured with; the
Python that launched them runs once, at capture, when SGLang's dummy batch holds no kvflow
request. So nothing the decode-time hook does may depend on Python state of this step (which
rows are kvflow's, their lengths, whether a row has holes): every such fact lives in a tensor
preallocated here and indexed by the batch's `req_pool_indices` (a graph input SGLang copies
into its static buffer at replay), and the hook emits the same ops for any batch, kvflow rows
or not. The host side of kvflow (`evict.py`: admission, positions, compaction, snapshots)
writes these tables between forwards, as SGLang's graph runner copies its inputs.

Tables (E = kvflow rows, `KVFLOW_SGLANG_GRAPH_ROWS`; row 0 is a sink that padded and
full-context rows write into; W = `KVFLOW_SGLANG_GRAPH_WINDOW`, R = `KVFLOW_SGLANG_GRAPH_SPAN`):

    row_of[pool slots]            int64  the kvflow row of a request-pool slot (0: not kvflow's)
    offset_of[pool slots]         int64  logical position - row position (RoPE keeps advancing)
    active, observing [E+1]       bool   the row is live; its evictor keeps H2O's statistic
    tokens [E+1]                  int64  queries written (the ring's write position, mod W)
    seen [E+1]                    int64  layers x forwards the hook ran for the row: the tripwire
    hole_start [E+1, L, Hkv], hole_end [E+1]  int64: head h's evicted slots [start, end) (none: 0, 0)
    queries[l] [E+1, W, Hq, D]    the query ring (post-RoPE queries, model dtype)
    stats[l] [E+1, Hkv, R]        float32 H2O's statistic by row position

`decode_step` is the in-graph part: per layer, for ALL rows of the batch at once, it counts the
row as seen, writes its query into the ring, adds H2O's attention statistic over the row's
first R slots and, for rows whose heads keep different numbers of tokens (PyramidKV, Ada-KV),
recomputes attention with each head's hole masked out. Its op count is O(1) per layer,
whatever the number of rows; its cost is O(batch x R) per layer (a second pass over the
rows' keys), the price of a fixed shape.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

ROWS = int(os.environ.get("KVFLOW_SGLANG_GRAPH_ROWS", "256") or 256)
WINDOW = int(os.environ.get("KVFLOW_SGLANG_GRAPH_WINDOW", "32") or 32)
SPAN = int(os.environ.get("KVFLOW_SGLANG_GRAPH_SPAN", "512") or 512)

_H2O = None


def accumulated_attention():
    """H2O's own `observe` (the one statistic the graph keeps): an instance to call it on."""
    global _H2O
    if _H2O is None:
        from kvflow_builtin.evictors.h2o import H2OEvictor

        _H2O = H2OEvictor(H2OEvictor.Params())
    return _H2O


def observes_in_graph(evictor) -> bool:
    """Can the graph keep this evictor's statistic? Only H2O's (accumulated attention)."""
    return type(evictor).observe is type(accumulated_attention()).observe


class Tables:
    """kvflow's per-slot state of one scheduler process, on the KV pool's device."""

    def __init__(self, req_to_token: torch.Tensor, layers: int) -> None:
        dev = req_to_token.device
        slots = req_to_token.shape[0]
        self.device, self.layers = dev, layers
        self.rows, self.window = ROWS, WINDOW
        self.span = min(SPAN, req_to_token.shape[1])
        e = self.rows + 1
        self.row_of = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.offset_of = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.active = torch.zeros(e, dtype=torch.bool, device=dev)
        self.observing = torch.zeros(e, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(e, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(e, dtype=torch.int64, device=dev)
        self.hole_end = torch.zeros(e, dtype=torch.int64, device=dev)
        self.hole_start: Optional[torch.Tensor] = None  # [E+1, L, Hkv], made with the first layer's shapes
        self.queries: list[Optional[torch.Tensor]] = [None] * layers
        self.stats: list[Optional[torch.Tensor]] = [None] * layers
        self.free = list(range(self.rows, 0, -1))

    # ------------------------------------------------------------------ allocation (eager, never in a capture)

    def ensure(self, lid: int, q_heads: int, kv_heads: int, head_dim: int, dtype) -> None:
        """The layer's ring and statistic exist (made at the first forward, i.e. before capture)."""
        if self.queries[lid] is not None:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kvflow's decode tables must exist before a CUDA graph is captured")
        e = self.rows + 1
        if self.hole_start is None:
            self.hole_start = torch.zeros(e, self.layers, kv_heads, dtype=torch.int64, device=self.device)
        self.queries[lid] = torch.zeros(e, self.window, q_heads, head_dim, dtype=dtype, device=self.device)
        self.stats[lid] = torch.zeros(e, kv_heads, self.span, dtype=torch.float32, device=self.device)

    def assign(self, observing: bool) -> Optional[int]:
        """A free kvflow row, cleared, or None when all E are taken (the request waits)."""
        if not self.free:
            return None
        row = self.free.pop()
        for t in (*self.queries, *self.stats):
            if t is not None:
                t[row].zero_()
        if self.hole_start is not None:
            self.hole_start[row].zero_()
        self.hole_end[row] = 0
        self.tokens[row] = 0
        self.seen[row] = 0
        self.active[row] = True
        self.observing[row] = observing
        return row

    def release(self, row: int, pool_idx: Optional[int]) -> None:
        self.active[row] = False
        self.observing[row] = False
        if pool_idx is not None and int(self.row_of[pool_idx]) == row:
            self.row_of[pool_idx] = 0
            self.offset_of[pool_idx] = 0
        self.free.append(row)

    # ------------------------------------------------------------------ host reads and writes (between forwards)

    def window_of(self, row: int, lid: int, written: int, w: int) -> torch.Tensor:
        """The row's last `w` queries of layer `lid`, oldest first, zeros before the first:
        [q_heads, w, D] (what the hf cache's query buffer holds)."""
        pos = (written - w + torch.arange(w)) % self.window
        return self.queries[lid][row, pos.to(self.device)].transpose(0, 1)

    def set_window(self, row: int, lid: int, queries: torch.Tensor) -> None:
        """Start the ring from a snapshot's window [q_heads, w, D] (written count w)."""
        w = queries.shape[1]
        self.queries[lid][row].zero_()
        self.queries[lid][row, :w] = queries.transpose(0, 1).to(self.queries[lid].dtype)

    def set_holes(self, row: int, holes: Optional[torch.Tensor], end: int) -> None:
        """holes [layers, kv_heads] kept counts, the row's new tokens from `end` (None: no hole)."""
        if holes is None:
            self.hole_start[row].zero_()
            self.hole_end[row] = 0
        else:
            self.hole_start[row] = holes.to(self.device)
            self.hole_end[row] = end


def decode_step(t: Tables, q: torch.Tensor, out: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *, lid: int,
                scaling: float, q_heads: int, kv_heads: int, head_dim: int, v_dim: int) -> torch.Tensor:
    """One layer's kvflow work for a decode batch, after the backend wrote the new keys.
    q: [bs, q_heads * D] post-RoPE; out: [bs, q_heads * Dv] the backend's output;
    k_buffer/v_buffer: [pool tokens, kv_heads, D] the layer's KV pool; returns the output
    (the backend's, or the hole-masked recomputation for rows with holes in this layer).
    No host syncs, no Python branch on tensor values: the ops are the same at every call."""
    bs = q.shape[0]
    qh = q.view(bs, q_heads, head_dim)  # [bs, Hq, D]
    rows = t.row_of[req_pool_indices]  # [bs] 0 for rows that are not kvflow's (and padding)
    live = t.active[rows]  # [bs]
    t.seen.index_add_(0, rows, live.to(torch.int64))  # the tripwire's count: checked by the host
    pos = t.tokens[rows] % t.window  # [bs]
    t.queries[lid].index_put_((rows, pos), qh.to(t.queries[lid].dtype))  # non-kvflow rows: into the sink row 0
    if lid == t.layers - 1:  # the last layer moves the ring on (a Python constant, baked per layer)
        t.tokens.index_add_(0, rows, live.to(torch.int64))
    # each row's first R slots, with each head's hole masked out
    span = t.span
    slots = req_to_token[req_pool_indices, :span].to(torch.int64)  # [bs, R]
    j = torch.arange(span, device=q.device)
    valid = j[None, :] < seq_lens[:, None]  # [bs, R]
    start = t.hole_start[rows, lid]  # [bs, Hkv]
    end = t.hole_end[rows]  # [bs]
    hole = (j[None, None, :] >= start[:, :, None]) & (j[None, None, :] < end[:, None, None])  # [bs, Hkv, R]
    mask = valid[:, None, :] & ~hole  # [bs, Hkv, R]
    keys = k_buffer[slots].permute(0, 2, 1, 3)  # [bs, Hkv, R, D]
    # H2O's statistic (its own observe), kept for observing rows only
    delta = torch.zeros(bs, kv_heads, span, dtype=torch.float32, device=q.device)
    accumulated_attention().observe(delta, qh[:, :, None, :], keys, mask[:, :, None, :], layer_idx=lid,
                                    scaling=scaling)
    keep = (t.observing[rows] & live).to(torch.float32)  # [bs]
    t.stats[lid].index_add_(0, rows, delta * keep[:, None, None])
    # rows whose heads have holes in this layer: attention again, each head over its own slots
    has_hole = (start < end[:, None]).any(-1) & live  # [bs]
    g = q_heads // kv_heads
    values = v_buffer[slots].permute(0, 2, 1, 3)  # [bs, Hkv, R, Dv]
    masked = torch.nn.functional.scaled_dot_product_attention(
        qh[:, :, None, :].to(keys.dtype), keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1),
        attn_mask=mask.repeat_interleave(g, dim=1)[:, :, None, :], scale=scaling)  # [bs, Hq, 1, Dv]
    flat = out.view(bs, -1)
    return torch.where(has_hole[:, None], masked.reshape(bs, q_heads * v_dim).to(flat.dtype), flat)
