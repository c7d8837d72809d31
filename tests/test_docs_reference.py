"""The documentation shows what a plugin author needs, where they read it (issue 34, 5):

- the API reference (mkdocstrings) renders `ScoreRequest`'s fields, `Scorer.score`, the
  constructors kvflow calls (`Scorer(params, context)`, `Committer(params, proposers)`) and
  what a committer does with None, nan and -inf scores;
- code the pages show from repository files is inline, equal to the file
  (`scripts/docs_inline.py`): a repository host renders no `--8<--` include, and tutorials
  read there showed empty code blocks;
- every relative link and every file a page, or a shipped pipeline's comment, names exists
  (pages cited a `METHODS.md` that the project does not contain), in the rendered API
  reference too.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("docs_inline", REPO / "scripts" / "docs_inline.py")
docs_inline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_inline)

PAGES = docs_inline.pages()
TOP = {p.name for p in REPO.iterdir()} - {".git", ".venv", "site"}
NAMED = re.compile(r"(?<![\w/.<{*-])((?:\.{1,2}/)?(?:[\w.-]+/)*[\w.-]+\.(?:md|py|ya?ml|toml|sh|txt))(?![\w/-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDERS = {"bench/script.py"}  # docs/benchmarks.md's template for a new section's title, not a file


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="docs extra not installed")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def page_text(site: Path, page: str) -> str:
    """A rendered page as plain text: tags dropped, entities decoded, whitespace collapsed."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", raw)))


def _spaced(text: str) -> str:
    """Punctuation of signatures spaced out and whitespace collapsed, so that a signature
    matches however the page wraps it."""
    return " " + re.sub(r"\s+", " ", re.sub(r"\s*([()\[\]:,]|->)\s*", r" \1 ", text)).strip() + " "


def test_the_api_reference_renders_what_a_plugin_author_needs(site):
    text = page_text(site, "plugins")
    for needle in [
        # ScoreRequest's fields, each described
        "ScoreRequest ( trajectory : Trajectory , candidate : Candidate )",
        "trajectory Trajectory The problem's committed trajectory so far",
        "candidate Candidate The proposed step",
        # the constructors kvflow calls
        "Scorer ( params : ScorerParams , context : ScorerContext )",
        "Committer ( params : CommitterParams , proposers : Sequence [ str ] )",
        "Pruner ( params : PrunerParams )", "Evictor ( params : EvictorParams )",
        # Scorer.score and Committer.pick, with the None / nan / -inf rule
        "score ( requests : Sequence [ ScoreRequest ] ) -> list [ float ]",
        "Required. One score per request, in request order",
        "pick ( candidates : Sequence [ Candidate ] ) -> int",
        "None : not scored", "nan or -inf : the scorer could not score it",
        "should rank None and nan below every scored candidate",
    ]:
        assert _spaced(needle) in _spaced(text), needle


def test_tutorials_show_their_code_inline_not_through_include_directives():
    snippets = [f"{p.relative_to(REPO)}:{i}" for p in PAGES
                for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                if docs_inline.SNIPPET.match(line.strip())]
    assert not snippets, f"include directives (empty where the repository is browsed): {snippets}"
    shown = [p for p in PAGES if "<!-- docs-inline:" in p.read_text(encoding="utf-8")]
    assert {"docs/tutorials/detector-plugin.md", "docs/tutorials/eviction-plugin.md"} <= \
        {str(p.relative_to(REPO)) for p in shown}


def test_every_inline_block_equals_the_file_it_shows():
    """Edit the file and run `python scripts/docs_inline.py`: the block follows."""
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = docs_inline.MARKER.match(line)
            if not m:
                continue
            end = lines.index("```", i + 2)
            path, _ = docs_inline.split_ref(m["ref"])
            where = f"{page.relative_to(REPO)}:{i + 1}"
            assert lines[i + 2] == f"# {path}", f"{where}: the block's first line names its file"
            assert lines[i + 3 : end] == docs_inline.source(m["ref"]), (
                f"{where}: the block differs from {m['ref']}; run python scripts/docs_inline.py")


def _named_files(text: str) -> list[str]:
    """Repository paths a text names: `dir/.../file.ext` under a top-level entry of the
    repository, `./` or `../` paths, and upper-case `NAME.md` files."""
    out = []
    for m in NAMED.finditer(text):
        name = m.group(1)
        first = name.split("/")[0]
        if first in TOP or first in (".", "..") or re.fullmatch(r"[A-Z][A-Z_]*\.md", name):
            out.append(name)
    return out


def _exists(name: str, *bases: Path) -> bool:
    return any((base / name).exists() for base in (*bases, REPO))


def test_every_relative_link_and_named_file_in_the_docs_resolves():
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(REPO)
        fenced = False
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("```"):
                fenced = not fenced
                continue
            for target in LINK.findall(line):
                target = target.split("#")[0].split("?")[0]
                if target and not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists():
                    missing.append(f"{rel}:{n}: link to {target}")
            # prose only: code blocks name files the reader writes (`# pipelines/mine.yaml`),
            # and their `include:`s are checked by tests/test_docs.py, which validates them
            for name in [] if fenced else _named_files(line):
                if name not in PLACEHOLDERS and not _exists(name, page.parent):
                    missing.append(f"{rel}:{n}: names {name}")
    assert not missing, "\n".join(missing)


def test_every_file_a_pipelines_comment_names_exists():
    missing = []
    for path in sorted((REPO / "pipelines").rglob("*.y*ml")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line.partition("#")[2] if line.lstrip().startswith("#") else line.partition(" #")[2]
            names = _named_files(comment) + re.findall(r"(?<![\w/.-])([\w.-]+\.ya?ml)\b", comment)
            for name in names:
                if not _exists(name, path.parent, REPO / "pipelines"):
                    missing.append(f"{path.relative_to(REPO)}:{n}: names {name}")
    assert not missing, "\n".join(missing)


def test_the_rendered_pages_name_no_missing_file(site):
    """Docstrings rendered by mkdocstrings are pages too (the evictors' modules cited METHODS.md)."""
    missing = []
    for index in sorted(site.rglob("index.html")):
        page = index.parent.relative_to(site)
        text = page_text(site, str(page)) if str(page) != "." else ""
        for name in set(re.findall(r"\b[A-Z][A-Z_]*\.md\b", text)):
            if not _exists(name):
                missing.append(f"{page}: names {name}")
    assert not missing, "\n".join(missing)
