"""`kvflow ls`, `kvflow plugins`: the installed components and the plugins that registered
them, and the pipeline files under ./pipelines."""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from kvflow.commands.common import errors, plugin_registry, rich_console
from kvflow.errors import UserError


class LsWhat(str, Enum):
    evictors = "evictors"
    pruners = "pruners"
    scorers = "scorers"
    committers = "committers"
    backends = "backends"
    pipelines = "pipelines"


def _fmt_defaults(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) and v != "<required>" else f"{k}={v}" for k, v in defaults.items())


def _components_table(kind: str):
    from rich.table import Table

    reg = plugin_registry()
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


def ls(what: Optional[LsWhat] = typer.Argument(None, help="What to list (default: all component kinds).")) -> None:
    """List installed components (name, description, parameter defaults) or ./pipelines files.

    Without an argument, lists every installed evictor, pruner, scorer and committer with its
    description (the first line of its docstring) and parameter defaults (`<required>` for a
    parameter without one). `kvflow ls backends` lists the engines (backends);
    `kvflow ls pipelines` lists the YAML files under `./pipelines` with their names and
    descriptions.
    \f
    ```sh
    kvflow ls
    kvflow ls evictors
    kvflow ls pipelines
    ```
    """
    console = rich_console()
    with errors():
        if what is LsWhat.pipelines:
            console.print(_pipelines_table(Path("pipelines")))
            return
        kinds = [what.value] if what else ["evictors", "pruners", "scorers", "committers"]
        for kind in kinds:
            console.print(_components_table(kind))


def plugins(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List plugins: distribution, version, status and what each registered.

    Plugins are the entry points of the group `kvflow` (kvflow's own components are the
    plugin `builtin`). Status is `ok`, `failed` (the error is shown instead of what it
    registered) or `disabled` (named in KVFLOW_DISABLE_PLUGINS). `--json` prints the same as
    a JSON list of objects with the keys `name`, `distribution`, `version`, `entry_point`,
    `status`, `error` and `registered`.
    \f
    See [Writing plugins](plugins.md).
    """
    with errors():
        infos = plugin_registry().plugins()
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
        rich_console().print(table)
