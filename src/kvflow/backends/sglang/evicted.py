"""Evicted problem states of `SGLangEngine`, on kvflow's side (the scheduler's side: `evict.py`; the
bookkeeping both streamed engines share: `kvflow.backends.snapshots`).

An evicted state is a snapshot in the SGLang scheduler holding the state's resident tokens per
(layer, KV head). A candidate is a request from the snapshot whose input is the pending token;
it leaves a snapshot of its own at its end, which adoption takes when the engine ended the
candidate exactly where kvflow did (else its tokens are ingested into the pre-step snapshot).
Ingesting text is a chain of requests from the snapshot, `max_new_tokens = 0`, each at most
`budget + buffer - resident` tokens long, so the scheduler compacts at `hf`'s points.
Snapshots kvflow no longer needs are dropped with the next request it sends (a drop that
reached the scheduler before the snapshot was made would leave it behind, so a candidate's is
dropped only once its end has arrived).

Data parallelism (`dp_size > 1`): each replica has its own scheduler, and a snapshot lives in
the one that made it. A state is given a replica when it starts (`dp_rank`: the replica with
the fewest of this engine's live states, lowest first) and every request made from it (its
ingests, its candidates, and the states they leave) names that replica (SGLang's
`routed_dp_rank`, which every load-balance method of its DP controller honours); drops go with
the next request to the replica that holds the snapshot.
"""

from __future__ import annotations

import os

from kvflow.backends.snapshots import EvictedState, SnapshotStates
from kvflow.errors import EngineError


class EvictedStates(SnapshotStates):
    """The evicted-state half of `SGLangEngine` (a mixin: it uses the engine's worker,
    counters and polling)."""

    engine_name = "SGLang"

    def _send_ingest(self, s: EvictedState, rid: str, end: int, spec: dict) -> None:
        """From the snapshot: its resident tail (stand-ins) and the chunk, `max_new_tokens` 0."""
        params = {"max_new_tokens": 0, "custom_params": {"kvflow_evict": spec}}
        self.worker.send("generate", rid, s.ids[s.cached - s.resident : end], params, 0, s.dp_rank)

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells kvflow's SGLang plugin (`evict.py`) about its evicted state."""
        spec = dict(self._common_spec(s, rng_key=rng_key, save_as=save_as), logical=s.cached)
        if self.dump_dir:
            spec["dump"] = str(self.dump_dir)
        return spec

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
