"""The `vllm` backend: proposers (full-context, and evicted on a CPU) and the `likelihood`,
`prm` and `llm_judge` scorers served by vLLM's engine, in vLLM's own environment.

- `engine.py`   the kvflow engine protocol over a vLLM worker (`VLLMEngine`);
- `worker.py`   the worker process that owns vLLM's `LLMEngine`, run by vLLM's interpreter
                (kvflow is not installed there: it is imported from kvflow's import path);
- `evict.py`    evicted requests inside the worker (kvflow's budgeted cache beside vLLM's);
- `evicted.py`  evicted problem states on kvflow's side (snapshots in the worker);
- `client.py`   starting and talking to workers, one per set of engine arguments;
- `settings.py` vLLM's interpreter (`KVFLOW_VLLM_PYTHON`, else `.venv-vllm`), the engine
                arguments of a model entry, and the settings kvflow refuses;
- `loading.py`  an engine for a model entry.

Not built yet, and refused before anything loads: evicted proposers on a GPU or with graphs
(`check_evictor`) and quantized KV. Install: `scripts/install.sh vllm` (docs/backends.md, "vllm").
"""

from __future__ import annotations

from typing import Any, Optional

from kvflow.backends.vllm.settings import SUPPORTED_VERSIONS  # settings imports nothing heavy

__all__ = ["VLLMBackend", "SUPPORTED_VERSIONS"]


class VLLMBackend:
    """vLLM's engine in a worker process started with vLLM's own interpreter.

    Registered as backend `vllm`; `load()` returns a `VLLMEngine`. Runs proposers (evicted ones
    on a CPU, through `evict.py`) and the scorers that need prompt log-probabilities (`likelihood`)."""

    name = "vllm"
    evicts = True  # evicted proposers run through kvflow's hooks in the worker (evict.py)
    #: the tiny model kvflow's contract suites run it on (kvflow.testing.engine_parity.contract_arch):
    #: vLLM's CPU attention serves head_dim 32 and up, not the 16 of the default tiny Qwen2
    contract_arch = "qwen2-hd32"

    @staticmethod
    def check_evictor(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
        """None if an evicted proposer with these evictor params can run on this model entry,
        else (field, sentence): `params.<name>` of the evictor, or `engine.<name>` / `device` of the model."""
        from kvflow.backends.vllm.settings import check_evicting

        return check_evicting(model_cfg, params)

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
    def load(model_cfg):
        """The model's engine."""
        from kvflow.backends.vllm.loading import load_engine

        return load_engine(model_cfg)
