"""`margin`: commit a helper step only when it beats the best base step by `delta`.

A conservative variant of `best`: the base's own step is kept unless some
other proposer's candidate scores more than `delta` above the best base candidate, which
limits how often the trajectory switches to the helper's text (and the base has to ingest
it) on small score differences. "Base" is the first proposer of the pipeline, or `base`.

Rules, in order:
- the best base candidate and the best other candidate are picked as in `best` (highest
  score, then the proposer listed first, then the lower index; an unscored candidate, whose
  score is None or nan, ranks below every scored one);
- with no base candidate (all pruned, or no base in the pipeline) the best other one wins,
  and with no other candidate the best base one does;
- otherwise the other candidate wins only if both are scored and
  `other.score > base.score + delta` (strictly: ties go to the base); an unscored base
  candidate loses to a scored other one.
"""

from __future__ import annotations

import math
from typing import Optional

from pydantic import Field

from kvflow.components.base import Committer, CommitterParams


class MarginParams(CommitterParams):
    delta: float = Field(0.0, description="Score margin another proposer's step needs over the best base step.")
    base: Optional[str] = Field(None, description="Which proposer is the base (default: the first one).")


def _score(c) -> Optional[float]:
    return None if c.score is None or math.isnan(c.score) else float(c.score)


class MarginCommitter(Committer):
    """The best base step, unless another proposer's best step scores more than `delta` higher."""

    Params = MarginParams

    def __init__(self, params, proposers) -> None:
        super().__init__(params, proposers)
        if params.base is not None and params.base not in self.proposers:
            from kvflow.errors import UserError

            raise UserError(f"committer.base: unknown proposer '{params.base}'",
                            hint=f"proposers of this pipeline: {', '.join(self.proposers)}")
        self.base = params.base or self.proposers[0]

    def _best(self, candidates, indices: list[int]) -> Optional[int]:
        def key(i: int):
            c = candidates[i]
            s = _score(c)
            order = self.proposers.index(c.source) if c.source in self.proposers else len(self.proposers)
            # unscored (None or nan) after every scored candidate, even one scored -inf
            return (s is None, -s if s is not None else 0.0, order, c.index)

        return min(indices, key=key) if indices else None

    def pick(self, candidates):
        base = self._best(candidates, [i for i, c in enumerate(candidates) if c.source == self.base])
        other = self._best(candidates, [i for i, c in enumerate(candidates) if c.source != self.base])
        if base is None or other is None:
            return base if other is None else other
        b, o = _score(candidates[base]), _score(candidates[other])
        if o is not None and (b is None or o > b + self.params.delta):
            return other
        return base
