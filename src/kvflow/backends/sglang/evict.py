"""Evicted requests inside SGLang: kvflow's evictors per (request, layer, KV head), via hooks.

This module runs in SGLang's scheduler process (kvflow's plugin registers its hooks there;
no SGLang file is changed). A request opts in with `custom_params["kvflow_evict"]`:

    {"evictor": "module:Class", "params": {...}, "rng_key": int, "n_protected": int,
     "logical": int,            # logical position of the request's first input token
     "from": snapshot id | None, "save_as": snapshot id | None, "drop": [snapshot ids],
     "dump": directory | None}  # torch.save the snapshot there too (inspection, tests)

Layout. SGLang's KV pool has one slot per token holding every head's key and value; nothing
forces head h and head h' of one slot to hold the same token. An evicted request owns at most
`budget + buffer` slots in its `req_to_token` row; slot j of (layer l, head h) holds the j-th
resident token of that head, in time order, exactly the layout of the `hf` cache
([rows, kv_heads, N, D] per layer). A compaction (when the row reaches `budget + buffer`)
gathers each (layer, head)'s kept tokens into the first `budget` slots and gives the rest
back to SGLang's allocator: the request never holds more than `budget + buffer` slots.

Varying allocations (PyramidKV's layer budgets, Ada-KV's head allocation) keep this layout
with one row for every layer: after a compaction (layer l, head h) holds its k_lh kept tokens
in slots [0, k_lh) and the row's new tokens start at K = max over layers and heads of k_lh,
so slots [k_lh, K) are a hole of that head. The attention hook recomputes those rows'
attention with each head's hole masked out (SGLang's own kernel sees every slot of the row),
and the evictor sees each head's tokens gathered contiguously, as on `hf`. A request's input
ids stand in for its resident tokens and kvflow's client counts the nominal length (budget +
tokens since the last compaction), so `begin` pads the stand-in prefix to the row's length.

Positions. SGLang derives positions from the row length; an evicted request's RoPE position
is its logical one, so `ForwardBatch.init_new` adds each request's offset (logical - resident).

Step-to-step state. A request that ends with `save_as` leaves a snapshot here (its resident
keys and values per layer, query window, H2O statistic, position, compaction count) before
SGLang frees its row; a later request with `from` starts from a copy of it in freshly
allocated slots (its `prefix_len` is the snapshot's length). That is a fork in O(budget);
ingesting text is a request from a snapshot whose input is the text, with
`max_new_tokens = 0`. Snapshots live outside SGLang's pool (plain tensors on the pool's
device) and go when a later request names them in `drop`, or with the engine.

Per-token state lives in per-request-pool-slot tables on the pool's device (`graph.Tables`:
query ring, H2O statistic, holes, offsets, the tripwire's counters). Decode forwards run
`graph.decode_step`, fixed-shape ops over the whole batch that a CUDA graph captures (SGLang
captures at engine start, with no kvflow row: nothing may depend on this step's Python state);
extend forwards run the per-row path (`attended`, `masked_attention`); the host writes the
tables between forwards. `KVFLOW_SGLANG_HOOKS=eager` runs the per-row path for decode too (the
old hooks: not capturable); `KVFLOW_SGLANG_REPLAY_PROXY=1` runs decode hooks as a replayed graph
would (`replay.py`). Compaction: `compaction.py`.

Hooks (see `register`): `Req.init_next_round_input` (start from a snapshot, never match the
radix tree), `ForwardBatch.init_new` (positions), `AttentionBackend.forward` (query window,
H2O statistic: read back from the pool after the backend wrote the new keys, so any attention
backend with one slot per token works), `process_batch_result_prefill/decode` (the tripwire, compaction),
`release_kv_cache` (snapshot), `PrefillAdder.add_one_req` and its running requests' offset
(admission reserves an evicted request's room to its next compaction, not its step cap),
and `state()`, which the plugin's `server_state()` hook adds.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from array import array
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvflow.backends.sglang.compaction import Compaction
from kvflow.backends.sglang.graph import Profile, Tables, decode_step, observes_in_graph, profile_problem
from kvflow.backends.sglang.replay import OpCounter, proxy_from_env
from kvflow.components.allocation import hole_mask

KEY = "kvflow_evict"
_INIT = "sglang.srt.managers.schedule_batch.Req.init_next_round_input"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_ATTENTION = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_RELEASE = "sglang.srt.mem_cache.common.release_kv_cache"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


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


class Runtime(Compaction):
    """All kvflow state in one scheduler process (one per tensor-parallel rank)."""

    def __init__(self) -> None:
        self.snapshots: dict[str, Snapshot] = {}
        self.live: dict[str, Live] = {}
        self._evictors: dict[str, Any] = {}
        self.peak_slots = 0  # most slots one evicted request held (reported in stats)
        self.retractions = 0  # evicted requests SGLang retracted (pool full)
        self.compactions = 0  # compactions of running rows (a saved copy compacted at the end: not counted)
        # kvflow's rows of the forward being run (set by ForwardBatch.init_new; the attention
        # layers see a copy of that ForwardBatch, and overlap scheduling is off: one at a time).
        # Host bookkeeping only: the decode hook of `graph` mode never reads it (a replayed graph
        # could not), the per-row path of extend forwards (and of `eager` mode) does
        self.rows: Optional[list] = None
        # the rows of this forward whose evictor observes with its own observe(), which
        # `decode_step` does not keep: observed row by row after it (only where no graph runs)
        self.own_observers: list = []
        # per request-pool slot state, on the pool's device (`graph.Tables`), made at the first use
        self.tables: Optional[Tables] = None
        # `graph` (default): decode forwards run `graph.decode_step`, fixed-shape ops over the
        # whole batch, capturable; `eager`: the per-row Python hooks of kvflow 0.x, for every
        # forward (they cannot run under a replayed graph: kept to measure and to show the proxy fails them)
        self.mode = os.environ.get("KVFLOW_SGLANG_HOOKS", "graph") or "graph"
        if self.mode not in ("graph", "eager"):
            raise ValueError(f"KVFLOW_SGLANG_HOOKS={self.mode!r}: 'graph' or 'eager'")
        self.proxy = proxy_from_env()  # KVFLOW_SGLANG_REPLAY_PROXY=1: the CPU proxy for graph replay
        # whether SGLang captured decode graphs in this process (engine start, before any request):
        # only then must every evictor fit the graph (without graphs a decode forward runs eagerly
        # and an evictor with its own observe() is observed row by row after `decode_step`)
        self.captured = False
        # what the decode hook does, from the evictors this engine serves (`graph.Profile`; an
        # engine started without them, in tests and benches, gets every part)
        self.profile = Profile.from_env() or Profile.general()
        self.ops = OpCounter() if os.environ.get("KVFLOW_SGLANG_COUNT_OPS") == "1" else None
        self.op_counts: list[dict] = []  # per decode forward (KVFLOW_SGLANG_COUNT_OPS=1)
        self.host_counts: dict[str, int] = {}
        # the tokens of evicted requests observed so far (every one must be: see `check_observed`)
        self.observed_tokens = 0
        # fault injection for the tripwire's test: skip the hooks of the N-th decode forward
        # that has evicted rows, as a replayed decode graph would (0: never)
        self.skip_decode_forward = int(os.environ.get("KVFLOW_SGLANG_FAULT_SKIP_HOOKS", "0") or 0)
        self.decode_forwards = 0
        self.skip = False

    # ------------------------------------------------------------------ requests

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

    # ------------------------------------------------------------------ forwards

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
        req_to_token = self.req_to_token_pool.req_to_token
        kv, t = self.kv, self.tables
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

    def hooked(self, backend, q, out, layer, forward_batch):
        """kvflow's part of one layer's attention (the AROUND hook's body); returns the output."""
        decode = forward_batch.forward_mode.is_decode()
        if self.mode == "graph" and decode:
            if not self.captured and _capturing():
                self.captured = True
            if not (self.live or self.proxy is not None or self.captured):
                return out  # no kvflow request and nothing being captured: nothing to observe
            t = self._ensure(backend, layer, q)
            if self.skip:  # the fault injection: a stale graph, none of kvflow's ops
                return out
            kv = self.kv
            lid = layer.layer_id
            shapes = dict(lid=lid, scaling=layer.scaling, q_heads=layer.tp_q_head_num, kv_heads=layer.tp_k_head_num,
                          head_dim=layer.qk_head_dim, v_dim=layer.v_head_dim)
            k_buf, v_buf = kv.get_key_buffer(lid), kv.get_value_buffer(lid)
            req_to_token = self.req_to_token_pool.req_to_token

            def step(q_, out_, rpi, seq_lens):
                return decode_step(t, q_, out_, k_buf, v_buf, req_to_token, rpi, seq_lens, **shapes)

            out = self._run(step, lid, q, out, forward_batch)
            if self.own_observers:  # an eager forward (check_fits refused such evictors where graphs run)
                self.observe_rows(q, layer, self.own_observers)
            return out
        if self.proxy is not None and decode:  # `eager` hooks as a replayed graph runs them
            if self.tables is None:
                return out

            def per_row(q_, out_, rpi, seq_lens):
                if self.rows and not self.skip:
                    self.attended(q_, layer, forward_batch)
                    self.masked_attention(q_, out_, layer)
                return out_

            return self._run(per_row, layer.layer_id, q, out, forward_batch)
        if self.rows and not self.skip:
            self._ensure(backend, layer, q)

            def per_row_eager(q_, out_, rpi, seq_lens):
                self.attended(q_, layer, forward_batch)
                self.masked_attention(q_, out_, layer)
                return out_

            return self._run(per_row_eager, layer.layer_id, q, out, forward_batch, replayed=False)
        return out

    def _run(self, fn, lid, q, out, forward_batch, replayed: bool = True):
        counter = self.ops
        if counter is not None:
            counter.in_hook = True
        try:
            if self.proxy is None or not replayed:
                return fn(q, out, forward_batch.req_pool_indices, forward_batch.seq_lens)
            return self.proxy.run(lid, fn, q, out, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  self._as_at_capture)
        finally:
            if counter is not None:
                counter.in_hook = False

    @contextlib.contextmanager
    def _as_at_capture(self):
        """kvflow's Python state as SGLang's graph capture finds it: no kvflow rows planned."""
        rows, self.rows = self.rows, None
        try:
            yield
        finally:
            self.rows = rows

    def _ensure(self, backend, layer, q) -> Tables:
        t = self.tables
        if t is None:
            t = self.make_tables(getattr(backend, "req_to_token_pool", None) or self.req_to_token_pool,
                                 getattr(backend, "token_to_kv_pool", None) or self.kv)
        t.ensure(layer.layer_id, layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, q.dtype)
        return t

    def check_observed(self, req, live: Live, seen: Optional[list] = None) -> None:
        """The tripwire, after each forward and before a request's row is released: every token
        SGLang wrote into an evicted request's row went through kvflow's hooks (positions
        planned, and the hook's per-row counter -- `Tables.seen`, incremented by the hook's own
        tensor ops, in the decode graph too -- advanced by one per layer and forward). A stale or
        skipped graph, a compiled forward that dropped the hook or an attention path that bypasses
        `AttentionBackend.forward` leaves the counter behind; the evicted state would then be
        silently wrong, so the scheduler stops instead."""
        written, counted = int(req.kv.kv_committed_len), live.resident + live.pending
        layers = self.tables.layers
        missed = None
        if written != counted:
            missed = f"SGLang holds {written} tokens in its row, kvflow's hooks planned {counted}"
        elif live.pending:
            live.checked += layers
            got = seen[live.row] if seen is not None else int(self.tables.seen[live.row])
            if got != live.checked:
                missed = (f"kvflow's attention hook counted {got - live.checked + layers} of {layers} layers in its "
                          f"last forward ({live.pending} token(s))")
                live.checked = got
        if missed is not None:
            raise TripwireError(
                f"kvflow tripwire: evicted request {req.rid}: {missed}. Its query window, attention statistics and "
                "hole masks would be stale, so the engine stops rather than decode on. Cause: the forward ran "
                "without kvflow's hooks (a decode graph replayed without them: with KVFLOW_SGLANG_HOOKS=eager, "
                "models.<entry>.engine.disable_cuda_graph must be true; enable_torch_compile; an attention backend "
                "that bypasses AttentionBackend.forward). Rerun `kvflow run` to resume once the setting is fixed.")
        self.observed_tokens += live.pending

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

    # ------------------------------------------------------------------ end of a request

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


class TripwireError(RuntimeError):
    """An evicted request's token went through a forward without kvflow's hooks."""


def _aborted(req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


RUNTIME = Runtime()


def _spec(req) -> Optional[dict]:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(KEY) if isinstance(params, dict) else None


# ---------------------------------------------------------------------- hooks


def _init_round(original, req, tree_cache=None, *args, **kwargs):
    spec = _spec(req)
    if spec is None:
        return original(req, tree_cache, *args, **kwargs)
    # an evicted request never matches the radix tree: a key of its own misses (its input ids
    # stand in for evicted tokens; the slots hold other tokens per head)
    req.extra_key = "kvflow-evict:" + req.rid
    snap = RUNTIME.snapshots.get(spec.get("from") or "")
    if snap is not None and snap.base and not getattr(req, "_kvflow_padded", False):
        # the client counts the nominal length; the row holds `base` more slots (the holes)
        ids = req.origin_input_ids
        req.origin_input_ids = type(ids)("q", [ids[0]] * snap.base) + ids if isinstance(ids, array) \
            else [ids[0]] * snap.base + list(ids)
        if req.logprob_start_len > 0:  # counted from the start of the (now longer) input
            req.logprob_start_len += snap.base
        req._kvflow_padded = True
    out = original(req, tree_cache, *args, **kwargs)
    RUNTIME.begin(req, tree_cache)
    return out


def _forward_batch(result, *args, **kwargs):
    batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
    RUNTIME.rows = None
    if RUNTIME.live:
        with _counted("plan_ops"):
            RUNTIME.plan(batch, result)
    return result


@contextlib.contextmanager
def _counted(field: str):
    """KVFLOW_SGLANG_COUNT_OPS=1: the operators kvflow's host side dispatches around a forward
    (positions before it: `plan_ops`; tripwire and compactions after it: `host_ops`)."""
    counter = RUNTIME.ops
    if counter is None:
        yield
        return
    counter.total = 0
    with counter:
        yield
    RUNTIME.host_counts[field] = counter.total


def _attention(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    if forward_batch.forward_mode.is_idle():
        return out
    return RUNTIME.hooked(backend, q, out, layer, forward_batch)


def _capturing() -> bool:
    """Is SGLang capturing its decode graphs (engine start: two eager warm-up forwards, in
    which kvflow's tables are made, then the capture)?"""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return get_is_capture_mode() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _counting(original, runner, forward_batch, *args, **kwargs):
    """KVFLOW_SGLANG_COUNT_OPS=1: the operators each decode forward dispatches."""
    counter = RUNTIME.ops
    if not forward_batch.forward_mode.is_decode():
        return original(runner, forward_batch, *args, **kwargs)
    counter.total = counter.hook = 0
    with counter:
        out = original(runner, forward_batch, *args, **kwargs)
    RUNTIME.op_counts.append({"forward": RUNTIME.decode_forwards, "rows": int(forward_batch.batch_size),
                              "evicted_rows": len(RUNTIME.rows or ()),
                              "ops": counter.total, "hook_ops": counter.hook,
                              "plan_ops": RUNTIME.host_counts.pop("plan_ops", 0)})
    del RUNTIME.op_counts[:-256]  # the latest (what `server_state()` reads)
    return out


def _after_result(result, processor, batch, *args, **kwargs):
    if RUNTIME.live:
        with _counted("host_ops"):
            RUNTIME.forwarded(processor, batch)
        if RUNTIME.ops is not None and RUNTIME.op_counts and "host_ops" not in RUNTIME.op_counts[-1]:
            RUNTIME.op_counts[-1]["host_ops"] = RUNTIME.host_counts.pop("host_ops", 0)
    return result


def _release(req, tree_cache, *args, **kwargs):
    if req.rid in RUNTIME.live:
        RUNTIME.released(req, tree_cache)
    return None


def _room(req, live: Live, admitting: bool) -> int:
    """Tokens an evicted request may still add before its next compaction frees the rest: all
    SGLang's admission control needs to reserve for it (its row never exceeds `budget +
    buffer`), where it would reserve the step cap."""
    size = live.nominal + (len(req.full_untruncated_fill_ids) - req.prefix_len if admitting else 0)
    return max(1, live.evictor.trigger - size)


def _reserving_room(admitting: bool):
    def hook(original, adder, req, *args, **kwargs):
        """For the length of the call, an evicted request's `max_new_tokens` is what fits
        before its next compaction (its own stop rule keeps the real one). A request whose
        snapshot found no room in the pool yet is not admitted (it waits for the next round)."""
        live = RUNTIME.live.get(req.rid)
        if live is None:
            return original(adder, req, *args, **kwargs)
        if admitting and not RUNTIME.restore(req, adder.tree_cache, live):
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.NO_TOKEN
        room, params = _room(req, live, admitting), req.sampling_params
        if len(req.output_ids) + room >= params.max_new_tokens:
            return original(adder, req, *args, **kwargs)
        real, params.max_new_tokens = params.max_new_tokens, len(req.output_ids) + room
        try:
            return original(adder, req, *args, **kwargs)
        finally:
            params.max_new_tokens = real
    return hook


def state() -> dict:
    """The evicted requests' part of `server_state()` (the plugin's state hook adds it)."""
    return {
        "evicted_requests": len(RUNTIME.live),
        "evicted_request_slots": {rid: live.resident for rid, live in RUNTIME.live.items()},
        "peak_request_slots": RUNTIME.peak_slots,
        "compactions": RUNTIME.compactions,
        "retractions": RUNTIME.retractions,
        "observed_tokens": RUNTIME.observed_tokens,
        "hooks": RUNTIME.mode,
        "profile": vars(RUNTIME.profile) | {},
        "table_bytes": RUNTIME.tables.nbytes() if RUNTIME.tables is not None else 0,
        "replay_proxy": None if RUNTIME.proxy is None else {
            "captures": RUNTIME.proxy.captures, "replays": RUNTIME.proxy.replays,
            "replays_by_bucket": {str(b): n for b, n in RUNTIME.proxy.replays_by_bucket.items()}},
        "op_counts": RUNTIME.op_counts[-64:],
        "snapshots": len(RUNTIME.snapshots),
        "snapshot_tokens": sum(s.length for s in RUNTIME.snapshots.values()),
    }


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_INIT, _init_round, HookType.AROUND)
    HookRegistry.register(_FORWARD_BATCH, _forward_batch, HookType.AFTER)
    HookRegistry.register(_ATTENTION, _attention, HookType.AROUND)
    HookRegistry.register(_PROCESSOR + ".process_batch_result_prefill", _after_result, HookType.AFTER)
    HookRegistry.register(_PROCESSOR + ".process_batch_result_decode", _after_result, HookType.AFTER)
    HookRegistry.register(_RELEASE, _release, HookType.BEFORE)
    if RUNTIME.ops is not None:
        HookRegistry.register(_RUNNER_FORWARD, _counting, HookType.AROUND)
    # admission: reserve an evicted request's room to its next compaction, not its step cap
    HookRegistry.register(_ADDER + ".add_one_req", _reserving_room(admitting=True), HookType.AROUND)
    HookRegistry.register(_ADDER + "._get_running_request_total_token_offset", _reserving_room(admitting=False),
                          HookType.AROUND)
