"""The layer rules of docs/architecture.md, checked on the source: a module imports only its own
layer and the layers below it (lazy imports inside functions count too), no import circles
between modules, and what runs inside an engine's worker process is imported by nothing on
kvflow's side but the modules the rule allows. Fails naming every import that breaks a rule."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO
from test_imports import _circles as circles  # Tarjan's, as issue 35's circle test reads it

#: the layers, bottom to top: (name, module prefixes); a module belongs to the layer of its
#: longest matching prefix. Keep in step with docs/architecture.md.
LAYERS = [
    ("foundations", ["kvflow", "kvflow._lazy", "kvflow.errors", "kvflow.jsonfile", "kvflow.timing",
                     "kvflow.versions", "kvflow.hookspecs", "kvflow.registry", "kvflow.faults",
                     "kvflow.kv_memory", "kvflow.outputs"]),
    ("components", ["kvflow.components"]),
    ("models", ["kvflow.models"]),
    ("config", ["kvflow.config", "kvflow.eval"]),
    ("backends", ["kvflow.backends"]),
    ("planning", ["kvflow.planning.demands", "kvflow.planning.placement"]),
    ("built-in components", ["kvflow_builtin"]),
    ("results", ["kvflow.results"]),
    ("runtime", ["kvflow.runtime"]),
    ("readers and services", ["kvflow.report", "kvflow.view", "kvflow.serve", "kvflow.testing"]),
    ("commands", ["kvflow.commands", "kvflow.cli", "kvflow.tools.explain", "kvflow.tools.sweep", "kvflow.tools.calibrate",
                  "kvflow.tools.calibrate_bits", "kvflow.tools.doctor", "kvflow.tools.cost", "kvflow.tools.json_schema"]),
]
#: inside backends/, the rooms each backend room may import: a backend imports the core
#: (base, served), never another backend
BACKEND_ROOMS = {"base": {"base"}, "served": {"base", "served"}, "hf": {"base", "hf"},
                 "sglang": {"base", "served", "sglang"}, "vllm": {"base", "served", "vllm"}}
#: the exceptions, each with its reason: vLLM's in-worker evicted requests keep their KV in
#: hf's BudgetedCache until they evict inside vLLM's own blocks (the vLLM eviction issue)
ALLOWED_ACROSS = {("kvflow.backends.vllm.in_worker.beside", "kvflow.backends.hf")}
SOURCES = {"kvflow": REPO / "src" / "kvflow", "kvflow_builtin": REPO / "plugins" / "kvflow_builtin"}


def modules() -> dict[str, Path]:
    out = {}
    for top, base in SOURCES.items():
        for path in base.rglob("*.py"):
            name = ".".join(path.relative_to(base.parent).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict) -> set[str]:
    """The kvflow modules `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known}


def _rank(module: str, table: list) -> tuple[int, str]:
    best = (-1, "", "")
    for i, entry in enumerate(table):
        prefixes = entry[1] if isinstance(entry, tuple) else entry
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[2]):
                best = (i, entry[0] if isinstance(entry, tuple) else prefix, prefix)
    return best[0], best[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def _backend_room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvflow", "backends"] else ""


def layer_breaks(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(edges.items()):
        mine, name = _rank(module, LAYERS)
        for target in sorted(targets):
            theirs, their_name = _rank(target, LAYERS)
            if theirs > mine:
                out.append(f"{module} ({name}) imports {target} ({their_name}), a layer above it")
            room, their_room = _backend_room(module), _backend_room(target)
            if room and their_room and their_room not in BACKEND_ROOMS.get(room, set()) and not any(
                    module.startswith(a) and target.startswith(b) for a, b in ALLOWED_ACROSS):
                out.append(f"{module} imports {target}: backends/{room} imports only the core "
                           "(backends/base, backends/served) and itself, never another backend")
    return out


def test_every_module_is_in_a_layer():
    assert [m for m in modules() if _rank(m, LAYERS)[0] < 0] == []


def test_the_top_level_holds_foundations_only():
    """src/kvflow/'s own modules are the foundations (and the CLI's entry point): commands' work
    is in kvflow.tools, planning in kvflow.planning, every other layer a package of its own."""
    top = [m for m, path in modules().items() if path.parent == SOURCES["kvflow"] and path.name != "__init__.py"]
    assert sorted(m for m in top if _rank(m, LAYERS)[1] != "foundations") == ["kvflow.cli"]


def test_no_module_imports_a_layer_above_its_own():
    assert layer_breaks(graph()) == []


def test_no_import_circles_even_through_type_imports_or_the_built_in_plugins():
    """tests/test_imports.py's circle test over src/kvflow, here with imports under
    TYPE_CHECKING counted too (a type-only circle still ties two modules' designs) and with
    the built-in plugins' package in the graph."""
    assert circles(graph()) == []


def test_kvflow_side_reads_only_the_profile_of_the_in_worker_code():
    """kvflow's process imports nothing of what runs inside an engine's worker but the SGLang
    decode profile (`in_worker.graph`), which both sides read."""
    edges = graph()
    inside = [m for m in edges if ".in_worker" in m]
    crossing = sorted(f"{m} imports {t}" for m, ts in edges.items() if ".in_worker" not in m and not m.startswith(
        "kvflow.testing") for t in ts if t in inside and not t.endswith("in_worker.graph"))
    assert crossing == []


def test_the_rule_fails_on_an_upward_import(tmp_path):
    """The checker itself: a foundation importing the runtime is reported."""
    edges = {"kvflow.errors": {"kvflow.runtime.scheduler"}, "kvflow.runtime.scheduler": set()}
    assert layer_breaks(edges) == ["kvflow.errors (foundations) imports kvflow.runtime.scheduler (runtime), "
                                   "a layer above it"]
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert layer_breaks({"kvflow.backends.sglang.engine": {"kvflow.backends.vllm.engine"}}) == [
        "kvflow.backends.sglang.engine imports kvflow.backends.vllm.engine: backends/sglang imports only the core "
        "(backends/base, backends/served) and itself, never another backend"]
