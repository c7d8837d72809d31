"""Every registered pruner (built-in or installed plugin, DESIGN.md §10) passes kvflow's pruner
contract, and so do two written the way a plugin author would: one that reads the trace's
confidence fields, and one without the optional `signal()`."""

from __future__ import annotations

import pytest
from pydantic import Field

from kvflow.components.base import Pruner, PrunerParams
from kvflow.registry import get_registry
from kvflow.testing.pruner_contract import PrunerContract

NAMES = get_registry().names("pruners")


def test_builtins_registered():
    assert {"entropy", "gzip", "confidence"} <= set(NAMES)


class TestRegisteredPruners(PrunerContract):
    @pytest.fixture(scope="class", params=NAMES)
    @classmethod
    def pruner_factory(cls, request):
        cls = get_registry().get("pruners", request.param)
        return lambda **params: cls(cls.Params(**params))


# --------------------------------------------------------------------------- written as a plugin would


class LowConfidenceShare(Pruner):
    """Stops a candidate once most of its newest tokens were written with low confidence."""

    class Params(PrunerParams):
        window: int = Field(16, ge=1, description="Newest tokens looked at.")
        threshold: float = Field(5.0, description="DeepConf token confidence below which a token counts as low.")
        min_tokens: int = Field(16, ge=1, description="No check before this many tokens.")

    signal_name = "low_confidence_share"
    needs_text = False

    def signal(self, trace):
        """Share of the newest `window` tokens with a confidence (`trace.confidences`) below
        `threshold` whose sampled token was a surprise (`trace.logprobs` below -1 nat): [rows]."""
        import torch

        n, w = trace.n_tokens, self.params.window  # [rows]
        cols = torch.arange(trace.confidences.shape[1])[None, :]  # [1, T]
        recent = (cols < n[:, None]) & (cols >= (n - w)[:, None])  # [rows, T]
        low = (trace.confidences < self.params.threshold) & (trace.logprobs < -1.0) & recent
        share = low.sum(-1) / recent.sum(-1).clamp(min=1)
        return share.float().masked_fill(n < self.params.min_tokens, float("nan"))

    def check(self, trace):
        return self.signal(trace) > 0.5  # nan compares False


class CheckOnly(Pruner):
    """Mean entropy of the newest tokens above a threshold, without the optional `signal()`."""

    class Params(PrunerParams):
        window: int = Field(16, ge=1, description="Newest tokens averaged.")
        threshold: float = Field(2.5, gt=0, description="Mean entropy (nats) above which a candidate is stopped.")
        min_tokens: int = Field(16, ge=1, description="No check before this many tokens.")

    needs_text = False

    def check(self, trace):
        import torch

        n, w = trace.n_tokens, self.params.window  # [rows]
        cols = torch.arange(trace.entropies.shape[1])[None, :]  # [1, T]
        recent = (cols < n[:, None]) & (cols >= (n - w)[:, None])  # [rows, T]
        mean = (trace.entropies * recent).sum(-1) / recent.sum(-1).clamp(min=1)
        return (mean > self.params.threshold) & (n >= self.params.min_tokens)


class TestConfidenceFieldsPlugin(PrunerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls):
        return lambda **params: LowConfidenceShare(LowConfidenceShare.Params(**params))


class TestPrunerWithoutSignal(PrunerContract):
    """`signal()` is optional: a pruner without it passes the contract, and runs on every
    engine with signals recorded (it had raised NotImplementedError there)."""

    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls):
        return lambda **params: CheckOnly(CheckOnly.Params(**params))
