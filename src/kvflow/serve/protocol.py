"""The OpenAI wire format of `kvflow serve`: request validation and response shapes.

`parse_chat` and `parse_completion` turn a decoded JSON body into a `Request` or raise
`ApiError` (an HTTP status and an OpenAI-style error body naming the field). What a request
may ask for:

- honoured: `model` (must be the pipeline's name, else 404), `messages` (chat; rendered with
  the base model's chat template) or `prompt` (completions; one string, used as is),
  `max_tokens` / `max_completion_tokens` (at most the pipeline's `limits.max_tokens`, or
  lowered to it with `serve.clamp_max_tokens`; the answer ends at the first step boundary at
  or past it, its last step cut to the limit),
  `seed` (the identity the request's rows are seeded by: a request with `seed: i` decodes as
  the `kvflow run` problem whose id is `<dataset.name>/<i>` of the same pipeline, the i-th
  line of a `dataset.path` file without an id field), `stop` (up to 4 strings; the answer
  is cut before the first one and ends there), `stream`, `stream_options.include_usage`,
  `user`, and the log-probabilities of the answer's tokens (`logprobs: true` on chat,
  `logprobs: 0` on completions: `Request.token_logprobs`; see kvflow.serve.app for which
  pipelines give them and what they mean). Their top-k alternatives (`top_logprobs` k > 0,
  completions' `logprobs` k > 0: `Request.top_logprobs`) are parsed but no engine keeps them,
  so the app refuses them;
- a scoring request (completions with `echo: true`, `max_tokens` 0 or 1, `logprobs` k >= 0:
  what an evaluation harness sends for loglikelihood tasks): the prompt, or a batch of them
  (strings or token ids), scored by the base model with a full cache, not decoded by the
  pipeline (`Request.echo`; see kvflow.serve.app);
- decided by the pipeline (`SERVE_IGNORABLE`: `temperature`, `top_p`, `n` > 1, tools,
  `response_format`, penalties, `logit_bias`): refused with a 400 naming the field,
  unless the pipeline's `serve.ignore` lists it (then accepted and ignored);
- anything else: 400 (an unknown field is refused rather than silently dropped), unless
  `serve.ignore` lists it or is `"*"` (every field not honoured is then ignored).

The response helpers build `chat.completion` / `text_completion` objects and their stream
chunks; every chunk of a committed step carries kvflow's own facts in an extension field
`kvflow` (step index, source proposer, score, candidates, pruned by pruner), and the usage
object adds `tokens_by_proposer`. The official `openai` SDK keeps unknown fields, so
`chunk.kvflow` / `chunk.model_extra["kvflow"]` reads them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvflow.config.schema import SERVE_IGNORABLE

MAX_STOP = 4
MAX_LOGPROBS = 20  # top alternatives a scoring request may ask for (vLLM's default bound)
MAX_SCORED_PROMPTS = 64  # prompts in one scoring request
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A validated request, before it is rendered to a prompt."""

    kind: str  # "chat" | "completion"
    model: str
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    messages: Optional[list[dict]] = None  # chat
    prompt: Optional[str] = None  # completion
    prompt_ids: Optional[list[int]] = None  # completion given as token ids (the base tokenizer's)
    clamped_from: Optional[int] = None  # the max_tokens asked for, when serve.clamp_max_tokens lowered it
    echo: bool = False  # a scoring request (see the module docstring)
    prompts: list = field(default_factory=list)  # a scoring request's prompts: str or list[int] each
    token_logprobs: bool = False  # the answer's tokens with their log-probabilities (chat `logprobs: true`,
    # completions `logprobs: k`)
    top_logprobs: int = 0  # alternatives asked for per token (chat `top_logprobs`, completions' `logprobs` k)
    ignored: list[str] = field(default_factory=list)  # fields asked for but not honoured (`serve.ignore`):
    # the answer says so (header `X-Kvflow-Ignored`, `kvflow.ignored`)


# fields each endpoint honours (besides the ignorable ones)
_CHAT = {"model", "messages", "max_tokens", "max_completion_tokens", "seed", "stop", "stream", "stream_options",
         "user", "n", "logprobs", "top_logprobs"}
_COMPLETION = {"model", "prompt", "max_tokens", "seed", "stop", "stream", "stream_options", "user", "n", "echo",
               "best_of", "suffix", "logprobs"}


def ignored(name: str, ignore: frozenset) -> bool:
    return name in ignore or "*" in ignore


