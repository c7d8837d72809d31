"""The KV memory of a pipeline, in one place: an evictor's budget for a model (`budget_bytes`
turned into tokens, its allocation checked), what `run.kv_memory` admits, read from the models'
configs before anything loads (`kv_memory_problems`, `refuse_kv_memory`: `kvflow validate`, the
first check of `kvflow run` and `serve`) and from the loaded engines (`resolve_kv_memory`, every
prompt checked by `refuse_unfitting_prompts`), the engine settings that bound the engines' own
pools (`kv_memory_engines`), and what `manifest.json` records (`kv_memory_facts`).

The byte arithmetic itself (layouts, row costs, `KVBudget`) is `kvflow.kv_memory`'s.
"""

from __future__ import annotations

from typing import Optional

from kvflow.backends.base import backend_named
from kvflow.config.validate import LoadedPipeline
from kvflow.errors import UserError
from kvflow.kv_memory import DTYPE_BYTES, resolve_evictor
from kvflow.models.shapes import entry_shape


# --------------------------------------------------------------------------- an evictor for a model


def resolve_budget_bytes(loaded: LoadedPipeline, proposer: str, params, kv_shape: tuple[int, int, int, int]):
    """Evictor params with `budget_bytes` turned into the largest token budget that fits, for a
    model of kv_shape = (layers, kv_heads, head_dim, bytes per element); others unchanged."""
    from kvflow.kv_memory import budget_for_bytes

    if getattr(params, "budget_bytes", None) is None:
        return params
    where = f"proposers.{proposer}.evictor.budget_bytes"
    try:
        cls = loaded.components.proposers[proposer].evictor.cls
        return params.with_budget(budget_for_bytes(params, *kv_shape, evictor_cls=cls))
    except ValueError as e:  # too few bytes, or a budget the other parameters do not fit in
        layers, heads, dim, elem = kv_shape
        raise UserError([loaded.problem(where, f"{params.budget_bytes} bytes do not give a usable budget for "
                                               f"this model ({layers} layers x {heads} KV heads x head_dim {dim}, "
                                               f"{elem} bytes/element): {e}",
                                        "raise budget_bytes; `kvflow explain` shows the bytes per token")]) from None


def check_allocation(loaded: LoadedPipeline, proposer: str, evictor, num_layers: int) -> None:
    """An evictor's per-layer budgets for this model (`Evictor.allocation`), or a UserError
    naming the evictor field (e.g. a PyramidKV budget too small for its window)."""
    if not getattr(evictor, "bounded", False):
        return
    try:
        evictor.allocation(num_layers)
    except ValueError as e:
        raise UserError([loaded.problem(f"proposers.{proposer}.evictor", f"its budgets for this model "
                                        f"({num_layers} layers) do not work: {e}",
                                        "raise budget (or buffer), lower window, or (pyramidkv) raise beta")]) from None


# --------------------------------------------------------------------------- before anything loads


def static_row_costs(loaded: "LoadedPipeline", shapes: Optional[dict] = None) -> tuple[list, list[str]]:
    """(RowCost per proposer whose model's shape can be read offline, proposers whose cannot
    with why), as `kvflow.runtime.compile.kv_budget_for` counts them once the engines load."""
    from kvflow.kv_memory import row_cost

    pipe, comps = loaded.pipeline, loaded.components
    shapes = {} if shapes is None else shapes
    costs, unknown = [], []
    for pname, prop in pipe.proposers.items():
        m = pipe.models[prop.model]
        if prop.model not in shapes:
            shapes[prop.model] = entry_shape(m)
        shape, note = shapes[prop.model]
        if shape is None:
            unknown.append(f"{pname} ({note})")
            continue
        dims = (shape.n_layers, shape.n_kv_heads, shape.head_dim, DTYPE_BYTES.get(m.dtype, 2))
        spec = comps.proposers[pname].evictor
        params, evictor = spec.params, None
        if getattr(spec.cls, "bounded", True):
            try:
                params, evictor = resolve_evictor(spec.cls, params, *dims)
            except ValueError as e:
                unknown.append(f"{pname} (its evictor does not fit this model: {e})")
                continue
        costs.append(row_cost(pname, prop.n, params, *dims, evictor=evictor))
    return costs, unknown


