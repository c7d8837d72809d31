"""`VLLMEngine`: kvflow's engine protocol over a vLLM worker (`ServedEngine` with vLLM's
requests; the shared shell: `kvflow.backends.served.engine`).

Every candidate is one vLLM request with the whole sequence as input; vLLM's prefix cache keeps
the shared prefix in whole KV blocks (128 tokens on a CPU). An evicted problem state is a
snapshot in the worker (`in_worker/evict.py`: a one-row `BudgetedCache` holding the state's first
`cached` tokens, evicted as `hf` evicts them); a candidate's evicted part starts at `cached` (the
tokens before it are stand-ins), and an ingest sends the prefix to be cached with `max_tokens = 1`
(the sampled token unused). The worker saves a snapshot for an aborted request too, so a
candidate kvflow stopped has one (dropped when the candidate is adopted by ingesting its tokens).

Sampling: candidate i of a request sends vLLM's per-request `seed = row_seed(request.seed, i)`.
vLLM draws each of that request's tokens from its own generator, so the same seed and prefix
give the same candidate, alone or in any batch (not the `hf` backend's tokens: another
generator). Temperature and top-p are vLLM's (the nucleus keeps the token that crosses top_p).
Greedy decoding equals `hf` token for token on the same weights in float32. Logprobs are the
model's own (`logprobs_mode: raw_logprobs`). Scoring (`likelihood`) uses vLLM's prompt
log-probabilities over the whole sequence (vLLM reads no prefix cache for a request that asks
for them).
"""

from __future__ import annotations

from kvflow.backends.served.engine import ServedEngine
from kvflow.backends.served.snapshots import EvictedState
from kvflow.backends.served.streamed import TOP_K, Row
from kvflow.backends.vllm.settings import RECORDED
from kvflow.components.engine import ProposeRequest, row_seed
from kvflow.errors import EngineError


class VLLMEngine(ServedEngine):
    """One model served by a vLLM worker process (see the module docstring)."""

    backend = "vllm"
    engine_name = "vLLM"
    RECORDED = RECORDED
    CONTEXT_SETTING = "max_model_len"
    #: evicted requests' counters: forwards vLLM recomputed one beside its blocks in, tokens its own
    #: KV held (not computed), the most KV blocks in use after any step, preemptions of requests in
    #: vLLM's blocks, the most blocks one evicted request held, compactions in vLLM's blocks
    OWN_COUNTERS = ("evicted_recomputes", "standins_skipped", "kv_blocks_peak", "evicted_preemptions",
                    "evicted_blocks_peak", "evicted_compactions", "snapshot_spills", "ring_replays")

    def _send_row(self, req: ProposeRequest, i: int, row: Row, cap: int) -> None:
        spec = req.spec
        # no stop strings: kvflow ends a step at the delimiter itself (matched on token
        # pieces as on `hf`) and aborts the request; EOS is the engine's stop too
        params = {"max_tokens": cap, "temperature": spec.temperature, "logprobs": TOP_K,
                  "stop_token_ids": sorted(self.eos_ids)}
        if spec.temperature > 0:
            params.update(top_p=spec.top_p, seed=row_seed(req.seed, i))
        state, evict = req.state, None
        if isinstance(state, EvictedState):  # the whole sequence; its evicted part starts at the pending token
            self._evicted_row(state, row)
            evict = self._spec(state, rng_key=row_seed(state.rng_key, i), save_as=row.snap)
        self.worker.send("generate", row.rid, state.ids, params, evict)

    def _send_ingest(self, s: EvictedState, rid: str, end: int, spec: dict) -> None:
        self.worker.send("generate", rid, s.ids[:end], {"max_tokens": 1, "temperature": 0.0}, spec)

    def _chunks_ingest(self, evictor) -> bool:
        """An evictor in vLLM's blocks (the same count in every layer and head): vLLM's scheduler
        runs such a request at most up to its next compaction per forward (`in_worker/evict.py`)."""
        return not evictor.varies(self.kv_shape()[0])

    def _spec(self, s: EvictedState, *, rng_key: int, save_as: str) -> dict:
        """What a request tells the worker (`in_worker/evict.py`) about its evicted state."""
        return dict(self._common_spec(s, rng_key=rng_key, save_as=save_as), first=s.cached)

    def kept_kv(self, state: EvictedState):
        """What an evicted state keeps: (keys, values, compactions) with keys[layer][head] the
        head's resident keys in time order, [n, D] (as `HFEngine.kept_kv`; inspection and the
        engine parity tests)."""
        import torch

        if not state.snap:
            raise EngineError("kept_kv: the state holds nothing yet")
        [(data, _)] = self.ask([("kept", state.snap)], f"reading snapshot {state.snap}")

        def tensors(x):
            return [[torch.tensor(h, dtype=torch.float32).reshape(len(h), -1) for h in layer] for layer in x]

        return tensors(data["keys"]), tensors(data["values"]), data["compactions"]

    def kept_statistic(self, state: EvictedState) -> list:
        """An observing evictor's statistic (H2O's) of the slots an evicted state keeps, per layer
        [kv_heads, n] float32 (as `HFEngine.kept_statistic`; the engine parity tests)."""
        import torch

        [(data, _)] = self.ask([("kept", state.snap)], f"reading snapshot {state.snap}")
        if data.get("stats") is None:
            raise EngineError("kept_statistic: the state's evictor keeps no statistic")
        return [torch.tensor(layer, dtype=torch.float32) for layer in data["stats"]]
