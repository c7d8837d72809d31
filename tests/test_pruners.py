"""Built-in pruners on synthetic traces: incoherent and looping text is flagged, a normal
solution passes; and the step loop's defined behaviour when every candidate is pruned."""

from __future__ import annotations

import random

import torch

from kvflow.components.base import StepTrace
from kvflow_builtin.pruners.entropy import EntropyPruner
from kvflow_builtin.pruners.gzip import GzipPruner, compression_ratio

SOLUTION = (
    "Natalia sold 48 clips in April. In May she sold half as many, which is 48 / 2 = 24 clips. "
    "Altogether she sold 48 + 24 = 72 clips in April and May. To check, 72 - 48 = 24, which is "
    "indeed half of 48, so the total is consistent with the problem statement. The answer is 72."
)
LOOP = "So the answer is 24 clips. " * 20
_RNG = random.Random(0)
NOISE = "".join(_RNG.choice("abcdefghijklmnopqrstuvwxyz0123456789 +-=()") for _ in range(400))


def trace(texts, entropies):
    n = max(len(e) for e in entropies)
    ent = torch.zeros(len(entropies), n)
    for i, e in enumerate(entropies):
        ent[i, : len(e)] = torch.tensor(e)
    return StepTrace(ent, torch.tensor([len(e) for e in entropies]), texts)


def test_entropy_flags_incoherent_and_passes_confident_text():
    pruner = EntropyPruner(EntropyPruner.Params(threshold=2.5, window=32, min_tokens=32))
    confident = [0.3, 1.1, 0.05, 0.8] * 16  # a normal solution: mostly low entropy, some forks
    incoherent = [3.8, 4.5, 3.1, 5.0] * 16  # the high-entropy mode of a broken cache
    late = [0.2] * 40 + [4.0] * 24  # turns incoherent: the window mean crosses the threshold
    short = [5.0] * 10  # above threshold but still warming up
    flags = pruner.check(trace([""] * 4, [confident, incoherent, late, short]))
    assert flags.tolist() == [False, True, True, False]


def test_gzip_flags_loops_and_passes_a_solution_and_noise():
    pruner = GzipPruner(GzipPruner.Params(threshold=0.25, window=256, min_tokens=32, every=1))
    texts = [SOLUTION, LOOP, NOISE]
    flags = pruner.check(trace(texts, [[0.1] * 64] * 3))
    assert flags.tolist() == [False, True, False]
    assert compression_ratio(LOOP[-256:]) < 0.25 < 0.5 < compression_ratio(SOLUTION[-256:])


def test_gzip_waits_for_min_tokens_and_min_chars():
    pruner = GzipPruner(GzipPruner.Params(threshold=0.25, min_tokens=32, min_chars=128, every=1))
    assert pruner.check(trace([LOOP[:100], LOOP], [[0.1] * 64, [0.1] * 8])).tolist() == [False, False]
