"""`kvflow serve`: any pipeline behind an OpenAI-compatible HTTP API (docs/serve.md).

A request is a problem on the pipeline's step scheduler: requests from every client decode
together in one `kvflow.runtime.session.Session` held for the life of the process, each
committed step streamed as it is committed. The modules, from the wire down:

- `kvflow.serve.server`: the process: loads the pipeline's engines, runs uvicorn, drains on
  SIGTERM/SIGINT, exits non-zero when an engine dies (`serve(...)`, used by `kvflow serve`);
- `kvflow.serve.app`: the ASGI app (FastAPI): routes, API key, body limit, SSE;
- `kvflow.serve.protocol`: request validation (what is honoured, what is refused and why)
  and the OpenAI-shaped responses and stream chunks, with kvflow's `kvflow` extension field;
- `kvflow.serve.loop`: the engine thread: a bounded queue of requests feeding the Session's
  step scheduler, cancellation at step boundaries, faults, records;
- `kvflow.serve.metrics`: counters and histograms in Prometheus text.

Nothing here is imported by `kvflow --help`; FastAPI and uvicorn (the `serve` extra) are
imported by `server` and `app` only.
"""
