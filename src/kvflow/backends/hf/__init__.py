"""The `hf` backend: transformers in kvflow's process, with kvflow's batched decode and budgeted
KV cache (CPU or GPU).

- `engine.py`   `HFRunner`: one loaded model and the forward passes kvflow needs;
- `decode.py`   `HFEngine`: the engine protocol (step-level continuous decoding);
- `cache.py`    the budgeted cache (per-row offsets, compaction per layer and KV head), with
  `rows.py` (host bookkeeping), `allocation.py` (budgets varying by layer or head) and
  `decode_batch.py` (one decode forward over several caches);
- `attention.py`, `matmul.py`, `sampling.py`, `quant.py`, `scoring.py`, `prm.py`: the parts.

This module imports no torch: the registry and `kvflow validate` read `HFBackend` cheaply.
"""

from __future__ import annotations

from kvflow.backends.base import Backend


class HFBackend(Backend):
    """transformers in-process (CPU or GPU): kvflow's batched decode with a budgeted KV cache.

    Registered as backend `hf`; `load()` returns an `HFEngine` (kvflow.backends.hf.decode)."""

    name = "hf"

    @staticmethod
    def check(model_cfg):
        """None if the model can be loaded here (nothing is loaded), else why not."""
        from kvflow.backends.hf.compat import check_transformers
        from kvflow.models.loading import check_available

        if getattr(model_cfg, "engine", None):
            return ("engine", f"backend 'hf' takes no engine settings (got {', '.join(model_cfg.engine)}); "
                              "they are SGLang's server arguments, for `backend: sglang`")
        why = check_transformers()  # the installed version, from metadata: nothing is imported
        if why:
            return ("backend", why)
        return check_available(model_cfg)

    @staticmethod
    def batch_invariant(model_cfg):
        """`run.deterministic` on this entry: (engine settings for it, None), or (None, why it
        cannot be). hf's batch-invariant forwards follow torch's deterministic algorithms, which
        the run turns on (kvflow.backends.hf.invariant): no engine setting, any device."""
        return {}, None

    @staticmethod
    def load(model_cfg, *, evicting: bool = True, evictors=None):
        """The engine of the model (any evictor runs on it); model entries that load the very same weights (see
        `load_model`) share one engine, so their proposers decode in one forward."""
        from kvflow.backends.hf.compat import check_transformers
        from kvflow.errors import UserError

        why = check_transformers()  # also for callers that load without `check` first
        if why:
            raise UserError(why)
        from kvflow.backends.hf.decode import HFEngine
        from kvflow.backends.hf.engine import HFRunner
        from kvflow.models.loading import load_model

        model, tokenizer = load_model(model_cfg)
        engine = getattr(model, "_kvflow_engine", None)
        if engine is None or engine.tokenizer is not tokenizer:
            engine = HFEngine(HFRunner(model, tokenizer))
            model._kvflow_engine = engine
        engine.reset()
        return engine
