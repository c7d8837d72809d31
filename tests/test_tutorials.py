"""Every code block of the tutorials (docs/tutorials/*.md) is exercised, page by page in
order, in a sandbox holding a copy of ./pipelines (so a block can write a pipeline that a
later command uses) and a link to ./plugins:

- a block that only includes files (pymdownx.snippets: `--8<-- "path"` or `"path:section"`),
  or an inline copy of one (after `<!-- docs-inline: path[:section] -->`, kept equal to the
  file by scripts/docs_inline.py and tests/test_docs_reference.py), shows the real file: the file and section must exist; included Python
  is compiled, pipelines validated, TOML parsed (the files' behaviour is tested elsewhere:
  the example plugins' own tests, tests/test_example_plugins.py, tests/test_config.py);
- python: executed in a fresh namespace in the sandbox;
- yaml: a pipeline (top-level `kvflow: 1` or `include:`) is written where its first-line
  comment says (`# pipelines/...yaml`, else pipelines/_tutorial_<line>.yaml) and validated;
- toml: parsed, and a `[project.entry-points.kvflow]` table must name importable modules;
- sh: each line is one command. `kvflow ...` is parsed by the real CLI (an unknown option or
  command fails), then `validate`, `explain`, `ls`, `plugins`, `schema`, `cost`, `models ls`
  and `--help` are run in-process and must exit 0 (or the tagged code); `run` is validated
  with its overrides, and with every `--sweep` point, without running; the rest (`report`,
  `calibrate`, `models pull` ...) are parsed only. `pip install -e DIR`, `pytest PATH`,
  `make TARGET` and `bash SCRIPT` must name things that exist; other commands fail;
- text: only as a directory listing tagged `tree DIR`, whose files must all exist.

A tag is an HTML comment on the line before a fence: `<!-- test: tree DIR -->`,
`<!-- test: expect-exit N -->` (every command of the shell block exits N), or
`<!-- test: compile -->` (a python block is compiled, not run).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO

TUTORIALS = REPO / "docs" / "tutorials"
PAGES = sorted(TUTORIALS.glob("*.md"))
CHEAP = {("validate",), ("explain",), ("ls",), ("plugins",), ("schema",), ("cost",), ("models", "ls"), ()}
SNIPPET = re.compile(r'^--8<--\s+"([^":]+)(?::([\w-]+))?"\s*$')
FENCE = re.compile(r"^(```+)\s*([\w+-]*)")
TAG = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
INLINE = re.compile(r"^<!-- docs-inline: ([^\s:]+)(?::([\w-]+))? -->$")


@dataclass
class Block:
    line: int  # of the opening fence
    lang: str
    text: str
    tag: str  # "" when untagged
    inline: tuple = ()  # (file, section) of an inline copy of a repository file


def blocks(path: Path) -> list[Block]:
    lines, out, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        tag = TAG.match(prev)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(m.group(1)))
        copy = INLINE.match(prev)
        out.append(Block(i + 1, m.group(2).lower(), "\n".join(lines[i + 1:end]) + "\n", tag.group(1) if tag else "",
                         (REPO / copy.group(1), copy.group(2) or "") if copy else ()))
        i = end + 1
    return out


# --------------------------------------------------------------------------- included files


def included(text: str) -> list[tuple[Path, str]]:
    """(file, section) of each snippet line, or [] if the block is not only snippet lines."""
    found = [SNIPPET.match(line.strip()) for line in text.strip().splitlines()]
    if not found or not all(found):
        return []
    return [(REPO / m.group(1), m.group(2) or "") for m in found]


def check_included(block: Block, files: list[tuple[Path, str]], registry) -> None:
    from kvflow.config import load_pipeline

    for path, section in files:
        assert path.is_file(), f"included file {path.relative_to(REPO)} does not exist"
        source = path.read_text(encoding="utf-8")
        if section:
            assert f"--8<-- [start:{section}]" in source and f"--8<-- [end:{section}]" in source, (
                f"{path.relative_to(REPO)} has no snippet section '{section}'")
        if block.lang == "python":
            compile(source, str(path), "exec")
        elif block.lang in ("yaml", "yml"):
            load_pipeline(path, registry=registry)
        elif block.lang == "toml":
            tomllib.loads(source)
        else:
            raise AssertionError(f"don't know how to check an included {block.lang or 'untyped'} file")


# --------------------------------------------------------------------------- languages


def check_python(block: Block, sandbox: Path) -> None:
    code = compile(block.text, f"<tutorial block at line {block.line}>", "exec")
    if block.tag != "compile":
        with contextlib.chdir(sandbox):
            exec(code, {"__name__": "tutorial_block"})


def check_yaml(block: Block, sandbox: Path, registry) -> None:
    from kvflow.config import load_pipeline

    assert re.search(r"^(kvflow:\s*1\b|include:)", block.text, re.M), "a YAML block must be a pipeline"
    first = re.match(r"\s*#\s*(pipelines/[\w./-]+\.ya?ml)\b", block.text)
    path = sandbox / (first.group(1) if first else f"pipelines/_tutorial_{block.line}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.text, encoding="utf-8")
    load_pipeline(path, registry=registry)


def check_toml(block: Block) -> None:
    import importlib.util

    data = tomllib.loads(block.text)
    for name, module in data.get("project", {}).get("entry-points", {}).get("kvflow", {}).items():
        assert importlib.util.find_spec(module.split(":")[0]) is not None, f"entry point {name}: no module {module}"


def check_tree(block: Block) -> None:
    root = REPO / block.tag.split(None, 1)[1]
    listed = [line.split("#")[0].strip() for line in block.text.splitlines()[1:] if line.split("#")[0].strip()]
    assert listed, "an empty tree"
    for rel in listed:
        assert (root / rel).exists(), f"{root.relative_to(REPO)}/{rel} does not exist"


# --------------------------------------------------------------------------- shell


def parse_cli(args: list[str]):
    """(command path, parsed parameters) of `kvflow ARGS`, parsed by the real CLI, nothing run."""
    import typer

    from kvflow.cli import app

    group = typer.main.get_command(app)
    ctx = group.make_context("kvflow", list(args))
    rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
    path: list[str] = []
    command = group
    while getattr(command, "commands", None) and rest and rest[0] in command.commands:
        path.append(rest.pop(0))
        command = command.commands[path[-1]]
        if getattr(command, "commands", None):
            ctx = command.make_context(path[-1], list(rest), parent=ctx)
            rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
    if "--help" in args:
        return tuple(), {}
    assert path and not getattr(command, "commands", None), f"no such command: kvflow {' '.join(args)}"
    sub = command.make_context(path[-1], rest, parent=ctx)
    return tuple(path), sub.params


@contextlib.contextmanager
def environment(env: dict):
    from kvflow.registry import set_registry

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    set_registry(None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        set_registry(None)


def check_kvflow(args: list[str], env: dict, expect: int, sandbox: Path) -> None:
    from typer.testing import CliRunner

    from kvflow.cli import app
    from kvflow.config import load_pipeline
    from kvflow.registry import get_registry
    from kvflow.tools.sweep import load_points, parse_sweeps

    command, params = parse_cli(args)
    with environment(env), contextlib.chdir(sandbox):
        if command in CHEAP:
            result = CliRunner().invoke(app, args)
            assert result.exit_code == expect, f"exit {result.exit_code}, expected {expect}:\n{result.output}"
        elif command == ("run",):
            sets, unsets = params.get("set_") or (), params.get("unset") or ()
            if params.get("sweep"):
                load_points(params["file"], parse_sweeps(params["sweep"]), sets, unsets, registry=get_registry())
            else:
                load_pipeline(params["file"], sets=sets, unsets=unsets, registry=get_registry())


def check_other(argv: list[str]) -> None:
    program, args = argv[0], argv[1:]
    if program in ("pip", "pip3") and args[:1] == ["install"]:
        dirs = [a for a in args[1:] if not a.startswith("-")]
        assert dirs and all((REPO / d / "pyproject.toml").is_file() for d in dirs), f"not installable: {dirs}"
    elif program == "pytest" or argv[:3] == ["python", "-m", "pytest"]:
        if program == "python":
            args = args[2:]
        paths, value = [], False  # options and their values (-k EXPR, -m MARK) are not paths
        for a in args:
            if not value and not a.startswith("-"):
                paths.append(a)
            value = a in ("-k", "-m")
        assert all((REPO / p).exists() for p in paths), f"no such test path: {paths}"
    elif program == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        assert all(a in targets for a in args), f"no such make target: {args} (targets: {targets})"
    elif program == "bash":
        assert (REPO / args[0]).is_file(), f"no such script: {args[0]}"
    else:
        raise AssertionError(f"unhandled command {program!r}: teach tests/test_tutorials.py how to check it")


def check_shell(block: Block, sandbox: Path) -> None:
    expect = int(block.tag.split()[1]) if block.tag.startswith("expect-exit") else 0
    commands = 0
    for raw in block.text.splitlines():
        argv = shlex.split(raw, comments=True)
        if not argv:
            continue
        env = {}
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        commands += 1
        try:
            if argv[0] == "kvflow":
                check_kvflow(argv[1:], env, expect, sandbox)
            else:
                check_other(argv)
        except Exception as e:  # noqa: BLE001 - reported with the command line
            raise AssertionError(f"`{raw.strip()}`: {type(e).__name__}: {e}") from e
    assert commands, "an empty shell block"


# --------------------------------------------------------------------------- the tests


@pytest.fixture
def sandbox(tmp_path):
    shutil.copytree(REPO / "pipelines", tmp_path / "pipelines")
    (tmp_path / "plugins").symlink_to(REPO / "plugins")
    return tmp_path


def test_the_five_tutorials_are_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    names = {p.name for p in PAGES}
    assert {"eviction-plugin.md", "detector-plugin.md", "ablation-and-sweep.md", "paper-tables-gpu.md",
            "cpu-reproduction.md"} <= names
    missing = [n for n in names if f"tutorials/{n}" not in nav]
    assert not missing, f"not in mkdocs.yml nav: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_code_block_runs_or_validates(page, sandbox):
    from kvflow.registry import Registry

    registry = Registry.from_entry_points()
    problems = []
    for block in blocks(page):
        try:
            files = included(block.text) or ([block.inline] if block.inline else [])
            if files:
                check_included(block, files, registry)
            elif block.tag.startswith("tree "):
                check_tree(block)
            elif block.lang == "python":
                check_python(block, sandbox)
            elif block.lang in ("yaml", "yml"):
                check_yaml(block, sandbox, registry)
            elif block.lang == "toml":
                check_toml(block)
            elif block.lang in ("sh", "bash", "shell", "console"):
                check_shell(block, sandbox)
            else:
                raise AssertionError(f"a {block.lang or 'untyped'} block that nothing checks (tag it, or show a file)")
        except Exception as e:  # noqa: BLE001 - collect every block's problem
            problems.append(f"{page.relative_to(REPO)}:{block.line}: {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)


def test_shell_checks_catch_a_wrong_option_and_a_failing_command(sandbox):
    bad_option = Block(1, "sh", "kvflow validate pipelines/quickstart.yaml --sett a=1\n", "")
    with pytest.raises(AssertionError, match="--sett"):
        check_shell(bad_option, sandbox)
    failing = Block(1, "sh", "kvflow validate pipelines/quickstart.yaml --set proposers.base.n=0\n", "")
    with pytest.raises(AssertionError, match="exit 2, expected 0"):
        check_shell(failing, sandbox)
    bad_run = Block(1, "sh", "kvflow run pipelines/quickstart.yaml --sweep proposers.base.evictor.budgt=1,2\n", "")
    with pytest.raises(AssertionError, match="budgt"):
        check_shell(bad_run, sandbox)
    with pytest.raises(AssertionError, match="unhandled command 'curl'"):
        check_shell(Block(1, "sh", "curl https://example.com\n", ""), sandbox)
