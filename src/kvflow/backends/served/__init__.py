"""The served-engine core: what every backend whose engine runs in a worker process shares
(SGLang, vLLM; a fourth engine starts here).

- `wire.py`            the one message format (JSON lines) and the finish words every worker sends;
- `worker.py`          kvflow's side of a worker process, and one registry of running workers
                       for every backend (`shared`, `hold`, `close_idle`);
- `engine.py`          `ServedEngine`: the engine protocol over a worker (states, proposals,
                       streamed rows, one-shot requests, scoring); a backend adds its requests;
- `snapshots.py`       evicted problem states as snapshots inside the engine;
- `streamed.py`        stop rules, pruners and candidates over streamed rows;
- `signals.py`         entropy estimates and confidences from top-k log-probabilities;
- `prompt_logprobs.py` the `likelihood` scorer's session over prompt log-probabilities;
- `position_values.py` per-position values for `prm` and `llm_judge`;
- `settings.py`        the shared steps of a backend's settings checks;
- `loading.py`         what kvflow's side reads from a model directory (tokenizer, EOS, KV shape).

A backend package (backends/sglang/, backends/vllm/) keeps what differs: its `Backend` class
(`__init__.py`), its `ServedEngine` subclass (`engine.py`), its settings and loading, and, in
`in_worker/`, what runs inside the engine's process.
"""
