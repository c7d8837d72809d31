"""Compile a validated pipeline into an executable `Plan` (DESIGN.md §3).

`check_models()` runs first and loads nothing: every model the pipeline uses must be
obtainable on this machine (a catalog checkpoint, a local file or directory, a hub id in
the local cache or with a reachable hub), otherwise the run fails before any weights load.
`build_plan()` then loads each distinct checkpoint once and instantiates the components.
"""

from __future__ import annotations


from typing import Callable

from kvflow.config.validate import LoadedPipeline
from kvflow.errors import EngineSettingError, UserError
from kvflow.backends.base import backend_named
from kvflow.runtime.kv_budget import (check_allocation, kv_memory_engines, kv_memory_facts, resolve_budget_bytes,
                                     resolve_kv_memory)

def cpu_hint() -> str:
    """What to run instead on a machine without a pipeline's models: the shipped quickstart,
    named by a path that works from the current directory (relative when it is below it,
    else absolute), or only `kvflow ls pipelines` where no shipped pipelines are found."""
    import os
    from pathlib import Path

    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):  # ./pipelines, then a source checkout's
        quickstart = root / "pipelines" / "quickstart.yaml"
        if quickstart.is_file():
            rel = os.path.relpath(quickstart)
            shown = rel if not rel.startswith("..") else str(quickstart)
            return (f"on a machine without these models, run a CPU pipeline instead: `kvflow run {shown}` "
                    f"or one under {Path(shown).parent / 'cpu'}/ (see `kvflow ls pipelines`)")
    return "on a machine without these models, run a CPU pipeline instead (see `kvflow ls pipelines`)"


def used_models(loaded: LoadedPipeline) -> list[str]:
    pipe = loaded.pipeline
    keys = [p.model for p in pipe.proposers.values()]
    scorer = loaded.components.scorer
    keys += scorer.cls.models_needed(scorer.params)
    return list(dict.fromkeys(keys))


def check_models(loaded: LoadedPipeline, registry=None) -> None:
    """Every used model is obtainable, as its backend says (`Backend.check(model_cfg)`: None
    or why not), before anything loads."""
    from kvflow.registry import get_registry

    registry = registry or get_registry()
    problems = []
    for key in used_models(loaded):
        cfg = loaded.pipeline.models[key]
        why = backend_named(cfg.backend, registry).check(cfg)
        if isinstance(why, tuple):  # (field under the entry, sentence): a setting, not availability
            problems.append(loaded.problem(f"models.{key}.{why[0]}", why[1]))
        elif why:
            problems.append(loaded.problem(f"models.{key}.id", f"model {cfg.id!r} is not available: {why}", cpu_hint()))
    problems += engine_use_problems(loaded, registry)
    problems += deterministic_problems(loaded, registry)
    if problems:
        raise UserError(problems)


def check_engine_use(loaded: LoadedPipeline, registry=None) -> None:
    """What each engine is asked to run, checked from the pipeline alone (no model, no engine
    installed needed; `kvflow validate` runs it): a scorer on a backend it cannot use, an
    evictor on a backend that does not evict, or that the backend cannot run as configured."""
    problems = engine_use_problems(loaded, registry)
    if problems:
        raise UserError(problems)


def engine_use_problems(loaded: LoadedPipeline, registry=None) -> list:
    from kvflow.registry import get_registry

    registry = registry or get_registry()
    problems = []
    scorer = loaded.components.scorer
    allowed = getattr(scorer.cls, "backends", None)  # a scorer that runs its model its own way
    for key in scorer.cls.models_needed(scorer.params):
        backend = loaded.pipeline.models[key].backend
        if allowed is not None and backend not in allowed:
            problems.append(loaded.problem(
                f"models.{key}.backend", f"scorer '{loaded.pipeline.scorer.kind}' runs its model on backend "
                f"{' or '.join(repr(b) for b in allowed)} only, not '{backend}'",
                f"set models.{key}.backend: {allowed[0]} (or score with `likelihood`, which runs on any engine)"))
        elif hasattr(scorer.cls, "check_backend"):  # a parameter the scorer cannot honour on this backend
            why = scorer.cls.check_backend(scorer.params, backend)
            if why:
                problems.append(loaded.problem(f"scorer.{why[0]}", why[1], why[2]))
    for name, prop in loaded.pipeline.proposers.items():
        if prop.evictor.kind == "none":
            continue
        backend = loaded.pipeline.models[prop.model].backend
        loader = backend_named(backend, registry)
        if not loader.evicts:
            problems.append(loaded.problem(
                f"proposers.{name}.evictor", f"backend '{backend}' (models.{prop.model}.backend) runs full-context "
                f"proposers only, not evictor '{prop.evictor.kind}'", "put this proposer's model on backend 'hf'"))
        else:  # what a backend cannot do with an evictor, said before loading
            spec = loaded.components.proposers[name].evictor
            why = loader.check_evictor(loaded.pipeline.models[prop.model], spec.params, evictor_cls=spec.cls)
            if why:  # ("params.<name>", ...) is the evictor's parameter, anything else the model entry's
                field, message = why
                param = field.removeprefix("params.")
                where = f"proposers.{name}.evictor.{param}" if param != field else f"models.{prop.model}.{field}"
                problems.append(loaded.problem(where, message))
    return problems


