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

Modules: `requests.py` (admission, snapshots, positions), `decode.py` (the decode graph's host
side), `extend.py` (the per-row extend path), `observing.py` (evictors' own observe()),
`tripwire.py`, `compaction.py`; `hooks.py` names every SGLang function kvflow wraps.
Hooks (`hooks.register_evicted`): `Req.init_next_round_input` (start from a snapshot, never match the
radix tree), `ForwardBatch.init_new` (positions), `AttentionBackend.forward` (query window,
H2O statistic: read back from the pool after the backend wrote the new keys, so any attention
backend with one slot per token works), `process_batch_result_prefill/decode` (the tripwire, compaction),
`release_kv_cache` (snapshot), `PrefillAdder.add_one_req` and its running requests' offset
(admission reserves an evicted request's room to its next compaction, not its step cap),
and `state()`, which the plugin's `server_state()` hook adds.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from kvflow.backends.sglang.in_worker.compaction import Compaction
from kvflow.backends.sglang.in_worker.decode import DecodeHost
from kvflow.backends.sglang.in_worker.extend import Extend
from kvflow.backends.sglang.in_worker.graph import Profile, Tables
from kvflow.backends.sglang.in_worker.observing import Observing
from kvflow.backends.sglang.in_worker.replay import OpCounter, proxy_from_env
from kvflow.backends.sglang.in_worker.requests import KEY, Live, Requests, Snapshot
from kvflow.backends.sglang.in_worker.tripwire import Tripwire, TripwireError

__all__ = ["KEY", "Live", "RUNTIME", "Runtime", "Snapshot", "TripwireError"]


class Runtime(Requests, DecodeHost, Extend, Observing, Tripwire, Compaction):
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


RUNTIME = Runtime()