def kv_memory_problems(loaded: "LoadedPipeline") -> list:
    """`run.kv_memory` that not even a problem with an empty prompt fits, found from the
    models' configs without loading them (`kvflow validate`, and `kvflow run` before it loads
    anything); proposers whose shape cannot be read offline are checked once loaded."""
    from kvflow.kv_memory import KV_HINT, KVBudget, kv_refusal, parse_bytes

    value = loaded.pipeline.run.kv_memory
    if value is None or value == "auto":
        return []
    costs, unknown = static_row_costs(loaded)
    if not costs:
        return []
    budget = KVBudget(parse_bytes(value), tuple(costs), loaded.pipeline.limits.max_tokens)
    smallest = budget.smallest_problem()
    if smallest <= budget.bound:
        return []
    what = "even with an empty prompt" + (f" (not counting {', '.join(unknown)})" if unknown else "")
    return [loaded.problem("run.kv_memory", kv_refusal(budget, smallest, what), KV_HINT)]


def refuse_kv_memory(loaded: "LoadedPipeline") -> None:
    """`kv_memory_problems` as a UserError (exit code 2), for the commands that load no model first."""
    from kvflow.errors import UserError

    problems = kv_memory_problems(loaded)
    if problems:
        raise UserError(problems)


def kv_memory_engines(loaded: LoadedPipeline, registry=None) -> LoadedPipeline:
    """With `run.kv_memory` in bytes, each model a proposer runs on gets the engine settings its
    backend gives for a KV pool of that many bytes (`Backend.kv_pool_settings`; SGLang:
    `max_total_tokens` = kv_memory / the model's KV bytes per token, unless the entry sizes its
    pool itself): the worker's pool is then the same bound as the scheduler's, and the engine
    admits candidates into it as slots free, with no room held back by kvflow (the engines
    decode every admitted problem's rows: no `batch_problems` cap unless it is set). `auto`
    leaves every engine to size its pool from the free memory."""
    import dataclasses

    from kvflow.kv_memory import DTYPE_BYTES, parse_bytes
    from kvflow.models.shapes import kv_bytes_per_token, resolve_shape
    from kvflow.registry import get_registry

    pipe = loaded.pipeline
    if pipe.run.kv_memory in (None, "auto"):
        return loaded
    registry = registry or get_registry()
    bound = parse_bytes(pipe.run.kv_memory)
    models = dict(pipe.models)
    for key in {p.model for p in pipe.proposers.values()}:
        m = models[key]
        try:
            per_token = kv_bytes_per_token(resolve_shape(m.id), DTYPE_BYTES.get(m.dtype, 2))
        except (UserError, OSError, ValueError):
            continue  # a shape not readable here: the engine sizes its pool as it would
        settings = backend_named(m.backend, registry).kv_pool_settings(m, bound, per_token)
        if settings:
            models[key] = m.model_copy(update={"engine": {**(m.engine or {}), **settings}})
    return dataclasses.replace(loaded, pipeline=pipe.model_copy(update={"models": models}))


# --------------------------------------------------------------------------- over the loaded engines


def kv_budget_for(pipe, proposers, bound: int):
    """The `KVBudget` of `bound` bytes over compiled `proposers` (each with its engine's KV shape)."""
    from kvflow.kv_memory import KVBudget, row_cost

    costs = tuple(row_cost(p.name, p.spec.n, p.evictor.params, *p.engine.kv_shape(),
                           evictor=p.evictor if getattr(p.evictor, "bounded", False) else None) for p in proposers)
    return KVBudget(bound, costs, pipe.limits.max_tokens)