def place_models(loaded: LoadedPipeline, gpus=None):
    """(loaded with each used model entry's GPU set, the Placement or None): `device: auto`
    entries get GPUs by kvflow's placement rule (kvflow.planning.placement), and models that do not fit
    are refused (UserError naming the field) before anything loads. `gpus`: [(index, total
    bytes)], None for this machine's CUDA GPUs; without GPUs nothing changes (auto is the CPU).
    `loaded.resolved` (and so the run's config hash) is left as written."""
    import dataclasses

    from kvflow.planning.placement import cuda_devices, place_pipeline

    gpus = cuda_devices() if gpus is None else gpus
    if not gpus:
        return loaded, None
    placement = place_pipeline(loaded, gpus, used_models(loaded))
    pipeline = loaded.pipeline.model_copy(update={"models": placement.placed_models(loaded.pipeline.models)})
    return dataclasses.replace(loaded, pipeline=pipeline), placement


def build_plan(loaded: LoadedPipeline, registry, on_load: Callable[[str], None] = lambda key: None, gpus=None):
    """Place the models on this machine's GPUs (`place_models`; `gpus` stands in for them in
    tests), load every distinct model once, as an engine of its backend, and instantiate the
    components. Returns (plan, engines by model key)."""
    from kvflow.components.engine import check_protocol

    loaded, placement = place_models(loaded, gpus)  # before any engine starts: refuses what cannot fit
    loaded = deterministic_engines(loaded)
    loaded = scorer_engines(loaded)
    loaded = kv_memory_engines(loaded)
    loaded = cpu_engines(loaded)
    pipe = loaded.pipeline
    engines: dict[str, object] = {}
    evicting = {p.model for p in pipe.proposers.values() if p.evictor.kind != "none"}
    served: dict[str, list] = {}  # model key -> (evictor class, params) of the proposers it serves
    for name, p in pipe.proposers.items():
        if p.evictor.kind != "none":
            spec = loaded.components.proposers[name].evictor
            served.setdefault(p.model, []).append((spec.cls, spec.params))
    # Model entries with equal settings (the quickstart's evicted base and full-context helper)
    # load as one model: a backend that shares engines between equal loads (SGLang's workers)
    # then starts one engine, with one copy of the weights, and batches both proposers'
    # requests together; an engine that serves evicted proposers serves full-context ones too
    own = dict(served)  # each entry's own evictors, before its twins' are added
    for key in pipe.models:
        twins = [other for other in pipe.models if pipe.models[other] == pipe.models[key]]
        if evicting & set(twins):
            evicting.add(key)
            served[key] = [pair for twin in twins for pair in own.get(twin, [])]

    def engine_for(key: str):
        if key not in engines:
            on_load(key)
            backend = backend_named(pipe.models[key].backend, registry)
            try:
                engines[key] = backend.load(pipe.models[key], evicting=key in evicting,
                                            evictors=list(served.get(key, [])))
            except EngineSettingError as e:  # what the engine resolved on this machine, located in the pipeline
                raise UserError(loaded.problem(f"models.{key}.{e.field}", e.message, e.hint)) from None
            except (UserError, KeyboardInterrupt, MemoryError):
                raise
            except Exception as e:  # what the checks could not see: the loader's own words, located
                raise UserError(loaded.problem(f"models.{key}.id", f"model {pipe.models[key].id!r} could not be "
                                               f"loaded: {type(e).__name__}: {e}",
                                               "check the checkpoint's files (config.json, weights, tokenizer)")) from e
            try:  # an engine of an older protocol runs, deprecated (a FutureWarning); an unknown one is refused
                check_protocol(engines[key])
            except ValueError as e:
                raise UserError(loaded.problem(f"models.{key}.backend", str(e))) from None
        return engines[key]

    try:
        return _plan(loaded, pipe, placement, engines, engine_for)
    except BaseException:
        close_engines(engines)  # a refusal after some engines loaded leaves none held
        raise


