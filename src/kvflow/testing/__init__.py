"""Test helpers for kvflow and its plugins.

- tiny real transformers models and a tiny tokenizer, built in-process from configs (random
  weights, no downloads): `tiny_model`, `tiny_runner`, `tiny_engine`, `tiny_tokenizer`, and
  `propose_now` (one proposal on an engine, stepped to its end);
- pipeline files that run on those models through the real `kvflow run`: `tiny_pipeline`
  (and `tiny_model_dir`, `tiny_dataset`, what it writes);
- contract suites (pytest) that every component of a kind must pass, built-in or not:
  `kvflow.testing.evictor_contract`, `pruner_contract`, `scorer_contract`,
  `committer_contract`, `engine_contract` (import them in a test module; they need pytest).

    from kvflow.testing import tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
"""

from kvflow.testing.models import ARCHITECTURES, propose_now, tiny_engine, tiny_model, tiny_runner, tiny_tokenizer
from kvflow.testing.pipelines import tiny_dataset, tiny_model_dir, tiny_pipeline

__all__ = ["ARCHITECTURES", "propose_now", "tiny_dataset", "tiny_engine", "tiny_model", "tiny_model_dir",
           "tiny_pipeline", "tiny_runner", "tiny_tokenizer"]
