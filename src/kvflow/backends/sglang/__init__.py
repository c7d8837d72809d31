"""The `sglang` backend: full-context and evicted proposers and scorers served by SGLang's engine.

- `engine.py`    `SGLangEngine`: the served-engine core (`kvflow.backends.served`) with SGLang's
                 requests (sampling parameters, evicted requests from scheduler snapshots, replicas);
- `loading.py`   an engine for a model entry: its decode profile, one worker per (arguments,
                 profile), the resolved settings checked;
- `settings.py`  the engine arguments: defaults per device, a model entry's `engine:` settings
                 checked against SGLang's own server arguments (no engine is loaded there);
- `in_worker/`   what runs inside SGLang's processes: the worker, kvflow's SGLang plugin, the
                 hooks of evicted requests, the decode graph's step and its profile.

Install: `scripts/install.sh sglang` (docs/backends.md).
"""

from __future__ import annotations

from typing import Any, Optional

from kvflow.backends.base import Backend, GpuLayout
from kvflow.backends.sglang.settings import SUPPORTED_VERSIONS  # noqa: E402 - settings imports nothing heavy

__all__ = ["SGLangBackend", "SUPPORTED_VERSIONS"]


class SGLangBackend(Backend):
    """SGLang's offline engine in a worker process (GPU, or CPU through kvflow's CPU platform).

    Registered as backend `sglang`; `load()` returns an `SGLangEngine`. Runs full-context
    proposers, evicted proposers (every registered evictor but quantized storage) and the
    scorers that need prompt log-probabilities."""

    name = "sglang"
    evicts = True
    serves_position_values = True  # its radix cache holds each problem's committed prefix

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
    def kv_pool_settings(model_cfg, kv_bytes: int, bytes_per_token: float) -> Optional[dict]:
        """SGLang sizes its token pool at start: `max_total_tokens` = the bytes / KV bytes per
        token, unless the entry sizes the pool itself (`max_total_tokens`, `mem_fraction_static`)."""
        from kvflow.backends.sglang.settings import POOL_SETTINGS

        if any(k in (model_cfg.engine or {}) for k in POOL_SETTINGS):
            return None
        return {"max_total_tokens": int(kv_bytes // bytes_per_token)}

    @staticmethod
    def gpu_layout(model_cfg) -> GpuLayout:
        """tp x dp x pp / nnodes GPUs from `base_gpu_id`, `gpu_id_step` apart, the weights split
        over tp x pp, and `mem_fraction_static` of each GPU's memory claimed at start."""
        engine = dict(model_cfg.engine or {})

        def setting(name: str, default: int = 1) -> int:
            value = engine.get(name)
            return int(value) if value is not None else default

        tp, dp, pp, nodes = setting("tp_size"), setting("dp_size"), setting("pp_size"), setting("nnodes")
        fraction = engine.get("mem_fraction_static")
        return GpuLayout(gpu_count=max(1, tp * dp * pp // max(1, nodes)), weight_shards=max(1, tp * pp),
                         gpu_id_step=setting("gpu_id_step"), fraction_setting="mem_fraction_static",
                         fraction=None if fraction is None else float(fraction),
                         first_gpu_setting="base_gpu_id",
                         first_gpu=None if engine.get("base_gpu_id") is None else int(engine["base_gpu_id"]),
                         quantized=bool(engine.get("quantization")))

    @staticmethod
    def placed_settings(model_cfg, first_gpu: int, fraction: Optional[float]) -> dict:
        """`base_gpu_id` where the entry set none, and the fraction SGLang must be told."""
        out: dict = {}
        if "base_gpu_id" not in (model_cfg.engine or {}):
            out["base_gpu_id"] = first_gpu
        if fraction is not None:
            out["mem_fraction_static"] = fraction
        return out

    @staticmethod
    def position_value_settings(head: bool) -> dict:
        """A PRM's head outputs come back as hidden states, which SGLang keeps for the last
        chunk of a chunked prefill only: no chunks (a scoring engine only prefills)."""
        return {"enable_return_hidden_states": True, "chunked_prefill_size": -1} if head else {}

    @staticmethod
    def describe(model_cfg, *, evicted: dict[str, str], full: list[str], scores: bool) -> list[str]:
        from kvflow.backends.sglang.settings import COMMON, CPU, EVICTING

        kinds = []
        if evicted:
            kinds.append(", ".join(f"{n} evicted ({kind}, per layer and KV head by kvflow's SGLang plugin)"
                                   for n, kind in evicted.items()))
        if full or scores:
            kinds.append((", ".join(full) + " " if full else "") + "full context, prefix kept in its radix cache")
        return ["SGLang in a worker process; " + "; ".join(kinds) + "; kvflow's defaults: "
                + ", ".join(f"{k}={v}" for k, v in COMMON.items())
                + (", " + ", ".join(f"{k}={v}" for k, v in EVICTING.items()) + " (evicted proposers)" if evicted else "")
                + "; where no GPU also " + ", ".join(f"{k}={v}" for k, v in CPU.items())
                + " (docs/backends.md, \"Running on GPUs\")"]

    @staticmethod
    def cpu_settings(model_cfg, engines: int) -> dict:
        """Alone on the CPU, the worker's idle OpenMP threads wait actively a little before they
        sleep (`served.settings.openmp_settings`); beside other engines they sleep at once (its
        cores are SGLang's own binding, not OMP_NUM_THREADS: not split here)."""
        from kvflow.backends.served.settings import openmp_settings

        return openmp_settings(engines, share_threads=False)

    @staticmethod
    def load(model_cfg, *, evicting: bool = True, evictors=None):
        """The model's engine. `evicting` (kvflow passes it): whether an evicted proposer runs
        on it; a full-context engine gets no kvflow hook at all. `evictors` (kvflow passes
        them): the (class, params) of the evictors it serves, from which its decode hook is
        specialised (`graph.Profile`: query ring, H2O statistic, hole recompute, span);
        docs/backends.md, "Running on GPUs"."""
        from kvflow.backends.sglang.loading import load_engine

        return load_engine(model_cfg, evicting, evictors)
