"""SGLang engine arguments for a model entry, and the checks on them (nothing is loaded here:
starting the engine is `kvflow.backends.sglang.loading`'s).

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
from typing import Optional

from kvflow.backends.served.settings import entry_kwargs, model_problem, refused, reserved_problem

#: kvflow's own settings; the model entry's keys of the same meaning are used instead
RESERVED = {"model_path": "id", "tokenizer_path": "tokenizer", "dtype": "dtype", "device": "device",
            "trust_remote_code": "trust_remote_code", "revision": "revision", "skip_tokenizer_init": None}

#: defaults on every device: overlap scheduling off (kvflow's plugin hooks see the batch that
#: runs), tokens streamed as they come (kvflow's pruners stop candidates mid-step: SGLang's
#: default batches 16 notifications before its event loop sees them), an idle scheduler that
#: sleeps (it busy-polls otherwise: a whole core while the hf base decodes), quiet logs, and
#: the `pytorch` sampler: kvflow draws every candidate from a per-request seed, and SGLang's
#: own pick on CUDA (`flashinfer`) asserts that no seed is set whenever top-p, top-k or min-p
#: is active (sglang/srt/layers/sampler.py) -- the first sampled batch would kill the scheduler
COMMON = {"log_level": "error", "disable_overlap_schedule": True, "stream_interval": 1, "batch_notify_size": 1,
          "sleep_on_idle": True, "sampling_backend": "pytorch"}

#: defaults without a GPU: kvflow's CPU platform (pure-torch kernels), no CUDA graphs, and a
#: bounded token pool (SGLang would size it from the machine's whole memory): 16,384 tokens
#: (0.5-0.75 GB of KV for the catalog's models in float32; 65,536 made the SGLang quickstart's
#: two engines take 12 GB, and a CI machine running two test workers killed one). The pool is
#: `max_total_tokens` wherever the memory the machine can give holds it: kvflow's plugin sizes
#: a CPU pool so (`plugin._cpu_pool_budget`; SGLang's own profile counts the page cache as used
#: and refused an engine at fraction 0.8 on a busy CI machine), so the fraction plays no part
CPU = {"attention_backend": "torch_native", "disable_cuda_graph": True, "max_total_tokens": 16384,
       "mem_fraction_static": 0.8}

#: defaults of an engine that serves evicted proposers, on every device: decode graphs as SGLang
#: resolves them (`full` on CUDA), prefill without graphs. kvflow's decode hook is capturable
#: (`graph.decode_step`: fixed-shape ops over the whole batch on per-slot tables the host writes
#: between forwards); its extend hook is Python per row, and a prefill graph would capture it
#: (SGLang's breakable prefill graph runs attention eagerly only behind a layer flag). The
#: tripwire in `evict.py` (a per-row counter the captured ops advance, checked after every
#: forward) proves every token observed, replayed or not
EVICTING = {"cuda_graph_config": {"prefill": {"backend": "disabled"}}}

#: settings with which an entry sizes its token pool itself (`run.kv_memory` then sets nothing)
POOL_SETTINGS = ("max_total_tokens", "mem_fraction_static")

def check_installed() -> Optional[str]:
    if importlib.util.find_spec("sglang") is None:
        return ("SGLang is not installed in this environment: run `scripts/install.sh sglang` "
                "(the CPU recipe where there is no GPU; docs/backends.md)")
    version = _version()
    if version not in _supported():
        return (f"SGLang {version} is installed; kvflow's sglang backend is tested with "
                f"{', '.join(_supported())} only (install it with `scripts/install.sh sglang`)")
    return None


#: the SGLang versions kvflow's hooks were read from and tested with (`kvflow.backends.sglang.SUPPORTED_VERSIONS`)
SUPPORTED_VERSIONS = ("0.5.23",)


def _supported():
    return SUPPORTED_VERSIONS


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


@functools.lru_cache(maxsize=1)
def server_arg_names() -> frozenset[str]:
    import inspect

    from sglang.srt.server_args import ServerArgs  # a msgspec Struct: its constructor lists the fields

    return frozenset(inspect.signature(ServerArgs).parameters)


#: SGLang settings kvflow cannot run under, on any engine: (field, test of a bad value, why)
REFUSED = (
    ("sampling_backend", lambda v: v not in (None, "pytorch"),
     "kvflow samples every candidate from its own seed, and SGLang's other samplers refuse per-request seeds "
     "(flashinfer asserts `sampling_seed is None` with top-p/top-k/min-p); kvflow sets `pytorch`"),
    ("disable_overlap_schedule", lambda v: v is False,
     "kvflow's plugin reads each batch's results before the next batch is prepared; kvflow turns overlap off"),
)

#: attention backends whose KV pool kvflow's hooks read (one token per slot, keys and values per
#: layer) and that run through `AttentionBackend.forward` (where kvflow observes attention)
EVICTING_ATTENTION = ("torch_native", "triton", "flashinfer", "fa3")

_HYBRID = ("separate prefill and decode backends run through SGLang's HybridAttnBackend, whose forward calls the "
           "chosen child's AttentionBackend.forward (hooked); each child must be one kvflow reads: torch_native, "
           "triton, flashinfer or fa3")

#: ... and on an engine that serves evicted proposers (the hooks of `evict.py`). Decode graphs
#: are served (kvflow's decode hook is captured with them: `graph.py`); what is refused is
#: what its Python parts would not survive
REFUSED_EVICTING = (
    ("cuda_graph_config", lambda v: v is not None and graphs_on(v, "prefill"),
     "a prefill graph would capture kvflow's extend hook, which is Python per evicted row (query windows, H2O "
     "statistics, hole masks for the tokens an extend appends); kvflow sets the prefill phase to `disabled` "
     "(decode graphs are served)"),
    ("enable_torch_compile", lambda v: v is True,
     "torch.compile traces the forward with kvflow's extend hook (Python per row) in it; only the decode hook "
     "is written to be captured"),
    ("page_size", lambda v: v not in (None, 1),
     "a head keeps its own tokens in a request's slots: one token per page"),
    ("attention_backend", lambda v: v is not None and v not in EVICTING_ATTENTION,
     "kvflow's hooks read keys and values from SGLang's one-token-per-slot MHA pool and run inside "
     "`AttentionBackend.forward`; tested with torch_native, read for triton, flashinfer and fa3 "
     "(set one of those)"),
    ("prefill_attention_backend", lambda v: v is not None and v not in EVICTING_ATTENTION, _HYBRID),
    ("decode_attention_backend", lambda v: v is not None and v not in EVICTING_ATTENTION, _HYBRID),
    ("kv_cache_dtype", lambda v: v not in (None, "auto"),
     "a quantized KV pool (fp8, fp4) holds raw bytes and scales, which kvflow's compaction would read as values; "
     "use the model's dtype (`auto`)"),
    ("enable_mixed_chunk", lambda v: v is True, "evicted requests are extended and decoded in separate forwards"),
    ("speculative_algorithm", lambda v: v is not None, "speculative decoding writes draft tokens kvflow does not evict"),
    ("pp_size", lambda v: v not in (None, 1),
     "a pipeline-parallel rank holds some layers only, and kvflow compacts every layer of a request at once"),
    ("enable_dp_attention", lambda v: v is True,
     "attention data parallelism splits a batch's requests over ranks that do not hold their snapshots"),
)


def graphs_on(cuda_graph_config, phase: Optional[str] = None) -> bool:
    """Does SGLang's resolved `cuda_graph_config` ({phase: {"backend": ...}}) run a forward
    phase (any, or `phase`) as a graph? (`disable_cuda_graph` is only an input: SGLang also
    turns graphs off itself, e.g. for `torch_native`.) A config written by hand (not a mapping)
    counts as on. A phase (or backend) a user's config leaves out is not asked for: kvflow's
    defaults fill it in (`engine_kwargs` merges per phase), and what SGLang resolved is judged too."""
    if not isinstance(cuda_graph_config, dict):
        return True
    if phase is not None:
        p = cuda_graph_config.get(phase)
        return p is not None and (not isinstance(p, dict) or p.get("backend") not in (None, "disabled"))
    return any(isinstance(p, dict) and p.get("backend") not in (None, "disabled") for p in cuda_graph_config.values())


def refusal(settings: dict, evicting: bool) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first setting kvflow cannot run under, or None. `settings`
    is what a user wrote under `engine:` (only the keys present are judged) or what SGLang
    resolved for the device (`SGLangEngine.resolved`): one rule table for both."""
    rules = [(r, "under kvflow") for r in REFUSED]
    if evicting:
        rules += [(r, "an evicted proposer") for r in REFUSED_EVICTING]
    return refused(settings, rules)


