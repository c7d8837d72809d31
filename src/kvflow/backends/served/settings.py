"""What every served backend does with a model entry's settings, before its worker starts.

A model entry's `engine:` mapping is passed to the engine over kvflow's defaults for the
device; kvflow sets the model, tokenizer, dtype, revision and remote-code arguments from the
entry itself (`RESERVED` per backend: refused under `engine:`), and refuses the settings its
hooks cannot run under (`REFUSED` rule tables: (key, bad(value), why)). Each backend's own
`settings.py` holds its names, defaults and rules; this module the shared steps.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional

Rule = tuple[str, Callable[[Any], bool], str]  # (engine argument, bad(value), why)

#: kvflow's own engine settings for a worker on the CPU (`Backend.cpu_settings` returns them;
#: `openmp_env` turns them into the worker's environment and the worker drops them from its
#: engine's arguments). `openmp_spin`, where the worker is the run's only engine on the CPU: its
#: idle OpenMP threads wait actively for a while (`GOMP_SPINCOUNT=OPENMP_SPIN_COUNT`) before they
#: sleep, instead of sleeping at once (the workers' `OMP_WAIT_POLICY=PASSIVE`): a passive wait
#: costs ~0.1 ms to wake a thread for every parallel op, and a CPU forward and kvflow's
#: compactions run hundreds of them a step. `openmp_threads`, where engines share the CPU: the
#: worker's share of the cores (`OMP_NUM_THREADS`), so that concurrent engines do not
#: oversubscribe them. docs/benchmarks.md#openmp has both measured.
OPENMP_SPIN, OPENMP_THREADS = "openmp_spin", "openmp_threads"
#: spins before an idle OpenMP thread sleeps: ~0.45 ms of one core after an op (2-core Xeon)
OPENMP_SPIN_COUNT = "10000"


def engine_arguments(engine_kwargs: dict) -> dict:
    """The arguments the engine itself takes: all but kvflow's OpenMP settings (in the worker's
    environment instead). They alone decide whether a running worker can serve an entry: the
    OpenMP settings change how fast its threads wait, not what it computes (a run shares the
    worker a test session or an earlier run started)."""
    return {k: v for k, v in engine_kwargs.items() if k not in (OPENMP_SPIN, OPENMP_THREADS)}


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which a worker started from it inherits."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def openmp_settings(engines: int, *, share_threads: bool = True) -> dict:
    """`Backend.cpu_settings` of a worker: alone (`engines` <= 1) its threads wait actively a
    while; beside others, its share of the cores (`share_threads`: the engine honours
    OMP_NUM_THREADS)."""
    if engines <= 1:
        return {OPENMP_SPIN: True}
    return {OPENMP_THREADS: max(1, usable_cores() // engines)} if share_threads else {}


def openmp_env(env: dict, engine_kwargs: dict) -> None:
    """The worker's OpenMP environment for kvflow's settings (`OPENMP_SPIN`, `OPENMP_THREADS`);
    what `env` already sets wins. GOMP_SPINCOUNT overrides OMP_WAIT_POLICY's spin count (libgomp)."""
    if engine_kwargs.get(OPENMP_SPIN):
        env.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    if engine_kwargs.get(OPENMP_THREADS):
        env.setdefault("OMP_NUM_THREADS", str(int(engine_kwargs[OPENMP_THREADS])))


def reserved_problem(engine: dict, reserved: dict) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first key under `engine:` that kvflow sets itself, or None.
    `reserved` maps the engine's argument name to the model entry's key of the same meaning
    (None: kvflow's own), or to a pipeline field ("run.deterministic")."""
    for key in engine:
        if key in reserved:
            own = reserved[key]
            source = f" from `{own}`" if own and "." in own else f" from the model entry's `{own}`" if own else ""
            return (f"engine.{key}", f"`{key}` is set by kvflow{source}")
    return None


def refused(settings: dict, rules: Iterable[tuple[Rule, str]]) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first setting a rule refuses, or None. `rules`: (rule, what
    cannot run: "under kvflow", "an evicted proposer"); only the keys present are judged, so
    the same table judges what a user wrote and what the engine resolved for the device."""
    for (key, bad, why), what in rules:
        if key in settings and bad(settings[key]):
            return (f"engine.{key}", f"`{key}: {settings[key]}` cannot run {what}: {why}")
    return None


def model_problem(model_cfg, backend: str) -> Optional[str]:
    """Why a served backend cannot load this entry's weights, or None: they must be available
    here, and a transformers directory or catalog model (no engine here reads GGUF)."""
    from kvflow.models.loading import check_available, resolve_source

    why = check_available(model_cfg)
    if why:
        return why
    src = resolve_source(model_cfg.id, model_cfg.gguf_file)
    if src.kind == "gguf" or (src.kind == "dir" and src.gguf_file):
        return f"backend {backend!r} serves transformers directories and catalog models, not GGUF files"
    return None


def entry_kwargs(model_cfg, *, model: str, tokenizer: str, device: Optional[str] = None) -> dict:
    """The engine arguments kvflow takes from the entry itself (its directory must exist), under
    the engine's own names for the model and tokenizer paths (and the device, where it has one)."""
    from kvflow.models.loading import model_directory

    kwargs: dict[str, Any] = {model: str(model_directory(model_cfg)), "dtype": model_cfg.dtype,
                              "trust_remote_code": bool(model_cfg.trust_remote_code)}
    if device is not None:
        kwargs["device"] = device
    if model_cfg.tokenizer:
        kwargs[tokenizer] = str(model_directory(model_cfg, tokenizer=True))
    if model_cfg.revision:
        kwargs["revision"] = model_cfg.revision
    return kwargs