def resolve_kv_memory(loaded: LoadedPipeline, proposers):
    """`run.kv_memory` as a `KVBudget` over the loaded proposers (None when unset): `auto` read
    from the base model's device now that the weights are in memory. A bound that not even a
    problem with an empty prompt fits is refused here, naming the field (before anything is
    written); a longer prompt that does not fit is refused by `check_kv_memory`."""
    from kvflow.kv_memory import KV_HINT, auto_kv_memory, kv_refusal, parse_bytes

    pipe = loaded.pipeline
    value = pipe.run.kv_memory
    if value is None:
        return None
    if value == "auto":
        bound, how = pools_bytes(proposers) or auto_kv_memory(str(proposers[0].engine.device))
        if bound < 1:
            raise UserError(loaded.problem("run.kv_memory", f"auto gives no memory ({how})", "give a byte size"))
    else:
        bound = parse_bytes(value)
    budget = kv_budget_for(pipe, proposers, bound)
    smallest = budget.smallest_problem()
    if smallest > bound:
        raise UserError(loaded.problem("run.kv_memory", kv_refusal(budget, smallest, "even with an empty prompt"),
                                       KV_HINT))
    return budget


def pools_bytes(proposers):
    """(bytes, how) of the KV pools the engines of `proposers` sized for themselves when every
    one did (`Engine.kv_pool_tokens`; SGLang's pool: the memory it found free after the
    weights, then `auto`'s bound), else None."""
    from kvflow.kv_memory import full_token_bytes

    engines = {id(p.engine): p.engine for p in proposers}.values()
    tokens = [e.kv_pool_tokens() for e in engines]
    if not all(tokens):
        return None
    total = 0
    for e, t in zip(engines, tokens):
        layers, heads, dim, elem = e.kv_shape()
        total += t * layers * heads * full_token_bytes(dim, elem)
    return total, "the KV pools the engines resolved"


def refuse_unfitting_prompts(loaded: LoadedPipeline, plan, prompts) -> None:
    """Every prompt of `prompts` ({problem id: prompt text}) fits `run.kv_memory` by itself,
    else a UserError naming the field and the first problem that does not (before the run
    writes anything)."""
    from kvflow.kv_memory import KV_HINT, kv_refusal
    from kvflow.runtime.admission import prompt_tokens

    budget = plan.kv_budget
    if budget is None:
        return
    for pid, prompt in prompts.items():
        needed = budget.problem_bytes(prompt_tokens(plan, prompt))
        if needed > budget.bound:
            raise UserError(loaded.problem("run.kv_memory", kv_refusal(budget, needed, f"for problem {pid}"),
                                           KV_HINT))


def kv_memory_facts(plan) -> dict:
    """Per proposer, the KV bytes one sequence holds (manifest.json `kv_memory`): the token
    budget (after any budget_bytes conversion), how many kept tokens are quantized and at how
    many bits, bytes kept after a compaction and bytes allocated (the cache allocates exactly
    this; tests/test_quant.py checks it against the tensors). A full cache has no bound."""
    from kvflow.kv_memory import full_token_bytes, layout

    out = {}
    for p in plan.proposers:
        layers, heads, dim, elem = p.engine.kv_shape()
        entry = {"bytes_per_token": layers * heads * full_token_bytes(dim, elem), "budget": None, "n_quantized": 0,
                 "bits": None, "kept_bytes": None, "peak_bytes": None}
        if p.evictor.bounded:
            lay = layout(p.evictor.params, layers, heads, dim, elem, evictor=p.evictor)
            q = getattr(p.evictor.params, "quantize", None)
            entry.update(budget=lay.budget, n_quantized=lay.n_quantized, bits=q.bits if q else None,
                         kept_bytes=lay.kept_bytes, peak_bytes=lay.peak_bytes)
            if lay.layer_budgets is not None:
                entry["layer_budgets"] = list(lay.layer_budgets)
        out[p.name] = entry
    return out
