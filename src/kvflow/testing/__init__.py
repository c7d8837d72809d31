"""Test helpers for kvflow and its plugins: tiny real transformers models and a tiny
tokenizer, built in-process from configs (random weights, no downloads).

    from kvflow.testing import tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
"""

from kvflow.testing.models import ARCHITECTURES, tiny_model, tiny_runner, tiny_tokenizer

__all__ = ["ARCHITECTURES", "tiny_model", "tiny_runner", "tiny_tokenizer"]
