"""The documentation stays true to the code (DESIGN.md §10: every doc code block runs or validates).

- every plugin hook and every built-in component has a docstring and a place in the docs,
  docs/plugins.md's hook table is generated from the hookspec docstrings (the full hook
  reference is rendered from them by mkdocstrings), and docs/components.md has a current
  parameter table for every built-in component;
- every field of the pipeline schema is documented in docs/pipeline-yaml.md, whose field
  tables are generated from the pydantic models (regenerate every generated table, and add a
  section for any built-in component that has none, with ``python tests/test_docs.py --update``
  or ``KVFLOW_UPDATE_DOCS=1 pytest tests/test_docs.py``; ``--update`` also regenerates the
  command reference of docs/cli.md, see scripts/cli_reference.py);
- every pipeline YAML block in README.md and docs/*.md validates, and so does every
  ``kvflow run|validate pipelines/...`` command line shown in a shell block;
- the README's plugin example works as printed;
- the fields of results files and the CLI commands are all documented;
- ``mkdocs build --strict`` passes.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
PIPELINE_DOC = DOCS / "pipeline-yaml.md"
COMPONENTS_DOC = DOCS / "components.md"
COMPONENT_KINDS = ("evictors", "pruners", "scorers", "committers")
UPDATE_HINT = "regenerate with: python tests/test_docs.py --update"


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- code blocks

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*$")


def code_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, text) of every fenced block in a markdown file."""
    out, lines, i = [], _read(path).splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, indent = i + 1, m.group("fence"), len(m.group("indent"))
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        out.append((start, m.group("lang").lower(), "\n".join(body) + "\n"))
        i += 1
    return out


def _pipeline_blocks() -> list[tuple[str, str]]:
    """YAML blocks that declare a pipeline (`kvflow: 1` or `include:` at the top level)."""
    found = []
    for path in _doc_files():
        for line, lang, text in code_blocks(path):
            if lang in ("yaml", "yml") and re.search(r"^(kvflow:\s*1\b|include:)", text, re.M):
                found.append((f"{path.relative_to(REPO)}:{line}", text))
    return found


def _command_lines() -> list[tuple[str, list[str]]]:
    """`kvflow run|validate pipelines/...yaml [--set ...] [--unset ...]` lines of shell blocks."""
    found = []
    for path in _doc_files():
        for line, lang, text in code_blocks(path):
            if lang not in ("sh", "bash", "console", "shell"):
                continue
            lines = text.splitlines()
            for n, raw in enumerate(lines):
                if n and lines[n - 1].rstrip().endswith("\\"):
                    continue  # a continuation: read with the line it continues
                while raw.rstrip().endswith("\\") and n + 1 < len(lines):  # `cmd \` + next line: one command
                    n += 1
                    raw = raw.rstrip()[:-1] + " " + lines[n].strip()
                cmd = raw.strip().lstrip("$ ").split("  #")[0].split(" # ")[0].strip()
                if re.match(r"^(\.venv/bin/)?kvflow\s+(run|validate)\s+pipelines/\S+\.ya?ml", cmd):
                    found.append((f"{path.relative_to(REPO)}:{line + 1 + n}", shlex.split(cmd)))
    return found


# --------------------------------------------------------------------------- (a) components and hooks


@functools.lru_cache(maxsize=None)
def _registry():
    """The installed plugins, built fresh (not the process-wide registry other tests replace)."""
    from kvflow.registry import Registry

    return Registry.from_entry_points()


def _hookspecs() -> dict[str, Any]:
    from kvflow import hookspecs

    return {n: f for n, f in vars(hookspecs).items() if callable(f) and hasattr(f, f"{hookspecs.PROJECT}_spec")}


