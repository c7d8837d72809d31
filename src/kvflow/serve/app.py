"""The ASGI app of `kvflow serve` (FastAPI): routes, the API key, body limits and SSE.

    POST /v1/chat/completions   messages -> the base model's chat template -> one problem
    POST /v1/completions        a raw prompt -> one problem; with `echo`, a scoring request
    GET  /v1/models             the pipeline's name as the one model id
    POST /tokenize, /detokenize the base model's tokenizer, as vLLM serves it
    GET  /tokenizer_info        its special tokens, chat template and context (vLLM's shape)
    GET  /health                200 {"status": "ok", ...} with engine rows; 503 once an engine
                                died ("dead") or while the server drains ("draining")
    GET  /metrics               Prometheus text (kvflow.serve.metrics)

Requests are validated by kvflow.serve.protocol and decoded by the engine thread
(kvflow.serve.loop). Every error is an OpenAI-shaped JSON body with a 4xx/5xx status, unknown
routes (404) and methods (405) included: a request can fail, the server does not. With an API
key (required off 127.0.0.1) every route but /health (and /metrics with `metrics_public`)
needs `Authorization: Bearer KEY`, else 401. The guard is plain ASGI middleware (not
Starlette's BaseHTTPMiddleware, which hides a client's disconnect from the route).

A streamed answer is one SSE event per committed step (`delta.content` the step's text,
`kvflow` its facts); the last event has `finish_reason` and `usage`, then `data: [DONE]`. A
client that goes away (a closed connection: a crashed harness, an SDK's timeout) cancels its
request, streamed or not: the stream's generator is closed, or the non-streamed wait sees the
`http.disconnect` message at once, and the engine thread cancels the trajectory (its rows stop
after the current token on an hf engine, at the step boundary elsewhere; the response is
logged as 499, the nginx code for a client that closed).

Answer logprobs (chat `logprobs: true`, completions `logprobs: 0`): each answer token with
the log-probability its proposer sampled it at (kvflow.components.records.Step keeps the
committed candidate's tokens and logprobs; kvflow.serve.loop cuts them with the answer), in
OpenAI's shapes (kvflow.serve.protocol.answer_logprobs). Given only where every proposer
tokenizes as the base model does (`logprobs_problem`), else 400; alternatives (top-k > 0) are
kept by no engine: 400. Either is answered without them when `serve.ignore` lists the field.

A scoring request (completions with `echo: true`, `max_tokens` 0 or 1, `logprobs` k: an
evaluation harness's loglikelihood request) is not a problem: each prompt is scored by the
base model over a full cache on the engine thread, between decode steps
(`Engine.prompt_logprobs`), and the answer has OpenAI's completion logprobs (tokens, their
log-probabilities, the top k alternatives at each, the greedy next token when max_tokens is 1).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.serve.loop import Job, Loop
from kvflow.serve.metrics import Metrics
from kvflow.serve.protocol import (ApiError, answer_logprobs, chunk, ignored, models_list, now, parse_chat,
                                   parse_completion, response, scored_choice, scored_response)


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
    clamp_max_tokens: bool = False
    metrics_public: bool = False  # /metrics without the API key (--metrics-public)
    context: Optional[int] = None  # the base model's context in tokens, where known
    logprobs_problem: Optional[str] = None  # why answers cannot carry token logprobs (kvflow.serve.loop)

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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown route (404), method (405)
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404 else
                   f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
                   str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None
                                     ).body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_middleware(_Guard, service=service)

    @app.get("/health")
    async def health():
        g = service.loop.gauges()
        status = "dead" if g["dead"] else ("draining" if service.loop.stopping else "ok")
        body = {"status": status, "model": service.name, "in_flight": g["in_flight"], "queued": g["queued"],
                "rows": g["rows"], "faults": service.loop.faults, **({"error": g["dead"]} if g["dead"] else {})}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return _tokenizer_info(service)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return _tokenize(service, await _read_json(request, service.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return _detokenize(service, await _read_json(request, service.max_body_bytes))

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


_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize",
           "/detokenize", "/tokenizer_info"}


class _Guard:
    """Plain ASGI middleware: the API key (401), a request's own fault answered as a 500 (never a
    dropped connection), and every answer counted in /metrics by route and status."""

    def __init__(self, app, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        service = self.service
        path = scope["path"]
        public = path == "/health" or (path == "/metrics" and service.metrics_public)
        if service.api_key and not public:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {service.api_key}".encode()):
                service.metrics.request(path if path in _ROUTES else "other", 401)
                reply = JSONResponse(ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)").body(),
                                     status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await reply(scope, receive, send)
        status: dict = {}

        async def send_(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as exc:  # noqa: BLE001 - never a dropped connection for a request's fault
            if "code" in status:  # the answer had begun: nothing more can be said on this connection
                raise
            status["code"] = 500
            reply = JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)
            await reply(scope, receive, send)
        finally:
            service.metrics.request(path if path in _ROUTES else "other", status.get("code", 499))


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
    req = parse(body, ignore=service.ignore, served_model=service.name, max_tokens_limit=service.max_tokens,
                clamp=service.clamp_max_tokens)
    if req.echo:
        return await _score(service, req)
    if req.token_logprobs:
        _check_logprobs(service, req)
    if req.prompt_ids is not None:
        req.prompt = _decode_ids(service, req.prompt_ids)
    prompt, question = service.render(req)
    n = len(service.encode(prompt))
    if n > service.max_prompt_tokens:
        raise ApiError(400, f"the prompt is {n} tokens; this server takes at most {service.max_prompt_tokens} "
                            f"(serve.max_prompt_tokens)", param="messages" if req.kind == "chat" else "prompt",
                       code="context_length_exceeded")
    job = Job(req, prompt, n, asyncio.get_running_loop(), question)
    service.loop.submit(job)
    created = now()
    headers = {"X-Request-Id": job.rid}
    if req.clamped_from is not None:
        headers["X-Kvflow-Max-Tokens-Clamped"] = f"requested {req.clamped_from}, used {req.max_tokens}"
    if req.ignored:  # accepted through serve.ignore but not honoured (e.g. temperature: the proposers' sampling)
        headers["X-Kvflow-Ignored"] = ", ".join(req.ignored)
    if req.stream:
        return StreamingResponse(_stream(service, job, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    return await _whole(service, job, request, created, headers)


def _check_logprobs(service: Service, req) -> None:
    """Whether the answer's token log-probabilities can be given (see the module docstring): 400
    naming the field where not, unless `serve.ignore` lists it (then the answer has none)."""
    field = "top_logprobs" if req.kind == "chat" else "logprobs"
    if service.logprobs_problem:
        if ignored("logprobs", service.ignore):
            req.token_logprobs, req.top_logprobs = False, 0
            req.ignored = sorted({*req.ignored, "logprobs"})
            return
        raise ApiError(400, f"`logprobs` cannot be given by this pipeline: {service.logprobs_problem}",
                       param="logprobs", code="unsupported_field")
    if req.top_logprobs:
        if ignored(field, service.ignore):
            req.top_logprobs = 0
            req.ignored = sorted({*req.ignored, field})
            return
        k = "`top_logprobs`" if req.kind == "chat" else "`logprobs` k"
        zero = "`top_logprobs: 0`" if req.kind == "chat" else "`logprobs: 0`"
        raise ApiError(400, f"{k} > 0 asks for each token's alternatives, which no engine keeps: ask for {zero} "
                            f"(each answer token's own log-probability)", param=field, code="unsupported_field")


async def _until_disconnect(request: Request) -> None:
    """Returns once the client has gone (its body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole(service: Service, job: Job, request: Request, created: int, headers: dict):
    text, tokens = [], []
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                service.loop.cancel(job)
                return JSONResponse({"error": {"message": "client closed the connection"}}, status_code=499)
            event = event.result()
            if event[0] == "step":
                text.append(event[1])
                tokens += event[3]
            elif event[0] == "end":
                facts = {"request_id": job.rid, "steps": job.steps, "finish": job.traj.finish if job.traj else None}
                if job.req.ignored:
                    facts["ignored"] = job.req.ignored
                return JSONResponse(response(job.req, job.rid, created, "".join(text), event[1], event[2], facts,
                                             answer_logprobs(job.req, tokens)), headers=headers)
            else:
                _, status, message, code = event
                raise ApiError(status, message, code=code)
    except asyncio.CancelledError:
        service.loop.cancel(job)
        raise
    finally:
        gone.cancel()


async def _score(service: Service, req) -> Any:
    """A scoring request: each prompt scored by the base model with a full cache, on the engine
    thread (see the module docstring)."""
    base = service.loop.base
    if not base.scores_prompts:
        raise ApiError(400, f"the base model's engine ({base.backend}) cannot score prompts: scoring requests "
                            f"(`echo`) need an hf base model", param="echo", code="unsupported_field")
    prompts = [service.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]
    vocab = len(service.tokenizer)
    for ids in prompts:
        if not ids:
            raise ApiError(400, "a prompt with no tokens cannot be scored", param="prompt")
        if max(ids) >= vocab:
            raise ApiError(400, f"token id {max(ids)} is not in the base model's vocabulary ({vocab})", param="prompt")
        if service.context and len(ids) + req.max_tokens > service.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the base model's context is {service.context}",
                           param="prompt", code="context_length_exceeded")
    k = max(1, req.top_logprobs)
    scored = []
    for ids in prompts:
        scored.append(await service.loop.call(lambda ids=ids: base.prompt_logprobs(ids, k)))
    piece = lambda i: service.tokenizer.decode([i])  # noqa: E731
    choices = []
    for index, (ids, got) in enumerate(zip(prompts, scored)):
        top = [None if alts is None else [(piece(t), v) for t, v in alts] for alts in got.top]
        completion = None
        if req.max_tokens == 1:
            token, lp = got.next[0]
            completion = (piece(token), lp, [(piece(t), v) for t, v in got.next])
        choices.append(scored_choice(index, [piece(i) for i in ids], got.logprobs, top, completion, req.top_logprobs,
                                     "length"))
    return JSONResponse(scored_response(req, f"cmpl-score-{now()}", now(), choices, sum(map(len, prompts))))


