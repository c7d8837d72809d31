"""Full-context scoring on the `hf` backend.

- `ScoringSession` gives per-token log-probabilities of candidate steps given the problem's
  committed trajectory. It keeps one full-KV cache row per problem, holding the prompt and
  every committed step (synced lazily from the trajectory text), so a round of scoring only
  runs the candidates' own tokens. Used by the `likelihood` scorer.
- `PositionForward` runs whole sequences (one per request: PRM input or judge prompt) through
  a model body, batched with right padding in length-sorted chunks of bounded size, and
  applies a small head at chosen positions only (step tags, the judge's answer slot). Used
  by the `prm` and `llm_judge` scorers: their inputs are re-rendered texts, not continuations
  of the trajectory, so there is no cache to reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvflow.backends.hf.cache import BudgetedCache
from kvflow.backends.hf.engine import HFRunner
from kvflow.components.base import Evictor, Trajectory

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
        for chunk in self._chunks([len(x) for x in ids]):
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
        return out

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices grouped longest first, each group within `batch_tokens` padded tokens."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        chunks: list[list[int]] = []
        for i in order:
            if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= self.batch_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks
