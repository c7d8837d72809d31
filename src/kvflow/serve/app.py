"""The ASGI app of `kvflow serve` (FastAPI): routes, the API key, body limits and SSE.

    POST /v1/chat/completions   messages -> the base model's chat template -> one problem
    POST /v1/completions        a raw prompt -> one problem
    GET  /v1/models             the pipeline's name as the one model id
    GET  /health                200 {"status": "ok", ...} with engine rows; 503 once an engine died
    GET  /metrics               Prometheus text (kvflow.serve.metrics)

Requests are validated by kvflow.serve.protocol and decoded by the engine thread
(kvflow.serve.loop). Every error is an OpenAI-shaped JSON body with a 4xx/5xx status: a
request can fail, the server does not. With an API key (required off 127.0.0.1) every route
but /health needs `Authorization: Bearer KEY`, else 401.

A streamed answer is one SSE event per committed step (`delta.content` the step's text,
`kvflow` its facts); the last event has `finish_reason` and `usage`, then `data: [DONE]`. A
client that goes away (a closed connection) cancels its request: the stream's generator is
closed, or the non-streamed wait notices it, and the engine thread drops the trajectory at its
next step boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvflow.serve.loop import Job, Loop
from kvflow.serve.metrics import Metrics
from kvflow.serve.protocol import ApiError, chunk, models_list, now, parse_chat, parse_completion, response


@dataclass
class Service:
    """What the routes need: built by kvflow.serve.server once the engines are loaded."""

    name: str  # the pipeline's name: the model id
    loop: Loop
    metrics: Metrics
    tokenizer: Any  # the base model's tokenizer (a copy: the engine thread uses its own)
    max_tokens: int  # limits.max_tokens
    max_prompt_tokens: int
    max_body_bytes: int
    ignore: frozenset
    retry_after: int
    api_key: Optional[str] = None
    created: int = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, req) -> tuple[str, str]:
        """(the prompt text for the base model, the question recorded for it)."""
        if req.kind == "completion":
            return req.prompt, req.prompt
        msgs = req.messages
        question = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), msgs[-1]["content"])
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), question
            except Exception as exc:  # a template that refuses these roles or this order
                raise ApiError(400, f"the base model's chat template refuses these messages: {exc}",
                               param="messages") from None
        roles = [m["role"] for m in msgs]
        if roles not in (["user"], ["system", "user"]):
            raise ApiError(400, "the base model has no chat template: send one user message (optionally after a "
                                "system one), or a raw prompt to /v1/completions", param="messages")
        head = f"{msgs[0]['content']}\n\n" if roles[0] == "system" else ""
        return f"{head}Question: {msgs[-1]['content']}\nAnswer:", question


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="kvflow serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        headers = dict(exc.headers)
        if exc.status in (429, 503):
            headers.setdefault("Retry-After", str(service.retry_after))
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug: the request fails, the server goes on
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if service.api_key and path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
                service.metrics.request(path, 401)
                return JSONResponse(ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)").body(),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            reply = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - never a dropped connection for a request's fault
            reply = JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)
        service.metrics.request(path if path in _ROUTES else "other", reply.status_code)
        return reply

    @app.get("/health")
    async def health():
        g = service.loop.gauges()
        body = {"status": "dead" if g["dead"] else ("draining" if service.loop.stopping else "ok"),
                "model": service.name, "in_flight": g["in_flight"], "queued": g["queued"], "rows": g["rows"],
                "faults": service.loop.faults, **({"error": g["dead"]} if g["dead"] else {})}
        return JSONResponse(body, status_code=503 if g["dead"] else 200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return models_list(service.name, service.created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(service, request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(service, request, parse_completion)

    return app


_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}


async def _read_json(request: Request, limit: int) -> Any:
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body is {size} bytes; the limit is {limit} (serve.max_body_bytes)")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes (serve.max_body_bytes)")
    try:
        return json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None


async def _complete(service: Service, request: Request, parse) -> Any:
    body = await _read_json(request, service.max_body_bytes)
    req = parse(body, ignore=service.ignore, served_model=service.name, max_tokens_limit=service.max_tokens)
    prompt, question = service.render(req)
    n = len(service.encode(prompt))
    if n > service.max_prompt_tokens:
        raise ApiError(400, f"the prompt is {n} tokens; this server takes at most {service.max_prompt_tokens} "
                            f"(serve.max_prompt_tokens)", param="messages" if req.kind == "chat" else "prompt",
                       code="context_length_exceeded")
    job = Job(req, prompt, n, asyncio.get_running_loop(), question)
    service.loop.submit(job)
    created = now()
    if req.stream:
        return StreamingResponse(_stream(service, job, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})
    return await _whole(service, job, request, created)


async def _whole(service: Service, job: Job, request: Request, created: int):
    text = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    service.loop.cancel(job)
                    return JSONResponse({"error": {"message": "client closed the connection"}}, status_code=499)
                continue
            if event[0] == "step":
                text.append(event[1])
            elif event[0] == "end":
                facts = {"request_id": job.rid, "steps": job.steps, "finish": job.traj.finish if job.traj else None}
                return JSONResponse(response(job.req, job.rid, created, "".join(text), event[1], event[2], facts),
                                    headers={"X-Request-Id": job.rid})
            else:
                _, status, message, code = event
                raise ApiError(status, message, code=code)
    except asyncio.CancelledError:
        service.loop.cancel(job)
        raise


async def _stream(service: Service, job: Job, created: int):
    first = True
    ended = False
    try:
        while True:
            event = await job.events.get()
            if event[0] == "step":
                yield _sse(chunk(job.req, job.rid, created, event[1], facts=event[2], first=first))
                first = False
            elif event[0] == "end":
                yield _sse(chunk(job.req, job.rid, created, "" if first else None, finish_reason=event[1],
                                 usage_=event[2], first=first))
                yield "data: [DONE]\n\n"
                ended = True
                return
            else:
                _, status, message, code = event
                yield _sse(ApiError(status, message, code=code).body())
                ended = True
                return
    finally:
        if not ended:  # the client went away (the generator was closed or cancelled)
            service.loop.cancel(job)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

