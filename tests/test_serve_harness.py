"""`kvflow serve` for evaluation harnesses (issue 40), against one real server over tiny
random-weight hf models for the whole module, spoken to through the official `openai` SDK
and raw HTTP (httpx), with the pipeline's `serve: {ignore: ["*"], clamp_max_tokens: true}`
(as pipelines/served_quickstart.yaml) and `--metrics-public`.

What is checked: a max_tokens past limits.max_tokens lowered, with the header saying so; any
field accepted and ignored; /metrics without the key; vLLM's /tokenize, /detokenize and
/tokenizer_info (what lm-eval's remote tokenizer reads); a scoring request (echo + logprobs +
max_tokens 1, what lm-eval's local-completions sends for loglikelihood tasks) equal to a plain
transformers forward of the base model; and (last) a request answered after all that traffic,
on an idle server, as the fresh server answered it. A second server (the base model alone,
greedy, full KV) checks answer logprobs (chat `logprobs: true`, completions `logprobs: 0`)
against plain transformers forwards.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from test_serve import CHAT, KEY, MAX_TOKENS, question_messages, start_server, tiny_serving_pipeline

openai = pytest.importorskip("openai")

FRESH = dict(model="tiny", messages=question_messages(2), seed=21)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harness")
    pipeline = tiny_serving_pipeline(directory, ignore=["*"], clamp_max_tokens=True)
    srv = start_server(directory, "--metrics-public", "--progress", "1", pipeline=pipeline)
    try:  # a failing first request must not leave the server running
        srv.fresh = srv.client().chat.completions.create(**FRESH)  # before any other traffic
        yield srv
    finally:
        srv.proc.kill()
        srv.proc.wait(30)


def load_base(pipeline):
    """A pipeline's base model and tokenizer, loaded here with transformers."""
    import transformers

    path = yaml.safe_load(pipeline.read_text())["models"]["base"]["id"]
    return (transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval(),
            transformers.AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def base_model(server):
    return load_base(server.pipeline)


def test_max_tokens_past_the_limit_is_clamped_and_said(server):
    raw = server.client().chat.completions.with_raw_response.create(model="tiny", messages=CHAT["messages"],
                                                                    max_tokens=10_000, seed=2)
    assert raw.headers["x-kvflow-max-tokens-clamped"] == f"requested 10000, used {MAX_TOKENS}"
    assert raw.parse().usage.completion_tokens <= MAX_TOKENS
    plain = server.client().chat.completions.with_raw_response.create(model="tiny", messages=CHAT["messages"],
                                                                      max_tokens=4, seed=2)
    assert "x-kvflow-max-tokens-clamped" not in plain.headers


def test_any_field_is_ignored_with_a_star(server):
    """... and the answer says which (a header, and `kvflow.ignored` in a whole answer): a
    harness's `temperature: 0` is not honoured, the pipeline's sampling is."""
    reply = server.post("/v1/chat/completions", {**CHAT, "max_tokens": 4, "temperature": 0, "top_k": 5, "store": True,
                                                 "repetition_penalty": 1.1, "min_p": 0.1, "logit_bias": {"1": 2}})
    assert reply.status_code == 200, reply.text
    ignored = ["logit_bias", "min_p", "repetition_penalty", "store", "temperature", "top_k"]
    assert reply.headers["x-kvflow-ignored"] == ", ".join(ignored) and reply.json()["kvflow"]["ignored"] == ignored
    reply = server.post("/v1/completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 4, "top_k": 5})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvflow-ignored"] == "top_k"
    plain = server.post("/v1/completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 4, "n": 1, "seed": 3})
    assert "x-kvflow-ignored" not in plain.headers and "ignored" not in plain.json()["kvflow"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={**CHAT, "max_tokens": 4, "stream": True, "temperature": 0.3}, timeout=60) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-kvflow-ignored"] == "temperature"
        streamed.read()


def test_the_server_prints_progress_while_it_serves(server):
    """Between "serving" and "stopped", a line every --progress seconds while there is traffic."""
    import time

    server.post("/v1/chat/completions", {**CHAT, "max_tokens": 4})
    deadline = time.monotonic() + 30
    while "requests answered" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(x for x in server.log.read_text().splitlines() if "requests answered" in x)
    assert "in flight" in line and "queued" in line and "answer tokens committed" in line


def test_metrics_public_and_the_rest_behind_the_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_tokenizer_routes_as_vllm_serves_them(server, base_model):
    _, tok = base_model
    info = server.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template  # what lm-eval reads
    text = "Natalia sold 48 clips."
    got = server.post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=False) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert server.post("/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": text}
    chat = server.post("/tokenize", {"model": "tiny", "messages": CHAT["messages"]}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(CHAT["messages"], tokenize=False,
                                                               add_generation_prompt=True), add_special_tokens=False)
    assert server.post("/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert server.post("/detokenize", {"tokens": [10**9]}).status_code == 400


def test_a_scoring_request_is_the_base_model_with_a_full_cache(server, base_model):
    """echo + logprobs + max_tokens 1 (lm-eval's loglikelihood request): every prompt token's
    log-probability, the top-k at each, and the greedy next token, as a plain forward gives."""
    import torch

    model, tok = base_model
    prompt = "Question: Tom has 5 boxes of 8 apples and eats 6. How many are left?\nAnswer: 34"
    reply = server.client().completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                               temperature=0, seed=1234)
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.as_tensor([ids])).logits[0].float(), -1)
    lp = reply.choices[0].logprobs
    assert lp.tokens[:-1] == [tok.decode([i]) for i in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx([float(logp[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)
    greedy = int(logp[-1].argmax())
    assert lp.tokens[-1] == tok.decode([greedy]) and lp.token_logprobs[-1] == pytest.approx(float(logp[-1, greedy]),
                                                                                            abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs[1:],
                                                                                 lp.token_logprobs[1:]))
    assert reply.choices[0].text == prompt + tok.decode([greedy])
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1
    # token ids, two prompts, max_tokens 0 (only the prompts' own log-probabilities)
    batch = server.post("/v1/completions", {"model": "tiny", "prompt": [ids[:5], ids], "echo": True, "logprobs": 0,
                                            "max_tokens": 0}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][1]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)
    assert len(batch["choices"][0]["logprobs"]["tokens"]) == 5
    assert all(math.isfinite(v) for v in batch["choices"][0]["logprobs"]["token_logprobs"][1:])


def test_an_idle_server_answers_as_a_fresh_one(server):
    """Last: after the traffic above and more, concurrent, the request the fresh server answered
    first gets the same committed steps and text (issue 40: a request's result does not
    depend on what the server served before it, once it is idle)."""
    def other(i: int):
        return server.post("/v1/chat/completions", {**CHAT, "seed": 300 + i, "messages": question_messages(i % 4)})

    with ThreadPoolExecutor(6) as pool:
        assert all(r.status_code == 200 for r in pool.map(other, range(12)))
    server.wait_idle()
    again = server.client().chat.completions.create(**FRESH)
    strip = lambda steps: [dict(s, score=None) for s in steps]  # noqa: E731
    assert again.choices[0].message.content == server.fresh.choices[0].message.content
    assert strip(again.model_extra["kvflow"]["steps"]) == strip(server.fresh.model_extra["kvflow"]["steps"])


# --------------------------------------------------------------------------- answer logprobs


@pytest.fixture(scope="module")
def full_kv_server(tmp_path_factory):
    """A server whose pipeline is the base model alone, greedy, one candidate, no eviction: its
    answers are plain greedy decoding, and each token's logprob is the model's own."""
    from kvflow.testing.pipelines import tiny_pipeline

    directory = tmp_path_factory.mktemp("logprobs")
    pipeline = tiny_pipeline(directory, helper=False, n=1, max_tokens=MAX_TOKENS, extra={
        "proposers": {"base": {"evictor": None, "sampling": {"temperature": 0}}},
        "limits": {"max_steps": 10}, "run": {"threads": 1}})
    srv = start_server(directory, pipeline=pipeline)
    yield srv
    srv.proc.kill()
    srv.proc.wait(30)


def greedy_logprobs(model, tok, messages, n: int) -> list[tuple[str, float]]:
    """(text, log p) of the first n greedy tokens after the chat prompt, by plain forwards."""
    import torch

    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.as_tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            out.append((tok.decode([token]), float(logp[token])))
            ids.append(token)
    return out


def test_chat_logprobs_are_the_committed_tokens_own(full_kv_server):
    """`logprobs: true`: every answer token with its log-probability, as a plain transformers
    forward gives them; the same in a stream (per step) and on /v1/completions (`logprobs: 0`);
    cut with the answer at max_tokens; alternatives (`top_logprobs` > 0) refused with a 400."""
    model, tok = load_base(full_kv_server.pipeline)
    client = full_kv_server.client()
    messages = question_messages(0)
    reply = client.chat.completions.create(model="tiny", messages=messages, seed=3, logprobs=True)
    content = reply.choices[0].logprobs.content
    assert len(content) > 16 and "".join(t.token for t in content) == reply.choices[0].message.content
    expected = greedy_logprobs(model, tok, messages, len(content))
    assert [t.token for t in content] == [t for t, _ in expected]
    assert [t.logprob for t in content] == pytest.approx([v for _, v in expected], abs=1e-4)
    assert all(t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in content)

    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, seed=3, logprobs=True,
                                                top_logprobs=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

    short = client.chat.completions.create(model="tiny", messages=messages, seed=3, logprobs=True, max_tokens=5)
    assert [t.token for t in short.choices[0].logprobs.content] == [t.token for t in content][:5]
    assert "".join(t.token for t in short.choices[0].logprobs.content) == short.choices[0].message.content

    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = client.completions.create(model="tiny", prompt=prompt, seed=3, logprobs=0).choices[0]
    assert text.logprobs.tokens == [t.token for t in content] and text.text == reply.choices[0].message.content
    assert text.logprobs.token_logprobs == pytest.approx([t.logprob for t in content], abs=1e-6)
    assert text.logprobs.text_offset == [sum(len(t.token) for t in content[:i]) for i in range(len(content))]

    plain = client.chat.completions.create(model="tiny", messages=messages, seed=3)
    assert plain.choices[0].logprobs is None
    for path, body, param in (("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
                              ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
                              ("/v1/completions", {"logprobs": 3}, "logprobs")):
        shape = {"messages": messages} if "chat" in path else {"prompt": prompt}
        reply = full_kv_server.post(path, {"model": "tiny", **shape, **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_logprobs_need_one_tokenizer_for_every_proposer():
    """A pipeline whose helper tokenizes otherwise cannot give one token sequence: said, by name."""
    from types import SimpleNamespace

    from kvflow.serve.loop import logprobs_problem
    from kvflow.testing.models import tiny_tokenizer

    def plan(*vocab_sizes):
        return SimpleNamespace(proposers=[SimpleNamespace(name=name, engine=SimpleNamespace(tokenizer=tiny_tokenizer(v)))
                                          for name, v in zip(("base", "helper"), vocab_sizes)])

    assert logprobs_problem(plan(400, 400)) is None
    assert "proposer `helper`'s model has another tokenizer" in logprobs_problem(plan(400, 300))
