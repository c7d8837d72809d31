"""Loading an `SGLangEngine` for a model entry: its arguments (`settings.py`), its decode
profile (from the evictors the pipeline serves on it: `graph.Profile`), the refusals that need
the model's config (checked before the worker starts: no weight loaded), one shared worker per
(arguments, profile), and what SGLang resolved for the device, checked once it started."""

from __future__ import annotations


from kvflow.backends.sglang.settings import check_resolved, engine_kwargs, graph_problem, kv_layout_problem


def load_engine(model_cfg, evicting: bool = True, evictors=None):
    """The engine of a model entry; entries with the same engine arguments and decode profile
    share one (one SGLang worker, one set of weights). `evicting`: whether evicted proposers run
    on it (their defaults apply and their refusals are checked against what SGLang resolved);
    True unless the caller knows otherwise. `evictors`: the (class, params) of every evictor the
    pipeline serves on it (kvflow's compiler passes them), from which its decode hook is built
    (`graph.Profile`); None: every part of the hook (tests, benches)."""
    from transformers import AutoConfig

    from kvflow.backends.sglang.client import shared
    from kvflow.backends.sglang.graph import Profile
    from kvflow.backends.sglang.engine import SGLangEngine
    from kvflow.models.loading import eos_token_ids

    from kvflow.errors import EngineSettingError

    kwargs = engine_kwargs(model_cfg, evicting)
    config = AutoConfig.from_pretrained(kwargs["model_path"], trust_remote_code=kwargs["trust_remote_code"])
    kv_shape = _kv_shape(config, model_cfg)
    profile = decode_profile(evictors, kv_shape, int(kwargs.get("tp_size") or 1)) if evicting else None
    # refused before the worker starts (no weight loaded): what the hooks cannot read or run
    if evicting and kv_layout_problem(config.to_dict()):
        raise EngineSettingError("id", kv_layout_problem(config.to_dict()), "see docs/backends.md, \"Running on GPUs\"")
    if evicting and evictors and kwargs["device"] == "cuda":
        why = graph_problem(kwargs, [cls(params) for cls, params in evictors])
        if why:
            raise EngineSettingError(why[0], why[1], "set it under the model's engine: mapping")
    worker = shared(kwargs, f"models entry {model_cfg.id!r} (backend sglang)",
                    profile.to_json() if profile is not None else None)
    check_resolved(worker.info.get("server_args") or {}, evicting)
    engine = worker.engine
    if engine is None:
        from transformers import AutoTokenizer

        path = kwargs.get("tokenizer_path", kwargs["model_path"])
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=kwargs["trust_remote_code"])
        engine = SGLangEngine(worker, tokenizer, vocab_size=config.vocab_size, kv_shape=kv_shape,
                              eos_ids=eos_token_ids(_generation_config(kwargs["model_path"]), config, tokenizer),
                              device=kwargs["device"])
        engine.resolved = dict(worker.info.get("server_args") or {})
        engine.profile = Profile.from_json(worker.evict) if worker.evict else None  # the worker's (it may cover more)
        engine.profile_shape = (kv_shape[0], max(1, kv_shape[1] // int(kwargs.get("tp_size") or 1)))
        worker.engine = engine
    engine.reset()
    worker.holders += 1  # until this holder's `engine.close()`
    return engine


def decode_profile(evictors, kv_shape: tuple[int, int, int, int], tp_size: int = 1):
    """The `graph.Profile` that serves these (evictor class, params) pairs on a model of
    kv_shape (layers, kv_heads, head_dim, bytes per element); None: the general one. A
    `budget_bytes` is turned into its budget here as the compiler will; an evictor whose
    parameters do not work for the model is left out (the compiler refuses it, naming the field)."""
    from kvflow.backends.sglang.graph import Profile
    from kvflow.kv_memory import budget_for_bytes

    if evictors is None:
        return Profile.general()
    layers, kv_heads = kv_shape[0], max(1, kv_shape[1] // tp_size)
    instances = []
    for cls, params in evictors:
        try:
            if getattr(params, "budget_bytes", None) is not None:
                params = params.with_budget(budget_for_bytes(params, *kv_shape, evictor_cls=cls))
            ev = cls(params)
            if getattr(ev, "bounded", True):
                ev.allocation(layers)
            instances.append(ev)
        except ValueError:
            continue
    return Profile.of(instances, layers, kv_heads)


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
