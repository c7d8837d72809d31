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
positions itself (`kvflow.backends.served.position_values.PositionValues`). The LM head SGLang needs
for the one token it samples is the embedding matrix (a PRM has none; that token is unused),
so the model costs no more memory than the checkpoint.

Registered with `register()` in every process of a kvflow-started engine that serves a PRM
(plugin.py), only under a name SGLang does not already serve, together with an extend attention
for SGLang's CPU backend that runs only the new tokens' queries (`new_queries_only`: SGLang's
own runs the cached prefix's too, quadratic in the row's length). No SGLang file is changed.
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


_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend"


def register() -> None:
    """Add the class to SGLang's model registry (where no model of that name is served), and
    the extend attention below to SGLang's CPU backend of this engine."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if ARCH not in ModelRegistry.models:
        ModelRegistry.models[ARCH] = Qwen2ForProcessRewardModel
    HookRegistry.register(_EXTEND, new_queries_only, HookType.AROUND)


def new_queries_only(original, backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                     extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                     causal=False, is_cross_attn=False, sliding_window_size=None):
    """SGLang's `torch_native` extend attention (the CPU's) runs a query for every position of
    a request, cached prefix included, and keeps the new ones: O(length^2) per request however
    short the extension, which makes a scoring round over a cached prefix grow with the square
    of the trajectory. This runs only the new queries against the whole row (a causal mask
    offset by the prefix): O(new x length). Same attention; the engine's own path for anything
    else (not causal, sliding windows, encoders). Registered for PRM engines only.

    query, output: [new tokens (all requests'), heads, head_dim]."""
    if not causal or is_cross_attn or encoder_lens is not None or (sliding_window_size is not None
                                                                   and sliding_window_size > -1):
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    from torch.nn.functional import scaled_dot_product_attention

    query = query.movedim(0, query.dim() - 2)  # [tokens, heads, dim] -> [heads, tokens, dim], as SGLang's
    start = 0
    for i in range(seq_lens.shape[0]):
        n_new, prefix, length = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        q = query[:, start : start + n_new, :]  # [heads, new, dim]
        tokens = req_to_token[req_pool_indices[i], :length]
        k = k_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)  # [kv_heads, length, dim]
        v = v_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
        # new query j (position prefix + j) sees keys 0..prefix + j
        mask = torch.ones(n_new, length, dtype=torch.bool, device=q.device).tril(diagonal=prefix) if prefix else None
        out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           enable_gqa=enable_gqa, scale=scaling, is_causal=not prefix)
        output[start : start + n_new] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start += n_new
    return output
