"""JSON Schema (draft 2020-12) for pipeline files, built after plugins load (`kvflow schema`).

The schema is `config.schema.Pipeline`'s, with every component entry (``proposers.*.evictor``,
``proposers.*.pruners[]``, ``scorer``, ``committer``) replaced by a ``oneOf`` over the installed
components of that kind: ``{kind: {const: NAME}, ...that component's Params fields...}`` with no
other keys allowed. So an editor (or `jsonschema`) checks a third-party component's parameters
exactly like a built-in's. Checks that JSON Schema cannot express (model validators such as
"window < budget", cross-references to `models`) are left to `kvflow validate`.

A file with ``include:`` is only complete after merging; its top-level required keys are then
not demanded (nested entries are still checked as written).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from kvflow.registry import Registry

DRAFT = "https://json-schema.org/draft/2020-12/schema"

#: registry kind -> the $defs name of its `oneOf`
COMPONENT_DEFS = {
    "evictors": "Evictor",
    "pruners": "Pruner",
    "scorers": "Scorer",
    "committers": "Committer",
}


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    """Copy of `node` with every ``{"$ref": "#/$defs/OLD"}`` pointing at ``#/$defs/NEW``."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#/$defs/"):
                old = v[len("#/$defs/"):]
                out[k] = "#/$defs/" + renames.get(old, old)
            else:
                out[k] = _rewrite_refs(v, renames)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, renames) for v in node]
    return node


def _params_model(cls: type):
    params = getattr(cls, "Params", None)
    if params is None:
        from kvflow.components.base import Params as params
    return params


def component_variant(kind: str, name: str, params_model: Any, defs: dict[str, Any],
                      description: str = "") -> dict[str, Any]:
    """The schema of one component entry ``{kind: name, **params}``; the Params model's own
    $defs are added to `defs` under names prefixed with the component, so that two components
    with a same-named nested model cannot clash."""
    schema = params_model.model_json_schema(mode="validation")
    own_defs = schema.pop("$defs", {})
    prefix = f"{COMPONENT_DEFS.get(kind, kind)}.{name}."
    renames = {k: prefix + k for k in own_defs}
    for old, sub in own_defs.items():
        defs[renames[old]] = _rewrite_refs(sub, renames)
    schema = _rewrite_refs(schema, renames)
    properties = {"kind": {"const": name, "description": f"{kind[:-1]} '{name}'"}}
    properties.update(schema.get("properties", {}))
    variant: dict[str, Any] = {
        "type": "object",
        "title": f"{kind[:-1]} {name}",
        "properties": properties,
        "required": ["kind", *[r for r in schema.get("required", []) if r != "kind"]],
        "additionalProperties": False,
    }
    if description:
        variant["description"] = description
    for key in ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentRequired"):
        if key in schema:  # rare: constraints a Params model adds at its top level
            variant[key] = schema[key]
    return variant


def _kind_schema(kind: str, registry: "Registry", defs: dict[str, Any]) -> dict[str, Any]:
    from kvflow.errors import ComponentImportError

    variants = []
    for name in registry.names(kind):
        try:
            cls = registry.get(kind, name)
        except ComponentImportError as e:
            # Still accept the name (the plugin is installed but broken); `kvflow validate` reports it.
            variants.append({"type": "object", "title": f"{kind[:-1]} {name}",
                             "description": f"(cannot import: {e})",
                             "properties": {"kind": {"const": name}}, "required": ["kind"]})
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        variants.append(component_variant(kind, name, _params_model(cls), defs, doc[0].strip() if doc else ""))
    names = registry.names(kind)
    return {
        "description": f"A {kind[:-1]}: {{kind: NAME, ...parameters}}; installed: {', '.join(names) or '(none)'}.",
        "type": "object",
        "required": ["kind"],
        "oneOf": variants,
    }


def _replace_component_ref(prop: dict[str, Any], target: str, default_kind: Optional[str] = None) -> dict[str, Any]:
    """A property that was ``$ref: ComponentRef`` (maybe with description/default) -> the kind's def."""
    out = {k: v for k, v in prop.items() if k not in ("$ref", "allOf", "title")}
    out["$ref"] = f"#/$defs/{target}"
    if default_kind is not None and "default" not in out:
        out["default"] = {"kind": default_kind}
    return out


def _default_kind(model: Any, field: str) -> Optional[str]:
    try:
        return model.model_fields[field].get_default(call_default_factory=True).kind
    except Exception:  # noqa: BLE001 - a default is a nicety
        return None


def pipeline_schema(registry: Optional["Registry"] = None) -> dict[str, Any]:
    """The JSON Schema of a pipeline file with the installed components' parameters."""
    from kvflow.config.schema import Pipeline, ProposerConfig

    if registry is None:
        from kvflow.registry import get_registry

        registry = get_registry()
    base = Pipeline.model_json_schema(mode="validation")
    defs: dict[str, Any] = base.pop("$defs", {})
    defs.pop("ComponentRef", None)
    for kind, def_name in COMPONENT_DEFS.items():
        defs[def_name] = _kind_schema(kind, registry, defs)

    props = base["properties"]
    props["scorer"] = _replace_component_ref(props["scorer"], "Scorer", _default_kind(Pipeline, "scorer"))
    props["committer"] = _replace_component_ref(props["committer"], "Committer", _default_kind(Pipeline, "committer"))
    prop_cfg = defs["ProposerConfig"]["properties"]
    prop_cfg["evictor"] = _replace_component_ref(prop_cfg["evictor"], "Evictor", _default_kind(ProposerConfig, "evictor"))
    pruners = dict(prop_cfg["pruners"])
    pruners["items"] = {"$ref": "#/$defs/Pruner"}
    prop_cfg["pruners"] = pruners

    props["include"] = {
        "description": "Pipeline file(s) to start from (paths relative to this file); this file's keys "
                       "are merged over theirs.",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    required = base.pop("required", [])
    schema: dict[str, Any] = {
        "$schema": DRAFT,
        "$id": "https://kvflow.dev/schema/pipeline.json",
        "title": "kvflow pipeline",
        "description": "A kvflow pipeline file (DESIGN.md §5), with the parameters of the installed "
                       "components (generated by `kvflow schema`).",
    }
    schema.update(base)
    if required:
        # A file that includes another is complete only after merging.
        schema["if"] = {"not": {"required": ["include"]}}
        schema["then"] = {"required": required}
    schema["$defs"] = defs
    _check_refs(schema)
    return schema


def _check_refs(schema: dict[str, Any]) -> None:
    """Every local $ref must resolve (a bug here would make the schema useless)."""
    defs = schema.get("$defs", {})
    missing: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[len("#/$defs/"):] not in defs:
                missing.add(ref)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    if missing:  # pragma: no cover - a programming error
        raise RuntimeError(f"pipeline schema has dangling refs: {sorted(missing)}")


def schema_command(output: Optional[Union[str, Path]] = None, *, registry: Optional["Registry"] = None,
                   echo=print) -> dict[str, Any]:
    schema = pipeline_schema(registry)
    text = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    if output is None or str(output) == "-":
        echo(text.rstrip("\n"))
    else:
        path = Path(output)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        echo(f"wrote {path}")
    return copy.deepcopy(schema)
