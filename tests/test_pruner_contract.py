"""Every registered pruner (built-in or installed plugin, DESIGN.md §10) passes kvflow's pruner
contract, and so do two written the way a plugin author would: docs/plugins.md's detector,
which reads the trace's confidence fields, and one without the optional `signal()`."""

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


def docs_detector() -> type:
    """The detector docs/plugins.md shows ("What a detector reads"), run from the page itself."""
    import re
    import sys
    import types

    from conftest import REPO

    text = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class LowConfidencePruner" in b]
    module = types.ModuleType("plugins_md_detector", "docs/plugins.md's confidence detector example.")
    sys.modules[module.__name__] = module
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)
    return module.LowConfidencePruner


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


class TestDocsConfidenceDetector(PrunerContract):
    """The detector of docs/plugins.md, which reads `trace.confidences` and `trace.logprobs`,
    passes the contract on both engines."""

    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls):
        pruner_cls = docs_detector()
        return lambda **params: pruner_cls(pruner_cls.Params(**params))


class TestPrunerWithoutSignal(PrunerContract):
    """`signal()` is optional: a pruner without it passes the contract, and runs on every
    engine with signals recorded (it had raised NotImplementedError there)."""

    @pytest.fixture(scope="class")
    @classmethod
    def pruner_factory(cls):
        return lambda **params: CheckOnly(CheckOnly.Params(**params))