def refuse_unfilled_trace_fields(loaded: LoadedPipeline, proposer: str, pruners, engine) -> None:
    """A pruner that reads `StepTrace` fields its proposer's engine does not fill (an engine of
    an older protocol: `Pruner.trace_fields`) is refused, naming it, before anything decodes."""
    from kvflow.components.engine import protocol_problem

    problems = []
    for i, pruner in enumerate(pruners):
        why = protocol_problem(engine, pruner.cls)
        if why:
            problems.append(loaded.problem(
                f"proposers.{proposer}.pruners[{i}]", f"pruner '{pruner.name}' {why}",
                "run this proposer on an engine of that protocol (hf and sglang are), or drop the pruner"))
    if problems:
        raise UserError(problems)


def close_engines(engines: dict) -> None:
    """Each model key's engine closed once (`Engine.close`, optional: the holder is done with
    it), so that a backend sharing engines between holders (SGLang's workers) may free them."""
    for engine in engines.values():
        engine.close()


def _plan(loaded, pipe, placement, engines, engine_for):
    """The proposers, scorer and committer of `build_plan` over its engines."""
    from kvflow.components.base import ScorerContext
    from kvflow.components.engine import SamplingSpec
    from kvflow.runtime.plan import Plan, Proposer

    proposers = []
    for name, cfg in pipe.proposers.items():
        comps = loaded.components.proposers[name]
        spec = SamplingSpec(
            n=cfg.n, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
            max_step_tokens=cfg.sampling.max_step_tokens, delimiter=pipe.run.delimiter,
            pruners=tuple((p.name, p.cls(p.params)) for p in comps.pruners),
            record_signals=pipe.run.record_signals,
        )
        engine = engine_for(cfg.model)
        refuse_unfilled_trace_fields(loaded, name, comps.pruners, engine)
        evictor_params = resolve_budget_bytes(loaded, name, comps.evictor.params, engine.kv_shape())
        evictor_params = resolve_rope_theta(loaded, name, evictor_params, pipe.models[cfg.model].id)
        evictor = comps.evictor.cls(evictor_params)
        check_allocation(loaded, name, evictor, engine.kv_shape()[0])
        proposers.append(Proposer(name, engine, evictor, spec))
    context = ScorerContext(
        load_session=lambda key: engine_for(key).scoring_session(),
        proposers=list(pipe.proposers), seed=pipe.run.seed, delimiter=pipe.run.delimiter, models=dict(pipe.models),
    )
    scorer = loaded.components.scorer.cls(loaded.components.scorer.params, context)
    committer = loaded.components.committer.cls(loaded.components.committer.params, list(pipe.proposers))
    kv_budget = resolve_kv_memory(loaded, proposers)
    written = pipe.run.model_fields_set  # with run.kv_memory, the count bounds apply only where the pipeline sets them
    batch_problems = pipe.run.batch_problems if kv_budget is None or "batch_problems" in written else None
    plan = Plan(proposers, scorer, committer, pipe.limits, pipe.run.seed, batch_problems=batch_problems,
                live_problems=pipe.run.live_problems, record_candidates=pipe.run.record_candidates,
                overlap=pipe.run.overlap_engines,
                placement=placement, kv_budget=kv_budget)
    return plan, engines


def engine_facts(plan, engines: dict) -> dict:
    """What `manifest.json` records of a run's loaded engines: the base's device, each
    proposer's KV memory, each model's backend and resolved settings, the GPU placement."""
    return {"device": plan.proposers[0].engine.device, "kv_memory": kv_memory_facts(plan),
            "engines": {k: e.backend for k, e in engines.items()},
            "engine_settings": {k: e.settings() for k, e in engines.items()},
            "placement": plan.placement.to_dict() if plan.placement else None}


def deterministic_engines(loaded: LoadedPipeline, registry=None) -> LoadedPipeline:
    """With `run.deterministic`, each used model's entry gets the engine settings its backend
    names for batch-invariant decoding (`Backend.batch_invariant(model_cfg)`; `check_models`
    refused the entries it cannot serve so)."""
    import dataclasses

    from kvflow.registry import get_registry

    pipe = loaded.pipeline
    if not pipe.run.deterministic:
        return loaded
    registry = registry or get_registry()
    models = dict(pipe.models)
    for key in used_models(loaded):
        settings, _ = batch_invariant(registry, models[key])
        if settings:
            models[key] = models[key].model_copy(update={"engine": {**(models[key].engine or {}), **settings}})
    return dataclasses.replace(loaded, pipeline=pipe.model_copy(update={"models": models}))


