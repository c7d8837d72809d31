"""Checks every component must pass, whatever its kind (DESIGN.md §4), as a pytest mixin.

The kind-specific suites (`evictor_contract`, `pruner_contract`, `scorer_contract`,
`committer_contract`) inherit these tests; each provides a `contract_component` fixture
(an instance built with the suite's parameters) and names the kind's base `Params` class.

- `Params` is a pydantic model derived from the kind's base parameters, frozen, rejecting
  unknown keys, with a description for every field (what `kvflow ls`, `kvflow schema` and
  the docs show) and a JSON Schema (what `kvflow schema` emits);
- the component keeps the `Params` object it was given as `.params`;
- the class has a docstring of its own whose first line describes it (`kvflow ls` shows
  that line) and its module has a docstring.
"""

from __future__ import annotations

import inspect
import sys
from typing import ClassVar

import pytest


class ComponentContract:
    """Mixin: subclasses set `params_base` and provide the `contract_component` fixture."""

    #: the kind's base parameter model, e.g. `kvflow.components.PrunerParams`
    params_base: ClassVar[type]

    @pytest.fixture(autouse=True)
    def _contract_threads(self):
        """Tiny models run fastest single-threaded (and shared CI machines are busy)."""
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)

    @pytest.fixture
    def contract_component(self):
        """An instance of the component under test, built with the suite's parameters."""
        raise NotImplementedError("the kind's contract suite provides `contract_component`")

    def test_params_model_is_frozen_and_strict(self, contract_component):
        from pydantic import ValidationError

        cls = type(contract_component)
        params_cls = cls.Params
        assert issubclass(params_cls, self.params_base), (
            f"{cls.__name__}.Params must subclass {self.params_base.__name__} (shared parameters keep their names)")
        params = contract_component.params
        assert isinstance(params, params_cls), f"{cls.__name__}.params is not a {params_cls.__name__}"
        for name in params_cls.model_fields:
            with pytest.raises((ValidationError, TypeError, AttributeError)):
                setattr(params, name, getattr(params, name))  # frozen: mutable state belongs elsewhere
        raw = params.model_dump()
        with pytest.raises(ValidationError):
            params_cls.model_validate({**raw, "no_such_parameter_xyz": 1})
        assert params_cls.model_validate(raw) == params, "Params do not round-trip through model_dump()"

    def test_every_parameter_is_described(self, contract_component):
        params_cls = type(contract_component).Params
        missing = [n for n, f in params_cls.model_fields.items() if not (f.description or "").strip()]
        assert not missing, (f"{params_cls.__name__}: no description for {missing}; "
                             "use pydantic.Field(default, description=...)")
        schema = params_cls.model_json_schema()
        assert set(schema.get("properties", {})) == set(params_cls.model_fields)

    def test_documented(self, contract_component):
        cls = type(contract_component)
        doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
        assert doc and doc.splitlines()[0].strip(), f"{cls.__qualname__} has no docstring of its own"
        module = sys.modules[cls.__module__]
        assert (module.__doc__ or "").strip(), f"module {cls.__module__} has no docstring"
