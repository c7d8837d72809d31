"""What kvflow's side of a served engine reads from a model's directory before it builds the
engine object: the tokenizer, the EOS ids, the vocabulary and the KV shape (`ModelFacts`).
The backend's own `loading.py` starts (or shares) the worker and builds its engine from these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ModelFacts:
    config: Any  # transformers' AutoConfig
    tokenizer: Any
    eos_ids: set[int]
    kv_shape: tuple[int, int, int, int]  # (layers, kv_heads, head_dim, bytes per element)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def read_config(model_path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def model_facts(model_cfg, model_path: str, tokenizer_path: Optional[str], trust_remote_code: bool,
                config=None) -> ModelFacts:
    """The facts of the entry's model (its config read once: pass it where the caller has it)."""
    from transformers import AutoTokenizer, GenerationConfig

    from kvflow.models.loading import eos_token_ids
    from kvflow.models.shapes import kv_shape

    config = config if config is not None else read_config(model_path, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        generation = None
    return ModelFacts(config, tokenizer, eos_token_ids(generation, config, tokenizer),
                      kv_shape(config.to_dict(), model_cfg))
