"""The `sglang` backend: full-context and evicted proposers and scorers served by SGLang's engine.

- `engine.py`   the kvflow engine protocol over an SGLang worker (`SGLangEngine`);
- `worker.py`   the worker process that owns `sglang.Engine` (SGLang kills its parent when
                one of its processes dies, so that parent is not kvflow's own process);
- `client.py`   starting and talking to workers, one per set of engine arguments;
- `plugin.py`   kvflow's SGLang plugin (seeded sampling on every attention backend);
- `evict.py`    evicted requests inside SGLang's scheduler (kvflow's evictors per request,
                layer and KV head), registered by the plugin;
- `settings.py` the engine arguments: defaults per device, a model entry's `engine:`
                settings checked against SGLang's own server arguments;
- `loading.py`  an engine for a model entry: its decode profile, one worker per
                (arguments, profile), the resolved settings checked;
- `graph.py`    the decode hook's profile, tables and in-graph step (`traffic.py` counts
                its bytes per step on meta tensors; `replay.py` the CPU proxy for graph replay).

Install: `scripts/install.sh sglang` (docs/backends.md).
"""

from __future__ import annotations

from typing import Any, Optional

from kvflow.backends.sglang.settings import SUPPORTED_VERSIONS  # noqa: E402 - settings imports nothing heavy

__all__ = ["SGLangBackend", "SUPPORTED_VERSIONS"]


class SGLangBackend:
    """SGLang's offline engine in a worker process (GPU, or CPU through kvflow's CPU platform).

    Registered as backend `sglang`; `load()` returns an `SGLangEngine`. Runs full-context
    proposers, evicted proposers (every registered evictor but quantized storage) and the
    scorers that need prompt log-probabilities."""

    name = "sglang"
    evicts = True

    @staticmethod
    def check_evictor(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
        """None if an evicted proposer with these evictor params (of `evictor_cls`, where the
        caller passes it) can run on this model entry, else (field, sentence): `params.<name>`
        of the evictor, `engine.<name>` or `id` of the model."""
        from kvflow.backends.sglang.settings import check_evicting

        return check_evicting(model_cfg, params, evictor_cls)

    @staticmethod
    def check(model_cfg) -> Optional[Any]:
        """None if the model can be served here, else why not: a sentence, or a
        (field under the model entry, sentence) pair."""
        from kvflow.backends.sglang.settings import check_installed, check_model, check_settings

        return check_installed() or check_settings(model_cfg) or check_model(model_cfg)

    @staticmethod
    def batch_invariant(model_cfg):
        """`run.deterministic` on this entry: (engine settings for it, None), or (None, why it
        cannot be): SGLang's `enable_deterministic_inference`, which needs a GPU attention backend
        (it refuses the CPU's torch_native, and its seeded CPU kernel is not on PyPI)."""
        from kvflow.models.loading import resolve_device

        if resolve_device(model_cfg.device) == "cpu":
            return None, ("runs on SGLang on the CPU, where SGLang has no deterministic (batch-invariant) "
                          "inference: it needs a GPU attention backend (flashinfer, fa3 or triton)")
        return {"enable_deterministic_inference": True}, None

    @staticmethod
    def load(model_cfg, evicting: bool = True, evictors=None):
        """The model's engine. `evicting` (kvflow passes it): whether an evicted proposer runs
        on it; a full-context engine gets no kvflow hook at all. `evictors` (kvflow passes
        them): the (class, params) of the evictors it serves, from which its decode hook is
        specialised (`graph.Profile`: query ring, H2O statistic, hole recompute, span);
        docs/backends.md, "Running on GPUs"."""
        from kvflow.backends.sglang.loading import load_engine

        return load_engine(model_cfg, evicting, evictors)
