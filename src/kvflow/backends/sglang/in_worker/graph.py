"""The per-token work of evicted requests as fixed-shape tensor ops: what a decode graph captures.

A CUDA graph replays the kernels its capture launched, on the buffers it captured with; the
Python that launched them runs once, at capture, when SGLang's dummy batch holds no kvflow
request. So nothing the decode-time hook does may depend on Python state of this step (which
rows are kvflow's, their lengths, whether a row has holes): every such fact lives in a tensor
preallocated here and indexed by the batch's `req_pool_indices` (a graph input SGLang copies
into its static buffer at replay), and the hook emits the same ops for any batch, kvflow rows
or not. The host side of kvflow (`evict.py`: admission, positions, compaction, snapshots)
writes these tables between forwards, as SGLang's graph runner copies its inputs.

What the hook does is decided once per engine, from the evictors it will serve (a `Profile`,
computed by the client from the compiled pipeline and passed to the scheduler process in
`KVFLOW_SGLANG_EVICT`), so an engine pays only for what its evictors read:

    query ring      only if an evictor scores with recent queries (W = the longest window)
    H2O statistic   only if an evictor observes attention (and only H2O's is kept in a graph)
    hole recompute  only if an allocation varies by layer or head (PyramidKV, Ada-KV)
    span R          the longest row those two read (budget + buffer + the step's token), not a
                    global constant; 0 when neither runs: the hook then reads no key or value

A full-context engine registers no kvflow hook at all (`plugin.py`): SGLang decodes as shipped.

Tables (E = kvflow rows, `KVFLOW_SGLANG_GRAPH_ROWS`; row 0 is a sink that padded and
full-context rows write into):

    row_of[pool slots]            int64  the kvflow row of a request-pool slot (0: not kvflow's)
    offset_of[pool slots]         int64  logical position - row position (RoPE keeps advancing)
    active, observing [E+1]       bool   the row is live; its evictor keeps H2O's statistic
    tokens [E+1]                  int64  queries written (the ring's write position, mod W)
    seen [E+1]                    int64  layers x forwards the hook ran for the row: the tripwire
    hole_start [E+1, L, Hkv], hole_end [E+1]  int64: head h's evicted slots [start, end) (none: 0, 0)
    queries[l] [E+1, W, Hq, D]    the query ring (post-RoPE queries, model dtype; W > 0 only)
    stats[l] [E+1, Hkv, R]        float32 H2O's statistic by row position (observing engines only)

`decode_step` is the in-graph part: per layer, for ALL rows of the batch at once, it counts the
row as seen and, as the profile asks, writes its query into the ring, adds H2O's statistic over
the row's first R slots and, for rows whose heads keep different numbers of tokens, recomputes
attention with each head's hole masked out. Keys are gathered once per layer as
[bs, Hkv, R, D] (query heads grouped per KV head: no GQA copies), scores are taken in float32
(on CUDA by a low-precision matmul with a float32 output: no float32 copy of the keys), and one
softmax serves both the statistic and the recompute. Its op count is O(1) per layer whatever
the number of rows; `bench/sglang_decode_bytes.py` counts its bytes per step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from kvflow.components.base import observed_statistic

ROWS = int(os.environ.get("KVFLOW_SGLANG_GRAPH_ROWS", "256") or 256)
ENV = "KVFLOW_SGLANG_EVICT"  # the engine's Profile, JSON: set by the worker for an evicting engine only


@dataclass(frozen=True)
class Profile:
    """What an evicting engine's decode hook does: decided from the evictors it serves."""

    window: int = 0  # W: the query ring's length (0: no evictor reads queries)
    observes: bool = False  # an evictor keeps H2O's statistic (in the graph)
    own_observers: bool = False  # an evictor observes with its own observe() (eager forwards only)
    varies: bool = False  # an allocation varies by layer or head: holes, the masked recompute
    span: int = 0  # R: the longest row the statistic or the recompute reads (0: neither runs)
    rows: int = ROWS  # E: kvflow rows of the tables (more evicted requests wait for a free one)

    @classmethod
    def of(cls, evictors, layers: int, kv_heads: int) -> "Profile":
        """The profile that serves exactly these evictor instances on a model of `layers`
        layers and `kv_heads` KV heads (per tensor-parallel rank: counts do not change R)."""
        window, observes, own, varies, span = 0, False, False, False, 0
        for ev in evictors:
            if not getattr(ev, "bounded", True):
                continue
            window = max(window, int(ev.query_window))
            if ev.observes_attention:
                observes = observes or observes_in_graph(ev)
                own = own or not observes_in_graph(ev)
            if ev.varies(layers):
                varies = True
            if ev.observes_attention or ev.varies(layers):
                span = max(span, row_width(ev, layers, kv_heads))
        return cls(window, observes, own, varies, span)

    @classmethod
    def general(cls) -> "Profile":
        """For an engine loaded without its evictors named (a test, a bench): every part on,
        rows up to 512 slots (kvflow 0.x's fixed shapes). `check_fits` refuses what it lacks."""
        return cls(window=32, observes=True, own_observers=True, varies=True, span=512)

    @property
    def reads_kv(self) -> bool:
        return bool(self.span) and (self.observes or self.varies)

    def covers(self, other: "Profile") -> bool:
        """Does a hook built for this profile serve every evictor `other` serves?"""
        return (self.window >= other.window and self.span >= other.span and self.rows >= other.rows
                and all(getattr(self, f) or not getattr(other, f) for f in ("observes", "own_observers", "varies")))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> "Profile":
        return cls(**json.loads(raw))

    @classmethod
    def from_env(cls) -> Optional["Profile"]:
        raw = os.environ.get(ENV)
        return cls.from_json(raw) if raw else None