def check_evicting(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
    if getattr(params, "quantize", None):
        return ("params.quantize", "backend 'sglang' does not store quantized KV (SGLang's pool has one "
                                   "precision per layer); use backend 'hf' for `quantize`")
    why = refusal(model_cfg.engine or {}, evicting=True)
    if why is None and evictor_cls is not None and str(model_cfg.device).startswith("cuda"):
        why = graph_problem(model_cfg.engine or {}, [evictor_cls(params)])
    if why is None:
        config = _local_config(model_cfg)
        if config is not None and kv_layout_problem(config):
            why = ("id", kv_layout_problem(config))
    return why


def graph_problem(engine: dict, evictors) -> Optional[tuple[str, str]]:
    """On a GPU with decode graphs on (SGLang's default there): an evictor that observes
    attention with its own observe() cannot run (the captured hook keeps H2O's statistic only)."""
    from kvflow.backends.sglang.in_worker.graph import observes_in_graph

    config = engine.get("cuda_graph_config")
    decode = config.get("decode") if isinstance(config, dict) else None
    if engine.get("disable_cuda_graph") is True or (isinstance(decode, dict) and decode.get("backend") == "disabled"):
        return None
    for ev in evictors:
        if ev.observes_attention and not observes_in_graph(ev):
            return ("engine.disable_cuda_graph",
                    f"evictor {type(ev).__name__} observes attention with its own observe(), and the decode graph "
                    "kvflow captures on a GPU keeps H2O's statistic only; set `disable_cuda_graph: true` under this "
                    "model's engine (kvflow then observes its rows eagerly)")
    return None


#: SGLang pools whose layout kvflow's hooks do not read (one token per slot, K and V per layer)
def kv_layout_problem(config: dict) -> Optional[str]:
    """Why an evicting engine cannot run on a model of this config.json, or None: multi-head
    latent attention (a compressed KV per token, no per-head keys) and hybrid sliding-window
    models (SGLang gives their window layers a pool of their own) hold no per-head keys in the
    pool kvflow compacts. A full-context engine runs them untouched."""
    text = {k: config.get(k) for k in ("model_type", "kv_lora_rank", "layer_types", "sliding_window_pattern",
                                       "use_sliding_window", "max_window_layers", "num_hidden_layers")}
    if text["kv_lora_rank"] or str(text["model_type"]).startswith(("deepseek_v2", "deepseek_v3", "kimi", "minicpm3")):
        return (f"model_type {text['model_type']!r} uses multi-head latent attention (kv_lora_rank): its KV pool has "
                "no per-head keys for kvflow's evictors; run its evicted proposers on backend 'hf', or this model "
                "full-context")
    layer_types = text["layer_types"] or []
    if any("sliding" in str(t) for t in layer_types) or text["sliding_window_pattern"] or (
            text["use_sliding_window"] and (text["max_window_layers"] or 0) < (text["num_hidden_layers"] or 0)):
        return (f"model_type {text['model_type']!r} mixes sliding-window and full-attention layers, which SGLang "
                "serves from separate pools kvflow's hooks do not read; run its evicted proposers on backend 'hf', "
                "or this model full-context")
    return None


def _local_config(model_cfg) -> Optional[dict]:
    """The model's config.json where it is a local directory (nothing fetched, nothing imported)."""
    try:
        path = Path(model_cfg.id) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError, TypeError):
        return None


