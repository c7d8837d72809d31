"""A budgeted, batched KV cache for transformers models (DESIGN.md §6-7).

Per layer: keys and values [rows, kv_heads, capacity, head_dim] (keys after RoPE); for
attention-based evictors, the last W post-RoPE queries [rows, q_heads, W, head_dim]; for
evictors that observe attention (H2O), a per-token statistic [rows, kv_heads, capacity]
float32 that `Evictor.observe()` updates at every forward and that moves with the keys.
Per row (shared by all layers): resident length, next logical position, protected prefix.

With `quantize` on the evictor (BreadthKV, `kvflow.backends.hf.quant`), a row's logical slots
[0, n_quantized) live packed in a `QuantizedStore` and the rest in a smaller full-precision
array of `residual + buffer + 1` slots. Tokens leave the full-precision region a whole key
group at a time when it fills (quantize only, until the store is full) or at a compaction
(evict, then quantize the kept tokens but the newest `residual`). Attention, the
evictor and H2O's statistic see the same logical slot order as an unquantized cache: a
layer's `update()` returns the dequantized slots followed by the full-precision ones.

Rows are written at their own offsets, so rows with different prompt lengths share one
batch without left padding. A forward may carry right padding (rows with fewer new tokens
than the widest row): padded tokens are written to a scratch slot past the resident region
and masked out. When a row's resident length reaches `budget + buffer` it is compacted in
place to exactly `budget` tokens per (layer, KV head), in time order.

Allocations that vary (`Evictor.varies()`: PyramidKV's layer budgets, Ada-KV's head
allocation; `kvflow.components.allocation`) keep the same cadence: a row's nominal length
(`RowState.lengths`) is the budget plus the tokens appended since its last compaction, and
every layer compacts when it reaches `budget + buffer`. After a compaction head h of layer l
holds its k_h kept tokens in slots [0, k_h) and the layer's new tokens go after its longest
head (slot K_l = max_h k_h onwards): per row, layer l's length is the nominal length plus
`layer_offset` (K_l - budget), and slots [hole_start_h, hole_end) = [k_h, K_l) are masked
out of head h's attention. A layer stores max(budget, the longest head it may keep) +
buffer + 1 slots per head (`layer_capacity`, what `kvflow.kv_memory` counts). The evictor
sees each head's tokens gathered contiguously ([0, k_h) then [K_l, length)).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvflow.backends.hf.allocation import LayerAllocation
from kvflow.backends.hf.quant import QuantizedStore
from kvflow.backends.hf.rows import RowState, WritePlan, new_rows
from kvflow.components.allocation import hole_index
from kvflow.components.base import Evictor
from kvflow.kv_memory import n_quantized

_GROW = 256  # capacity granule for unbounded (full-KV) caches


def grown_capacity(current: int, need: int) -> int:
    """The capacity an unbounded cache grows to when it needs `need` slots: at least double
    the current one (rounded up to `_GROW`), so a cache that grows token by token copies its
    storage O(log n) times, not every `_GROW` tokens."""
    return max(-(-need // _GROW) * _GROW, 2 * current)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive ids in an ascending list."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _take(t: torch.Tensor, rows: torch.Tensor, run: Optional[tuple[int, int]]) -> torch.Tensor:
    """t's rows (dim 0) as a new tensor: a slice's copy when they are one run of consecutive
    ids (on a CPU far faster than index_select of bf16 rows)."""
    return t[run[0] : run[1]].clone() if run is not None else t.index_select(0, rows)


def _per_query_head(mask: torch.Tensor, q_heads: int) -> torch.Tensor:
    """A mask [rows, kv_heads, T, span] per KV head as one per query head; [rows, 1 or q_heads,
    T, span] as it is."""
    if mask.shape[1] in (1, q_heads):
        return mask
    return mask.repeat_interleave(q_heads // mask.shape[1], dim=1)


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t with zero rows appended up to n rows (dim 0)."""
    out = t.new_zeros(n, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class BudgetedLayer(CacheLayerMixin):
    """One layer's storage. `update()` is what the model's attention calls."""

    def __init__(self, cache: "BudgetedCache", index: int) -> None:
        super().__init__()
        # a weak reference: the cache holds its layers, and a layer holding its cache back would
        # make each cache a reference cycle, whose KV tensors only Python's cyclic GC frees (rarely:
        # a server's resident memory crept by tens of MiB between its full collections, issue 40)
        self._cache = weakref.ref(cache)
        self.index = index
        self.queries: Optional[torch.Tensor] = None  # [rows, q_heads, W, head_dim]
        self.stats: Optional[torch.Tensor] = None  # [rows, kv_heads, capacity] float32 (observing evictors)
        self.qstore: Optional[QuantizedStore] = None  # slots [0, n_quantized) of each row (quantized caches)

    @property
    def cache(self) -> "BudgetedCache":
        return self._cache()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, kv_heads, _, head_dim = key_states.shape
        cache = self.cache
        quant_slots, fp_slots = cache.quant_split(self.index)
        cap = fp_slots if cache.quant else cache.layer_capacity(self.index)
        self.keys = key_states.new_zeros(rows, kv_heads, cap, head_dim)
        self.values = value_states.new_zeros(rows, kv_heads, cap, value_states.shape[-1])
        if cache.quant:
            self.qstore = QuantizedStore.empty(rows, kv_heads, quant_slots, head_dim, cache.quant.bits,
                                               cache.quant.group_size, key_states.dtype, key_states.device)
        if self.cache.evictor.observes_attention:
            self.stats = torch.zeros(rows, kv_heads, cap, dtype=torch.float32, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not self.cache.evictor.bounded and self.keys.shape[2] < self.cache.capacity:
            self._grow(self.cache.capacity)
        write = self.cache.plan(self.index)  # set by BudgetedCache.begin_forward
        if self.qstore is not None:
            return self._update_quantized(key_states, value_states, write)
        if write.contiguous_at is not None:
            start, t = write.contiguous_at, key_states.shape[2]
            self.keys[:, :, start : start + t] = key_states
            self.values[:, :, start : start + t] = value_states
        else:
            # advanced indexing puts the (row, token) dims first: [rows, T, kv_heads, head_dim].
            # (index_put is ~500x faster than scatter_ on CPU bf16 here.)
            row = torch.arange(key_states.shape[0], device=key_states.device)[:, None]  # [rows, 1]
            self.keys[row, :, write.slots] = key_states.transpose(1, 2)
            self.values[row, :, write.slots] = value_states.transpose(1, 2)
        return self.keys[:, :, : write.span], self.values[:, :, : write.span]

    def _update_quantized(self, key_states, value_states, write: "WritePlan"):
        row = torch.arange(key_states.shape[0], device=key_states.device)[:, None]  # [rows, 1]
        self.keys[row, :, write.fp_slots] = key_states.transpose(1, 2)
        self.values[row, :, write.fp_slots] = value_states.transpose(1, 2)
        if write.view_index is None:  # nothing quantized yet: logical slots are full-precision slots
            return self.keys[:, :, : write.span], self.values[:, :, : write.span]
        return self.logical(write.view_index)

    def logical(self, view_index: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """Keys and values of a quantized layer in logical slot order: [rows, kv_heads, N, D] each.

        view_index: [rows, N] int64 into cat(dequantized slots, full-precision slots), see
        `BudgetedCache.view_index`; rows: the device rows to read (all by default).
        """
        store = self.qstore if rows is None else self.qstore.map_rows(lambda t: t.index_select(0, rows))
        fp_keys = self.keys if rows is None else self.keys.index_select(0, rows)
        fp_values = self.values if rows is None else self.values.index_select(0, rows)
        q_keys, q_values = store.dequantize()  # [rows, kv_heads, quant_capacity, D]
        keys = torch.cat([q_keys, fp_keys], dim=2)
        values = torch.cat([q_values, fp_values], dim=2)
        r, n = view_index.shape
        idx = view_index[:, None, :, None]
        return (keys.gather(2, idx.expand(r, keys.shape[1], n, keys.shape[3])),
                values.gather(2, idx.expand(r, values.shape[1], n, values.shape[3])))

    def record_queries(self, query: torch.Tensor) -> None:
        """Keep the last W real queries of each row, right-aligned. query: [rows, q_heads, T, head_dim]."""
        w = self.cache.query_window
        rows, heads, t, d = query.shape
        if self.queries is None:
            self.queries = query.new_zeros(rows, heads, w, d)
        joined = torch.cat([self.queries, query], dim=2)  # [rows, heads, W + T, d]
        # old valid entries end at W and new ones start there, so the last W valid entries of
        # row r are joined[s_r : s_r + W], with s_r the row's real new-token count.
        idx = self.cache.plan(self.index).query_gather  # [rows, W]
        self.queries = joined.gather(2, idx[:, None, :, None].expand(rows, heads, w, d))

    def observe(self, query: torch.Tensor, keys: torch.Tensor, scaling: float, layer_idx: int) -> None:
        """Let the evictor update the per-token statistic. keys: [rows, kv_heads, span, head_dim]."""
        plan = self.cache.plan(self.index)
        self.cache.evictor.observe(self.stats[:, :, : plan.span], query, keys, plan.observe_mask,
                                   layer_idx=layer_idx, scaling=scaling)

    def _grow(self, capacity: int) -> None:
        pad = capacity - self.keys.shape[2]
        self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, pad))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, pad))
        if self.stats is not None:
            self.stats = torch.nn.functional.pad(self.stats, (0, pad))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.plan(self.index).span, 0

    def get_seq_length(self) -> int:
        return int(self.cache.rows.lengths.max()) if len(self.cache.rows.lengths) else 0

    def get_max_length(self) -> int:
        return self.cache.capacity if self.cache.evictor.bounded else -1


