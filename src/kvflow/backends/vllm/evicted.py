"""Evicted problem states of `VLLMEngine`, on kvflow's side (the worker's side: `evict.py`; the
bookkeeping both streamed engines share: `kvflow.backends.snapshots`).

An evicted state is a snapshot in the vLLM worker: a one-row `BudgetedCache` holding the
state's first `cached` tokens, evicted as `hf` evicts them. A candidate is a vLLM request whose
input is the whole logical sequence (prompt + committed tokens, the pending token last) and
whose evicted part starts at `cached` (the tokens before it are stand-ins: `evict.py`). An
ingest request sends the prefix to be cached with `max_tokens = 1` (the sampled token unused).
The worker saves a snapshot for an aborted request too, so a candidate kvflow stopped has one
(dropped when the candidate is adopted by ingesting its tokens).
"""

from __future__ import annotations

from kvflow.backends.snapshots import EvictedState, SnapshotStates
from kvflow.errors import EngineError


class EvictedStates(SnapshotStates):
    """The evicted-state half of `VLLMEngine` (a mixin: it uses the engine's worker, counters
    and reply handling)."""

    engine_name = "vLLM"

    def _init_evicted(self) -> None:
        self._init_snapshots()
        self._kept: dict[str, object] = {}  # "kept" query rid -> its reply (None: waiting)

    def _send_ingest(self, s: EvictedState, rid: str, end: int, spec: dict) -> None:
        self.worker.send("generate", rid, s.ids[:end], {"max_tokens": 1, "temperature": 0.0}, spec)

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells the worker (`evict.py`) about its evicted state."""
        return dict(self._common_spec(s, rng_key=rng_key, save_as=save_as), first=s.cached)

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (as `HFEngine.kept_kv`; inspection and the
        engine parity tests)."""
        import torch

        if not state.snap:
            raise EngineError("kept_kv: the state holds nothing yet")
        rid = self.worker.new_rid("k")
        self._kept[rid] = None
        self.worker.send("kept", rid, state.snap)
        self._wait(lambda: self._kept[rid] is not None, "a snapshot's keys")
        msg = self._kept.pop(rid)
        if msg[0] == "error":
            raise EngineError(f"{self.worker.where}: vLLM worker could not read snapshot {state.snap}: {msg[2]}")
        data = msg[2]

        def tensors(x):
            return [[torch.tensor(h, dtype=torch.float32).reshape(len(h), -1) for h in layer] for layer in x]

        return tensors(data["keys"]), tensors(data["values"]), data["compactions"]
