"""Per-request state of evicted requests in SGLang's scheduler: admission, snapshots, positions.

A mixin of `evict.Runtime` (see `evict.py` for the layout and the life of a request). Here:
the request's kvflow side (`Live`) and the state it leaves between requests (`Snapshot`);
admission (`begin`: the evictor, a row of the tables, the snapshot put into fresh slots, or
wait), positions and the rows of each forward (`plan`), what happens after a forward's results
(`forwarded`: the tripwire's check, counts, compactions that are due) and at a request's end
(`released`: its snapshot kept if asked, its row of the tables given back).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvflow.backends.sglang.in_worker.graph import Tables, observes_in_graph, profile_problem

KEY = "kvflow_evict"  # the request's opt-in: custom_params[KEY] (evict.py's docstring lists its fields)


@dataclass
class Snapshot:
    """An evicted state between requests: resident tokens per (layer, KV head)."""

    keys: torch.Tensor  # [layers, kv_heads, n, D]
    values: torch.Tensor  # [layers, kv_heads, n, Dv]
    queries: Optional[torch.Tensor]  # [layers, q_heads, W, D] (query-window evictors)
    stats: Optional[torch.Tensor]  # [layers, kv_heads, n] float32 (observing evictors)
    logical: int  # logical position of the next token
    compactions: int
    rng_key: int
    n_protected: int
    holes: Optional[torch.Tensor] = None  # [layers, kv_heads] int64 k_lh, varying allocations (None: no holes)
    base: int = 0  # row length after the last compaction minus the budget (varying allocations)

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])


@dataclass
class Live:
    """A running evicted request's kvflow side (the rest is SGLang's `Req`)."""

    evictor: Any
    rng_key: int
    n_protected: int
    compactions: int
    resident: int  # tokens in the row (every layer and head)
    offset: int  # logical position - row position
    save_as: Optional[str]
    row: Optional[int] = None  # its row of the per-slot tables (`graph.Tables`), once admitted
    pool_idx: Optional[int] = None  # the request-pool slot the tables map to that row
    written: int = 0  # queries written to its ring (the ring's write position, mod W)
    checked: int = 0  # layers x forwards its hooks must have counted (the tripwire's expectation)
    pending: int = 0  # tokens the current forward appends (set in init_new)
    dump: Optional[str] = None  # a directory to save the snapshot in (torch.save), if asked
    source: Optional[Snapshot] = None  # the snapshot still to be put into the request's slots
    holes: Optional[torch.Tensor] = None  # [layers, kv_heads] int64: head h of layer l holds slots [0, k) and [K, row)
    base: int = 0  # K - budget: the row length minus the nominal length (varying allocations)

    @property
    def nominal(self) -> int:
        """The budget plus the tokens since the last compaction (what the trigger counts)."""
        return self.resident - self.base

    def stats_width(self, layers: int, kv_heads: int) -> int:
        """Slots H2O's statistic needs per head: the longest row (+1), as the hf cache's."""
        ev = self.evictor
        return (max(ev.layer_widths(layers, kv_heads)) if ev.varies(layers) else ev.trigger) + 1

    @property
    def hole_end(self) -> int:
        """Where the row's new tokens start since the last compaction (K, its longest head)."""
        return self.base + self.evictor.params.budget

    def has_holes(self) -> bool:
        return self.holes is not None and bool((self.holes < self.hole_end).any())


