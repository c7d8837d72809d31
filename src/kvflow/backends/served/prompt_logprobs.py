"""Full-context token log-probabilities of candidate steps from an engine's prompt log-probabilities
(`ScoringSession`), for the engines in another process (SGLang's, vLLM's) and the `likelihood` scorer.

The engine provides `encode(text)` and `score_ids([(ids, start)]) -> [[log p of ids[start:]]]`.
Same contract as `hf`'s session (`kvflow.components.engine`, "scoring_session"): the context is
the prompt and then each committed step tokenized on its own, as the proposers' caches hold it.
"""

from __future__ import annotations


class ScoringSession:
    """Token log-probabilities of texts after each problem's trajectory (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._context: dict[str, tuple[list[int], int]] = {}  # problem -> (ids, steps included)

    def _ids(self, t) -> list[int]:
        ids, n = self._context.get(t.problem_id) or (self.engine.encode(t.prompt), 0)
        if n < len(t.steps):
            ids = ids + [i for s in t.steps[n:] for i in self.engine.encode(s.text)]
        self._context[t.problem_id] = (ids, len(t.steps))
        return ids

    def token_logprobs(self, trajectories, texts) -> list[list[float]]:
        seqs = []
        for t, text in zip(trajectories, texts):
            ctx = self._ids(t)
            seqs.append((ctx + self.engine.encode(text), len(ctx)))
        return self.engine.score_ids(seqs)

    def release(self, problem_ids) -> None:
        for pid in problem_ids:
            self._context.pop(pid, None)
