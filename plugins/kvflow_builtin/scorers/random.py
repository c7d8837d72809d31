"""`random`: a uniform random score per candidate — the control for scorer ablations.

Draws are seeded from (run seed, problem, step, proposer, candidate), so a run is
reproducible and independent of batching.
"""

from __future__ import annotations

import hashlib
import random

from kvflow_builtin.scorers._steps import StepScorer


class RandomScorer(StepScorer):
    """Uniform(0, 1) score per candidate, seeded by (run seed, problem, step, candidate)."""

    def score(self, requests):
        out = []
        for r in requests:
            key = repr((self.context.seed, r.trajectory.problem_id, len(r.trajectory.steps), r.candidate.source, r.candidate.index))
            seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
            out.append(random.Random(seed).random())
        return out
