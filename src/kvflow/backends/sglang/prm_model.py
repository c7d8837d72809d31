"""A Qwen2 process reward model for SGLang, registered by kvflow's SGLang plugin (issue 26).

SGLang 0.5.23 serves reward models with last-token pooling (`Qwen2ForRewardModel`) but has no
process reward model: nothing reads a head at every step tag. This module gives SGLang's
model registry a `Qwen2ForProcessRewardModel` (the architecture name Qwen2.5-Math-PRM
checkpoints declare): SGLang's own Qwen2 body (its attention backends, radix cache, tensor
parallel layers) plus the PRM's two-class token head `score = Linear(h, h), ReLU, Linear(h, 2)`.

It runs as a generation model, so that the radix cache keeps each problem's committed prefix:
a request (`max_new_tokens: 0`, `return_hidden_states: True`; the engine needs
`enable_return_hidden_states`) runs only the tokens the cache does not hold, and what comes
back as its "hidden states" is the head's logits at each of those positions ([new tokens, 2],
float32) instead of the body's final hidden states. kvflow keeps the values at cached
positions itself (`kvflow.backends.sglang.scoring.PositionValues`). The LM head SGLang needs
for the one token it samples is the embedding matrix (a PRM has none; that token is unused),
so the model costs no more memory than the checkpoint.

Registered with `register()` in every process of a kvflow-started engine (plugin.py), only
under a name SGLang does not already serve. No SGLang file is changed.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

ARCH = "Qwen2ForProcessRewardModel"
N_CLASSES = 2


class Qwen2ForProcessRewardModel(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.models.qwen2 import Qwen2Model
        from sglang.srt.utils import add_prefix

        super().__init__()
        self.config, self.quant_config = config, quant_config
        self.model = Qwen2Model(config, quant_config=quant_config, prefix=add_prefix("model", prefix))
        self.lm_head = self.model.embed_tokens  # for the unused sampled token only (see the module docstring)
        self.logits_processor = LogitsProcessor(config)
        h = config.hidden_size
        self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, N_CLASSES))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: Optional[torch.Tensor] = None, get_embedding: bool = False, **kwargs):
        hidden = self.model(input_ids, positions, forward_batch, input_embeds)  # [tokens, hidden]
        out = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)
        mode = getattr(forward_batch, "capture_hidden_mode", None)
        if out.hidden_states is not None and mode is not None and mode.is_full():
            # every extended position's class logits, where SGLang returns hidden states
            out.hidden_states = self.score(hidden).float()  # [tokens, 2]
        return out

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM

        seen = []

        def named():
            for name, w in weights:
                if name.startswith("lm_head"):
                    continue
                if name.startswith("score."):
                    seen.append(name)
                yield name, w

        result = Qwen2ForCausalLM._legacy_load_weights(self, named())
        missing = {f"score.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")} - set(seen)
        if missing:  # a randomly initialised head must never score anything
            raise ValueError(f"{ARCH}: the checkpoint lacks the PRM head weights {sorted(missing)}")
        return result


def register() -> None:
    """Add the class to SGLang's model registry (where no model of that name is served)."""
    from sglang.srt.models.registry import ModelRegistry

    if ARCH not in ModelRegistry.models:
        ModelRegistry.models[ARCH] = Qwen2ForProcessRewardModel
