"""`kvflow doctor`: whether kvflow works on this machine (versions, devices, engines, a tiny
model through each engine, a pipeline's placement); the logic is in kvflow.tools.doctor."""

from __future__ import annotations

from typing import Optional

import typer

from kvflow.commands.common import errors


def doctor(
    pipeline: Optional[str] = typer.Argument(None, metavar="[PIPELINE]",
                                             help="Also show where this pipeline's models would go and their KV pools."),
    engines: str = typer.Option("hf,sglang", "--engines", help="Engines to try a tiny model on (hf,sglang)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", metavar="NxGB",
                                       help="Stand-in GPUs for the pipeline's placement, e.g. 1x80 or 8x80."),
) -> None:
    """Check that kvflow works here: versions, GPUs, engines, a tiny model through each engine.

    The first command to run on a new machine, and what to paste into a bug report. Each line
    says `ok`, `warn`, `FAIL` or `skip`, and for anything but `ok` what to do. Exits 1 if a
    check failed. With PIPELINE, also where `kvflow run` would place its models (on this
    machine's GPUs, or on `--gpus`) and each SGLang engine's KV pool.
    \f
    ```sh
    kvflow doctor
    kvflow doctor pipelines/sglang/kv_rescue.yaml --gpus 1x80
    ```
    """
    from kvflow.tools.doctor import run_doctor
    from kvflow.planning.placement import parse_gpus

    with errors():
        devices = parse_gpus(gpus) if gpus else None
        code = run_doctor(pipeline, engines=tuple(e.strip() for e in engines.split(",") if e.strip()), gpus=devices,
                          echo=typer.echo)
    raise typer.Exit(code)
