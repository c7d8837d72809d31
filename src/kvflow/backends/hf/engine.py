"""The `hf` backend: one loaded transformers model and the forward passes kvflow needs.

`HFRunner.forward()` appends tokens to a `BudgetedCache` (rows at their own offsets, right
padding allowed) and returns the logits of each row's last real token; `ingest()` appends
text of any length without ever holding more than `budget + buffer` tokens, compacting as
it goes. `decode_step()` runs one decode token for the live rows of many caches at once. The engine
built on these (proposals, sampling, sync) lives in `kvflow.backends.hf.decode`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvflow.backends.hf import invariant
from kvflow.backends.hf.attention import kvflow_attention_enabled
from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.compat import cache_keyword
from kvflow.backends.hf.decode_batch import DecodeBatch
from kvflow.backends.hf.rows import new_rows
from kvflow.backends.hf.matmul import fp32_linear, fp32_min_tokens
from kvflow.components.base import Evictor
from kvflow.models.loading import eos_token_ids

_INGEST_CHUNK = 512  # tokens per forward when ingesting into an unbounded cache


class HFRunner:
    """A transformers causal LM + tokenizer, driven with kvflow's budgeted cache."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.body = model.base_model  # decoder stack without the LM head
        # "cache" or "past_key_values" (older transformers): every forward passes kvflow's
        # cache under this keyword (kvflow.backends.hf.compat)
        self.cache_keyword = cache_keyword(self.body)
        self.lm_head = model.get_output_embeddings()
        self.num_layers = model.config.num_hidden_layers
        self.eos_ids = eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer)
        self._pieces: dict[int, str] = {}
        # bf16 on a CPU without fast bf16 GEMMs: forwards of this many tokens or more compute
        # their linear layers in float32 (kvflow.backends.hf.matmul); None = never
        self.fp32_min_tokens: Optional[int] = fp32_min_tokens(model)

    def upcast(self, n_tokens: int):
        """Context for a forward (or LM head) over `n_tokens` rows x tokens. Batch-invariant mode
        (`run.deterministic`, kvflow.backends.hf.invariant): linear layers in fixed-size tiles,
        in float32 wherever this CPU computes bf16 so (whatever `n_tokens`). Otherwise float32
        linear layers where that is faster here (kvflow.backends.hf.matmul), else nothing."""
        if invariant.enabled():
            return invariant.linear_tiles(self.model)
        return fp32_linear(self.fp32_min_tokens is not None and n_tokens >= self.fp32_min_tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [..., vocab] float32 of final hidden states [..., hidden]: as
        they come in the default mode, in tiles in batch-invariant mode."""
        with invariant.linear_tiles(self.model):  # a null context in the default mode
            return self.lm_head(hidden).float()

    def kv_shape(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, head_dim, bytes per element) of this model's cache."""
        cfg = self.model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        elem = next(self.model.parameters()).element_size()
        return self.num_layers, kv_heads, head_dim, elem

    # ------------------------------------------------------------------ text

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """Text of one token on its own (partial UTF-8 shows as U+FFFD; the delimiter is ASCII)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def pieces(self) -> list[str]:
        """`piece()` of every id the LM head can produce (ids past the tokenizer's: ""). A fast
        tokenizer's Rust decoder does it in one call (what `decode` runs, without the Python
        conversions that make a 150k vocabulary take a second); others decode id by id."""
        n = len(self.tokenizer)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        else:
            texts = [self.piece(i) for i in range(n)]
        return texts + [""] * max(0, self.lm_head.out_features - n)

    # ------------------------------------------------------------------ caches

    def new_cache(self, evictor: Evictor, n_rows: int, rng_keys: Optional[Sequence[int]] = None) -> BudgetedCache:
        return BudgetedCache(evictor, self.num_layers, new_rows(n_rows, rng_keys), self.device,
                             kv_heads=self.kv_shape()[1])

    def prefill(self, cache: BudgetedCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Ingest each prompt but its last token, which stays pending: [rows] int64.

        Keeping the last token out of the cache makes a row's state "cache + pending token",
        which a candidate's state also is when it stops, so adopting a candidate is a copy.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        # protection is set before ingesting: a prompt longer than budget + buffer is compacted
        # while it is ingested, and its first tokens (slots 0..n-1) must survive that too
        cache.rows.n_protected = torch.as_tensor([cache.evictor.n_protected(len(p) - 1) for p in prompts],
                                                 dtype=torch.long)
        self.ingest(cache, [p[:-1] for p in prompts])
        return torch.as_tensor([p[-1] for p in prompts], dtype=torch.long)

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def forward(self, cache: BudgetedCache, ids: Sequence[Sequence[int]] | torch.Tensor,
                logits: str = "last") -> Optional[torch.Tensor]:
        """Append ids[r] to row r and run the model.

        logits: "last" -> [rows, vocab] float32 at each row's last new token (rows with no new
                token get garbage); "hidden" -> the final hidden states [rows, T, hidden];
                "none" -> None.
        """
        if isinstance(ids, torch.Tensor):  # [rows, T], no padding
            input_ids = ids
            step_lens = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)
        else:
            step_lens = torch.as_tensor([len(x) for x in ids], dtype=torch.long)
            width = max(1, int(step_lens.max()))
            input_ids = torch.zeros(len(ids), width, dtype=torch.long)
            for r, x in enumerate(ids):
                input_ids[r, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        width = input_ids.shape[1]
        plan = cache.begin_forward(step_lens, width)
        positions = cache.rows.positions[:, None] + torch.arange(width)[None, :]  # [rows, T]
        with kvflow_attention_enabled(self.model), self.upcast(input_ids.numel()):
            out = self.body(
                input_ids=input_ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=plan.mask,
                use_cache=True,
                kvflow_cache=cache,
                **{self.cache_keyword: cache},
            )
        cache.end_forward(step_lens)
        hidden = out.last_hidden_state  # [rows, T, hidden]
        if logits == "none":
            return None
        if logits == "hidden":
            return hidden
        last = (step_lens - 1).clamp(min=0).to(self.device)
        return self.head(hidden[torch.arange(hidden.shape[0], device=self.device), last])

    @torch.inference_mode()
    def decode_step(self, parts: Sequence[tuple[BudgetedCache, torch.Tensor]], tokens: torch.Tensor) -> torch.Tensor:
        """One decode token for the live rows of several caches of this model, one forward.

        parts: (cache, its live rows [k] int64 ascending); tokens: [L] int64, the token each
        live row appends, parts in order; returns logits [L, vocab] float32. Each part attends
        over its own slots (`DecodeBatch`); rows not listed are left as they are.
        """
        batch = DecodeBatch(parts)
        positions = torch.cat([c.rows.positions[live] for c, live in parts])[:, None]  # [L, 1]
        with kvflow_attention_enabled(self.model), self.upcast(int(positions.shape[0])):
            out = self.body(
                input_ids=tokens[:, None].to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=None,
                use_cache=True,
                kvflow_cache=batch,
                **{self.cache_keyword: batch},
            )
        batch.end_forward()
        return self.head(out.last_hidden_state[:, -1])

    def ingest(self, cache: BudgetedCache, ids: Sequence[Sequence[int]]) -> None:
        """Append ids[r] to row r, in chunks that never push a row past `budget + buffer`."""
        remaining = [list(x) for x in ids]
        while any(remaining):
            if cache.evictor.bounded:
                room = cache.room().tolist()
            else:
                room = [_INGEST_CHUNK] * cache.n_rows
            chunk = [r[: max(0, n)] for r, n in zip(remaining, room)]
            remaining = [r[len(c):] for r, c in zip(remaining, chunk)]
            self.forward(cache, chunk, logits="none")

