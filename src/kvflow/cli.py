"""The `kvflow` command line (typer + rich).

    kvflow validate FILE... [--set PATH=VALUE] [--unset PATH]
    kvflow ls [evictors|pruners|scorers|committers|proposers|backends|pipelines]
    kvflow plugins [--json]
    kvflow run FILE [--set ...] [--unset ...] [--force] [--sweep PATH=V1,V2,... ...]
    kvflow serve FILE [--set ...] [--unset ...] [--host 127.0.0.1] [--port 8000] [--grace S] [--api-key K] [--record DIR]
    kvflow models pull NAME | kvflow models ls
    kvflow calibrate RESULTS_DIR [--bins 40] [--out DIR] [--no-plots]
    kvflow report DIR... [--out DIR] [--allow-mixed] [--oracle-evicted DIR --oracle-helper DIR --oracle-full DIR]
    kvflow view DIR... [-o/--out FOLDER] [--serve [--port N]]
    kvflow schema [--output FILE]
    kvflow explain FILE [--set ...] [--unset ...]
    kvflow cost MODEL... [--budget 512 --buffer 128 --lengths 1k,2k,4k,8k --helper MODEL --png FILE]
    kvflow doctor [PIPELINE] [--engines hf,sglang] [--gpus NxGB]

The commands themselves are in kvflow.commands, one module per group; this module only builds
the Typer app, its root options and the order of its commands.

Exit codes: 0 ok, 2 user error (bad pipeline, bad override...), 4 plugin error under
`--strict-plugins`, 130 interrupted. User errors are printed as ``file:line: path: message``
without a traceback. Only `run` may import torch/transformers, and only inside the command,
so `--help`, `validate`, `ls` and `plugins` stay fast.
"""

from __future__ import annotations

import typer

import kvflow
from kvflow.commands import calibrate, common, components, cost, doctor, models, pipelines, results, run, serve

app = typer.Typer(
    name="kvflow",
    help="Step-level decoding pipelines for KV-cache eviction research (KV-Rescue and friends).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # help texts are markdown, as in the generated docs/cli.md
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvflow {kvflow.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    strict_plugins: bool = typer.Option(
        False, "--strict-plugins", help="Fail (exit 4) if any plugin fails to load; also KVFLOW_STRICT_PLUGINS=1."
    ),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    common.state["strict"] = strict_plugins


# the commands, in the order `kvflow --help` lists them
app.command()(pipelines.validate)
app.command("ls")(components.ls)
app.command()(components.plugins)
app.command()(run.run)
app.command()(serve.serve)
app.command()(pipelines.schema)
app.command()(pipelines.explain)
app.command()(results.report)
app.command()(results.view)
app.command()(cost.cost)
app.command()(calibrate.calibrate)
app.command("calibrate-bits")(calibrate.calibrate_bits)
app.add_typer(models.models_app, name="models")
app.command()(doctor.doctor)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="kvflow")


if __name__ == "__main__":  # pragma: no cover
    main()
