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
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvflow.backends.hf.allocation import LayerAllocation
from kvflow.backends.hf.cache_rows import _GROW, CacheRows, grown_capacity  # noqa: F401 - grown_capacity: the cache's API
from kvflow.backends.hf.compaction import Compaction
from kvflow.backends.hf.quant import QuantizedStore
from kvflow.backends.hf.rows import RowState, WritePlan
from kvflow.components.allocation import hole_index
from kvflow.components.base import Evictor
from kvflow.kv_memory import n_quantized

def _per_query_head(mask: torch.Tensor, q_heads: int) -> torch.Tensor:
    """A mask [rows, kv_heads, T, span] per KV head as one per query head; [rows, 1 or q_heads,
    T, span] as it is."""
    if mask.shape[1] in (1, q_heads):
        return mask
    return mask.repeat_interleave(q_heads // mask.shape[1], dim=1)


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


class BudgetedCache(LayerAllocation, CacheRows, Compaction, Cache):
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
