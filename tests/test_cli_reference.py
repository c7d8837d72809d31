"""docs/cli.md's command reference is generated from the Typer app by scripts/cli_reference.py
and must match the app: a new command, option or docstring change makes this test fail until
`python scripts/cli_reference.py` is run."""

from __future__ import annotations

import importlib.util

import typer

from conftest import REPO

_spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
cli_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_reference)


def test_cli_reference_is_up_to_date():
    text = cli_reference.CLI_DOC.read_text(encoding="utf-8")
    assert cli_reference.render_doc(text) == text, "docs/cli.md is stale; regenerate: python scripts/cli_reference.py"
    assert cli_reference.main(["--check"]) == 0


def test_every_command_option_and_docstring_is_in_the_reference():
    from typer._click import Context

    from kvflow.cli import app

    reference = cli_reference.render_reference()
    root = typer.main.get_command(app)
    for full, command, ctx in cli_reference._commands(root, Context(root, info_name="kvflow"), "kvflow"):
        assert f"`{full}` {{#{full.replace(' ', '-')}}}" in reference, full
        assert cli_reference._help_markdown(command).split("\n\n")[0] in reference
        for param in command.get_params(ctx):
            if param.param_type_name == "option" and param.name != "help":
                assert f"`{' '.join(param.get_help_record(ctx)[0].split())}`" in reference, (full, param.name)


def test_a_new_command_makes_the_reference_stale(monkeypatch):
    from kvflow.cli import app

    def frobnicate(level: int = typer.Option(3, "--level", help="How much.")) -> None:
        """Frobnicate the pipelines.

        More words for the docs.
        \f
        ```sh
        kvflow frobnicate --level 4
        ```
        """

    monkeypatch.setattr(app, "registered_commands", [*app.registered_commands])
    app.command()(frobnicate)
    reference = cli_reference.render_reference()
    assert "## `kvflow frobnicate` {#kvflow-frobnicate}" in reference
    assert "More words for the docs." in reference and "kvflow frobnicate --level 4" in reference
    assert "| `--level <int>` | How much. [default: 3] |" in reference
    assert cli_reference.main(["--check"]) == 1