def _decode_ids(service: Service, ids: list[int]) -> str:
    if max(ids) >= len(service.tokenizer):
        raise ApiError(400, f"token id {max(ids)} is not in the base model's vocabulary ({len(service.tokenizer)})",
                       param="prompt")
    return service.tokenizer.decode(ids)


def _check_model(service: Service, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != service.name:
        raise ApiError(404, f"the model `{model}` does not exist: this server serves `{service.name}`",
                       param="model", code="model_not_found")


def _tokenize(service: Service, body: Any) -> dict:
    """vLLM's /tokenize: {prompt, add_special_tokens (true)} or {messages, add_generation_prompt
    (true)}, `model` optional -> {count, max_model_len, tokens, token_strs}."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(service, body)
    if "messages" in body:
        req = parse_chat({"model": service.name, "messages": body["messages"]}, ignore=frozenset(),
                         served_model=service.name, max_tokens_limit=service.max_tokens)
        prompt = service.render(req)[0]
        special = bool(body.get("add_special_tokens", False))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "`prompt` (a string) or `messages` is required", param="prompt")
        special = bool(body.get("add_special_tokens", True))
    tokens = service.tokenizer.encode(prompt, add_special_tokens=special)
    strs = service.tokenizer.convert_ids_to_tokens(tokens) if body.get("return_token_strs") else None
    return {"count": len(tokens), "max_model_len": service.context, "tokens": tokens, "token_strs": strs}


def _detokenize(service: Service, body: Any) -> dict:
    """vLLM's /detokenize: {tokens} -> {prompt}."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(service, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise ApiError(400, "`tokens` must be a list of token ids", param="tokens")
    return {"prompt": _decode_ids(service, tokens) if tokens else ""}


def _tokenizer_info(service: Service) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's class, special tokens, chat template and context."""
    tok = service.tokenizer
    info = {"tokenizer_class": type(tok).__name__, "model_max_length": service.context}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        info[name] = value if isinstance(value, str) or value is None else str(value)
    info["chat_template"] = getattr(tok, "chat_template", None)
    return info


async def _stream(service: Service, job: Job, created: int):
    first = True
    ended = False
    sent = 0  # characters streamed: the offset of the next chunk's tokens (completions' logprobs)
    try:
        while True:
            event = await job.events.get()
            if event[0] == "step":
                yield _sse(chunk(job.req, job.rid, created, event[1], facts=event[2], first=first,
                                 logprobs=answer_logprobs(job.req, event[3], sent)))
                sent += sum(len(t) for t, _ in event[3])
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

