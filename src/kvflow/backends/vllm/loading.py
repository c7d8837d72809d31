"""Loading a `VLLMEngine` for a model entry: its arguments (`settings.py`), vLLM's interpreter,
one shared worker per set of arguments, and the tokenizer, EOS ids and KV shape kvflow's side needs."""

from __future__ import annotations


def load_engine(model_cfg):
    """The engine of a model entry; entries with the same engine arguments share one (one vLLM
    worker, one set of weights)."""
    from transformers import AutoConfig, AutoTokenizer

    from kvflow.backends.vllm.client import EngineError, shared
    from kvflow.backends.vllm.engine import VLLMEngine
    from kvflow.backends.vllm.settings import check_installed, engine_kwargs, vllm_python, worker_env
    from kvflow.models.loading import eos_token_ids, resolve_device

    where = f"models entry {model_cfg.id!r} (backend vllm)"
    why = check_installed()
    if why:
        raise EngineError(f"{where}: {why}")
    kwargs = engine_kwargs(model_cfg)
    worker = shared(vllm_python(), kwargs, worker_env(kwargs), where)
    engine = worker.engine
    if engine is None:
        remote = kwargs["trust_remote_code"]
        config = AutoConfig.from_pretrained(kwargs["model"], trust_remote_code=remote)
        tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer", kwargs["model"]), trust_remote_code=remote)
        engine = VLLMEngine(worker, tokenizer, vocab_size=config.vocab_size, kv_shape=_kv_shape(config, model_cfg),
                            eos_ids=eos_token_ids(_generation_config(kwargs["model"]), config, tokenizer),
                            device=resolve_device(model_cfg.device))
        worker.engine = engine
    engine.reset()
    worker.holders += 1  # until this holder's `engine.close()`
    return engine


def _kv_shape(config, model_cfg) -> tuple[int, int, int, int]:
    from kvflow.cost import shape_from_config

    shape = shape_from_config(config.to_dict(), model_cfg.id)
    return (shape.n_layers, shape.n_kv_heads, shape.head_dim, 4 if model_cfg.dtype == "float32" else 2)


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
