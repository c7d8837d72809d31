"""Every code example in README.md and docs/ that defines a component passes the contract
suite those pages tell its reader to run (issue 34, 3).

Each ```python block of a page is a module of its own (a snippet, one that does not begin
with the `# path.py` of the file it is, gets a module docstring: the reader's module has
one); a block that defines a subclass of
`Evictor`, `Pruner`, `Scorer` or `Committer` gets a test class of the kind's suite
(`kvflow.testing.<kind>_contract`), written the way docs/plugins.md says ("Testing a
plugin"), and all of them run in one pytest subprocess, as a plugin author would run them.
Blocks that are copies of a repository file (`docs_inline`: tutorials) are left to that
file's own tests (the example plugins run their contract suites themselves). The suites' engine
axes (`[sglang]`, `[vllm]`: the same component on every engine) are left out here: each starts
engines of its own in the subprocess (about 50 s of `make test` on 2 cores), and the example
plugins' suites (plugins/kvflow-example-*: a third-party evictor and pruner) run them.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
FILE_COMMENT = re.compile(r"^# [\w./-]+\.py\s*$", re.M)  # a block that is a whole file says which: `# my_pkg/x.py`
SUITES = {  # base class -> (suite module, suite class, factory fixture, factory body)
    "Evictor": ("evictor_contract", "EvictorContract", "evictor_factory",
                "lambda **params: {cls}({cls}.Params(**params))"),
    "Pruner": ("pruner_contract", "PrunerContract", "pruner_factory",
               "lambda **params: {cls}({cls}.Params(**params))"),
    "Scorer": ("scorer_contract", "ScorerContract", "scorer_factory",
               "lambda context, **params: {cls}({cls}.Params(**params), context)"),
    "Committer": ("committer_contract", "CommitterContract", "committer_factory",
                  "lambda proposers, **params: {cls}({cls}.Params(**params), proposers)"),
}


def code_blocks(page: Path, lang: str = "python") -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every fenced block of `lang`, dedented (blocks
    may sit inside list items); blocks right after a `docs_inline` marker are skipped."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        inlined = start > 0 and "docs-inline:" in lines[start - 1]
        if m["lang"] == lang and not inlined:
            out.append((start + 1, textwrap.dedent("\n".join(body)) + "\n"))
    return out


def _component_classes(code: str) -> list[tuple[str, str]]:
    """(class name, kind base) of the classes a block defines, by the names of their bases:
    a direct subclass of a kind's base, or of a class of the block that is one."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                kind = name if name in SUITES else found.get(name)
                if kind is None and name.endswith(tuple(SUITES)) and name not in found:
                    kind = next(k for k in SUITES if name.endswith(k))  # e.g. an imported MyEvictor
                if kind:
                    found[node.name] = kind
    return list(found.items())


def examples() -> list[tuple[str, int, str, list[tuple[str, str]]]]:
    """(page, line, code, [(class, kind)]) of every block that defines a component."""
    out = []
    for page in PAGES:
        for line, code in code_blocks(page):
            try:
                classes = _component_classes(code)
            except SyntaxError:
                continue  # fragments (a signature, `...`) are not modules
            if classes:
                out.append((str(page.relative_to(REPO)), line, code, classes))
    return out


def test_the_headline_examples_are_found():
    """The extractor sees the examples the issue is about (it would pass on finding none)."""
    found = {(page, cls) for page, _, _, classes in examples() for cls, _ in classes}
    assert {("README.md", "NgramPruner"), ("docs/plugins.md", "NgramPruner"),
            ("docs/plugins.md", "RecentEvictor"), ("docs/plugins.md", "LowConfidencePruner")} <= found, found


def test_every_component_example_passes_its_contract_suite(tmp_path):
    lines = ["import importlib", "", "import pytest", ""]
    for k, (page, line, code, classes) in enumerate(examples()):
        module = f"doc_example_{k}"
        if not FILE_COMMENT.match(code):  # a snippet: the reader pastes it into a module of their own
            code = f'"""The example at {page}:{line}."""\n\n' + code
        (tmp_path / f"{module}.py").write_text(code, encoding="utf-8")
        for cls, kind in classes:
            suite_module, suite, fixture, body = SUITES[kind]
            tag = re.sub(r"\W", "_", f"{page}_L{line}_{cls}")
            lines += [
                f"from kvflow.testing.{suite_module} import {suite}  # noqa: E402",
                "",
                "",
                f"class Test_{tag}({suite}):",
                f'    """{cls} of {page}:{line}."""',
                "",
                "    @pytest.fixture(scope='class')",
                "    @classmethod",
                f"    def {fixture}(cls):",
                f"        component = importlib.import_module({module!r}).{cls}",
                f"        return {body.format(cls='component')}",
                "",
            ]
    (tmp_path / "test_doc_examples_generated.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-W", "error::pytest.PytestRemovedIn10Warning", "-k", "not sglang and not vllm",
                           "test_doc_examples_generated.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
