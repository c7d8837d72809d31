"""`kvflow cost`: KV memory per sequence and decode FLOPs per token from the models' shapes."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import errors


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
    from kvflow.tools.cost import cost_command

    with errors():
        cost_command(models, budget=budget, buffer=buffer, lengths=lengths, helper=helper, png=png,
                     bytes_per_elem=kv_bytes, as_json=as_json, echo=typer.echo)
