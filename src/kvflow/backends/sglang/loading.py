"""Loading an `SGLangEngine` for a model entry: its arguments (`settings.py`), its decode
profile (from the evictors the pipeline serves on it: `in_worker/graph.Profile`), the refusals
that need the model's config (checked before the worker starts: no weight loaded), one shared
worker per (arguments, profile), and what SGLang resolved for the device, checked once it started."""

from __future__ import annotations

import os
import sys
from typing import Optional

from kvflow.backends.sglang.settings import check_resolved, engine_kwargs, graph_problem, kv_layout_problem

_START_TIMEOUT_S = 600
WORKER_MODULE = "kvflow.backends.sglang.in_worker.worker"


def load_engine(model_cfg, evicting: bool = True, evictors=None):
    """The engine of a model entry; entries with the same engine arguments and decode profile
    share one (one SGLang worker, one set of weights). `evicting`: whether evicted proposers run
    on it (their defaults apply and their refusals are checked against what SGLang resolved);
    True unless the caller knows otherwise. `evictors`: the (class, params) of every evictor the
    pipeline serves on it (kvflow's compiler passes them), from which its decode hook is built
    (`graph.Profile`); None: every part of the hook (tests, benches)."""
    from kvflow.backends.served.loading import model_facts, read_config
    from kvflow.backends.served.worker import hold
    from kvflow.backends.sglang.engine import SGLangEngine
    from kvflow.backends.sglang.in_worker.graph import Profile
    from kvflow.errors import EngineSettingError
    from kvflow.models.shapes import kv_shape as kv_shape_of

    kwargs = engine_kwargs(model_cfg, evicting)
    config = read_config(kwargs["model_path"], kwargs["trust_remote_code"])
    kv_shape = kv_shape_of(config.to_dict(), model_cfg)
    tp_size = int(kwargs.get("tp_size") or 1)
    profile = decode_profile(evictors, kv_shape, tp_size) if evicting else None
    # refused before the worker starts (no weight loaded): what the hooks cannot read or run
    if evicting and kv_layout_problem(config.to_dict()):
        raise EngineSettingError("id", kv_layout_problem(config.to_dict()), "see docs/backends.md, \"Running on GPUs\"")
    if evicting and evictors and kwargs["device"] == "cuda":
        why = graph_problem(kwargs, [cls(params) for cls, params in evictors])
        if why:
            raise EngineSettingError(why[0], why[1], "set it under the model's engine: mapping")
    worker = shared_worker(kwargs, f"models entry {model_cfg.id!r} (backend sglang)",
                           profile.to_json() if profile is not None else None)
    check_resolved(worker.info.get("settings") or {}, evicting)

    def build() -> SGLangEngine:
        facts = model_facts(model_cfg, kwargs["model_path"], kwargs.get("tokenizer_path"), kwargs["trust_remote_code"],
                            config)
        engine = SGLangEngine(worker, facts.tokenizer, vocab_size=facts.vocab_size, kv_shape=facts.kv_shape,
                              eos_ids=facts.eos_ids, device=kwargs["device"])
        evict = worker.hello.get("evict")
        engine.profile = Profile.from_json(evict) if evict else None  # the worker's (it may cover more)
        engine.profile_shape = (kv_shape[0], max(1, kv_shape[1] // tp_size))
        return engine

    return hold(worker, build)


def shared_worker(engine_kwargs: dict, where: str, evict: Optional[str] = None):
    """The running SGLang worker for these engine arguments and decode profile (`evict`: a
    `graph.Profile` as JSON for an engine that serves evicted proposers, None for one that does
    not: no kvflow hook then), started on first use. A running worker with the same arguments
    (kvflow's OpenMP settings aside: `served.settings.engine_arguments`) whose profile covers
    the one asked for (`graph.Profile.covers`) serves too: a sweep, or a test session, starts
    one engine, not one per budget or evictor; a full-context engine only ever shares a worker
    without kvflow's hooks."""
    from kvflow.backends.served.settings import openmp_env, engine_arguments
    from kvflow.backends.served.worker import Worker, shared
    from kvflow.backends.sglang.in_worker.graph import Profile

    args = ("sglang", *sorted((k, repr(v)) for k, v in engine_arguments(engine_kwargs).items()))
    key = (*args, ("kvflow_evict", evict))

    def covers(theirs: tuple, _worker) -> bool:
        profile = theirs[-1][1] if theirs[:-1] == args else None
        return evict is not None and profile is not None and Profile.from_json(profile).covers(Profile.from_json(evict))

    def start() -> Worker:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # SGLang's torch threads must not spin between ops while an `hf` engine in this
        # process decodes on the same cores
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        openmp_env(env, engine_kwargs)  # alone on the CPU: a short active wait first (Backend.cpu_settings)
        binding = cpu_binding(engine_kwargs)
        if binding and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = binding
        return Worker.start([sys.executable, "-m", WORKER_MODULE], env, {"engine": engine_kwargs, "evict": evict},
                            where=where, engine_name="SGLang", timeout=_START_TIMEOUT_S)

    return shared(key, start, covers)


def cpu_binding(engine_kwargs: dict) -> Optional[str]:
    """Cores per rank for SGLang's CPU path with several ranks (`SGLANG_CPU_OMP_THREADS_BIND`):
    this process's cores in equal contiguous groups ("0|1" for tp_size 2 on two cores).
    SGLang's own default binds a rank per NUMA node and refuses more ranks than nodes."""
    ranks = 1
    for key in ("tp_size", "dp_size", "pp_size"):
        ranks *= int(engine_kwargs.get(key) or 1)
    if engine_kwargs.get("device") != "cpu" or ranks < 2:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return None  # SGLang's message says what to set
    per = len(cores) // ranks
    groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def decode_profile(evictors, kv_shape: tuple[int, int, int, int], tp_size: int = 1):
    """The `graph.Profile` that serves these (evictor class, params) pairs on a model of
    kv_shape (layers, kv_heads, head_dim, bytes per element); None: the general one. A
    `budget_bytes` is turned into its budget here as the compiler will; an evictor whose
    parameters do not work for the model is left out (the compiler refuses it, naming the field)."""
    from kvflow.backends.sglang.in_worker.graph import Profile
    from kvflow.kv_memory import resolve_evictor

    if evictors is None:
        return Profile.general()
    layers, kv_heads = kv_shape[0], max(1, kv_shape[1] // tp_size)
    instances = []
    for cls, params in evictors:
        try:
            instances.append(resolve_evictor(cls, params, *kv_shape)[1])
        except ValueError:
            continue
    return Profile.of(instances, layers, kv_heads)
