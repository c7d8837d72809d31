"""`SGLangEngine`: kvflow's engine protocol over SGLang's offline engine (`ServedEngine` with
SGLang's requests; the shared shell: `kvflow.backends.served.engine`).

A full-context candidate is one SGLang request with the whole sequence as input, whose shared
prefix SGLang's radix cache keeps. An evicted problem state is a snapshot in SGLang's scheduler
holding the state's resident tokens per (layer, KV head) (`in_worker/evict.py`); a candidate is
a request from the snapshot whose input is its resident tail and the pending token, and an
ingest (text another proposer wrote) a chain of requests with `max_new_tokens = 0`, each at most
`budget + buffer - resident` tokens long, so the scheduler compacts at `hf`'s points.

Sampling: candidate i of a request sends `sampling_seed = row_seed(request.seed, i)`; kvflow's
SGLang plugin (`in_worker/plugin.py`) makes SGLang draw each token from a hash of that seed and
the token's position, so the same seed and prefix give the same candidate, alone or in any
batch (not the `hf` backend's tokens: another generator). Greedy decoding equals `hf` token for
token on the same weights in float32. Logprobs are the model's own (temperature 1; SGLang's
`SGLANG_RETURN_ORIGINAL_LOGPROB`).

Data parallelism (`dp_size > 1`): each replica has its own scheduler, and a snapshot lives in
the one that made it. A state is given a replica when it starts (the one with the fewest of
this engine's live states, lowest first) and every request made from it names that replica
(SGLang's `routed_dp_rank`, which every load-balance method of its DP controller honours); drops
go with the next request to the replica that holds the snapshot.
"""

from __future__ import annotations

import os
from typing import Optional

from kvflow.backends.served.engine import ServedEngine
from kvflow.backends.served.snapshots import EvictedState
from kvflow.backends.served.streamed import TOP_K, Row
from kvflow.backends.sglang.settings import RECORDED
from kvflow.components.engine import ProposeRequest, row_seed
from kvflow.errors import EngineError


class SGLangEngine(ServedEngine):
    """One model served by an SGLang worker process (see the module docstring)."""

    backend = "sglang"
    engine_name = "SGLang"
    RECORDED = RECORDED
    CONTEXT_SETTING = "context_length"

    def __init__(self, worker, tokenizer, **kw) -> None:
        super().__init__(worker, tokenizer, **kw)
        self._rank_load: dict[int, int] = {}  # dp_size > 1: live states per replica (`_route`)
        self.profile = None  # graph.Profile of its decode hook (None: started without kvflow's hooks)
        self.profile_shape = (self._kv_shape[0], self._kv_shape[1])  # (layers, KV heads per tensor-parallel rank)
        self.dump_dir: Optional[str] = None  # set: the scheduler saves every snapshot there (`<snap>.pt`)

    def reset(self) -> None:
        super().reset()
        self._rank_load = {}

    def kv_pool_tokens(self) -> int:
        """SGLang's token pool as it resolved it (`max_total_tokens`)."""
        return int(self.resolved.get("max_total_tokens") or 0)

    # ------------------------------------------------------------------ replicas

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the engine (SGLang's resolved `dp_size`)."""
        return int(self.resolved.get("dp_size") or 1)

    def _route(self) -> Optional[int]:
        if self.dp_size < 2:
            return None
        rank = min(range(self.dp_size), key=lambda r: (self._rank_load.get(r, 0), r))
        self._rank_load[rank] = self._rank_load.get(rank, 0) + 1
        return rank

    def _unroute(self, state) -> None:
        rank = getattr(state, "dp_rank", None)
        if rank is not None and self._rank_load.get(rank):
            self._rank_load[rank] -= 1

    # ------------------------------------------------------------------ requests

    def check_evictor(self, evictor) -> None:
        """Refuse, before any request, an evictor this engine's decode hook was not started for
        (`graph.Profile`: kvflow starts each engine for the evictors the pipeline serves on it)."""
        from kvflow.backends.sglang.in_worker.graph import profile_problem

        if self.profile is None:
            raise EngineError(f"evictor {type(evictor).__name__}: this SGLang engine was started for full-context "
                              "proposers and scorers only (no kvflow hook); load it with the evictors it serves")
        layers, kv_heads = self.profile_shape
        why = profile_problem(self.profile, evictor, layers, kv_heads, graphs=False)
        if why:
            raise EngineError(f"evictor {type(evictor).__name__} cannot run on this SGLang engine: {why}")

    def _send_row(self, req: ProposeRequest, i: int, row: Row, cap: int) -> None:
        spec = req.spec
        params = {"max_new_tokens": cap, "temperature": spec.temperature, "top_p": spec.top_p,
                  "stop": [spec.delimiter] if spec.delimiter else [], "no_stop_trim": True,
                  "skip_special_tokens": False}
        if spec.temperature > 0:
            params["sampling_seed"] = row_seed(req.seed, i)
        state, ids = req.state, req.state.ids
        if isinstance(state, EvictedState):  # from the state's snapshot: its resident tail + the pending token
            self._evicted_row(state, row)
            params["custom_params"] = {"kvflow_evict": self._spec(
                state, rng_key=row_seed(state.rng_key, i), save_as=row.snap)}
            ids = ids[state.cached - state.resident :]
        self.worker.send("generate", row.rid, ids, params, TOP_K, state.dp_rank)

    def _send_ingest(self, s: EvictedState, rid: str, end: int, spec: dict) -> None:
        """From the snapshot: its resident tail (stand-ins) and the chunk, `max_new_tokens` 0."""
        params = {"max_new_tokens": 0, "custom_params": {"kvflow_evict": spec}}
        self.worker.send("generate", rid, s.ids[s.cached - s.resident : end], params, 0, s.dp_rank)

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells kvflow's SGLang plugin (`in_worker/evict.py`) about its evicted state."""
        spec = dict(self._common_spec(s, rng_key=rng_key, save_as=save_as), logical=s.cached)
        if self.dump_dir:
            spec["dump"] = str(self.dump_dir)
        return spec

    # ------------------------------------------------------------------ inspection

    def server_state(self) -> dict:
        """The scheduler's KV slots in use and kvflow's snapshots (`in_worker/evict.py`)."""
        [(state, _)] = self.ask([("state",)], "state query")
        return state

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (as `HFEngine.kept_kv`), from the snapshot
        the scheduler saved under `dump_dir` (set it before the state is made; inspection and
        the engine parity tests)."""
        import torch

        if not self.dump_dir or not state.snap:
            raise EngineError("kept_kv needs `dump_dir` set before the state was made")
        snap = torch.load(os.path.join(self.dump_dir, f"{state.snap}.pt"))
        keys, values, holes = snap["keys"], snap["values"], snap.get("holes")
        end = snap.get("base", 0) + state.evictor.params.budget  # where each head's hole ends

        def head(t, layer, h):  # [layers, kv_heads, n, D] -> the head's tokens, hole skipped
            x = t[layer, h]
            return x if holes is None else torch.cat([x[: int(holes[layer, h])], x[end:]])

        return ([[head(keys, l, h) for h in range(keys.shape[1])] for l in range(keys.shape[0])],
                [[head(values, l, h) for h in range(values.shape[1])] for l in range(values.shape[0])],
                snap["compactions"])
