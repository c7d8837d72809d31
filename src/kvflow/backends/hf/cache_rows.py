"""The row pool of `BudgetedCache` (`cache.py`): its rows forked, added, kept, copied between
caches and concatenated, with every per-layer tensor (keys, values, the quantized store, the
query window, H2O's statistic) moving with its row. A mixin: the cache holds the state
(`layers`, `rows`, `evictor`, `capacity`, `device`, `kv_heads`)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvflow.backends.hf.quant import QuantizedStore
from kvflow.backends.hf.rows import RowState, new_rows

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


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t with zero rows appended up to n rows (dim 0)."""
    out = t.new_zeros(n, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class CacheRows:
    """Row operations of `BudgetedCache` (see the module docstring)."""

    # ------------------------------------------------------------------ rows

    @property
    def n_rows(self) -> int:
        return int(self.rows.lengths.shape[0])

    def select(self, rows: torch.Tensor | Sequence[int]) -> "CacheRows":
        """A new cache holding copies of the given rows (fork a row N ways by repeating it)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        capacity = self.capacity
        if not self.evictor.bounded:  # an unbounded cache (a row pool's, say) may hold far more slots than these rows use
            used = int(self.rows.lengths.index_select(0, rows).max()) + 1 if len(rows) else 1
            capacity = min(self.capacity, -(-(used + 1) // _GROW) * _GROW)
        out = type(self)(self.evictor, len(self.layers), self.rows.select(rows), self.device, capacity,
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

    def copy_rows(self, dst: torch.Tensor, src: "CacheRows", src_rows: torch.Tensor) -> None:
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

    @classmethod
    def cat(cls, caches: Sequence["CacheRows"]) -> "CacheRows":
        """Rows of several caches (same evictor and model) in one cache."""
        first = caches[0]
        capacity = max(c.capacity for c in caches)
        out = cls(first.evictor, len(first.layers), RowState.cat([c.rows for c in caches]),
                            first.device, capacity, first.kv_heads)
        for i, layer in enumerate(out.layers):
            parts = [c.layers[i] for c in caches]
            ready = [p for p in parts if p.is_initialized]
            if ready:  # a part that never ran a forward holds nothing yet: zeros of its row count
                for p in ready:  # bounded caches of one evictor have one capacity (a quantized one's keys hold fewer slots)
                    if not first.evictor.bounded and p.keys.shape[2] < capacity:
                        p._grow(capacity)
                ref = ready[0]

                def take(p, name: str, n: int) -> torch.Tensor:
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
