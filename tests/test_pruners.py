"""Built-in pruners on synthetic traces: incoherent and looping text is flagged, a normal
solution passes; and the step loop's defined behaviour when every candidate is pruned."""

from __future__ import annotations

import random

import pytest
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


# --------------------------------------------------------------------------- confidence (DeepConf)


def conf_trace(confidences):
    """A StepTrace whose rows carry these token confidences ([rows][tokens], ragged)."""
    n = max(len(c) for c in confidences)
    conf = torch.full((len(confidences), n), 99.0)  # past a row's count: stale values the pruner must ignore
    for i, c in enumerate(confidences):
        conf[i, : len(c)] = torch.tensor(c)
    return StepTrace(torch.zeros_like(conf), torch.tensor([len(c) for c in confidences]), [""] * len(confidences),
                     logprobs=torch.zeros_like(conf), confidences=conf)


def deepconf_reference(c, mode, window):
    """DeepConf's statistics of one step's token confidences, written out in plain Python."""
    w = min(window, len(c))
    groups = [sum(c[e - w:e]) / w for e in range(w, len(c) + 1)]  # every window inside the step
    return {"tail": groups[-1], "lowest_group": min(groups), "mean": sum(c) / len(c)}[mode]


def test_confidence_signal_is_deepconfs_statistic_in_every_mode():
    from kvflow_builtin.pruners.confidence import ConfidencePruner

    gen = random.Random(1)
    rows = [[gen.uniform(3, 12) for _ in range(n)] for n in (5, 8, 13, 40, 41)]
    for mode in ("tail", "lowest_group", "mean"):
        pruner = ConfidencePruner(ConfidencePruner.Params(mode=mode, window=8, min_tokens=1))
        got = pruner.signal(conf_trace(rows)).tolist()
        want = [deepconf_reference(c, mode, 8) for c in rows]
        assert got == pytest.approx(want, abs=1e-5), mode
    # the three differ on one row whose confidence dips in the middle
    dip = [10.0] * 16 + [3.0] * 8 + [10.0] * 16
    values = {m: float(ConfidencePruner(ConfidencePruner.Params(mode=m, window=8, min_tokens=1))
                       .signal(conf_trace([dip]))[0]) for m in ("tail", "lowest_group", "mean")}
    assert values == pytest.approx({"tail": 10.0, "lowest_group": 3.0, "mean": 8.6}, abs=1e-5)


def test_confidence_flags_a_flat_mode_and_waits_for_min_tokens():
    from kvflow_builtin.pruners.confidence import ConfidencePruner

    pruner = ConfidencePruner(ConfidencePruner.Params())  # tail of 32 tokens below 5.0, from token 32
    confident = [8.3, 11.0, 6.0, 9.5] * 16  # a coherent step (Qwen2.5-Coder-0.5B: windows 7.4-11.3)
    flat = [4.6, 4.1, 5.2, 4.0] * 16  # gibberish-like: flat distributions
    late = [9.0] * 40 + [4.0] * 32  # turns flat: the newest window crosses the threshold
    short = [3.0] * 10  # below threshold but still warming up
    assert pruner.check(conf_trace([confident, flat, late, short])).tolist() == [False, True, True, False]
    assert torch.isnan(pruner.signal(conf_trace([short]))).all()


def test_confidence_refuses_a_trace_without_confidences():
    from kvflow_builtin.pruners.confidence import ConfidencePruner

    pruner = ConfidencePruner(ConfidencePruner.Params())
    with pytest.raises(ValueError, match="confidences"):
        pruner.check(trace([""], [[0.5] * 40]))