def test_every_hook_has_a_docstring_and_is_documented():
    from kvflow import hookspecs

    specs = _hookspecs()
    assert set(hookspecs.KINDS.values()) <= set(specs), "KINDS names a hook that is not a hookspec"
    plugins_md = _read(DOCS / "plugins.md")
    assert re.search(r"^::: kvflow\.hookspecs\s*$", plugins_md, re.M), "docs/plugins.md must render `::: kvflow.hookspecs`"
    problems = []
    for name, fn in sorted(specs.items()):
        doc = (fn.__doc__ or "").strip()
        if not doc:
            problems.append(f"hook {name} has no docstring")
        else:
            if "Example" not in doc:
                problems.append(f"hook {name}: docstring has no example")
            if not re.search(r"Added in kvflow \d", doc):
                problems.append(f"hook {name}: docstring does not say which version added it ('Added in kvflow X.Y')")
        if f"`{name}" not in plugins_md:
            problems.append(f"hook {name} is not mentioned in docs/plugins.md")
    assert not problems, "\n".join(problems)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_added_in_versions_agree_with_kvflows():
    """What plugin authors read as "added in" (hook docstrings, the hook table, protocol
    docstrings) names a kvflow version that exists: no later than kvflow's own (0.1.0: all
    "added in 0.1"), and every hook says one (docs/plugins.md, "Versions")."""
    import kvflow
    from kvflow import hookspecs
    from kvflow.components import base, engine

    current = _minor(kvflow.__version__)
    texts = {f"hook {n}": inspect.cleandoc(f.__doc__ or "") for n, f in _hookspecs().items()}
    texts.update({"kvflow.hookspecs": hookspecs.__doc__ or "", "kvflow.components.engine": inspect.getsource(engine),
                  "kvflow.components.base": inspect.getsource(base), "docs/plugins.md": _read(PLUGINS_DOC)})
    problems = []
    for where, text in texts.items():
        for version in re.findall(r"[Aa]dded in (?:kvflow )?(\d+\.\d+)", text):
            if _minor(version) > current:
                problems.append(f"{where}: 'added in {version}', but kvflow is {kvflow.__version__}")
        for version in re.findall(r"\bin (\d+\.\d+)\b", text):
            if _minor(version) > current:
                problems.append(f"{where}: 'in {version}', but kvflow is {kvflow.__version__}")
    for name in _hookspecs():
        if not re.search(r"^Added in kvflow \d+\.\d+\.?$", texts[f"hook {name}"], re.M):
            problems.append(f"hook {name}: no line 'Added in kvflow X.Y.' (the hook table's 'added in' is read from it)")
    assert not problems, "\n".join(problems)


PLUGINS_DOC = DOCS / "plugins.md"


def hooks_table() -> str:
    """docs/plugins.md's hook reference: a table of each hookspec, the first line of its
    docstring and the version that added it (in the order of `kvflow.hookspecs.KINDS`, then
    any other hook), and the mkdocstrings directive that renders every hook's docstring."""
    from kvflow import hookspecs

    specs = _hookspecs()
    order = list(hookspecs.KINDS.values()) + sorted(set(specs) - set(hookspecs.KINDS.values()))
    rows = ["| hook | registers | added in |", "| --- | --- | --- |"]
    for name in order:
        doc = inspect.cleandoc(specs[name].__doc__ or "")
        added = re.search(r"Added in kvflow (\S+?)\.?$", doc, re.M)
        first = doc.splitlines()[0] if doc else ""
        rows.append(f"| [`{name}`](#kvflow.hookspecs.{name}) | {_md_text(first)} | {added.group(1) if added else ''} |")
    members = "".join(f"        - {name}\n" for name in order)
    directive = ("::: kvflow.hookspecs\n    options:\n      show_root_heading: false\n      heading_level: 3\n"
                 f"      members:\n{members}")
    return "\n".join(rows) + "\n\n" + directive.rstrip("\n")


def render_plugins_doc(text: str) -> str:
    return _replace_block(text, "hooks", hooks_table())


def test_hook_table_is_generated_from_the_hookspecs():
    if os.environ.get("KVFLOW_UPDATE_DOCS"):
        update_docs()
    text = _read(PLUGINS_DOC)
    assert _block_re("hooks").search(text), "docs/plugins.md has no generated hook table (markers 'hooks')"
    assert render_plugins_doc(text) == text, f"docs/plugins.md hook table is stale; {UPDATE_HINT}"


def _builtin_components() -> list[tuple[str, str, str]]:
    """(kind, name, "module:Class") of every component registered by the built-in plugin."""
    reg = _registry()
    out = []
    for kind in COMPONENT_KINDS:
        for name in reg.names(kind):
            info = reg.info(kind, name)
            if info.plugin == "builtin":
                assert info.error is None, f"{kind} {name}: {info.error}"
                out.append((kind, name, info.target))
    return out


def test_builtin_components_are_found():
    names = {(k, n) for k, n, _ in _builtin_components()}
    assert {("evictors", "none"), ("pruners", "entropy"), ("scorers", "likelihood"), ("committers", "best")} <= names


