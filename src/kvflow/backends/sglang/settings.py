"""SGLang engine arguments for a model entry, and loading an `SGLangEngine`.

A model entry's `engine:` mapping is passed to `sglang.Engine` as server arguments (tensor
and data parallel sizes, memory fraction, attention backend, context length, ...), over
kvflow's defaults for the device; names are checked against SGLang's own `ServerArgs`
fields, with "did you mean". kvflow sets the model, tokenizer, dtype, device and
remote-code arguments from the entry itself, so those are refused under `engine:`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

#: kvflow's own settings; the model entry's keys of the same meaning are used instead
RESERVED = {"model_path": "id", "tokenizer_path": "tokenizer", "dtype": "dtype", "device": "device",
            "trust_remote_code": "trust_remote_code", "revision": "revision", "skip_tokenizer_init": None}

#: defaults on every device: overlap scheduling off (kvflow's plugin hooks see the batch that
#: runs), tokens streamed as they come (kvflow's pruners stop candidates mid-step: SGLang's
#: default batches 16 notifications before its event loop sees them), an idle scheduler that
#: sleeps (it busy-polls otherwise: a whole core while the hf base decodes), quiet logs
COMMON = {"log_level": "error", "disable_overlap_schedule": True, "stream_interval": 1, "batch_notify_size": 1,
          "sleep_on_idle": True}

#: defaults without a GPU: kvflow's CPU platform (pure-torch kernels), no CUDA graphs, and a
#: bounded token pool (SGLang would size it from the machine's whole memory)
CPU = {"attention_backend": "torch_native", "sampling_backend": "pytorch", "disable_cuda_graph": True,
       "max_total_tokens": 65536, "mem_fraction_static": 0.3}


def check_installed() -> Optional[str]:
    if importlib.util.find_spec("sglang") is None:
        return ("SGLang is not installed in this environment: run `scripts/install.sh sglang` "
                "(the CPU recipe where there is no GPU; docs/backends.md)")
    version = _version()
    if version not in _supported():
        return (f"SGLang {version} is installed; kvflow's sglang backend is tested with "
                f"{', '.join(_supported())} only (install it with `scripts/install.sh sglang`)")
    return None


def _supported():
    from kvflow.backends.sglang import SUPPORTED_VERSIONS

    return SUPPORTED_VERSIONS


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


@functools.lru_cache(maxsize=1)
def server_arg_names() -> frozenset[str]:
    import inspect

    from sglang.srt.server_args import ServerArgs  # a msgspec Struct: its constructor lists the fields

    return frozenset(inspect.signature(ServerArgs).parameters)


#: engine settings an evicted request cannot run under: (value that breaks it, why)
EVICTING_REFUSES = {
    "disable_overlap_schedule": (False, "kvflow's plugin compacts the batch that just ran; with overlap "
                                        "scheduling the next one is already prepared"),
    "page_size": (lambda v: v not in (None, 1), "a head keeps its own tokens in a request's slots: one token per page"),
    "enable_mixed_chunk": (True, "evicted requests are extended and decoded in separate forwards"),
    "speculative_algorithm": (lambda v: v is not None, "speculative decoding writes draft tokens kvflow does not evict"),
}


def check_evicting(model_cfg, params) -> Optional[tuple[str, str]]:
    if getattr(params, "quantize", None):
        return ("params.quantize", "backend 'sglang' does not store quantized KV (SGLang's pool has one "
                                   "precision per layer); use backend 'hf' for `quantize`")
    for key, (bad, why) in EVICTING_REFUSES.items():
        if key in (model_cfg.engine or {}):
            value = model_cfg.engine[key]
            if (bad(value) if callable(bad) else value == bad):
                return (f"engine.{key}", f"`{key}: {value}` cannot run an evicted proposer: {why}")
    return None


def check_settings(model_cfg) -> Optional[tuple[str, str]]:
    import difflib

    names = server_arg_names()
    for key in (model_cfg.engine or {}):
        if key in RESERVED:
            own = RESERVED[key]
            return (f"engine.{key}", f"`{key}` is set by kvflow" + (f" from the model entry's `{own}`" if own else ""))
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; `python -m sglang.launch_server --help` lists them"
            return (f"engine.{key}", f"unknown SGLang server argument '{key}'{hint}")
    return None


def check_model(model_cfg) -> Optional[str]:
    from kvflow.models.loading import check_available, resolve_source

    why = check_available(model_cfg)
    if why:
        return why
    src = resolve_source(model_cfg.id, model_cfg.gguf_file)
    if src.kind == "gguf" or (src.kind == "dir" and src.gguf_file):
        return "backend 'sglang' serves transformers directories and catalog models, not GGUF files"
    if src.kind == "dir":
        config = Path(src.ref) / "config.json"
        try:
            arch = json.loads(config.read_text()).get("architectures")
        except (OSError, ValueError) as e:
            return f"{config}: {e}"
        if not arch:
            return f"{config} names no `architectures` (SGLang picks its model class from it)"
    return None


def engine_kwargs(model_cfg) -> dict:
    """The `sglang.Engine` arguments of a model entry (its directory must exist)."""
    from kvflow.models.loading import model_directory, resolve_device

    device = resolve_device(model_cfg.device)
    kwargs: dict[str, Any] = {"model_path": str(model_directory(model_cfg)), "dtype": model_cfg.dtype,
                              "device": "cpu" if device == "cpu" else "cuda",
                              "trust_remote_code": bool(model_cfg.trust_remote_code)}
    if model_cfg.tokenizer:
        kwargs["tokenizer_path"] = str(model_directory(model_cfg, tokenizer=True))
    if model_cfg.revision:
        kwargs["revision"] = model_cfg.revision
    kwargs.update(COMMON)
    if device == "cpu":
        kwargs.update(CPU)
    kwargs.update(model_cfg.engine or {})
    return kwargs


_ENGINES: dict[tuple, Any] = {}


def load_engine(model_cfg):
    """The engine of a model entry; entries with the same engine arguments share one (one
    SGLang worker, one set of weights)."""
    from kvflow.backends.sglang.client import shared
    from kvflow.backends.sglang.engine import SGLangEngine
    from kvflow.models.loading import eos_token_ids

    kwargs = engine_kwargs(model_cfg)
    worker = shared(kwargs, f"models entry {model_cfg.id!r} (backend sglang)")
    engine = _ENGINES.get(id(worker))
    if engine is None or engine.worker is not worker:
        from transformers import AutoConfig, AutoTokenizer

        path = kwargs.get("tokenizer_path", kwargs["model_path"])
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=kwargs["trust_remote_code"])
        config = AutoConfig.from_pretrained(kwargs["model_path"], trust_remote_code=kwargs["trust_remote_code"])
        engine = SGLangEngine(worker, tokenizer, vocab_size=config.vocab_size, kv_shape=_kv_shape(config, model_cfg),
                              eos_ids=eos_token_ids(_generation_config(kwargs["model_path"]), config, tokenizer),
                              device=kwargs["device"])
        _ENGINES[id(worker)] = engine
    engine.reset()
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
