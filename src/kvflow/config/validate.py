"""From a pipeline file to a validated `LoadedPipeline`, with every problem located.

`load_pipeline()` does, in order: load YAML + includes (`loader`), apply ``--unset``/``--set``
(`overrides`), validate the whole file against `schema.Pipeline` (pydantic), then a second
pass over the component entries (``proposers.*.evictor``, ``proposers.*.pruners[i]``,
``scorer``, ``committer``): look ``kind`` up in the plugin registry and validate the other
keys against that component's own ``Params`` model. Cross-references (proposer -> model,
scorer ``model`` -> model) are checked last. Every problem of every pass is collected and
raised as one `UserError`, each with file, line and dotted path.
"""

from __future__ import annotations

import hashlib
import json
import difflib
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Iterable, Literal, NamedTuple, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kvflow.config.loader import Locations, PathParts, display_path, format_path, load_config
from kvflow.config.overrides import apply_overrides
from kvflow.config.schema import ComponentRef, Pipeline, ProposerConfig
from kvflow.errors import ComponentImportError, ConfigProblem, UserError, did_you_mean, unknown_component_hint

if TYPE_CHECKING:  # pragma: no cover
    from kvflow.registry import Registry


class ComponentSpec(NamedTuple):
    cls: type
    params: BaseModel


class PrunerSpec(NamedTuple):
    name: str  # the kind, or kind_2, kind_3... when a proposer uses one kind twice (finish `pruned:<name>`)
    cls: type
    params: BaseModel


class ProposerComponents(NamedTuple):
    evictor: ComponentSpec
    pruners: list[PrunerSpec]


@dataclass(frozen=True)
class ResolvedComponents:
    """The component classes and validated `Params` a pipeline uses, in pipeline order."""

    proposers: dict[str, ProposerComponents]
    scorer: ComponentSpec
    committer: ComponentSpec


@dataclass
class LoadedPipeline:
    path: Path
    pipeline: Pipeline
    resolved: dict  # plain data after include + overrides, without `include`
    components: ResolvedComponents
    locations: Locations = field(default_factory=Locations, repr=False)

    @property
    def hash(self) -> str:
        return config_hash(self.resolved)

    def problem(self, path: Union[str, PathParts], message: str, hint: Optional[str] = None) -> ConfigProblem:
        """A problem located at `path` (dotted or tuple), for later stages (compile, runtime)
        that find something wrong with the pipeline: ``raise UserError(loaded.problem(...))``."""
        from kvflow.config.loader import parse_path

        parts = parse_path(path) if isinstance(path, str) else tuple(path)
        loc = self.locations.lookup(parts)
        return ConfigProblem(loc.file, loc.line, format_path(parts), message, hint)


#: settings that say how many of the dataset's problems to run, how they are scheduled and
#: where results go, not what any problem's result is: they are left out of the hash that
#: names a results directory, so a larger `dataset.limit` (same seeded order) grows the same
#: run, a different batch size resumes it, and so does another executor (local or Ray workers)
NOT_HASHED = (("dataset", "limit"), ("run", "batch_problems"), ("run", "live_problems"), ("run", "threads"), ("run", "kv_memory"),
              ("run", "overlap_engines"), ("run", "output"), ("run", "executor"), ("run", "workers"), ("run", "worker_gpus"),
              # how `kvflow serve` answers requests changes no trajectory
              ("serve", "ignore"), ("serve", "queue"), ("serve", "retry_after"), ("serve", "max_body_bytes"),
              ("serve", "max_prompt_tokens"))


def config_hash(resolved: dict) -> str:
    """Short (8 hex) sha256 of the canonical JSON of a resolved pipeline, without NOT_HASHED."""
    data = dict(resolved)
    data.pop("sweep", None)  # the grid a point belongs to is not the point's configuration
    for section, key in NOT_HASHED:
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section] = {k: v for k, v in data[section].items() if k != key}
            if not data[section]:
                del data[section]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


# --------------------------------------------------------------------------- pydantic errors