def _refuse_fixed(body: dict, ignore: frozenset, scoring: bool) -> list[str]:
    """The pipeline-decided fields the body sets: refused (400) unless `serve.ignore` lists
    them; returns those accepted and ignored."""
    accepted = []
    for name in SERVE_IGNORABLE:
        if name not in body:
            continue
        if scoring and name == "temperature" and body[name] in (0, 0.0):
            continue  # a scoring request is greedy
        value = body[name]
        if value is None or (name == "n" and value == 1):
            continue  # the OpenAI default spelled out asks for nothing
        if ignored(name, ignore):
            accepted.append(name)
            continue
        raise ApiError(400, f"`{name}` is decided by the pipeline (its proposers' sampling, one answer per request, "
                            f"no tools) and cannot be set per request; leave it out, or list it in the pipeline's "
                            f"`serve.ignore` to have it accepted and ignored", param=name, code="unsupported_field")
    return accepted


def _common(body: Any, allowed: set, ignore: frozenset, served_model: str, max_tokens_limit: int, kind: str,
            clamp: bool = False) -> Request:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in allowed and k not in SERVE_IGNORABLE and not ignored(k, ignore))
    if unknown:
        raise ApiError(400, f"unknown field `{unknown[0]}` (kvflow serve refuses what it would not honour; the "
                            f"pipeline's `serve.ignore` may list it to have it accepted and ignored)",
                       param=unknown[0], code="unknown_field")
    scoring = kind == "completion" and body.get("echo") is True
    ignored_fields = _refuse_fixed(body, ignore, scoring)
    ignored_fields += [k for k in body if k not in allowed and k not in SERVE_IGNORABLE]  # unknown, in serve.ignore
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required: the pipeline's name (GET /v1/models)", param="model")
    if model != served_model:
        raise ApiError(404, f"the model `{model}` does not exist: this server serves `{served_model}`",
                       param="model", code="model_not_found")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, "`stream_options` may only hold `include_usage`", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    limit_name = "max_tokens"
    value = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        limit_name, value = "max_completion_tokens", body["max_completion_tokens"]
    if value is None:
        value = 0 if scoring else max_tokens_limit
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if scoring else 1):
        raise ApiError(400, f"`{limit_name}` must be a positive integer", param=limit_name)
    if scoring and value > 1:
        raise ApiError(400, f"`echo` asks for a scoring request (the prompt's token logprobs): `{limit_name}` must "
                            f"be 0 or 1 with it", param=limit_name, code="unsupported_field")
    clamped_from = None
    if value > max_tokens_limit:
        if not clamp:
            raise ApiError(400, f"`{limit_name}` = {value} is past this pipeline's limit, limits.max_tokens = "
                                f"{max_tokens_limit} (serve.clamp_max_tokens lowers it instead)", param=limit_name)
        clamped_from, value = value, max_tokens_limit
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "`seed` must be an integer", param="seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise ApiError(400, f"`stop` must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    return Request(kind=kind, model=model, max_tokens=value, stream=stream, include_usage=include_usage, seed=seed,
                   stop=list(stop), clamped_from=clamped_from, ignored=sorted(ignored_fields))


def parse_chat(body: Any, *, ignore: frozenset, served_model: str, max_tokens_limit: int,
               clamp: bool = False) -> Request:
    """A `POST /v1/chat/completions` body, validated (see the module docstring)."""
    req = _common(body, _CHAT, ignore, served_model, max_tokens_limit, "chat", clamp)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where}: a message is an object whose `role` is one of {', '.join(ROLES)}",
                           param=where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{where}: unsupported key `{sorted(extra)[0]}` (no tools here)", param=where)
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string", param=f"{where}.content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    req.messages = out
    want = body.get("logprobs")
    if want not in (None, True, False):
        raise ApiError(400, "`logprobs` must be true or false", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"`top_logprobs` must be an integer from 0 to {MAX_LOGPROBS}", param="top_logprobs")
        if top and not want:
            raise ApiError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    req.token_logprobs, req.top_logprobs = bool(want), top or 0
    return req


def parse_completion(body: Any, *, ignore: frozenset, served_model: str, max_tokens_limit: int,
                     clamp: bool = False) -> Request:
    """A `POST /v1/completions` body, validated (see the module docstring)."""
    req = _common(body, _COMPLETION, ignore, served_model, max_tokens_limit, "completion", clamp)
    for name, default in (("best_of", 1), ("suffix", None)):
        if body.get(name) not in (None, default) and not ignored(name, ignore):
            raise ApiError(400, f"`{name}` is not supported by kvflow serve", param=name, code="unsupported_field")
    echo = body.get("echo")
    if echo not in (None, False, True):
        raise ApiError(400, "`echo` must be true or false", param="echo")
    prompts = _prompts(body.get("prompt"))
    if echo:
        k = body.get("logprobs")
        k = 0 if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise ApiError(400, f"`logprobs` must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs")
        if req.stream:
            raise ApiError(400, "a scoring request (`echo`) is not streamed", param="stream")
        if len(prompts) > MAX_SCORED_PROMPTS:
            raise ApiError(400, f"at most {MAX_SCORED_PROMPTS} prompts per scoring request", param="prompt")
        req.echo, req.top_logprobs, req.prompts = True, k, prompts
        return req
    k = body.get("logprobs")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise ApiError(400, f"`logprobs` must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs")
        req.token_logprobs, req.top_logprobs = True, k
    if len(prompts) != 1:
        raise ApiError(400, "`prompt` must be one prompt (batches of prompts are served for scoring requests, "
                            "`echo: true`, only): send one request per prompt", param="prompt")
    if isinstance(prompts[0], str):
        req.prompt = prompts[0]
    else:
        req.prompt_ids = prompts[0]
    return req