def test_every_builtin_component_has_a_docstring_and_a_docs_section():
    import importlib

    reg = _registry()
    text = _read(DOCS / "components.md") + "\n" + _read(DOCS / "plugins.md")
    directives = set(re.findall(r"^::: ([\w.]+)\s*$", text, re.M))
    problems = []
    for kind, name, target in _builtin_components():
        module_name, _, cls_name = target.partition(":")
        cls = reg.get(kind, name)
        if not (cls.__dict__.get("__doc__") or "").strip():
            problems.append(f"{kind[:-1]} '{name}': class {target} has no docstring of its own")
        if not (importlib.import_module(module_name).__doc__ or "").strip():
            problems.append(f"{kind[:-1]} '{name}': module {module_name} has no docstring")
        if module_name not in directives and f"{module_name}.{cls_name}" not in directives:
            problems.append(f"{kind[:-1]} '{name}' ({target}) has no `::: {module_name}` section in docs/components.md; "
                            f"{UPDATE_HINT} (adds missing sections)")
        if _block_re(_params_marker(kind, name)).search(text) is None:
            problems.append(f"{kind[:-1]} '{name}' has no parameter table in docs/components.md; {UPDATE_HINT}")
    assert not problems, "\n".join(problems)


def test_component_parameter_tables_are_up_to_date():
    if os.environ.get("KVFLOW_UPDATE_DOCS"):
        update_docs()
    text = _read(COMPONENTS_DOC)
    assert render_components_doc(text) == text, f"docs/components.md parameter tables are stale; {UPDATE_HINT}"


# --------------------------------------------------------------------------- (b) pipeline schema

#: How each schema model appears in a pipeline file (section anchor in docs/pipeline-yaml.md).
ANCHORS = {
    "Pipeline": "top-level",
    "DatasetConfig": "dataset",
    "ModelConfig": "models",
    "ProposerConfig": "proposers",
    "SamplingConfig": "sampling",
    "ComponentRef": "components",
    "LimitsConfig": "limits",
    "RunConfig": "run",
    "BaselinesConfig": "baselines",
    "ServeConfig": "serve",
}

#: Descriptions of fields whose pydantic `Field` carries none (better: give them one in schema.py).
FALLBACK_DESCRIPTIONS = {
    ("Pipeline", "name"): "Run name; the results directory is `<run.output>/<name>__<config hash>/`.",
    ("Pipeline", "description"): "Free text, shown by `kvflow ls pipelines`.",
    ("Pipeline", "dataset"): "Which problems to run.",
    ("Pipeline", "models"): "Checkpoints by key; proposers and scorers refer to these keys.",
    ("Pipeline", "proposers"): "Proposers by name, in order; the first one is the base (the evicted model).",
    ("Pipeline", "scorer"): "Scores surviving candidates (see Components: scorers).",
    ("Pipeline", "committer"): "Picks the step to commit (see Components: committers).",
    ("Pipeline", "limits"): "When a trajectory ends.",
    ("Pipeline", "run"): "Seed, batching, output and step delimiter.",
    ("ModelConfig", "dtype"): "Weights and compute dtype.",
    ("ModelConfig", "revision"): "Hub revision (branch, tag or commit).",
    ("SamplingConfig", "top_p"): "Nucleus sampling mass.",
    ("ProposerConfig", "sampling"): "How candidates are sampled.",
    ("ProposerConfig", "evictor"): "KV eviction method of this proposer's cache (see Components: evictors).",
    ("ProposerConfig", "pruners"): "Online detectors that stop this proposer's candidates (see Components: pruners).",
    ("ComponentRef", "kind"): "Registered component name (`kvflow ls`); every other key is a parameter of that component.",
    ("RunConfig", "seed"): "Seed of every random draw (sampling, random evictors and scorers, shuffling).",
}


def schema_models() -> list[type[BaseModel]]:
    from kvflow.config import schema

    return [
        obj for obj in vars(schema).values()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == schema.__name__ and obj.model_fields
    ]


