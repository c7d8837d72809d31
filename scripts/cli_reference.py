"""Generate the command reference of docs/cli.md from the Typer app (`kvflow.cli.app`).

    .venv/bin/python scripts/cli_reference.py           # rewrite the generated part of docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check   # exit 1 if docs/cli.md is out of date

The reference sits between ``<!-- BEGIN GENERATED: cli -->`` and ``<!-- END GENERATED: cli -->``;
everything outside the markers is hand-written. It walks the command tree (groups'
subcommands too) and gives, for each command: a heading with the anchor ``kvflow-<name>``,
the usage line, the command's docstring as markdown (also the part after ``\\f``, which
``--help`` leaves out: put examples and links there), and its arguments and options as
``--help`` describes them. tests/test_cli_reference.py fails when the file is stale.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI_DOC = REPO / "docs" / "cli.md"
BEGIN, END = "<!-- BEGIN GENERATED: cli -->", "<!-- END GENERATED: cli -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)


def _cell(text: str) -> str:
    """Markdown table-cell text: `|` escaped and `<`/`>` made literal outside code spans."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _help_markdown(command) -> str:
    """The command's docstring: both sides of ``\\f``, click's ``\\b`` markers dropped."""
    text = inspect.cleandoc(command.help or "")
    text = "\n\n".join(part.strip() for part in text.split("\f") if part.strip())
    return "\n".join(line for line in text.splitlines() if line.strip() != "\b")


def _params_tables(command, ctx) -> str:
    arguments, options = [], []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or getattr(param, "hidden", False) or param.name == "help":
            continue
        names, help_text = record
        if getattr(param, "multiple", False):
            help_text += " (repeatable)"
        row = f"| `{' '.join(names.split())}` | {_cell(help_text)} |"
        (options if param.param_type_name == "option" else arguments).append(row)
    tables = []
    for title, rows in (("argument", arguments), ("option", options)):
        if rows:
            tables.append("\n".join([f"| {title} | description |", "| --- | --- |", *rows]))
    return "\n\n".join(tables)


def _usage(command, ctx) -> str:
    return " ".join(command.get_usage(ctx).split()).removeprefix("Usage: ")


def _commands(group, ctx, prefix: str):
    """(full name, command, context) of every command under `group`, depth first, in order."""
    from typer._click import Context

    for name, command in group.commands.items():
        sub = Context(command, info_name=name, parent=ctx)
        full = f"{prefix} {name}"
        yield full, command, sub
        if getattr(command, "commands", None):
            yield from _commands(command, sub, full)


def render_reference() -> str:
    """The generated part of docs/cli.md (without the markers)."""
    import typer
    from typer._click import Context

    from kvflow.cli import app

    root = typer.main.get_command(app)
    ctx = Context(root, info_name="kvflow")
    commands = list(_commands(root, ctx, "kvflow"))
    out = [f"```text\n{_usage(root, ctx)}\n```", _help_markdown(root), _params_tables(root, ctx)]
    summary = ["| command | what it does |", "| --- | --- |"]
    for full, command, _ in commands:
        first = _help_markdown(command).split("\n\n")[0]
        summary.append(f"| [`{full}`](#{full.replace(' ', '-')}) | {_cell(first)} |")
    out.append("\n".join(summary))
    for full, command, sub in commands:
        level = "#" * (1 + full.count(" "))
        section = [f"{level} `{full}` {{#{full.replace(' ', '-')}}}", f"```text\n{_usage(command, sub)}\n```",
                   _help_markdown(command), _params_tables(command, sub)]
        out.append("\n\n".join(s for s in section if s))
    return "\n\n".join(s for s in out if s)


def render_doc(text: str) -> str:
    """`text` (docs/cli.md) with its generated block replaced by a fresh one."""
    if not BLOCK.search(text):
        raise SystemExit(f"{CLI_DOC}: no {BEGIN} ... {END} block")
    return BLOCK.sub(lambda _m: f"{BEGIN}\n{render_reference()}\n{END}", text)


def main(argv: list[str]) -> int:
    old = CLI_DOC.read_text(encoding="utf-8")
    new = render_doc(old)
    if argv == ["--check"]:
        if new != old:
            print(f"{CLI_DOC.relative_to(REPO)} is out of date; regenerate with: python scripts/cli_reference.py")
            return 1
        return 0
    if argv:
        print(__doc__)
        return 2
    if new != old:
        CLI_DOC.write_text(new, encoding="utf-8")
        print(f"updated: {CLI_DOC.relative_to(REPO)}")
    else:
        print(f"{CLI_DOC.relative_to(REPO)} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
