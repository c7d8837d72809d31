"""`best`: commit the highest-scored candidate (KV-Rescue's committer).

Ties go to the proposer listed first in the pipeline (the base), then to the lower candidate
index, so a deterministic scorer gives a deterministic trajectory. Candidates without a
score (None: their proposer is not scored by the scorer; or nan) rank below every scored
one (even a score of -inf); among unscored candidates the same tie rule applies. `margin` is the variant that asks
a helper step to beat the base by a margin.
"""

from __future__ import annotations

import math

from kvflow.components.base import Committer


class BestCommitter(Committer):
    """Highest score wins; ties go to the base (the first proposer), then the lower index."""

    def pick(self, candidates):
        def key(i: int):
            c = candidates[i]
            scored = c.score is not None and not math.isnan(c.score)
            return (not scored, -c.score if scored else 0.0, self.proposers.index(c.source), c.index)

        return min(range(len(candidates)), key=key)