def row_width(ev, layers: int, kv_heads: int) -> int:
    """Slots an evicted row of this evictor holds during a forward at most: its longest
    (layer, head) between compactions + the token the forward appends."""
    return (max(ev.layer_widths(layers, kv_heads)) if ev.varies(layers) else ev.trigger) + 1


def observes_in_graph(evictor) -> bool:
    """Can the graph keep this evictor's statistic? Only accumulated attention (H2O's), which the
    evictor declares (`Evictor.observed_statistic`) and the graph computes itself."""
    return observed_statistic(evictor) == "accumulated_attention"


def profile_problem(profile: Profile, ev, layers: int, kv_heads: int, graphs: bool) -> Optional[str]:
    """Why an engine built for `profile` cannot serve evictor `ev`, or None."""
    varies = ev.varies(layers)
    if ev.observes_attention and observes_in_graph(ev) and not profile.observes:
        return "it observes attention (H2O's statistic), and the engine was started for evictors that do not"
    if ev.observes_attention and not observes_in_graph(ev) and not profile.own_observers:
        return "it observes attention with its own observe(), and the engine was started for evictors that do not"
    if varies and not profile.varies:
        return "its allocation varies by layer or head, and the engine was started for uniform budgets"
    if (ev.observes_attention or varies) and row_width(ev, layers, kv_heads) > profile.span:
        return f"its rows reach {row_width(ev, layers, kv_heads)} slots, past the engine's span {profile.span}"
    if ev.query_window > profile.window:
        return f"its query window {ev.query_window} is past the engine's {profile.window}"
    if ev.observes_attention and not observes_in_graph(ev) and graphs:
        return ("it observes attention with its own observe(), and the decode graph keeps H2O's statistic only "
                "(set models.<entry>.engine.disable_cuda_graph: true: without decode graphs kvflow observes such "
                "rows eagerly)")
    return None


class Tables:
    """kvflow's per-slot state of one scheduler process, on the KV pool's device, sized by the
    engine's `Profile` (a part the profile leaves out allocates nothing)."""

    def __init__(self, req_to_token: torch.Tensor, layers: int, profile: Profile) -> None:
        dev = req_to_token.device
        slots = req_to_token.shape[0]
        self.device, self.layers, self.profile = dev, layers, profile
        self.rows, self.window = profile.rows, profile.window
        self.span = min(profile.span, req_to_token.shape[1]) if profile.reads_kv else 0
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
        self.made = [False] * layers
        self.free = list(range(self.rows, 0, -1))

    # ------------------------------------------------------------------ allocation (eager, never in a capture)

    def ensure(self, lid: int, q_heads: int, kv_heads: int, head_dim: int, dtype) -> None:
        """The layer's ring and statistic exist (made at the first forward, i.e. before capture)."""
        if self.made[lid]:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kvflow's decode tables must exist before a CUDA graph is captured")
        e = self.rows + 1
        if self.hole_start is None:
            self.hole_start = torch.zeros(e, self.layers, kv_heads, dtype=torch.int64, device=self.device)
        if self.window:
            self.queries[lid] = torch.zeros(e, self.window, q_heads, head_dim, dtype=dtype, device=self.device)
        if self.span and (self.profile.observes or self.profile.own_observers):
            self.stats[lid] = torch.zeros(e, kv_heads, self.span, dtype=torch.float32, device=self.device)
        self.made[lid] = True

    def nbytes(self) -> int:
        """Device bytes the tables hold (outside SGLang's KV pool: what placement sets aside)."""
        ts = [self.row_of, self.offset_of, self.active, self.observing, self.tokens, self.seen, self.hole_end,
              self.hole_start, *self.queries, *self.stats]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

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