def _unwrap(tp: Any) -> Any:
    """Optional[X] / Annotated[X, ...] -> X."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _annotation_at(tp: Any, parts: PathParts) -> Any:
    """The declared type at `parts` below model/type `tp`, or None when it cannot be followed."""
    for part in parts:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            f = tp.model_fields.get(str(part))
            if f is None:
                return None
            tp = f.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) in (list, tuple):
            tp = get_args(tp)[0]
        else:
            return None
    return _unwrap(tp)


def _data_path(loc: tuple, data: Any) -> PathParts:
    """pydantic's error loc, minus the union-member tags it inserts (e.g. 'int',
    'function-after[...]') that are not keys of the data."""
    out: list[Any] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif i == len(loc) - 1:
            node = None  # a missing or unknown field: the last part names it
        else:
            continue
        out.append(part)
    return tuple(out)


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pydantic_problems(
    exc: ValidationError,
    model: type[BaseModel],
    data: Any,
    locations: Locations,
    prefix: PathParts = (),
) -> list[ConfigProblem]:
    """Turn every error of `exc` (validating `data` against `model`) into a located problem."""
    problems = []
    for err in exc.errors(include_url=False):
        parts = _data_path(tuple(err["loc"]), data)
        loc = locations.lookup(prefix + parts)
        typ, msg, hint = err["type"], err["msg"], None
        field_name = str(parts[-1]) if parts else ""
        if typ == "extra_forbidden":
            parent = _annotation_at(model, parts[:-1])
            allowed = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
            msg, hint = f"unknown field '{field_name}'", did_you_mean(field_name, allowed)
        elif typ == "missing":
            msg = f"missing required field '{field_name}'"
        elif typ == "literal_error":
            ann = _annotation_at(model, parts)
            allowed = [repr(a) for a in get_args(ann)] if get_origin(ann) is Literal else []
            expected = ", ".join(allowed) or err.get("ctx", {}).get("expected", "")
            msg = f"must be one of {expected} (got {_show(err.get('input'))})"
            close = difflib.get_close_matches(str(err.get("input")), [a.strip("'") for a in allowed], n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else None
        elif typ in ("model_type", "dict_type"):
            msg = f"must be a mapping (got {_show(err.get('input'))})"
            if _annotation_at(model, parts) is ComponentRef:
                hint = "write a component as a mapping: {kind: NAME, param: value, ...}"
        else:
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            msg = msg[:1].lower() + msg[1:]
            if "input" in err and typ != "value_error":
                msg += f" (got {_show(err['input'])})"
        problems.append(ConfigProblem(loc.file, loc.line, format_path(prefix + parts), msg, hint))
    return problems


# --------------------------------------------------------------------------- the second pass

_KIND_OF = {"evictor": "evictors", "pruners": "pruners", "scorer": "scorers", "committer": "committers"}


def _default_kind(model: type[BaseModel], name: str) -> str:
    return model.model_fields[name].get_default(call_default_factory=True).kind


def _component_entries(data: dict) -> Iterable[tuple[str, PathParts, Any]]:
    """(registry kind, path, raw entry) for every component entry, defaults included."""
    proposers = data.get("proposers")
    if isinstance(proposers, dict):
        for pname, prop in proposers.items():
            if not isinstance(prop, dict):
                continue
            entry = prop.get("evictor", {"kind": _default_kind(ProposerConfig, "evictor")})
            yield "evictors", ("proposers", pname, "evictor"), entry
            pruners = prop.get("pruners")
            if isinstance(pruners, list):
                for i, entry in enumerate(pruners):
                    yield "pruners", ("proposers", pname, "pruners", i), entry
    for key in ("scorer", "committer"):
        yield _KIND_OF[key], (key,), data.get(key, {"kind": _default_kind(Pipeline, key)})


def _check_component(
    kind: str, path: PathParts, entry: Any, registry: "Registry", locs: Locations, problems: list[ConfigProblem]
) -> Optional[ComponentSpec]:
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        return None  # the schema pass has reported it already
    name = entry["kind"]
    loc = locs.lookup(path + ("kind",))
    where = format_path(path + ("kind",))
    if not registry.has(kind, name):
        problems.append(ConfigProblem(loc.file, loc.line, where, f"unknown {kind[:-1]} '{name}'",
                                      unknown_component_hint(kind, name, registry.names(kind))))
        return None
    try:
        cls = registry.get(kind, name)
    except ComponentImportError as e:
        problems.append(ConfigProblem(loc.file, loc.line, where, str(e),
                                      "`kvflow plugins` shows which plugins loaded; reinstall the one that provides it"))
        return None
    params_model = getattr(cls, "Params", None)
    if params_model is None:
        from kvflow.components.base import Params as params_model
    raw = {k: v for k, v in entry.items() if k != "kind"}
    try:
        return ComponentSpec(cls, params_model.model_validate(raw))
    except ValidationError as e:
        problems.extend(pydantic_problems(e, params_model, raw, locs, path))
        return None


def _check_backends(data: dict, registry: "Registry", locs: Locations, problems: list) -> None:
    """Every model's `backend` names a registered engine (built-in or a plugin's)."""
    models = data.get("models")
    for key, entry in (models.items() if isinstance(models, dict) else ()):
        backend = entry.get("backend", "hf") if isinstance(entry, dict) else None
        if isinstance(backend, str) and backend and not registry.has("backends", backend):
            path = ("models", key, "backend")
            loc = locs.lookup(path)
            problems.append(ConfigProblem(loc.file, loc.line, format_path(path), f"unknown backend '{backend}'",
                                          unknown_component_hint("backends", backend, registry.names("backends"))))


def _check_refs(data: dict, specs: dict[PathParts, Optional[ComponentSpec]], locs: Locations, problems: list) -> None:
    models = data.get("models")
    if not isinstance(models, dict):
        return

    def check(path: PathParts, value: Any) -> None:
        if isinstance(value, str) and value not in models:
            loc = locs.lookup(path)
            problems.append(ConfigProblem(loc.file, loc.line, format_path(path), f"unknown model '{value}'",
                                          did_you_mean(value, list(models), "models defined in `models`")))

    proposers = data.get("proposers")
    for pname, prop in (proposers.items() if isinstance(proposers, dict) else ()):
        if isinstance(prop, dict):
            check(("proposers", pname, "model"), prop.get("model"))
    scorer = data.get("scorer")
    if isinstance(scorer, dict) and "model" in scorer:
        spec = specs.get(("scorer",))
        # a scorer whose Params has no `model` field already got "unknown field"
        if spec is None or "model" in type(spec.params).model_fields:
            check(("scorer", "model"), scorer["model"])


def _pruner_specs(entries: list[tuple[str, type, BaseModel]]) -> list[PrunerSpec]:
    from kvflow.config.names import pruner_names

    names = pruner_names(kind for kind, _, _ in entries)
    return [PrunerSpec(name, cls, params) for name, (_, cls, params) in zip(names, entries)]


def _sort_key(main: str):
    return lambda p: (p.file.startswith("<"), p.file != main, p.file, p.line)


def load_pipeline(
    path: Union[str, os.PathLike],
    sets: Iterable[str] = (),
    unsets: Iterable[str] = (),
    registry: Optional["Registry"] = None,
) -> LoadedPipeline:
    """Load, override and validate a pipeline file. Raises UserError with every problem."""
    if registry is None:
        from kvflow.registry import get_registry

        registry = get_registry()
    data, locs = load_config(path)
    problems: list[ConfigProblem] = []
    try:
        apply_overrides(data, locs, sets, unsets)
    except UserError as e:  # the overrides that could be applied were; keep checking the rest
        problems.extend(e.problems)
    pipeline: Optional[Pipeline] = None
    try:
        pipeline = Pipeline.model_validate(data)
    except ValidationError as e:
        problems.extend(pydantic_problems(e, Pipeline, data, locs))

    specs: dict[PathParts, Optional[ComponentSpec]] = {}
    for kind, cpath, entry in _component_entries(data):
        specs[cpath] = _check_component(kind, cpath, entry, registry, locs, problems)
    _check_refs(data, specs, locs, problems)
    _check_backends(data, registry, locs, problems)

    if problems or pipeline is None:
        unique = list(dict.fromkeys(problems))
        raise UserError(sorted(unique, key=_sort_key(display_path(Path(path).expanduser().resolve()))))

    proposers = {}
    for pname, prop in pipeline.proposers.items():
        evictor = specs[("proposers", pname, "evictor")]
        pruners = [(p.kind, *specs[("proposers", pname, "pruners", i)]) for i, p in enumerate(prop.pruners)]
        proposers[pname] = ProposerComponents(evictor, _pruner_specs(pruners))
    components = ResolvedComponents(proposers, specs[("scorer",)], specs[("committer",)])
    return LoadedPipeline(Path(path), pipeline, data, components, locs)