def _prompts(prompt: Any) -> list:
    """`prompt` as a list of prompts, each a non-empty string or a non-empty list of token ids."""
    def one(p: Any) -> bool:
        if isinstance(p, str):
            return bool(p)
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in p)

    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return list(prompt)
    raise ApiError(400, "`prompt` must be a non-empty string or list of token ids (or, for a scoring request, a "
                        "list of them)", param="prompt")


# --------------------------------------------------------------------------- responses


def step_facts(index: int, step, traj) -> dict:
    """kvflow's extension field of a committed step's chunk."""
    score = step.score if step.score is None or math.isfinite(step.score) else None
    return {"step": index, "source": step.source, "score": score, "n_tokens": step.n_tokens,
            **({"fallback": True} if step.fallback else {}),
            "candidates": dict(traj.candidates), "pruned": dict(traj.pruned)}


def usage(prompt_tokens: int, completion_tokens: int, traj) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "tokens_by_proposer": dict(traj.tokens_generated) if traj is not None else {}}


#: a log-probability JSON cannot carry (-inf): what vLLM sends in its place
FLOOR_LOGPROB = -9999.0


def answer_logprobs(req: Request, tokens: list[tuple[str, float]], offset: int = 0) -> Optional[dict]:
    """The `logprobs` of a choice (or of a stream chunk) holding the answer tokens `tokens`
    ((text, log-probability) each): chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets into the answer,
    its earlier chunks' `offset` characters first). None when the request did not ask for them.
    No alternatives are kept (`top_logprobs` is [] / None: see kvflow.serve.app)."""
    if not req.token_logprobs:
        return None
    values = [v if math.isfinite(v) else FLOOR_LOGPROB for _, v in tokens]
    if req.kind == "chat":
        return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                            for (t, _), v in zip(tokens, values)], "refusal": None}
    offsets = []
    for t, _ in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": [t for t, _ in tokens], "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def chunk(req: Request, rid: str, created: int, text: Optional[str], *, facts: Optional[dict] = None,
          finish_reason: Optional[str] = None, usage_: Optional[dict] = None, first: bool = False,
          choices: bool = True, logprobs: Optional[dict] = None) -> dict:
    """One stream chunk (`chat.completion.chunk` or `text_completion`)."""
    if req.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        out = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    out["choices"] = [choice] if choices else []
    if usage_ is not None:
        out["usage"] = usage_
    if facts is not None:
        out["kvflow"] = facts
    return out


def response(req: Request, rid: str, created: int, text: str, finish_reason: str, usage_: dict,
             facts: dict, logprobs: Optional[dict] = None) -> dict:
    """A whole (non-streamed) answer, kvflow's facts of every step once under `kvflow`."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": logprobs}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [choice],
            "usage": usage_, "kvflow": facts}


def scored_choice(index: int, pieces: list[str], logprobs: list, top: list, completion: Optional[tuple], k: int,
                  finish_reason: str) -> dict:
    """One choice of a scoring request: the prompt's tokens (`pieces`, their text) with their
    log-probabilities (`logprobs[0]` None) and top-k alternatives ({text: logprob}), then the
    completion's token (text, logprob, alternatives) when max_tokens is 1. `text` echoes the
    prompt, plus that token."""
    tokens, token_logprobs = list(pieces), list(logprobs)
    top_logprobs = [None if alts is None else {t: v for t, v in alts[:k]} for alts in top]
    if completion is not None:
        text, lp, alts = completion
        tokens.append(text)
        token_logprobs.append(lp)
        top_logprobs.append({t: v for t, v in alts[:k]})
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"index": index, "text": "".join(tokens), "finish_reason": finish_reason,
            "logprobs": {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                         "text_offset": offsets}}


def scored_response(req: Request, rid: str, created: int, choices: list[dict], prompt_tokens: int) -> dict:
    completion_tokens = req.max_tokens * len(choices)
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def models_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvflow"}]}


def now() -> int:
    return int(time.time())