class Requests:
    """Admission, snapshots, positions and request ends of `evict.Runtime`."""

    def evictor(self, target: str, params: dict):
        key = target + json.dumps(params, sort_keys=True)
        ev = self._evictors.get(key)
        if ev is None:
            from kvflow.components.base import Evictor

            module, _, name = target.partition(":")
            cls = getattr(importlib.import_module(module), name)
            if not (isinstance(cls, type) and issubclass(cls, Evictor)):
                raise ValueError(f"{target} is not a kvflow Evictor")
            ev = self._evictors[key] = cls(cls.Params.model_validate(params))
        return ev

    def make_tables(self, req_to_token_pool, kv) -> Tables:
        if self.tables is None:
            self.req_to_token_pool, self.kv = req_to_token_pool, kv
            self.tables = Tables(req_to_token_pool.req_to_token, len(kv.k_buffer), self.profile)
        return self.tables

    def check_fits(self, ev) -> None:
        """What this engine's decode hook was built for (its `Profile`, from the evictors the
        pipeline serves on it): an evictor that needs a part the profile left out is refused
        before it runs (kvflow's client checks the same first, `SGLangEngine.check_evictor`;
        this is the scheduler's backstop)."""
        problem = profile_problem(self.profile, ev, self.tables.layers, self.kv.k_buffer[0].shape[1],
                                  graphs=self.mode == "graph" and (self.captured or self.proxy is not None))
        if problem:
            raise ValueError(f"kvflow: evictor {type(ev).__name__} cannot run on this engine: {problem}")

    def begin(self, req, tree_cache) -> None:
        """A kvflow request is being scheduled: start it from its snapshot (once)."""
        spec = req.sampling_params.custom_params[KEY]
        self.make_tables(tree_cache.req_to_token_pool, tree_cache.token_to_kv_pool_allocator.get_kvcache())
        for sid in spec.get("drop") or ():
            self.snapshots.pop(sid, None)
        live = self.live.get(req.rid)
        if live is None:
            ev = self.evictor(spec["evictor"], spec["params"])
            self.check_fits(ev)
            snap = self.snapshots[spec["from"]] if spec.get("from") else None
            n = snap.length if snap is not None else 0
            logical = snap.logical if snap is not None else int(spec.get("logical") or 0)
            live = Live(ev, int(spec["rng_key"]), int(snap.n_protected if snap else spec["n_protected"]),
                        snap.compactions if snap else 0, n, logical - n, spec.get("save_as"))
            live.dump = spec.get("dump")
            live.source = snap
            if snap is not None:
                live.holes, live.base = snap.holes, snap.base
            self.live[req.rid] = live
            req.skip_radix_cache_insert = True  # the row's slots do not hold the tokens the tree would key
        self.restore(req, tree_cache, live)

    def restore(self, req, tree_cache, live: Live) -> bool:
        """Give the request its row of the tables and put its snapshot into fresh slots (once).
        False while the tables or the pool have no room: the request then waits
        (`_reserving_room` refuses its admission) and is retried."""
        if live.row is None:
            ev = live.evictor  # rows of an evictor with its own observe() are observed after `decode_step`
            live.row = self.tables.assign(observing=ev.observes_attention and observes_in_graph(ev))
            if live.row is None:
                return False
            if live.source is not None:
                self._load(live, live.source)
        if live.source is not None and not req.kv.holds_kv:
            if not self._restore(req, tree_cache, live.source, live):
                return False
            live.source = None
        if live.resident:
            req.prefix_len = live.resident
        return True

    def _restore(self, req, tree_cache, snap: Snapshot, live: Live) -> bool:
        n = snap.length
        pool = tree_cache.req_to_token_pool
        allocator = tree_cache.token_to_kv_pool_allocator
        if pool.alloc([req]) is None:
            return False
        slots = allocator.alloc(n)
        if slots is None:
            pool.free(req)
            return False
        kv = allocator.get_kvcache()
        for layer in range(snap.keys.shape[0]):
            kv.k_buffer[layer][slots] = snap.keys[layer].transpose(0, 1).to(kv.k_buffer[layer].dtype)
            kv.v_buffer[layer][slots] = snap.values[layer].transpose(0, 1).to(kv.v_buffer[layer].dtype)
        pool.req_to_token[req.kv.req_pool_idx, :n] = slots.to(pool.req_to_token.dtype)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n
        req.kv.cache_protected_len = 0
        return True

    def _load(self, live: Live, snap: Snapshot) -> None:
        """A snapshot's query window, statistic and holes into the request's row of the tables
        (they exist: a snapshot comes from a request that ran forwards in this process)."""
        t, row = self.tables, live.row
        if snap.queries is not None:
            for layer, q in enumerate(snap.queries):
                t.set_window(row, layer, q)
            live.written = snap.queries.shape[2]
        if snap.stats is not None:
            for layer, s in enumerate(snap.stats):
                t.stats[layer][row, :, : s.shape[1]] = s
        t.set_holes(row, snap.holes, snap.base + live.evictor.params.budget)

    def _map(self, live: Live, pool_idx: int) -> None:
        """The tables' view of the request's pool slot (set when SGLang gives it one)."""
        if live.pool_idx != pool_idx:
            t = self.tables
            t.row_of[pool_idx] = live.row
            t.offset_of[pool_idx] = live.offset
            live.pool_idx = pool_idx

    def plan(self, batch, forward_batch) -> None:
        """Offsets for the positions, and which rows of the forward are kvflow's."""
        reqs = batch.reqs
        mine = [(i, self.live.get(r.rid)) for i, r in enumerate(reqs)]
        mine = [(i, live) for i, live in mine if live is not None]
        self.rows, self.own_observers = None, []
        if not mine:
            return
        decode = forward_batch.forward_mode.is_decode()
        if decode:
            counts = [1] * len(reqs)
        else:
            counts = list(batch.extend_lens)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        rows = []
        for i, live in mine:
            live.pending = counts[i]
            self._map(live, reqs[i].kv.req_pool_idx)
            rows.append((i, starts[i], counts[i], live, reqs[i].kv.req_pool_idx))
        if decode and self.mode == "graph":
            # one gather whatever the rows (0 for rows that are not kvflow's)
            if any(live.offset for _, live in mine):
                forward_batch.positions = forward_batch.positions + self.tables.offset_of[forward_batch.req_pool_indices]
        else:
            offsets = torch.zeros(starts[-1], dtype=forward_batch.positions.dtype)
            for i, live in mine:
                if live.offset:
                    offsets[starts[i] : starts[i + 1]] = live.offset
            if bool(offsets.any()):
                forward_batch.positions = forward_batch.positions + offsets.to(forward_batch.positions.device)
        self.rows = rows
        self.own_observers = [r for r in rows if r[3].evictor.observes_attention
                              and not observes_in_graph(r[3].evictor)]
        self.decode_forwards += decode
        self.skip = decode and self.decode_forwards == self.skip_decode_forward

    def forwarded(self, processor, batch) -> None:
        """After a forward's results: check and count its tokens; compact running rows that are due."""
        seen = None
        due: dict[tuple, list] = {}
        for i, req in enumerate(batch.reqs):
            live = self.live.get(req.rid)
            if live is None:
                continue
            if seen is None and self.tables is not None:
                seen = self.tables.seen.tolist()  # one read for the batch (the hooks' counters)
            self.check_observed(req, live, seen)
            if not live.pending:
                continue
            live.resident += live.pending
            live.written += live.pending
            live.pending = 0
            self.peak_slots = max(self.peak_slots, live.resident)
            if req.finished() or live.nominal < live.evictor.trigger:
                continue
            ev = live.evictor
            if ev.varies(self.tables.layers):  # holes: per row
                self._compact_row(processor, batch, i, req, live)
            else:  # rows of one evictor and length come due together (a fork's candidates): at once
                due.setdefault((id(ev), live.resident), []).append((i, req, live))
        for group in due.values():
            self._compact_rows(processor, batch, group)

    def released(self, req, tree_cache) -> None:
        """Before SGLang frees an evicted request's row: keep its state if asked to; its row of
        the tables goes back."""
        live = self.live.pop(req.rid, None)
        try:
            self._released(req, tree_cache, live)
        finally:
            if live is not None and live.row is not None:
                self.tables.release(live.row, live.pool_idx)

    def _released(self, req, tree_cache, live: Optional[Live]) -> None:
        if live is not None and req.kv.holds_kv:
            self.check_observed(req, live)
        if live is not None and not req.finished():
            # retracted under memory pressure: SGLang re-prefills it later from its input and
            # output ids; `begin` then starts it again from its step's snapshot and ingests the
            # tokens made so far in one extend (valid, but not compacted at hf's points)
            self.retractions += 1
            return
        if live is None or not live.save_as or _aborted(req) or not req.kv.holds_kv:
            return
        n = live.resident + live.pending  # its last forward's results are being processed
        live.written += live.pending
        self.peak_slots = max(self.peak_slots, n)
        kv = tree_cache.token_to_kv_pool_allocator.get_kvcache()
        slots = tree_cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        keys, values = self._read(kv, slots)
        t = self.tables
        stats = [t.stats[layer][live.row, :, :n].clone() for layer in range(t.layers)] \
            if live.evictor.observes_attention else None
        offset, compactions, holes, base = live.offset, live.compactions, live.holes, live.base
        if n - base >= live.evictor.trigger:  # it ended on the token that made it due: compact the copy
            keys, values, stats, holes = self._compacted(live, keys, values)
            offset += n - keys.shape[2]
            n = keys.shape[2]
            base = n - live.evictor.params.budget
            compactions += 1
        snap = self.snapshots[live.save_as] = Snapshot(
            keys.clone(), values.clone(),
            torch.stack([self._window(live, layer) for layer in range(t.layers)]) if live.evictor.query_window else None,
            torch.stack(stats) if stats else None,
            logical=n + offset, compactions=compactions, rng_key=live.rng_key, n_protected=live.n_protected,
            holes=holes, base=base)
        if live.dump:  # for inspection and tests: what the state keeps, per (layer, KV head)
            torch.save(vars(snap), os.path.join(live.dump, f"{live.save_as}.pt"))


def _aborted(req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"