class BudgetedCache(LayerAllocation, Cache):
    """The KV cache of one proposer batch. See the module docstring."""

    def __init__(self, evictor: Evictor, num_layers: int, rows: RowState, device: torch.device,
                 capacity: Optional[int] = None, kv_heads: Optional[int] = None) -> None:
        self.evictor = evictor
        self.kv_heads = kv_heads
        self.varies = evictor.bounded and evictor.varies(num_layers)
        if self.varies:
            if kv_heads is None:
                raise ValueError("a cache whose allocation varies by layer or head needs kv_heads")
            if getattr(evictor.params, "quantize", None) and evictor.adaptive_heads:
                raise ValueError("quantize does not support budgets that vary by head yet")
            self.budgets = evictor.allocation(num_layers)
            self.widths = evictor.layer_widths(num_layers, kv_heads)
            rows = rows.with_allocation(num_layers, kv_heads)
        self.query_window = evictor.query_window
        self.observes = evictor.observes_attention
        if evictor.bounded and self.query_window > evictor.trigger:
            raise ValueError(f"evictor needs {self.query_window} queries but compacts at {evictor.trigger} tokens")
        self.device = device
        self.rows = rows
        if evictor.bounded:
            self.capacity = evictor.trigger + 1  # +1: the scratch slot for padding writes
        else:
            self.capacity = capacity or _GROW
        self.quant = getattr(evictor.params, "quantize", None) if evictor.bounded else None
        if self.quant:
            budget = evictor.params.budget
            self.quant_capacity = n_quantized(budget, self.quant)  # quantized slots per row
            self.fp_capacity = budget - self.quant_capacity + evictor.params.buffer + 1  # residual + buffer + scratch
        super().__init__(layers=[BudgetedLayer(self, i) for i in range(num_layers)])
        self._write_plan: Optional[WritePlan] = None
        self._layer_plans: Optional[list[WritePlan]] = None  # varying allocations: one plan per layer
        self._step_lens: Optional[torch.Tensor] = None  # [rows] the current forward's new tokens (host)
        self._extents: dict = {}  # id(plan) -> row_extents, batch-invariant mode

    def quant_split(self, layer_idx: int) -> tuple[int, int]:
        """(quantized slots, full-precision slots including the scratch slot) per (row, KV head)
        of one layer of a quantized cache: a varying allocation splits each layer's own budget,
        and its full-precision part holds the rest of the layer's width."""
        if not self.quant:
            return 0, 0
        if not self.varies:
            return self.quant_capacity, self.fp_capacity
        quantized = n_quantized(self.budgets[layer_idx], self.quant)
        return quantized, self.widths[layer_idx] - quantized + 1

    def layer_quantized(self, layer_idx: int) -> torch.Tensor:
        """[rows] int64: leading slots of each row held quantized in one layer."""
        nq = self.rows.n_quantized
        return nq[:, layer_idx] if nq.dim() == 2 else nq

    def layer_capacity(self, layer_idx: int) -> int:
        """Slots per (row, KV head) that layer `layer_idx` stores, the scratch slot included."""
        if not self.varies:
            return self.capacity
        return self.widths[layer_idx] + 1

    def plan(self, layer_idx: int) -> WritePlan:
        """The current forward's write plan for one layer."""
        return self._layer_plans[layer_idx] if self._layer_plans is not None else self._write_plan

    def attention_mask(self, layer_idx: int, q_heads: int) -> Optional[torch.Tensor]:
        """The mask of one layer's attention: [rows, 1 or q_heads, T, span] bool, or None."""
        mask = self.plan(layer_idx).mask
        return None if mask is None else _per_query_head(mask, q_heads)

    def row_extents(self, layer_idx: int, q_heads: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """For batch-invariant attention (`kvflow.backends.hf.invariant`) in the current forward:
        (real queries per row [rows] int64 (host), the layer's mask [rows, 1 or q_heads, T, span]
        bool, causal where the plan leaves it out, where each row's keys end); once per plan."""
        plan = self.plan(layer_idx)
        found = self._extents.get(id(plan))
        if found is None:
            from kvflow.backends.hf.invariant import causal_mask, key_ends

            mask = plan.mask
            if mask is None:
                mask = causal_mask(self.rows.lengths, self._step_lens, plan.slots.shape[1], plan.span).to(self.device)
            found = self._extents[id(plan)] = (mask, key_ends(mask, self._step_lens))
        mask, ends = found
        return self._step_lens, _per_query_head(mask, q_heads), ends

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        """[rows, kv_heads] int64 (host): tokens each head of the layer holds per row."""
        lengths = self.rows.lengths
        heads = self.kv_heads or (self.layers[layer_idx].keys.shape[1] if self.layers[layer_idx].is_initialized else 1)
        if not self.varies:
            return lengths[:, None].expand(-1, heads).clone()
        r = self.rows
        length = lengths + r.layer_offset[:, layer_idx]
        return length[:, None] - (r.hole_end[:, layer_idx, None] - r.hole_start[:, layer_idx])

    def resident(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each head's resident keys and values in time order, gathered contiguously:
        ([R, kv_heads, N, D], [R, kv_heads, N, Dv], head lengths [R, kv_heads]); slots past a
        head's length are padding. Quantized caches give the dequantized keys and values."""
        layer = self.layers[layer_idx]
        dev_rows = rows.to(self.device)
        heads = self.head_lengths(layer_idx).index_select(0, rows)  # [R, H]
        n = int(heads.max())
        if self.quant:
            view = self.view_index(self.layer_quantized(layer_idx).index_select(0, rows), n, layer_idx).to(self.device)
            keys, values = layer.logical(view, dev_rows)
            return keys, values, heads
        if not self.varies:
            return layer.keys.index_select(0, dev_rows)[:, :, :n], layer.values.index_select(0, dev_rows)[:, :, :n], heads
        idx = self.head_index(layer_idx, rows, n).to(self.device)[..., None]
        keys = layer.keys.index_select(0, dev_rows)
        values = layer.values.index_select(0, dev_rows)
        return (keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1])),
                values.gather(2, idx.expand(-1, -1, -1, values.shape[-1])), heads)

    def head_index(self, layer_idx: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[R, kv_heads, n] int64 (host): the stored slot of each head's j-th resident token
        under a varying allocation (the head's hole skipped; past its length: padding)."""
        r = self.rows
        start = r.hole_start[:, layer_idx].index_select(0, rows)  # [R, H]
        end = r.hole_end[:, layer_idx].index_select(0, rows)  # [R]
        return hole_index(start, end, n).clamp(max=self.layer_capacity(layer_idx) - 2)

    # ------------------------------------------------------------------ rows

    @property
    def n_rows(self) -> int:
        return int(self.rows.lengths.shape[0])

    def select(self, rows: torch.Tensor | Sequence[int]) -> "BudgetedCache":
        """A new cache holding copies of the given rows (fork a row N ways by repeating it)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        capacity = self.capacity
        if not self.evictor.bounded:  # an unbounded cache (a row pool's, say) may hold far more slots than these rows use
            used = int(self.rows.lengths.index_select(0, rows).max()) + 1 if len(rows) else 1
            capacity = min(self.capacity, -(-(used + 1) // _GROW) * _GROW)
        out = BudgetedCache(self.evictor, len(self.layers), self.rows.select(rows), self.device, capacity,
                            self.kv_heads)
        dev_rows = rows.to(self.device)
        cut = slice(None) if self.evictor.bounded else slice(0, capacity)  # bounded layers may differ in capacity
        runs = _runs(rows.tolist()) if len(rows) and bool((rows[1:] > rows[:-1]).all()) else []
        run = runs[0] if len(runs) == 1 else None  # one run of consecutive rows (an adoption: one row)
        for src, dst in zip(self.layers, out.layers):
            if src.is_initialized:
                dst.keys = _take(src.keys[:, :, cut], dev_rows, run)
                dst.values = _take(src.values[:, :, cut], dev_rows, run)
                if src.qstore is not None:
                    dst.qstore = src.qstore.map_rows(lambda t: _take(t, dev_rows, run))
                if src.stats is not None:
                    dst.stats = _take(src.stats[:, :, cut], dev_rows, run)
                dst.is_initialized = True
            if src.queries is not None:
                dst.queries = _take(src.queries, dev_rows, run)
        return out

    def add_rows(self, n: int) -> torch.Tensor:
        """n empty rows (length 0, zero storage) appended in place: their ids [n] int64. The
        storage is copied once (a row pool grows geometrically, see `RowPool`)."""
        old, total = self.n_rows, self.n_rows + n
        extra = new_rows(n)
        if self.varies:
            extra = extra.with_allocation(len(self.layers), self.kv_heads)
        self.rows = RowState.cat([self.rows, extra])
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = _pad_rows(layer.keys, total), _pad_rows(layer.values, total)
                if layer.stats is not None:
                    layer.stats = _pad_rows(layer.stats, total)
                if layer.qstore is not None:
                    layer.qstore = layer.qstore.map_rows(lambda t: _pad_rows(t, total))
            if layer.queries is not None:
                layer.queries = _pad_rows(layer.queries, total)
        return torch.arange(old, total)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (ascending ids), renumbered 0..k-1, dropping the others (a
        row pool giving back rows it no longer uses; one copy of the kept rows)."""
        self.rows = self.rows.select(keep)
        runs = _runs(keep.tolist())
        dev = keep.to(self.device)

        def take(t: torch.Tensor) -> torch.Tensor:  # slices of consecutive rows: plain copies
            if not runs:  # every row given back (torch.cat needs at least one slice)
                return t[:0].clone()
            return torch.cat([t[a:b] for a, b in runs]) if len(runs) <= 64 else t.index_select(0, dev)

        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = take(layer.keys), take(layer.values)
                if layer.stats is not None:
                    layer.stats = take(layer.stats)
                if layer.qstore is not None:
                    layer.qstore = layer.qstore.map_rows(take)
            if layer.queries is not None:
                layer.queries = take(layer.queries)

    def reserve(self, slots: int) -> None:
        """An unbounded cache: room for `slots` slots per row (scratch slot included) from now
        on, grown geometrically (`grown_capacity`), so forwards up to there copy nothing."""
        if not self.evictor.bounded and slots > self.capacity:
            self.capacity = grown_capacity(self.capacity, slots)
            for layer in self.layers:
                if layer.is_initialized:
                    layer._grow(self.capacity)

    def copy_rows(self, dst: torch.Tensor, src: "BudgetedCache", src_rows: torch.Tensor) -> None:
        """Rows `src_rows` of `src` (same evictor and model) written over rows `dst` of this
        cache, storage and bookkeeping (a fork: `src_rows` repeats one row). A bounded cache
        copies whole rows (so nothing of a row's previous occupant survives, e.g. H2O
        statistics past its length); an unbounded one copies the resident slots only, after
        `reserve()` made room for them."""
        for f in RowState.__dataclass_fields__:
            getattr(self.rows, f)[dst] = getattr(src.rows, f).index_select(0, src_rows)
        bounded = self.evictor.bounded
        used = int(src.rows.lengths.index_select(0, src_rows).max()) if len(src_rows) else 0
        if not bounded:
            self.reserve(used + 1)
        dev_dst, dev_src = dst.to(self.device), src_rows.to(self.device)
        # a fork (one source row) into runs of consecutive rows: strided copies, which on a CPU
        # run ~10x faster than index_copy_/index_select of bf16 rows
        one = len(src_rows) > 0 and bool((src_rows == src_rows[0]).all())
        runs = _runs(dst.tolist()) if one else None

        def put(d: torch.Tensor, s: Optional[torch.Tensor], slots: Optional[int] = None) -> None:
            if s is None:  # the source never ran a forward: an empty row
                d.index_fill_(0, dev_dst, 0)
                return
            n = min(d.shape[2], s.shape[2]) if d.dim() > 2 else None
            if slots is not None:
                n = slots
            elif n is not None and n < d.shape[2]:  # a longer destination: no stale tail
                d.index_fill_(0, dev_dst, 0)
            if n is not None:
                d, s = d.narrow(2, 0, n), s.narrow(2, 0, n)
            if runs is not None:
                row = int(src_rows[0])
                for a, b in runs:
                    d[a:b].copy_(s[row : row + 1].expand(b - a, *s.shape[1:]))
            else:
                d.index_copy_(0, dev_dst, s.index_select(0, dev_src))

        for s_layer, d_layer in zip(src.layers, self.layers):
            if s_layer.is_initialized and not d_layer.is_initialized:
                d_layer.lazy_initialization(s_layer.keys.new_empty(self.n_rows, *s_layer.keys.shape[1:2], 1, s_layer.keys.shape[3]),
                                            s_layer.values.new_empty(self.n_rows, 1, 1, s_layer.values.shape[3]))
                if not bounded and d_layer.keys.shape[2] < self.capacity:
                    d_layer._grow(self.capacity)
            if d_layer.is_initialized:
                ready = s_layer.is_initialized
                slots = None if bounded else used
                put(d_layer.keys, s_layer.keys if ready else None, slots)
                put(d_layer.values, s_layer.values if ready else None, slots)
                if d_layer.stats is not None:
                    if not bounded:
                        d_layer.stats.index_fill_(0, dev_dst, 0)
                    put(d_layer.stats, s_layer.stats if ready else None, slots)
                if d_layer.qstore is not None:
                    for f in d_layer.qstore.FIELDS:
                        put(getattr(d_layer.qstore, f), getattr(s_layer.qstore, f) if ready else None)
            if s_layer.queries is not None and d_layer.queries is None:
                d_layer.queries = s_layer.queries.new_zeros(self.n_rows, *s_layer.queries.shape[1:])
            if d_layer.queries is not None:
                put(d_layer.queries, s_layer.queries)

    @staticmethod
    def cat(caches: Sequence["BudgetedCache"]) -> "BudgetedCache":
        """Rows of several caches (same evictor and model) in one cache."""
        first = caches[0]
        capacity = max(c.capacity for c in caches)
        out = BudgetedCache(first.evictor, len(first.layers), RowState.cat([c.rows for c in caches]),
                            first.device, capacity, first.kv_heads)
        for i, layer in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            ready = [p for p in parts if p.is_initialized]
            if ready:  # a part that never ran a forward holds nothing yet: zeros of its row count
                for p in ready:  # bounded caches of one evictor have one capacity (a quantized one's keys hold fewer slots)
                    if not first.evictor.bounded and p.keys.shape[2] < capacity:
                        p._grow(capacity)
                ref = ready[0]

                def take(p: BudgetedLayer, name: str, n: int) -> torch.Tensor:
                    t = getattr(ref, name)
                    return getattr(p, name) if p.is_initialized else t.new_zeros(n, *t.shape[1:])

                sizes = [c.n_rows for c in caches]
                layer.keys = torch.cat([take(p, "keys", n) for p, n in zip(parts, sizes)])
                layer.values = torch.cat([take(p, "values", n) for p, n in zip(parts, sizes)])
                if ref.stats is not None:
                    layer.stats = torch.cat([take(p, "stats", n) for p, n in zip(parts, sizes)])
                if ref.qstore is not None:
                    stores = [p.qstore if p.is_initialized else ref.qstore.map_rows(lambda t, n=n: t.new_zeros(n, *t.shape[1:]))
                              for p, n in zip(parts, sizes)]
                    layer.qstore = QuantizedStore(ref.qstore.bits, ref.qstore.group,
                                                  *(torch.cat([getattr(q, f) for q in stores]) for f in QuantizedStore.FIELDS))
                layer.is_initialized = True
            with_queries = [p.queries for p in parts if p.queries is not None]
            if with_queries:
                q = with_queries[0]
                layer.queries = torch.cat([p.queries if p.queries is not None else q.new_zeros(c.n_rows, *q.shape[1:])
                                           for p, c in zip(parts, caches)])
        return out

    def resident_bytes(self) -> int:
        """Bytes held by the key/value storage, quantized part included (all rows, all layers)."""
        return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                   + (l.qstore.nbytes() if l.qstore is not None else 0) for l in self.layers if l.is_initialized)

    def room(self) -> torch.Tensor:
        """[rows] int64: tokens each row can take before a compaction is due."""
        if not self.evictor.bounded:
            return torch.full_like(self.rows.lengths, 2**62)
        if self.quant and self.varies:  # the nominal cadence, and each layer's full-precision room
            room = self.evictor.trigger - self.rows.lengths
            for layer_idx in range(len(self.layers)):
                _, fp = self.quant_split(layer_idx)
                length = self.rows.lengths + self.rows.layer_offset[:, layer_idx]
                room = torch.minimum(room, fp - 1 - (length - self.layer_quantized(layer_idx)))
            return room
        if self.quant:
            return self.fp_capacity - 1 - (self.rows.lengths - self.rows.n_quantized)
        return self.evictor.trigger - self.rows.lengths

    def view_index(self, n_quantized: torch.Tensor, span: int, layer_idx: int = 0) -> torch.Tensor:
        """[rows, span] int64: where logical slot s of each row is stored in
        cat(quantized slots, full-precision slots) of a layer (`quant_split`)."""
        quantized, fp = self.quant_split(layer_idx)
        s = torch.arange(span)[None, :]
        nq = n_quantized[:, None]
        idx = torch.where(s < nq, s, quantized + s - nq)
        return idx.clamp(max=quantized + fp - 1)

    # ------------------------------------------------------------------ forward bookkeeping

    def begin_forward(self, step_lens: torch.Tensor, width: int) -> WritePlan:
        """Plan the writes of a forward that appends `step_lens[r]` (≤ width) tokens per row."""
        lengths = self.rows.lengths
        new_lengths = lengths + step_lens
        self._step_lens, self._extents = step_lens, {}
        if self.evictor.bounded:
            if bool((step_lens > self.room()).any()):
                raise RuntimeError("BudgetedCache: forward would exceed budget + buffer; chunk the input")
        elif int(new_lengths.max()) + 1 > self.capacity:  # +1: the scratch slot
            self.capacity = grown_capacity(self.capacity, int(new_lengths.max()) + 1)
        if self.varies:
            self._layer_plans = [self._layer_plan(l, step_lens, width) for l in range(len(self.layers))]
            self._write_plan = self._layer_plans[0]
            return self._write_plan
        scratch = self.capacity - 1
        t = torch.arange(width)
        slots = torch.where(t[None, :] < step_lens[:, None], lengths[:, None] + t[None, :], scratch)
        span = int(new_lengths.max())
        uniform = bool((lengths == lengths[0]).all()) and bool((step_lens == width).all())
        contiguous_at = int(lengths[0]) if uniform else None
        if uniform and (width == 1 or int(lengths[0]) == 0):
            mask = None  # plain causal attention over the whole span is exact here
        else:
            key = torch.arange(span)
            mask = key[None, None, :] <= (lengths[:, None, None] + t[None, :, None])  # [rows, T, span]
            mask = mask[:, None].to(self.device)
        query_gather = None
        if self.query_window:
            query_gather = (step_lens[:, None] + torch.arange(self.query_window)[None, :]).to(self.device)
        observe_mask = None
        if self.observes:
            key = torch.arange(span)
            observe_mask = (key[None, None, :] <= (lengths[:, None, None] + t[None, :, None])) \
                & (t[None, :, None] < step_lens[:, None, None])
            observe_mask = observe_mask.to(self.device)
        fp_slots = view_index = None
        if self.quant:
            contiguous_at = None
            nq = self.rows.n_quantized
            fp_slots = torch.where(slots == scratch, self.fp_capacity - 1, slots - nq[:, None]).to(self.device)
            if bool((nq > 0).any()):
                view_index = self.view_index(nq, span).to(self.device)
        self._write_plan = WritePlan(slots.to(self.device), span, contiguous_at, mask, query_gather, observe_mask,
                                     fp_slots, view_index)
        return self._write_plan

    def end_forward(self, step_lens: torch.Tensor) -> None:
        self.rows.lengths = self.rows.lengths + step_lens
        self.rows.positions = self.rows.positions + step_lens
        if self.query_window:
            self.rows.n_queries = torch.clamp(self.rows.n_queries + step_lens, max=self.query_window)
        self._write_plan = None
        self._layer_plans = None
        if self.evictor.bounded:
            due = (self.room() <= 0).nonzero().flatten()
            if len(due):
                self.compact(due)

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
        for layer_idx, layer in enumerate(self.layers):
            if self.quant:
                keys, values = layer.logical(view_index, dev_rows)
            else:
                keys = layer.keys.index_select(0, dev_rows)[:, :, :n]
                values = layer.values.index_select(0, dev_rows)[:, :, :n]
            queries = layer.queries.index_select(0, dev_rows) if layer.queries is not None else None
            stats = layer.stats.index_select(0, dev_rows)[:, :, :n] if layer.stats is not None else None
            keep = self.evictor.select(
                keys, values, queries, layer_idx=layer_idx, lengths=lengths,
                n_protected=self.rows.n_protected.index_select(0, rows), generators=generators, stats=stats,
            )  # [rows, kv_heads, budget]
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