def check_settings(model_cfg) -> Optional[tuple[str, str]]:
    import difflib

    from kvflow.backends.served.settings import OPENMP_SPIN, OPENMP_THREADS

    names = server_arg_names() | {OPENMP_SPIN, OPENMP_THREADS}  # kvflow's own (Backend.cpu_settings)
    why = reserved_problem(model_cfg.engine or {}, RESERVED)
    if why:
        return why
    for key in (model_cfg.engine or {}):
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; `python -m sglang.launch_server --help` lists them"
            return (f"engine.{key}", f"unknown SGLang server argument '{key}'{hint}")
    return refusal(model_cfg.engine or {}, evicting=False)


def check_model(model_cfg) -> Optional[str]:
    from kvflow.models.loading import resolve_source

    why = model_problem(model_cfg, "sglang")
    if why:
        return why
    src = resolve_source(model_cfg.id, model_cfg.gguf_file)
    if src.kind == "dir":
        config = Path(src.ref) / "config.json"
        try:
            arch = json.loads(config.read_text()).get("architectures")
        except (OSError, ValueError) as e:
            return f"{config}: {e}"
        if not arch:
            return f"{config} names no `architectures` (SGLang picks its model class from it)"
    return None


def engine_kwargs(model_cfg, evicting: bool = True) -> dict:
    """The `sglang.Engine` arguments of a model entry (its directory must exist): kvflow's
    defaults for the device (and, where the engine serves evicted proposers, for those), under
    the entry's own `engine:` settings."""
    from kvflow.models.loading import resolve_device

    device = resolve_device(model_cfg.device)
    kwargs = entry_kwargs(model_cfg, model="model_path", tokenizer="tokenizer_path",
                          device="cpu" if device == "cpu" else "cuda")
    kwargs.update(COMMON)
    if device == "cpu":
        kwargs.update(CPU)
    if evicting:
        kwargs.update(EVICTING)
    own = dict(model_cfg.engine or {})
    if evicting and isinstance(own.get("cuda_graph_config"), dict):  # per phase over kvflow's (prefill off)
        ours = EVICTING["cuda_graph_config"]
        own["cuda_graph_config"] = {phase: {**ours.get(phase, {}), **(own["cuda_graph_config"].get(phase) or {})}
                                    for phase in {*ours, *own["cuda_graph_config"]}}
    kwargs.update(own)
    return kwargs


