"""Engine protocol versions (docs/changelog.md): a third-party engine written to protocol 0.1
still passes the engine contract (deprecated: a FutureWarning at load), and a pruner that reads
what 0.1 engines do not fill (`Pruner.trace_fields`) is refused on one before anything decodes.

`Legacy01Engine` is what a plugin author wrote against the 0.1 documentation: a real engine (the
`hf` one underneath, on a tiny random-weight Qwen2) that declares no `protocol`, leaves
`Candidate.confidences` empty and builds its `StepTrace`s without `logprobs` and `confidences`.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import kvflow
from kvflow.components.base import StepTrace
from kvflow.components.engine import PROTOCOL_VERSION, check_protocol, protocol_of, protocol_problem, speaks
from kvflow.config.schema import ModelConfig
from kvflow.testing.engine_contract import EngineContract


class _Trace01:
    """A pruner seen through a 0.1 engine: its traces have neither logprobs nor confidences."""

    def __init__(self, pruner) -> None:
        self.pruner = pruner

    def _strip(self, trace: StepTrace) -> StepTrace:
        return dataclasses.replace(trace, logprobs=None, confidences=None)

    def check(self, trace):
        return self.pruner.check(self._strip(trace))

    def signal(self, trace):
        return self.pruner.signal(self._strip(trace))

    def __getattr__(self, name):
        return getattr(self.pruner, name)


class Legacy01Engine:
    """An engine of engine protocol 0.1 (no `protocol` attribute), over an hf engine."""

    backend = "legacy01"

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        if name == "protocol":
            raise AttributeError(name)  # written before protocols had versions
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name == "_inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)  # label, clock: what the scheduler sets

    def submit(self, requests):
        for r in requests:
            r.spec = dataclasses.replace(r.spec, pruners=tuple((n, _Trace01(p)) for n, p in r.spec.pruners))
        return self._inner.submit(requests)

    def step(self, max_rows=None):
        finished = self._inner.step(max_rows)
        for proposal in finished:
            for c in proposal.candidates:
                c.confidences = []  # 0.1 had no confidences
        return finished


class Legacy01Backend:
    name = "legacy01"

    @staticmethod
    def check(model_cfg):
        return None

    @staticmethod
    def load(model_cfg, evicting=True):
        from kvflow.backends.hf import HFBackend

        return Legacy01Engine(HFBackend.load(model_cfg.model_copy(update={"backend": "hf"})))


class LegacyPlugin:
    @kvflow.hookimpl
    def register_backends(self, register):
        register("legacy01", Legacy01Backend)


def test_versions_are_read_from_the_engine():
    class Newer:
        backend, protocol = "newer", "9.0"

    class Garbled:
        backend, protocol = "garbled", "zero.two"

    assert protocol_of(object()) == "0.1" and not speaks(object(), "0.2")
    for engine in (Newer(), Garbled()):
        with pytest.raises(ValueError, match=engine.backend):
            check_protocol(engine)


class TestProtocol01Engine(EngineContract):
    """The whole contract on a 0.1 engine: what 0.1 promised is checked, nothing later."""

    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_dir(cls, shared_tiny_qwen):
        return shared_tiny_qwen

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        return lambda model_dir: Legacy01Backend.load(
            ModelConfig(id=str(model_dir), backend="hf", dtype="float32", device="cpu"))

    def test_is_deprecated_not_refused(self, engine):
        assert protocol_of(engine) == "0.1" and PROTOCOL_VERSION != "0.1"
        with pytest.warns(FutureWarning, match=r"engine protocol 0\.1 .*confidences"):
            check_protocol(engine, once=False)


def test_a_confidence_pruner_is_refused_on_a_01_engine(tmp_path, cli, shared_tiny_qwen):
    from kvflow.registry import Registry, set_registry
    from kvflow.testing import tiny_pipeline

    import kvflow_builtin

    conf = {"kind": "confidence", "threshold": 1.0, "min_tokens": 2, "window": 2}
    entropy = {"kind": "entropy", "threshold": 50.0, "min_tokens": 2}
    legacy = {"models": {"base": {"backend": "legacy01"}}}
    path = tiny_pipeline(tmp_path, pruners=[entropy, conf], problems=1, helper=False, extra=legacy)
    set_registry(Registry.from_plugins([("builtin", kvflow_builtin), ("legacy", LegacyPlugin())]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            result = cli("run", path)
        assert result.exit_code == 2, result.output
        assert "proposers.base.pruners[1]" in result.output and "confidence" in result.output
        assert "engine protocol 0.1" in result.output and "Traceback" not in result.output
        assert not (tmp_path / "results").exists() or not list((tmp_path / "results").glob("*/samples.jsonl"))
        # without the confidence pruner the same 0.1 engine runs the pipeline
        path = tiny_pipeline(tmp_path / "without", pruners=[entropy], problems=1, helper=False, extra=legacy)
        result = cli("run", path)
        assert result.exit_code == 0, result.output
    finally:
        set_registry(None)


def test_pruners_say_what_they_read():
    from kvflow.registry import get_registry

    registry = get_registry()
    confidence = registry.get("pruners", "confidence")
    assert confidence.trace_fields == ("confidences",)
    legacy = Legacy01Engine.__new__(Legacy01Engine)
    assert "StepTrace.confidences" in protocol_problem(legacy, confidence)
    for name in registry.names("pruners"):  # what the built-ins read that 0.1 had not: only confidence
        if name != "confidence":
            assert protocol_problem(legacy, registry.get("pruners", name)) is None, name
