"""`best`: commit the highest-scored candidate (KV-Rescue, DESIGN.md §6).

Ties go to the proposer listed first in the pipeline (the base), then to the lower candidate
index, so a deterministic scorer gives a deterministic trajectory. Candidates without a
score (their proposer is not scored by the scorer) rank below every scored one.
"""

from __future__ import annotations

import math

from kvflow.components.base import Committer


class BestCommitter(Committer):
    """Highest score wins; ties go to the base (the first proposer), then the lower index."""

    def pick(self, candidates):
        def key(i: int):
            c = candidates[i]
            score = c.score if c.score is not None and not math.isnan(c.score) else -math.inf
            return (-score, self.proposers.index(c.source), c.index)

        return min(range(len(candidates)), key=key)
