"""Full-context scoring on the `hf` backend.

- `ScoringSession` gives per-token log-probabilities of candidate steps given the problem's
  committed trajectory. It keeps one full-KV cache row per problem, holding the prompt and
  every committed step (synced lazily from the trajectory text), so a round of scoring only
  runs the candidates' own tokens. Used by the `likelihood` scorer.
- `PrefixForward` gives a small head's outputs (a PRM's class logits, the LM head restricted
  to a few label tokens) at chosen positions of re-rendered inputs (PRM input, judge prompt),
  running only the tokens it has not seen: per problem it keeps the token ids of the round's
  shared prefix, their full KV (one row) and the head's outputs at every one of those
  positions ([T, C], C = 2). A round crops that cache back to its token-level longest common
  prefix (LCP) with the round's inputs -- a rendering is nearly append-only, but not quite:
  the judge's "(no steps yet)" becomes the first step, BPE merges across a step boundary, a
  chat template's closing tokens follow the last step --, extends it by the rest of the
  prefix the round's inputs share (one row: the committed step), and runs the candidates'
  own tokens packed into one row over it (a tree mask: each candidate sees the prefix and
  itself), so the prefix's KV is read once, never copied per candidate. Used by `prm` and `llm_judge` (their default, `prefix_reuse`).
- `PositionForward` runs whole sequences through the body with no cache (right padding,
  length-sorted chunks of bounded size): what `prefix_reuse: false` runs, and the reference
  the reuse is tested against.
- `label_head()`: the LM head restricted to a few label tokens, without the full-vocabulary
  logits.
- `prompt_logprobs()`: every token of one token sequence scored by the model with a full
  cache (log p of each token given the ones before it, the `top` likeliest tokens at each
  position, and the likeliest next token): what `kvflow serve` answers an `echo` +
  `logprobs` completion with (an evaluation harness's loglikelihood request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvflow.backends.hf import invariant
from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.base import Evictor, Trajectory
from kvflow.components.engine import common_prefix

_POSITIONS_PER_CHUNK = 128  # bounds the [positions, vocab] logits held at once


@dataclass
class _ProblemState:
    cache: BudgetedCache  # one row: prompt + committed steps, last token pending
    pending: int
    n_steps: int


class ScoringSession:
    def __init__(self, runner: HFRunner, full_kv: Evictor) -> None:
        self.runner = runner
        self.full_kv = full_kv
        self._states: dict[str, _ProblemState] = {}

    def _sync(self, trajectories: Sequence[Trajectory]) -> list[_ProblemState]:
        """Each problem's state, brought up to date with its committed steps: new problems'
        prompts are prefilled together, and the steps committed since the last call are
        ingested together (one batched forward each, not one per problem)."""
        new = list(dict.fromkeys(t.problem_id for t in trajectories if t.problem_id not in self._states))
        if new:
            prompts = {t.problem_id: t.prompt for t in trajectories}
            cache = self.runner.new_cache(self.full_kv, len(new))
            pending = self.runner.prefill(cache, [self.runner.encode(prompts[pid]) for pid in new]).tolist()
            for i, pid in enumerate(new):
                self._states[pid] = _ProblemState(cache.select([i]), int(pending[i]), 0)
        behind: dict[str, tuple[_ProblemState, list[int], int]] = {}
        for t in trajectories:
            st = self._states[t.problem_id]
            if st.n_steps < len(t.steps) and t.problem_id not in behind:
                # step by step, as the proposers ingest committed steps (same tokens whether
                # this problem was scored every round or skipped some)
                ids = [i for s in t.steps[st.n_steps:] for i in self.runner.encode(s.text)]
                behind[t.problem_id] = (st, ids, len(t.steps))
        todo = [(st, ids, n) for st, ids, n in behind.values() if ids]
        if todo:
            cache = BudgetedCache.cat([st.cache for st, _, _ in todo])
            self.runner.ingest(cache, [[st.pending] + ids[:-1] for st, ids, _ in todo])
            for i, (st, ids, _) in enumerate(todo):
                st.cache, st.pending = cache.select([i]), ids[-1]
        for st, _, n in behind.values():
            st.n_steps = n
        return [self._states[t.problem_id] for t in trajectories]

    @torch.inference_mode()
    def token_logprobs(self, trajectories: Sequence[Trajectory], texts: Sequence[str]) -> list[list[float]]:
        """log p(token | trajectory, earlier tokens of the text) for every token of each text."""
        states = self._sync(trajectories)
        ids = [self.runner.encode(x) for x in texts]
        batch = BudgetedCache.cat([s.cache.select([0]) for s in states])
        hidden = self.runner.forward(batch, [[s.pending] + x[:-1] for s, x in zip(states, ids)], logits="hidden")
        out = []
        for r, x in enumerate(ids):
            lps = []
            for start in range(0, len(x), _POSITIONS_PER_CHUNK):
                h = hidden[r, start : start + _POSITIONS_PER_CHUNK][: len(x) - start]
                with self.runner.upcast(h.shape[0]):
                    logits = self.runner.lm_head(h)
                logp = torch.log_softmax(logits.float(), dim=-1)
                target = torch.as_tensor(x[start : start + len(h)], device=logp.device)
                lps.extend(logp.gather(-1, target[:, None]).squeeze(-1).tolist())
            out.append(lps)
        return out

    def release(self, problem_ids: Sequence[str]) -> None:
        for pid in problem_ids:
            self._states.pop(pid, None)


@dataclass
class PromptLogprobs:
    """`prompt_logprobs`' answer for ids[0..n-1]: `logprobs[i]` = log p(ids[i] | ids[:i]) (None
    for i = 0), `top[i]` = the `top` likeliest (id, log p) at position i (None for i = 0), and
    `next` = the `top` likeliest (id, log p) after the last token, greedy first."""

    logprobs: list
    top: list
    next: list


@torch.inference_mode()
def prompt_logprobs(runner: HFRunner, full_kv: Evictor, ids: Sequence[int], top: int) -> PromptLogprobs:
    """Score `ids` with the model over a full cache (one forward; see the module docstring)."""
    if not ids:
        raise ValueError("nothing to score: an empty token sequence")
    cache = runner.new_cache(full_kv, 1)
    hidden = runner.forward(cache, [list(ids)], logits="hidden")[0]  # [n, hidden]
    k = max(1, top)
    logprobs: list = [None]
    tops: list = [None]
    after: list = []
    target = torch.as_tensor(list(ids[1:]) + [0], device=hidden.device)
    for start in range(0, len(ids), _POSITIONS_PER_CHUNK):
        h = hidden[start : start + _POSITIONS_PER_CHUNK]
        with runner.upcast(h.shape[0]):
            logits = runner.lm_head(h)
        logp = torch.log_softmax(logits.float(), dim=-1)  # position j predicts ids[j + 1]
        chosen = logp.gather(-1, target[start : start + len(h), None]).squeeze(-1).tolist()
        values, indices = logp.topk(k, dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        for j in range(len(h)):
            if start + j + 1 < len(ids):
                logprobs.append(chosen[j])
                tops.append(alternatives[j][:top])
            else:
                after = alternatives[j]
    return PromptLogprobs(logprobs, tops, after)


class PositionForward:
    """Batched full forwards that return `head(hidden)` at chosen positions only.

    body:  a transformers decoder stack (e.g. `Qwen2Model`, `HFRunner.body`), called with
           right-padded `input_ids` and a 2D `attention_mask` (plain causal attention).
    head:  maps final hidden states [k, hidden] to [k, C] logits (a PRM's class head, or the
           LM head restricted to a few label tokens).
    batch_tokens: most padded tokens per forward (rows x longest row); a sequence longer than
           that runs alone.
    """

    def __init__(self, body: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], *,
                 pad_id: int = 0, batch_tokens: int = 16384) -> None:
        self.body = body
        self.head = head
        self.pad_id = pad_id
        self.batch_tokens = batch_tokens
        self.device = next(body.parameters()).device

    @torch.inference_mode()
    def __call__(self, ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For every sequence i: head logits at positions[i], [len(positions[i]), C] float32 (CPU)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        with invariant.linear_tiles(self.body):
            for chunk in self._chunks([len(x) for x in ids]):
                self._chunk(chunk, ids, positions, out)
        return out

    def _chunk(self, chunk: list[int], ids, positions, out: list) -> None:
        """One padded forward of the sequences `chunk`, their head logits put in `out`."""
        width = max(len(ids[i]) for i in chunk)
        input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            input_ids[r, : len(ids[i])] = torch.as_tensor(list(ids[i]), dtype=torch.long)
            mask[r, : len(ids[i])] = 1
        hidden = self.body(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                           use_cache=False).last_hidden_state  # [rows, T, hidden]
        rows = torch.cat([torch.full((len(positions[i]),), r, dtype=torch.long) for r, i in enumerate(chunk)])
        cols = torch.cat([torch.as_tensor(list(positions[i]), dtype=torch.long) for i in chunk])
        logits = self.head(hidden[rows.to(self.device), cols.to(self.device)]).float().cpu() if len(rows) else None
        start = 0
        for i in chunk:
            k = len(positions[i])
            out[i] = logits[start : start + k] if logits is not None else torch.empty(0, 0)
            start += k

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices grouped longest first, each group within `batch_tokens` padded tokens; in
        batch-invariant mode one sequence per forward (sdpa reduces a padded row differently)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        if invariant.enabled():
            return [[i] for i in order]
        chunks: list[list[int]] = []
        for i in order:
            if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= self.batch_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks


def label_head(lm_head: torch.nn.Module, labels: Sequence[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [k, hidden] -> logits [k, len(labels)] of those tokens only (the rows of the LM
    head's weight; a full-vocabulary projection at every position would dwarf the head)."""
    idx = torch.as_tensor(list(labels), dtype=torch.long, device=lm_head.weight.device)
    weight = lm_head.weight[idx]  # [C, hidden]
    bias = lm_head.bias[idx] if getattr(lm_head, "bias", None) is not None else None
    return lambda h: torch.nn.functional.linear(h.to(weight.dtype), weight, bias)


