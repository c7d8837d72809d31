"""A served recipe that reproduces `kvflow run` problem by problem (issue 49, docs/serve.md).

The recipe: the pipeline with `run.deterministic: true` and `serve.seed_by: dataset` behind
`kvflow serve`; each problem sent as its prompt template renders it (`kvflow.eval.prompts`),
with one seed for every request as lm-eval sends them (1234: not honoured, said in the
X-Kvflow-Ignored header; the question seeds the request as `kvflow run` seeds its problem).
Then each answer is the committed steps `kvflow run` gives that problem, on a real checkpoint
in bfloat16 (SmolLM2-135M, a sampled evicted base), although the requests arrive one by one,
concurrently and in another order than `kvflow run` decodes them (seen failing with
`run.deterministic: false`: the batches differ, and with them the last bits).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

from test_serve import KVFLOW, start_server, wait_record

from kvflow.eval.prompts import get_prompt
from kvflow.testing import tiny_pipeline
from kvflow.testing.pipelines import PROBLEMS


def test_served_answers_are_kvflow_runs_problem_by_problem_in_bf16(tmp_path):
    pipeline = tiny_pipeline(
        tmp_path, model="catalog:smollm2-135m-instruct", problems=3, n=2, helper=False, max_step_tokens=16,
        max_tokens=40, evictor={"kind": "random", "budget": 24, "buffer": 8},
        extra={"run": {"deterministic": True, "threads": 1, "batch_problems": 4, "live_problems": 4},
               "models": {"base": {"dtype": "bfloat16"}}, "serve": {"queue": 8, "seed_by": "dataset"}})
    out = tmp_path / "run"
    done = subprocess.run([*KVFLOW, "run", str(pipeline), "--set", f"run.output={out}"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ran = {r["id"]: r for r in map(json.loads, next(out.glob("*/samples.jsonl")).read_text().splitlines())}
    assert len(ran) == 3

    server = start_server(tmp_path / "serve", pipeline=pipeline)
    try:
        template = get_prompt("qwen25-math-cot")

        def ask(i: int):
            raw = server.client().chat.completions.with_raw_response.create(
                model="tiny", messages=template.messages(PROBLEMS[i][0]), seed=1234)
            assert raw.headers["x-kvflow-ignored"] == "seed"
            return raw.parse()

        with ThreadPoolExecutor(3) as pool:
            replies = dict(zip([2, 0, 1], pool.map(ask, [2, 0, 1])))
        served = {i: wait_record(server, reply.id) for i, reply in replies.items()}
    finally:
        server.proc.kill()
        server.proc.wait(30)
    for i, rec in served.items():
        expected = ran[f"tiny/{i}"]
        assert rec["prompt"] == expected["prompt"]
        assert [(s["text"], s["source"], s["n_tokens"]) for s in rec["steps"]] == \
               [(s["text"], s["source"], s["n_tokens"]) for s in expected["steps"]], i
