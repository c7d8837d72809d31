"""`kvflow serve`: a pipeline behind an OpenAI-compatible HTTP API (kvflow.serve.server)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvflow.commands.common import SET_HELP, UNSET_HELP, errors, plugin_registry


def serve(
    file: Path = typer.Argument(..., metavar="FILE", help="Pipeline YAML file."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE", help=SET_HELP),
    unset: Optional[List[str]] = typer.Option(None, "--unset", metavar="PATH", help=UNSET_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind. Any address but loopback needs an API key."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to bind."),
    grace: float = typer.Option(30.0, "--grace", min=0.0, metavar="SECONDS",
                                help="On SIGTERM/SIGINT, how long requests in flight may take to finish before "
                                     "they are cancelled."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", metavar="KEY",
        help="Require `Authorization: Bearer KEY` on every route but /health (default: KVFLOW_API_KEY)."),
    record: Optional[Path] = typer.Option(
        None, "--record", metavar="DIR",
        help="Append every answered request to DIR/samples.jsonl as a results record, for `kvflow view` "
             "and `kvflow report`."),
    metrics_public: bool = typer.Option(
        False, "--metrics-public", help="Serve /metrics without the API key (for a Prometheus scraper without it)."),
    progress: float = typer.Option(
        30.0, "--progress", min=0.0, metavar="SECONDS",
        help="Every SECONDS while requests come, print a progress line to stderr (requests answered, in flight, "
             "queued, answer tokens committed and their rate); 0: none."),
) -> None:
    """Serve a pipeline behind an OpenAI-compatible API (chat and text completions).

    Loads the pipeline's engines once and answers `POST /v1/chat/completions` (messages
    rendered with the base model's chat template) and `POST /v1/completions` (a raw
    prompt), streamed or not, plus `GET /v1/models` (the pipeline's name is the model id),
    `GET /health` and `GET /metrics` (Prometheus text), and the base model's tokenizer as
    vLLM serves it (`/tokenize`, `/detokenize`, `/tokenizer_info`). A completion with
    `echo: true` and `max_tokens` 0 or 1 is a scoring request (an evaluation harness's
    loglikelihood): the prompt's token logprobs under the base model with a full cache. Every request is a problem on the
    pipeline's step scheduler: requests from all clients decode together within
    `run.batch_problems` / `run.live_problems`, and a streamed answer sends each committed
    step as it is committed, with kvflow's facts (source proposer, score, candidates,
    pruned) in a `kvflow` field. Past `serve.queue` waiting requests, 429.

    `max_tokens`, `seed`, `stop` and `logprobs` (each answer token's log-probability, as its
    proposer sampled it; see docs/serve.md) are honoured; fields the pipeline decides
    (`temperature`, `top_p`, `n` > 1, tools, `response_format`) are refused with
    a 400 unless the pipeline's `serve.ignore` lists them (or is "*"); a `max_tokens` past
    `limits.max_tokens` is refused, or lowered with `serve.clamp_max_tokens`. A client that
    goes away cancels its request. Binds 127.0.0.1 unless told otherwise; another address
    needs an API key. SIGTERM or Ctrl-C drains: new requests get 503 and /health says
    "draining" while requests in flight finish within `--grace` seconds; the rest is cancelled.

    Needs the `serve` extra (FastAPI, uvicorn).
    \f
    The API, streaming, an lm-evaluation-harness example and metrics: [Serving](serve.md).

    ```sh
    kvflow serve pipelines/quickstart.yaml
    kvflow serve pipelines/quickstart.yaml --port 8100 --record served/
    KVFLOW_API_KEY=secret kvflow serve pipelines/quickstart.yaml --host 0.0.0.0
    ```
    """
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime.kv_budget import refuse_kv_memory

    code = 0
    with errors("kvflow: interrupted"):
        loaded = load_pipeline(file, sets=set_ or (), unsets=unset or (), registry=plugin_registry())
        refuse_kv_memory(loaded)  # before any model loads (once loaded, each prompt is checked)
        from kvflow.serve.server import serve as serve_  # heavy (torch, fastapi): only here

        code = serve_(loaded, plugin_registry(), host=host, port=port, grace=grace, api_key=api_key, record=record,
                      metrics_public=metrics_public, progress=progress)
    raise typer.Exit(code)
