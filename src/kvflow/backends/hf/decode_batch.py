"""One decode forward over the live rows of an engine's running proposals.

The candidate rows of every running proposal of an `HFEngine` that share an evictor live in
one `RowPool`: one `BudgetedCache` whose rows are handed out to proposals (a fork copies the
problem's state into n free rows) and handed back when the proposal's handle is dropped. A
decode step is one `DecodeBatch` over the pools' live rows, and kvflow's attention function
calls `attend()`, which writes the new keys and values and runs one attention call per layer
and pool, whatever the number of proposals (issue 25: a GPU runs a fixed number of kernels
per layer instead of ~10 per proposal). Rows differ in length: the write plan's per-row mask
is turned into an additive float mask once per step (sdpa would convert a boolean mask at
every layer, and CUDA's memory-efficient kernel takes a float mask as it is).
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections import deque
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvflow.backends.hf import invariant
from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.rows import new_rows


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim; elsewhere nothing):
    a pool's storage, freed when it goes idle, would otherwise stay in the process's resident
    memory, fragmented, and a server's RSS would creep up with every burst it serves."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


class RowPool:
    """The rows of every running proposal of one engine with one evictor, in one cache.

    Rows are reused lowest-first; the pool grows geometrically (a copy of its storage each
    time it doubles), and an unbounded pool reserves, at each fork, the slots its new rows
    can reach (`length + token cap + 1`), so no decode step grows it. Rows of a proposal that
    has ended stay as they are until its handle (`PoolRows`) is dropped: they sit in the
    attention call (their output is not used) but are not written. When at most half of the
    rows are in use, `shrink()` moves them to the front and drops the rest (handles are
    renumbered), so freed rows do not stay in every attention call. When none is in use (the
    engine is idle on this pool), `shrink()` drops them all, slots too: the pool is then what a
    new engine's is, so what the engine decodes next does not depend on what it decoded before
    (the number of rows in a forward changes its float rounding; a server must answer the same
    request alike whatever it served earlier), and its memory goes back.
    """

    def __init__(self, evictor, num_layers: int, device, kv_heads: int) -> None:
        self._shape = (evictor, num_layers, device, kv_heads)
        self.cache = self._new_cache()
        self.free: list[int] = []  # a heap of free row ids
        self.returned: deque = deque()  # rows whose handle was dropped (from any thread)
        self.holders: "weakref.WeakSet[PoolRows]" = weakref.WeakSet()
        self.lock = threading.Lock()  # a handle dropped on another thread vs renumbering

    def _new_cache(self) -> BudgetedCache:
        evictor, num_layers, device, kv_heads = self._shape
        return BudgetedCache(evictor, num_layers, new_rows(0), device, kv_heads=kv_heads)

    def give_back(self, box: list) -> None:
        """A handle was dropped: its rows (box[0], current numbering) are free at the next reclaim."""
        with self.lock:
            self.returned.append(box[0])

    def shrink(self, min_rows: int = 16) -> bool:
        """If at most half of the pool's rows (and at least `min_rows`) are in use, keep only
        those, moved to the front in order (one copy of them), and renumber their handles; if
        none is, drop them all. Returns whether it did."""
        with self.lock:
            self.reclaim()
            n = self.cache.n_rows
            if n and len(self.free) == n:  # idle: back to a new pool (see the class docstring)
                self.cache = self._new_cache()
                self.free = []
                _trim_heap()
                return True
            if n < min_rows or 2 * (n - len(self.free)) > n:
                return False
            free = set(self.free)
            keep = torch.as_tensor([r for r in range(n) if r not in free], dtype=torch.long)
            self.cache.keep_rows(keep)
            new_id = torch.full((n,), -1, dtype=torch.long)
            new_id[keep] = torch.arange(len(keep))
            for holder in list(self.holders):
                holder._box[0] = new_id[holder._box[0]]
            self.free = []
            return True

    def fork(self, state: BudgetedCache, n: int, rng_keys: Sequence[int], room: int) -> "PoolRows":
        """n copies of row 0 of `state` in free rows, each with its own evictor seed; `room`
        is the most tokens a row will append (an unbounded pool makes room for them now)."""
        cache = self.cache
        self.make_room(n, int(state.rows.lengths[0]) + room + 1)
        rows = torch.as_tensor(sorted(heapq.heappop(self.free) for _ in range(n)), dtype=torch.long)
        cache.copy_rows(rows, state, torch.zeros(n, dtype=torch.long))
        cache.rows.rng_keys[rows] = torch.as_tensor(list(rng_keys), dtype=torch.long)
        return PoolRows(self, rows)

    def make_room(self, rows: int, slots: int) -> None:
        """At least `rows` free rows and, unbounded, `slots` slots per row: grown once for a
        whole burst of forks (the engine asks before admitting them), at least doubling (a
        pool of R rows has been copied O(log R) times)."""
        self.reclaim()
        cache = self.cache
        if len(self.free) < rows:
            for r in cache.add_rows(max(cache.n_rows, rows - len(self.free))).tolist():
                heapq.heappush(self.free, r)
        if not cache.evictor.bounded:
            cache.reserve(slots)

    def reclaim(self) -> None:
        """Rows handed back since the last call become free (length 0: out of the attention's span)."""
        while self.returned:
            rows = self.returned.popleft()
            self.cache.rows.lengths[rows] = 0
            for r in rows.tolist():
                heapq.heappush(self.free, r)


class PoolRows:
    """A proposal's rows in a `RowPool` (the `Proposal.handle` of the hf engine): what
    adoption reads (`select`) and inspection asks (`head_lengths`, `resident_bytes`). The
    rows go back to the pool when this object is dropped (`HFEngine.release`)."""

    def __init__(self, pool: RowPool, rows: torch.Tensor) -> None:
        self.pool = pool
        self._box = [rows]  # [n] int64 pool rows, renumbered in place by RowPool.shrink
        pool.holders.add(self)
        weakref.finalize(self, pool.give_back, self._box)

    @property
    def ids(self) -> torch.Tensor:
        """[n] int64: these rows in the pool."""
        return self._box[0]

    @property
    def evictor(self):
        return self.pool.cache.evictor

    @property
    def layers(self):
        return self.pool.cache.layers

    @property
    def rows(self):
        """These rows' bookkeeping (a copy: `RowState`)."""
        return self.pool.cache.rows.select(self.ids)

    @property
    def n_rows(self) -> int:
        return len(self.ids)

    def select(self, rows: Sequence[int]) -> BudgetedCache:
        """Copies of some of these rows as a cache of their own (adoption)."""
        return self.pool.cache.select(self.ids[torch.as_tensor(rows, dtype=torch.long)])

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        return self.pool.cache.head_lengths(layer_idx).index_select(0, self.ids)

    def resident(self, layer_idx: int, rows: torch.Tensor):
        return self.pool.cache.resident(layer_idx, self.ids[rows])

    def resident_bytes(self) -> int:
        cache = self.pool.cache
        return cache.resident_bytes() * len(self.ids) // max(cache.n_rows, 1)


class DecodeBatch(Cache):
    """One decode forward over the live rows of several caches of one model ("parts": an
    engine's row pools, or any caches).

    The model runs on the live rows only ([L, 1] tokens, L = live rows of all parts, part by
    part); attention runs once per layer and part over all of the part's rows (rows that are
    not live attend with a zero query; their output is dropped), so nothing is copied into a
    joint tensor. A row that is not live is not written: its pending write goes to the part's
    scratch slot.
    """

    def __init__(self, parts: Sequence[tuple[BudgetedCache, torch.Tensor]]) -> None:
        # parts: (cache, its live rows [k] int64, in forward order)
        self.parts = []
        for cache, live in parts:
            n = cache.n_rows
            full = len(live) == n and bool((live == torch.arange(n)).all())
            step_lens = torch.zeros(n, dtype=torch.long)
            step_lens[live] = 1
            cache.begin_forward(step_lens, 1)
            self.parts.append(_Part(cache, live.to(cache.device), full, step_lens))
        self.counts = [len(live) for _, live in parts]
        super().__init__(layers=[_DecodeLayer() for _ in range(len(parts[0][0].layers))])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # written part by part in attend()

    def attend(self, attention, module, query, key, value, **kwargs):
        """Write each part's new keys and values and attend over all of its rows at once.

        query: [L, q_heads, 1, D]; key, value: [L, kv_heads, 1, D] (post-RoPE, live rows in
        part order); attention: the sdpa forward; returns ([L, 1, q_heads, D], None)."""
        layer_idx = module.layer_idx
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        by_row = invariant.enabled()  # batch-invariant mode: each live row over its own keys
        outs = []
        for part, q, k, v in zip(self.parts, query.split(self.counts), key.split(self.counts),
                                 value.split(self.counts)):
            cache, live, q_live = part.cache, part.live, q
            if not part.full:  # rows that are not live: a zero query and key, written to the scratch slot
                q, k, v = (x.new_zeros(cache.n_rows, *x.shape[1:]).index_copy_(0, live, x) for x in (q, k, v))
            layer = cache.layers[layer_idx]
            keys, values = layer.update(k, v)  # [rows, kv_heads, span, D]
            if cache.query_window:
                layer.record_queries(q)
            if by_row:  # kvflow.backends.hf.invariant: a boolean mask, the row's own span
                queries, mask, ends = cache.row_extents(layer_idx, q.shape[1])
                if cache.observes:
                    invariant.observe_rows(cache, layer_idx, q, keys, queries, ends, scaling)
                out = invariant.attend_rows(attention, module, q, keys, values, queries, mask, ends, **kwargs)
                outs.append(out if part.full else out.index_select(0, live))
                continue
            if cache.observes:
                layer.observe(q, keys, scaling, layer_idx)
            if part.gather is not None:  # few live rows: attend over copies of theirs (up to their longest)
                keys, values = (x[:, :, : part.gather][live] for x in (keys, values))  # [L, kv_heads, span', D]
                out, _ = attention(module, q_live, keys, values, part.mask(layer_idx, q_live, live=True), **kwargs)
                outs.append(out)
                continue
            out, _ = attention(module, q, keys, values, part.mask(layer_idx, q), **kwargs)  # [rows, 1, heads, D]
            outs.append(out if part.full else out.index_select(0, live))
        return torch.cat(outs) if len(outs) > 1 else outs[0], None

    def end_forward(self) -> None:
        for part in self.parts:
            part.cache.end_forward(part.step_lens)


_GATHER_BELOW = 1 / 3  # live share of a part's rows under which attention runs over copies of the live rows


class _Part:
    """One cache of a DecodeBatch and its step's additive masks (built once per step, or
    once per layer for allocations that vary by layer).

    A part whose live rows are few (under a third of its rows: a pool draining at the end of
    a round, or holding ended proposals until they are released) attends over copies of the
    live rows' keys and values, up to the longest of them (`gather`: that span, else None),
    instead of over every row: the copy reads and writes what the attention then reads, so it
    pays below a third. Layouts whose layers differ (varying allocations, quantized storage)
    always attend over all rows."""

    def __init__(self, cache: BudgetedCache, live: torch.Tensor, full: bool, step_lens: torch.Tensor) -> None:
        self.cache, self.live, self.full, self.step_lens = cache, live, full, step_lens
        self._masks: dict[tuple[int, bool], Optional[torch.Tensor]] = {}
        self.gather: Optional[int] = None
        if not full and not cache.varies and not cache.quant and len(live) < _GATHER_BELOW * cache.n_rows:
            self.gather = int(cache.rows.lengths.index_select(0, live.cpu()).max()) + 1  # the live rows' new span

    def mask(self, layer_idx: int, query: torch.Tensor, live: bool = False) -> Optional[torch.Tensor]:
        """[rows, 1 or q_heads, 1, span] in the query's dtype: 0 where a key is attended, the
        dtype's lowest value elsewhere (not -inf: a free row, with no key, gets no NaN); with
        `live`, the live rows' [L, ..., gather]."""
        key = (layer_idx if self.cache.varies else 0, live)
        if key not in self._masks:
            mask = self.cache.attention_mask(layer_idx, query.shape[1])  # bool or None
            if mask is not None:
                if live:
                    mask = mask[:, :, :, : self.gather].index_select(0, self.live)
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
                    ~mask, torch.finfo(query.dtype).min)
            self._masks[key] = mask
        return self._masks[key]


class _DecodeLayer(CacheLayerMixin):
    """Placeholder layer: storage lives in the parts of the DecodeBatch."""

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return 1, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1