@dataclass
class _Prefix:
    ids: list[int]  # tokens whose KV and head outputs are kept
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, T, head_dim]
    head: torch.Tensor  # [T, C] float32 (CPU): the head's outputs at every kept position


class PrefixForward:
    """`head(hidden)` at chosen positions, running only tokens not cached for the problem
    (see the module docstring). Same results as `PositionForward` (to float rounding).

    body:  a transformers decoder stack (`Qwen2Model`, `HFRunner.body`) with full attention in
           every layer (a sliding-window layer forgets what a crop would need: refused).
    head:  final hidden states [k, hidden] -> [k, C] logits.
    batch_tokens: most candidate tokens per forward (candidates are packed into one row).
    """

    def __init__(self, body: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], *,
                 batch_tokens: int = 16384) -> None:
        from kvflow.backends.hf.compat import cache_keyword

        types = getattr(body.config, "layer_types", None) or []
        if any(t != "full_attention" for t in types) or getattr(body.config, "use_sliding_window", False):
            raise ValueError("prefix reuse needs full attention in every layer (this model has sliding-window "
                             "layers); score with prefix_reuse: false")
        self.body, self.head, self.batch_tokens = body, head, batch_tokens
        self.device = next(body.parameters()).device
        self.cache_keyword = cache_keyword(body)
        self._states: dict[str, _Prefix] = {}
        self.tokens_run = 0  # tokens forwarded so far (the benchmark's and tests' measure of reuse)

    @torch.inference_mode()
    def __call__(self, keys: Sequence[str], ids: Sequence[Sequence[int]],
                 positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For every sequence i (of problem keys[i]): head logits at positions[i],
        [len(positions[i]), C] float32 (CPU)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        with invariant.linear_tiles(self.body):  # a problem's forwards hold its own tokens only
            for key, idx in groups.items():
                self._problem(key, idx, ids, positions, out)
        return out

    def release(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._states.pop(key, None)

    def _problem(self, key: str, idx: list[int], ids, positions, out) -> None:
        seqs = [list(ids[i]) for i in idx]
        shared = seqs[0]
        for s in seqs[1:]:
            shared = shared[: common_prefix(shared, s)]
        st = self._states.get(key)
        keep = common_prefix(st.ids, shared) if st is not None else 0
        kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in st.kv] if st is not None and keep else None
        head = st.head[:keep] if st is not None else torch.empty(0, 0)
        if len(shared) > keep:  # the part of the shared prefix not cached yet (a committed step): one row
            kv, new = self._forward(kv, [shared[keep:]], keep)
            head = torch.cat([head.reshape(keep, new.shape[-1]), new[0]]) if keep else new[0]
        self._states[key] = st = _Prefix(shared, kv, head)
        n = len(shared)
        suffix: dict[int, torch.Tensor] = {}
        todo = [i for i in idx if len(ids[i]) > n]
        for chunk in self._chunks(todo, ids, n):
            new = self._packed(st.kv, [list(ids[i][n:]) for i in chunk], n)
            for i, values in zip(chunk, new):
                suffix[i] = values
        for i in idx:
            pos = torch.as_tensor(list(positions[i]), dtype=torch.long)
            if len(pos) == 0:
                out[i] = torch.empty(0, st.head.shape[-1] if st.head.numel() else 0)
                continue
            rows = [st.head[p] if p < n else suffix[i][p - n] for p in pos.tolist()]
            out[i] = torch.stack(rows)

    def _chunks(self, todo: list[int], ids, n: int) -> list[list[int]]:
        """Candidates packed into one row each, at most `batch_tokens` of their own tokens a row."""
        chunks: list[list[int]] = []
        used = 0
        for i in todo:
            k = len(ids[i]) - n
            if chunks and used + k <= self.batch_tokens:
                chunks[-1].append(i)
                used += k
            else:
                chunks.append([i])
                used = k
        return chunks

    def _packed(self, kv, seqs: list[list[int]], past: int) -> list[torch.Tensor]:
        """Several candidates' own tokens in ONE row after the `past` cached tokens, each
        attending to the prefix and causally to itself only (a tree mask; positions restart at
        `past` for each): the prefix's KV is read once, not copied per candidate. Returns the
        head's outputs [len(seq), C] per candidate."""
        from transformers import DynamicCache

        total = sum(len(x) for x in seqs)
        input_ids = torch.as_tensor([t for x in seqs for t in x], dtype=torch.long)[None, :]  # [1, S]
        positions = torch.cat([past + torch.arange(len(x)) for x in seqs])[None, :]  # [1, S]
        allowed = torch.zeros(total, past + total, dtype=torch.bool)  # [S, past + S]
        allowed[:, :past] = True
        start = 0
        for x in seqs:
            block = torch.ones(len(x), len(x), dtype=torch.bool).tril()
            allowed[start : start + len(x), past + start : past + start + len(x)] = block
            start += len(x)
        dtype = next(self.body.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        cache = DynamicCache(config=self.body.config)
        for layer, (k, v) in enumerate(kv or ()):
            cache.update(k, v, layer)
        hidden = self.body(input_ids=input_ids.to(self.device), attention_mask=mask[None, None].to(self.device),
                           position_ids=positions.to(self.device), use_cache=True,
                           **{self.cache_keyword: cache}).last_hidden_state[0]  # [S, hidden]
        self.tokens_run += total
        head = self.head(hidden).float().cpu()  # [S, C]
        return list(head.split([len(x) for x in seqs]))

    def _forward(self, kv, seqs: list[list[int]], past: int, keep_kv: bool = True):
        """Run seqs (right-padded) after `past` cached tokens (kv: per layer [rows, kv_heads,
        past, head_dim], or None). Returns (the new per-layer kv if keep_kv, head [rows, W, C])."""
        from transformers import DynamicCache

        rows, width = len(seqs), max(len(s) for s in seqs)
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, past + width, dtype=torch.long)
        mask[:, :past] = 1
        for r, s in enumerate(seqs):
            input_ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[r, past : past + len(s)] = 1
        cache = DynamicCache(config=self.body.config)
        for layer, (k, v) in enumerate(kv or ()):
            cache.update(k, v, layer)
        positions = (past + torch.arange(width))[None, :].expand(rows, -1)
        hidden = self.body(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                           position_ids=positions.to(self.device), use_cache=True,
                           **{self.cache_keyword: cache}).last_hidden_state  # [rows, W, hidden]
        self.tokens_run += sum(len(s) for s in seqs)
        head = self.head(hidden.reshape(rows * width, -1)).float().cpu().reshape(rows, width, -1)
        new_kv = [(layer.keys, layer.values) for layer in cache.layers] if keep_kv else None
        return new_kv, head


def head_forward(body: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], *, reuse: bool, pad_id: int,
                 batch_tokens: int) -> Callable:
    """What `prm` and `llm_judge` score with on `hf`: `PrefixForward` with `reuse`, else (or
    for a model with sliding-window layers, with a warning) `PositionForward`; either way
    called as `(keys, ids, positions)`, with `release(keys)` where there is state."""
    if reuse:
        try:
            return PrefixForward(body, head, batch_tokens=batch_tokens)
        except ValueError as e:
            import logging

            logging.getLogger(__name__).warning("%s: re-encoding every input", e)
    plain = PositionForward(body, head, pad_id=pad_id, batch_tokens=batch_tokens)
    return lambda keys, ids, positions: plain(ids, positions)
