"""`kvflow run`: a pipeline over its dataset, or a sweep of them, into results directories
(kvflow.runtime.runner; with `--sweep`, kvflow.tools.sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import SET_HELP, UNSET_HELP, errors, plugin_registry


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
    log: bool = typer.Option(False, "--log", help="One plain line per finished problem on stderr, even on a terminal "
                             "(instead of the progress bar)."),
) -> None:
    """Run a pipeline over its dataset and write a results directory.

    Validates the pipeline, checks that every model it uses can be obtained on this machine
    (before loading any), then decodes the dataset in batches with the step loop and writes
    `results/<name>__<hash>/`. Each finished problem is graded and appended to
    `samples.jsonl` at once, and a summary table is printed at the end.

    Running the same command again resumes an interrupted run with the problems not yet
    recorded; a complete run is skipped (its summary is printed) unless `--force` is given.
    The directory name includes a hash of the resolved configuration, so a changed override
    writes to a new directory. With `--sweep`, or a `sweep:` mapping in the pipeline file
    (path -> values; a --sweep on the same path replaces its axis), every point of the grid is
    validated before any runs, then each runs in turn into its own results directory, and
    complete points are skipped, so an interrupted sweep resumes too. A full-KV point (`none`)
    ignores a budget axis and runs once.

    With `run.executor: ray` the problems are decoded by kvflow workers on a Ray cluster
    (`--ray-address`, else RAY_ADDRESS, else a local one), each with its own engines, and
    this process writes the same results directory; the points of a sweep share the workers.

    On a terminal, a progress bar shows the problems done, the accuracy so far, the tokens
    generated per second and the time left (ETA); a sweep's bar counts its points. When
    stderr is not a terminal, or with `--log`, each finished problem is one line instead.
    \f
    What a results directory holds: [Results](results.md). Grids and ablations:
    [Compose an ablation and a sweep](tutorials/ablation-and-sweep.md). Ray: [Clusters](cluster.md).

    ```sh
    kvflow run pipelines/quickstart.yaml
    kvflow run pipelines/quickstart.yaml --set proposers.base.evictor.budget=128
    kvflow run pipelines/leaderboard/gsm8k_cpu.yaml       # its sweep: every evictor x budget
    kvflow run pipelines/quickstart.yaml --sweep proposers.base.evictor.budget=64,128
    kvflow run pipelines/quickstart.yaml --set run.executor=ray --set run.workers=2
    ```
    """
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.kv_budget import refuse_kv_memory
    from kvflow.runtime.progress import plain_log

    plain_log(log)
    code = 0
    with errors("kvflow: interrupted; finished problems are saved, run the same command again to resume"):
        loaded = None if sweep else load_pipeline(file, sets=set_ or (), unsets=unset or (), registry=plugin_registry())
        if sweep or loaded.pipeline.sweep:
            from kvflow.tools.sweep import run_sweep

            code = run_sweep(file, sweep or [], sets=set_ or (), unsets=unset or (), force=force,
                             registry=plugin_registry(), ray_address=ray_address)
            raise typer.Exit(code)
        refuse_kv_memory(loaded)  # before any model loads (once loaded, each prompt is checked)
        from kvflow.runtime.runner import run_pipeline  # heavy (torch, transformers): only here

        code = int(run_pipeline(loaded, force=force, **({"ray_address": ray_address} if ray_address else {})) or 0)
    raise typer.Exit(code)