#: the resolved settings `manifest.json` records per SGLang engine (all of them: `SGLangEngine.resolved`)
RECORDED = ("device", "dtype", "sampling_backend", "attention_backend", "prefill_attention_backend",
            "decode_attention_backend", "page_size", "kv_cache_dtype", "disable_cuda_graph", "cuda_graph_config",
            "enable_torch_compile", "disable_overlap_schedule", "disable_radix_cache", "tp_size", "dp_size", "pp_size",
            "load_balance_method",
            "base_gpu_id", "mem_fraction_static", "max_total_tokens", "context_length", "chunked_prefill_size",
            "max_running_requests", "enable_deterministic_inference", "speculative_algorithm")


def check_resolved(resolved: dict, evicting: bool) -> None:
    """Refuse what SGLang resolved for this device that kvflow cannot serve (it may differ from
    what the entry asked: SGLang picks `trtllm_mha` with `page_size` 64 on Blackwell, say)."""
    from kvflow.errors import EngineSettingError

    why = refusal(resolved, evicting)
    if why is not None:
        field, message = why
        key = field.removeprefix("engine.")
        raise EngineSettingError(field, f"SGLang resolved this for the device ({message})",
                                 f"set models.<entry>.engine.{key} to a value kvflow serves "
                                 f"(docs/backends.md, \"Running on GPUs\")")
