"""Lazy module proxies, so that component modules can be imported (for their `Params`)
by `kvflow validate` / `kvflow ls` without importing torch."""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_kvflow_module"] = None

    def _load(self) -> types.ModuleType:
        mod = self.__dict__["_kvflow_module"]
        if mod is None:
            mod = importlib.import_module(self.__name__)
            self.__dict__["_kvflow_module"] = mod
        return mod

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)


torch = LazyModule("torch")