def _type_name(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Annotated:  # a discriminated union: the union it annotates
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping {_type_name(args[0])} → {_type_name(args[1])}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return f"[{ann.__name__}](#{_anchor(ann)})"
    return getattr(ann, "__name__", str(ann))


def _constraints(field: Any) -> str:
    out = []
    for m in field.metadata:
        for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {getattr(m, attr)}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"min length {m.min_length}")
        if getattr(m, "pattern", None):
            out.append(f"pattern `{m.pattern}`")
    return ", ".join(out)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _default(model: type[BaseModel], name: str, field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel) and type(value).__name__ == "ComponentRef":
        inner = ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in value.model_dump().items())
        return f"`{{{inner}}}`"
    if isinstance(value, BaseModel):
        return f"see [{name}](#{_anchor(type(value))})"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{_yaml_scalar(value)}`"


def _md_text(text: str) -> str:
    """Plain text for a table cell: `|` escaped, and `<`/`>` outside code spans too (not HTML)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def field_table(model: type[BaseModel], header: str = "field") -> str:
    rows = [f"| {header} | type | default | description |", "| --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        typ = _type_name(f.annotation)
        cons = _constraints(f)
        if cons:
            typ += f" ({cons})"
        desc = f.description or FALLBACK_DESCRIPTIONS.get((model.__name__, name), "")
        desc = _md_text(desc.replace("\n", " "))
        rows.append(f"| `{name}` | {typ} | {_default(model, name, f)} | {desc} |")
    if model.model_config.get("extra") == "allow":
        rows.append("| *(any other key)* | | | A parameter of the component named by `kind`, validated by its `Params` model. |")
    return "\n".join(rows)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"


def _block_re(name: str) -> re.Pattern:
    begin, end = _markers(name)
    return re.compile(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), re.S)


def _anchor(model: type) -> str:
    return ANCHORS.get(model.__name__, model.__name__.lower())


def add_missing_model_sections(text: str) -> str:
    """Append a section (heading with anchor, field table markers) for every schema model that has none."""
    for model in schema_models():
        if _block_re(model.__name__).search(text) is None:
            begin, end = _markers(model.__name__)
            text = text.rstrip("\n") + f"\n\n### `{model.__name__}` {{#{_anchor(model)}}}\n\n{begin}\n{end}\n"
    return text


def render_pipeline_doc(text: str) -> str:
    """`text` with every generated field table replaced by a fresh one."""
    for model in schema_models():
        text = _block_re(model.__name__).sub(
            lambda _m, model=model: f"{_markers(model.__name__)[0]}\n{field_table(model)}\n{_markers(model.__name__)[1]}",
            text,
        )
    return text


def _params_marker(kind: str, name: str) -> str:
    return f"params {kind}/{name}"


def _replace_block(text: str, marker: str, body: str) -> str:
    begin, end = _markers(marker)
    return _block_re(marker).sub(lambda _m: f"{begin}\n{body}\n{end}", text)


def params_table(cls: type) -> str:
    params = getattr(cls, "Params", None)
    if params is None or not params.model_fields:
        return "No parameters."
    return field_table(params, header="parameter")


def render_components_doc(text: str) -> str:
    """`text` with every built-in component's parameter table replaced by a fresh one."""
    from kvflow.components import base

    reg = _registry()
    for kind, name, _ in _builtin_components():
        text = _replace_block(text, _params_marker(kind, name), params_table(reg.get(kind, name)))
    from kvflow.components import params as component_params

    for cls in (base.EvictorParams, base.PrunerParams, base.ScorerParams,  # the shared parameters
                component_params.AdaKVAllocation, component_params.PyramidAllocation):  # the allocation wrappers
        text = _replace_block(text, f"params {cls.__name__}", field_table(cls, header="parameter"))
    return text


KIND_TITLES = {"evictors": "Evictors", "pruners": "Pruners", "scorers": "Scorers", "committers": "Committers"}


def add_missing_component_sections(text: str) -> str:
    """Append a section (heading, parameter table, `::: module`) for every built-in component
    that has none, at the end of its kind's `## <Kind>` section."""
    for kind, name, target in _builtin_components():
        module = target.partition(":")[0]
        if re.search(rf"^::: {re.escape(module)}\s*$", text, re.M):
            if _block_re(_params_marker(kind, name)).search(text) is None:  # section without its table
                begin, end = _markers(_params_marker(kind, name))
                text = re.sub(rf"^(::: {re.escape(module)}\s*)$", lambda m: f"{begin}\n{end}\n\n{m.group(1)}",
                              text, count=1, flags=re.M)
            continue
        begin, end = _markers(_params_marker(kind, name))
        section = f"### `{name}`\n\n{begin}\n{end}\n\n::: {module}\n    options:\n      heading_level: 4\n\n"
        title = re.search(rf"^## {KIND_TITLES[kind]}\s*$", text, re.M)
        if title is None:
            text = text.rstrip("\n") + f"\n\n## {KIND_TITLES[kind]}\n\n" + section
            continue
        nxt = re.compile(r"^## ", re.M).search(text, title.end())
        at = nxt.start() if nxt else len(text)
        text = text[:at].rstrip("\n") + "\n\n" + section + text[at:]
    return text.rstrip("\n") + "\n"


