"""The statistics kvflow's readers put on results: Wilson intervals of an accuracy and the exact
McNemar test of two runs over the same problems."""

from __future__ import annotations

import math


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion correct/n (sensible at small n and near 0 or 1)."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(rescued: int, broken: int) -> float:
    """Two-sided exact McNemar test (the sign test on the discordant pairs): the probability,
    if neither run were better, of a split of the `rescued + broken` discordant problems at
    least as uneven as this one. 1.0 when there is no discordant problem."""
    n = rescued + broken
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(rescued, broken) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