def cpu_engines(loaded: LoadedPipeline, registry=None) -> LoadedPipeline:
    """Each used model's entry on the CPU gets the settings its backend names for computing
    there with the run's other engines (`Backend.cpu_settings(model_cfg, engines)`: how many
    compute on the CPU; entries with equal settings load as one engine), under the entry's own
    `engine:` settings. Not under `executor: ray`, whose workers are given CPUs by Ray."""
    import dataclasses

    from kvflow.models.loading import resolve_device
    from kvflow.registry import get_registry

    pipe = loaded.pipeline
    if pipe.run.executor == "ray":
        return loaded
    models = dict(pipe.models)
    on_cpu = [key for key in used_models(loaded) if resolve_device(models[key].device) == "cpu"]
    engines = []  # one per set of equal entries (build_plan loads twins as one model)
    for key in on_cpu:
        if not any(models[key] == other for other in engines):
            engines.append(models[key])
    registry = registry or get_registry()
    for key in on_cpu:
        extra = backend_named(models[key].backend, registry).cpu_settings(models[key], len(engines))
        if extra:
            models[key] = models[key].model_copy(update={"engine": {**extra, **(models[key].engine or {})}})
    return dataclasses.replace(loaded, pipeline=pipe.model_copy(update={"models": models}))


def scorer_engines(loaded: LoadedPipeline) -> LoadedPipeline:
    """The scorer's models with the engine settings the scorer needs on their backend
    (`Scorer.engine_settings(params, backend)`, e.g. SGLang's `enable_return_hidden_states` for
    a PRM), under the entry's own `engine:` settings; the entry's own value wins."""
    import dataclasses

    scorer = loaded.components.scorer
    hook = getattr(scorer.cls, "engine_settings", None)
    if hook is None:
        return loaded
    pipe = loaded.pipeline
    models = dict(pipe.models)
    for key in scorer.cls.models_needed(scorer.params):
        extra = hook(scorer.params, models[key].backend)
        if extra:
            models[key] = models[key].model_copy(update={"engine": {**extra, **(models[key].engine or {})}})
    return dataclasses.replace(loaded, pipeline=pipe.model_copy(update={"models": models}))


#: SGLang settings that size its KV pool: an entry that sets one keeps its own pool under run.kv_memory


def batch_invariant(registry, model_cfg) -> tuple:
    """The backend's answer for `run.deterministic` on this entry: (engine settings, None) or
    (None, why not); a backend that does not declare `batch_invariant` cannot."""
    return backend_named(model_cfg.backend, registry).batch_invariant(model_cfg)


def deterministic_problems(loaded: LoadedPipeline, registry=None) -> list:
    """`run.deterministic` where a used model's backend cannot decode batch-invariantly (as
    the backend says: `Backend.batch_invariant(model_cfg)`)."""
    from kvflow.registry import get_registry

    pipe = loaded.pipeline
    if not pipe.run.deterministic:
        return []
    registry = registry or get_registry()
    problems = []
    for key in used_models(loaded):
        _, why = batch_invariant(registry, pipe.models[key])
        if why:
            problems.append(loaded.problem("run.deterministic", f"models.{key} {why}",
                                           f"unset run.deterministic, or put models.{key} on a GPU or on backend 'hf' "
                                           "(kvflow's batch-invariant forwards, CPU or GPU)"))
    return problems


def resolve_rope_theta(loaded: LoadedPipeline, proposer: str, params, model_id: str):
    """Evictor params whose `rope_theta` field is unset (expected-attention) with the model's
    RoPE base read from its config (the same on every engine); a model without plain RoPE is
    a UserError naming the field. Others unchanged."""
    if "rope_theta" not in type(params).model_fields or params.rope_theta is not None:
        return params
    from kvflow.models.shapes import resolve_shape

    where = f"proposers.{proposer}.evictor.rope_theta"
    try:
        shape = resolve_shape(model_id)
    except UserError as e:
        raise UserError([loaded.problem(where, f"cannot read the model's RoPE base: {e}",
                                        "give rope_theta in the evictor")]) from None
    if shape.rope_theta is None:
        raise UserError([loaded.problem(where, f"{model_id}: {shape.rope_note}; this evictor rotates queries "
                                               "with plain RoPE", "use another evictor for this model")])
    return params.model_copy(update={"rope_theta": shape.rope_theta})


def pruner_owners(loaded: LoadedPipeline) -> dict[str, list[str]]:
    owners: dict[str, list[str]] = {}
    for name, comps in loaded.components.proposers.items():
        for p in comps.pruners:
            owners.setdefault(p.name, []).append(name)
    return owners