def _cli_reference():
    """scripts/cli_reference.py, the generator of docs/cli.md's command reference."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def update_docs() -> list[str]:
    """Regenerate the generated parts of the docs; returns the files that changed."""
    changed = []
    for path, render in ((PIPELINE_DOC, lambda t: render_pipeline_doc(add_missing_model_sections(t))),
                         (COMPONENTS_DOC, lambda t: render_components_doc(add_missing_component_sections(t))),
                         (PLUGINS_DOC, render_plugins_doc),
                         (DOCS / "cli.md", lambda t: _cli_reference().render_doc(t))):
        old = _read(path)
        new = render(old)
        if new != old:
            path.write_text(new, encoding="utf-8")
            changed.append(str(path.relative_to(REPO)))
    return changed


def test_every_schema_field_is_documented():
    text = _read(PIPELINE_DOC)
    problems = []
    for model in schema_models():
        m = _block_re(model.__name__).search(text)
        if m is None:
            begin, end = _markers(model.__name__)
            problems.append(f"{model.__name__}: no field table in docs/pipeline-yaml.md; {UPDATE_HINT} "
                            f"(adds a section with the markers {begin} ... {end})")
            continue
        for name in model.model_fields:
            if not re.search(rf"^\| `{re.escape(name)}` \|", m.group(1), re.M):
                problems.append(f"{model.__name__}.{name} is missing from its table in docs/pipeline-yaml.md; {UPDATE_HINT}")
        if f"{{#{_anchor(model)}}}" not in text:
            problems.append(f"{model.__name__}: docs/pipeline-yaml.md has no heading with anchor {{#{_anchor(model)}}}")
    assert not problems, "\n".join(problems)


def test_schema_field_tables_are_up_to_date():
    if os.environ.get("KVFLOW_UPDATE_DOCS"):
        update_docs()
    text = _read(PIPELINE_DOC)
    assert render_pipeline_doc(text) == text, f"docs/pipeline-yaml.md field tables are stale; {UPDATE_HINT}"


# --------------------------------------------------------------------------- (c) doc examples validate


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A copy of ./pipelines, so doc examples can `include:` the shipped pipelines."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "pipelines", root / "pipelines")
    return root


PIPELINE_BLOCKS = _pipeline_blocks()


def test_docs_have_pipeline_examples():
    where = {w.split(":")[0] for w, _ in PIPELINE_BLOCKS}
    assert "README.md" in where and "docs/pipeline-yaml.md" in where, where


@pytest.mark.parametrize("where,text", PIPELINE_BLOCKS, ids=[w for w, _ in PIPELINE_BLOCKS])
def test_pipeline_block_validates(where, text, sandbox):
    """A block whose first line is a comment naming a file (``# pipelines/ablations/x.yaml``) is
    written there, so its relative `include:` resolves as in the repository; any other block is
    written into pipelines/."""
    from kvflow.config import load_pipeline

    first = re.match(r"\s*#\s*(pipelines/[\w./-]+\.ya?ml)\b", text)
    rel = first.group(1) if first else f"pipelines/_doc_{re.sub(r'[^A-Za-z0-9]+', '_', where)}.yaml"
    path = sandbox / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    load_pipeline(path, registry=_registry())


COMMANDS = _command_lines()


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_validates(where, argv):
    """The pipeline file and the --set/--unset overrides of a documented command are valid."""
    from kvflow.config import load_pipeline

    argv = argv[2:]
    paths, sets, unsets, i = sorted(REPO.glob(argv[0])), [], [], 1
    assert paths, f"{where}: {argv[0]} does not exist"
    while i < len(argv):
        opt = argv[i]
        if opt in ("--set", "-s", "--unset"):
            (unsets if opt == "--unset" else sets).append(argv[i + 1])
            i += 2
        elif opt.startswith("--set="):
            sets.append(opt.split("=", 1)[1])
            i += 1
        else:
            i += 1
    for path in paths:
        load_pipeline(path, sets=sets, unsets=unsets, registry=_registry())


def test_readme_plugin_example_works(monkeypatch):
    """The README's ten-line plugin registers, validates from YAML and stops a looping candidate."""
    import torch

    from kvflow.components.base import StepTrace
    from kvflow.config import load_pipeline
    from kvflow.registry import Registry

    blocks = [t for _, lang, t in code_blocks(README) if lang == "python" and "register_pruners" in t]
    assert len(blocks) == 1, "README.md should have one python block with the plugin example"
    module = types.ModuleType("my_pkg")
    monkeypatch.setitem(sys.modules, "my_pkg", module)
    exec(compile(blocks[0], "README.md:my_pkg", "exec"), module.__dict__)
    import kvflow_builtin

    reg = Registry.from_plugins([("builtin", kvflow_builtin), ("my_pkg", module)])
    assert "ngram" in reg.names("pruners")
    loaded = load_pipeline(REPO / "pipelines" / "quickstart.yaml", registry=reg,
                           sets=["proposers.base.pruners=[{kind: ngram, n: 8, threshold: 3}]"])
    (spec,) = loaded.components.proposers["base"].pruners
    pruner = spec.cls(spec.params)
    texts = ["Step 1: add. " * 10, "Step 1: 48 / 2 = 24 clips, so she sold 72 clips in total."]
    trace = StepTrace(entropies=torch.zeros(2, 64), n_tokens=torch.tensor([40, 40]), texts=texts)
    assert pruner.check(trace).tolist() == [True, False]


def test_plugins_page_evictor_example_works():
    """docs/plugins.md's sliding-window evictor keeps the newest `budget` tokens."""
    import torch

    from kvflow.components import EvictorParams

    blocks = [t for _, lang, t in code_blocks(DOCS / "plugins.md") if lang == "python" and "class RecentEvictor" in t]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/plugins.md", "exec"), namespace)
    evictor = namespace["RecentEvictor"](EvictorParams(budget=4, buffer=4, window=1))
    keys = torch.randn(2, 3, 10, 8)
    keep = evictor.select(keys, keys, None, layer_idx=0, lengths=torch.tensor([10, 7]),
                          n_protected=torch.tensor([0, 2]), generators=[])
    assert keep[0, 0].tolist() == [6, 7, 8, 9]
    assert keep[1, 2].tolist() == [0, 1, 5, 6]  # the protected prompt, then the newest


# --------------------------------------------------------------------------- results fields, CLI


def test_results_fields_are_documented(tmp_path):
    from kvflow.components.base import Step, Trajectory
    from kvflow.results.files import compute_metrics
    from kvflow.runtime.core import record as make_record

    traj = Trajectory("p1", "q?", "prompt", steps=[Step("a\n\n", "base", 0.5, 2, fallback=True)], finish="eos",
                      tokens_generated={"base": 2}, pruned={"entropy": 0}, candidates={"base": 1},
                      committed_tokens=2, signals=[{"step": 0}])
    plan = types.SimpleNamespace(proposers=[types.SimpleNamespace(name="base")])
    timing = {"wall": 1.0, "phases": {"propose/forward:base": 0.9, "other": 0.1}}
    record = make_record(traj, types.SimpleNamespace(id="p1", question="q?", gold="1"), "1", True, 1.0, plan, timing)
    import inspect

    kwargs = {}
    if "baselines" in inspect.signature(compute_metrics).parameters:  # adds `recovery`, `baselines`
        kwargs["baselines"] = {"full": str(tmp_path / "full"), "evicted": str(tmp_path / "evicted")}
    metrics = compute_metrics([record], ["base"], {"entropy": ["base"]}, **kwargs)
    text = _read(DOCS / "results.md")
    missing = [f"samples.jsonl: {k}" for k in [*record, *record["steps"][0]] if f"`{k}`" not in text]
    missing += [f"metrics.json: {k}" for k in metrics if f"`{k}`" not in text]
    assert not missing, "not described in docs/results.md: " + ", ".join(missing)


def test_every_cli_command_is_documented():
    import typer

    from kvflow.cli import app

    group = typer.main.get_command(app)
    text = _read(DOCS / "cli.md")
    missing = []
    for name, cmd in group.commands.items():
        if f"kvflow {name}" not in text:
            missing.append(name)
        for sub in getattr(cmd, "commands", {}) or {}:
            if f"kvflow {name} {sub}" not in text:
                missing.append(f"{name} {sub}")
    assert not missing, f"docs/cli.md does not document: {', '.join(missing)}"


# --------------------------------------------------------------------------- (d) mkdocs build --strict


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="docs extra not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(REPO / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "components" / "index.html").is_file()


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        changed = update_docs()
        print(f"updated: {', '.join(changed)}" if changed else "generated docs are up to date")
    else:
        print(textwrap.dedent(__doc__))
        sys.exit(2)