_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")  # bmm(..., out_dtype=) (CUDA and meta kernels; torch >= 2.8)


def _scores(qg: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """qg [n, g, D] (already scaled) x keys [n, R, D] -> [n, g, R] float32 scores. On a GPU a
    low-precision model multiplies in its own dtype with float32 accumulation and output (no
    float32 copy of the keys); elsewhere (the CPU) in float32, as the hf cache's observe does."""
    if keys.dtype != torch.float32 and keys.device.type != "cpu" and _BMM_OUT_DTYPE:
        return torch.bmm(qg.to(keys.dtype), keys.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(qg.float(), keys.float().transpose(1, 2))


def decode_step(t: Tables, q: torch.Tensor, out: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *, lid: int,
                scaling: float, q_heads: int, kv_heads: int, head_dim: int, v_dim: int) -> torch.Tensor:
    """One layer's kvflow work for a decode batch, after the backend wrote the new keys.
    q: [bs, q_heads * D] post-RoPE; out: [bs, q_heads * Dv] the backend's output;
    k_buffer/v_buffer: [pool tokens, kv_heads, D] the layer's KV pool; returns the output
    (the backend's, or the hole-masked recomputation for rows with holes in this layer).
    No host syncs, no Python branch on tensor values: the ops are the same at every call
    (the branches below read the engine's profile, fixed before capture)."""
    p = t.profile
    bs = q.shape[0]
    rows = t.row_of[req_pool_indices]  # [bs] 0 for rows that are not kvflow's (and padding)
    live = t.active[rows]  # [bs]
    t.seen.index_add_(0, rows, live.to(torch.int64))  # the tripwire's count: checked by the host
    if t.window:
        pos = t.tokens[rows] % t.window  # [bs]
        ring = t.queries[lid]
        ring.index_put_((rows, pos), q.view(bs, q_heads, head_dim).to(ring.dtype))  # others: the sink row 0
        if lid == t.layers - 1:  # the last layer moves the ring on (a Python constant, baked per layer)
            t.tokens.index_add_(0, rows, live.to(torch.int64))
    if not t.span:
        return out
    # each row's first R slots, each head's hole masked out
    span, g = t.span, q_heads // kv_heads
    slots = req_to_token[req_pool_indices, :span].to(torch.int64)  # [bs, R]
    j = torch.arange(span, device=q.device)
    heads = torch.arange(kv_heads, device=q.device)
    mask = j[None, :] < seq_lens[:, None]  # [bs, R]
    if p.varies:
        start = t.hole_start[rows, lid]  # [bs, Hkv]
        end = t.hole_end[rows]  # [bs]
        hole = (j[None, None, :] >= start[:, :, None]) & (j[None, None, :] < end[:, None, None])  # [bs, Hkv, R]
        mask = mask[:, None, :] & ~hole  # [bs, Hkv, R]
    else:
        mask = mask[:, None, :].expand(bs, kv_heads, span)
    keys = k_buffer[slots[:, None, :], heads[None, :, None]]  # [bs, Hkv, R, D]: one gather, no GQA copy
    qg = q.view(bs * kv_heads, g, head_dim) * scaling  # [bs*Hkv, g, D]: query heads grouped by KV head
    scores = _scores(qg, keys.view(bs * kv_heads, span, head_dim)).view(bs, kv_heads, g, span)
    # every row keeps slot 0 (padding rows have length 1, holes start past the window): no empty softmax
    probs = torch.softmax(scores.masked_fill_(~mask[:, :, None, :], float("-inf")), dim=-1)  # [bs, Hkv, g, R]
    if p.observes:  # H2O's statistic: the attention each slot receives, summed over the group's heads;
        kept = torch.where(t.observing[rows] & live, rows, 0)  # rows that do not keep it add into the sink row
        t.stats[lid].index_add_(0, kept, probs.sum(2))
    if not p.varies:
        return out
    # rows whose heads have holes in this layer: attention again, each head over its own slots
    has_hole = (start < end[:, None]).any(-1) & live  # [bs]
    values = v_buffer[slots[:, None, :], heads[None, :, None]]  # [bs, Hkv, R, Dv]
    masked = torch.bmm(probs.view(bs * kv_heads, g, span).to(values.dtype),
                       values.view(bs * kv_heads, span, v_dim))  # [bs*Hkv, g, Dv]
    flat = out.view(bs, -1)
    return torch.where(has_hole[:, None], masked.view(bs, q_heads * v_dim).to(flat.dtype), flat)
