"""The `vllm` backend: proposers (full-context and evicted) and the `likelihood`,
`prm` and `llm_judge` scorers served by vLLM's engine, in vLLM's own environment.

- `engine.py`    `VLLMEngine`: the served-engine core (`kvflow.backends.served`) with vLLM's requests;
- `loading.py`   an engine for a model entry: vLLM's interpreter, one shared worker per set of arguments;
- `settings.py`  vLLM's interpreter (`KVFLOW_VLLM_PYTHON`, else `.venv-vllm`), the engine
                 arguments of a model entry, and the settings kvflow refuses;
- `in_worker/`   what runs inside the worker process, in vLLM's environment: the worker (run by
                 its path; kvflow is imported from kvflow's import path) and kvflow's evicted
                 requests inside it (`evict.py`: uniform budgets in vLLM's own blocks, attended
                 by vLLM's kernel, `blocks.py`, H2O's statistic kept in the forward, `statistic.py`;
                 budgets varying by layer or head beside them, `beside.py`; the graph-replay proxy, `replay.py`).

Refused before anything loads (`check_evictor`): budgets varying by layer or head off a CPU or
under graphs, an evictor's own `observe()` under CUDA graphs, H2O past `KVFLOW_VLLM_STAT_SPAN`,
quantized KV. Install: `scripts/install.sh vllm` (docs/backends.md, "vllm").
"""

from __future__ import annotations

from typing import Any, Optional

from kvflow.backends.base import Backend
from kvflow.backends.vllm.settings import SUPPORTED_VERSIONS  # settings imports nothing heavy

__all__ = ["VLLMBackend", "SUPPORTED_VERSIONS"]


class VLLMBackend(Backend):
    """vLLM's engine in a worker process started with vLLM's own interpreter.

    Registered as backend `vllm`; `load()` returns a `VLLMEngine`. Runs proposers (evicted ones
    through `in_worker/evict.py`), the scorers that need prompt log-probabilities
    (`likelihood`) and per-position values (`prm`, `llm_judge`)."""

    name = "vllm"
    evicts = True  # evicted proposers run through kvflow's hooks in the worker (in_worker/evict.py)
    serves_position_values = True  # its prefix cache holds each problem's committed prefix
    #: the tiny model kvflow's contract suites run it on (kvflow.testing.engine_parity.contract_arch):
    #: vLLM's CPU attention serves head_dim 32 and up, not the 16 of the default tiny Qwen2
    contract_arch = "qwen2-hd32"

    @staticmethod
    def check_evictor(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
        """None if an evicted proposer with these evictor params can run on this model entry,
        else (field, sentence): `params.<name>` of the evictor, or `engine.<name>` / `device` of the model."""
        from kvflow.backends.vllm.settings import check_evicting

        return check_evicting(model_cfg, params, evictor_cls)

    @staticmethod
    def position_value_settings(head: bool) -> dict:
        """A PRM on vLLM's pooling runner, pooling every position (vLLM's PRM pools at its step
        tag, 151651, Qwen's `<extra_0>`, by default), so that any tokenizer's tags are read where
        kvflow finds them."""
        return {"runner": "pooling", "pooler_config": {"tok_pooling_type": "ALL"}} if head else {}

    @staticmethod
    def describe(model_cfg, *, evicted: dict[str, str], full: list[str], scores: bool) -> list[str]:
        from kvflow.backends.vllm.settings import COMMON, CPU

        return ["vLLM in a worker process (its own environment: .venv-vllm or KVFLOW_VLLM_PYTHON); "
                "full-context requests in vLLM's blocks (prefix cache on), evicted ones in vLLM's blocks too "
                "(compacted in place; budgets varying by layer or head in kvflow's cache beside them, on a CPU); "
                "kvflow's defaults: "
                + ", ".join(f"{k}={v}" for k, v in COMMON.items())
                + "; where no GPU also " + ", ".join(f"{k}={v}" for k, v in CPU.items())
                + " (docs/backends.md, \"vLLM\")"]

    @staticmethod
    def check(model_cfg) -> Optional[Any]:
        """None if the model can be served here, else why not: a sentence, or a
        (field under the model entry, sentence) pair."""
        from kvflow.backends.vllm.settings import check_installed, check_model, check_settings

        return check_settings(model_cfg) or check_installed() or check_model(model_cfg)

    @staticmethod
    def batch_invariant(model_cfg):
        """`run.deterministic` on this entry: (engine settings for it, None), or (None, why it
        cannot be): vLLM's `VLLM_BATCH_INVARIANT` mode (kvflow's engine setting `batch_invariant`
        sets it in the worker's environment), whose kernels are Triton's, on a GPU only."""
        from kvflow.models.loading import resolve_device

        if resolve_device(model_cfg.device) == "cpu":
            return None, ("runs on vLLM on the CPU, where vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT, "
                          "Triton kernels) does not run: it needs a GPU")
        return {"batch_invariant": True}, None

    @staticmethod
    def cpu_settings(model_cfg, engines: int) -> dict:
        """Alone on the CPU, the worker's idle OpenMP threads wait actively a little before they
        sleep; beside other engines, it runs on its share of the cores, waiting passively
        (`served.settings.openmp_settings`)."""
        from kvflow.backends.served.settings import openmp_settings

        return openmp_settings(engines)

    @staticmethod
    def load(model_cfg, *, evicting: bool = True, evictors=None):
        """The model's engine (one engine serves full-context and evicted requests alike)."""
        from kvflow.backends.vllm.loading import load_engine

        return load_engine(model_cfg)
