"""What the `hf` backend needs of the installed transformers, and how it adapts to it.

- `check_transformers()`: None, or why the installed transformers cannot run the `hf` engine.
  It reads the version from the distribution's metadata (`importlib.metadata`) and imports
  neither torch nor transformers, so `HFBackend.check` runs it before anything loads.
- `cache_keyword(module)`: the keyword under which `module.forward` takes a KV cache. Newer
  transformers (5.24, the version kvflow develops on) name it `cache` and still accept the old
  name `past_key_values` with a deprecation warning (removal announced for 5.40); older ones
  (5.17, 5.19) name it `past_key_values` only, and a `cache=` keyword then rides along in
  `**kwargs` unused while the model builds a throwaway cache of its own: kvflow's cache is
  never written, which is silently wrong decoding (full KV) or an `AttributeError` (evicted).
  The keyword is therefore read from the forward's signature, once per model class, and
  every forward kvflow runs with its cache passes it through this one function.

The floor is the oldest transformers on which kvflow's `hf` exactness tests were run and pass
(CPU: the cache tests, the evictor and engine contracts, greedy decoding == `generate`);
pyproject.toml's range starts at the same version.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Optional

#: oldest transformers the `hf` engine was verified on, and the range pyproject.toml declares
TRANSFORMERS_FLOOR = "5.17.0"
TRANSFORMERS_RANGE = ">=5.17,<5.30"

#: the names a transformers forward gives its cache argument, preferred first
CACHE_KEYWORDS = ("cache", "past_key_values")


def _release(version: str) -> tuple[int, ...]:
    """(5, 17, 0) for "5.17.0", "5.17.0.dev0", "5.17.0+local"; () when it has no leading number."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def installed_transformers() -> Optional[str]:
    """The installed transformers version (its distribution metadata), or None if none is."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def check_transformers(installed: Optional[str] = None) -> Optional[str]:
    """None if transformers `installed` (default: the installed one) can run the `hf` engine,
    else a sentence naming it, the supported range and how to install a supported one."""
    installed = installed if installed is not None else installed_transformers()
    fix = f"install a supported one: pip install 'transformers{TRANSFORMERS_RANGE}'"
    if installed is None:
        return f"transformers is not installed; backend 'hf' needs transformers{TRANSFORMERS_RANGE} ({fix})"
    if _release(installed) < _release(TRANSFORMERS_FLOOR):
        return (f"transformers {installed} is installed; backend 'hf' supports transformers{TRANSFORMERS_RANGE} "
                f"(verified down to {TRANSFORMERS_FLOOR}): {fix}")
    return None


@functools.lru_cache(maxsize=None)
def _cache_keyword_of(cls: type) -> str:
    from kvflow.errors import UserError

    try:
        params = inspect.signature(cls.forward).parameters  # follows the decorators' __wrapped__
    except (TypeError, ValueError):
        params = {}
    # only a parameter named in the signature counts: every transformers forward also takes
    # **kwargs, which would swallow either name without using it
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for name in CACHE_KEYWORDS:
        if name in params and params[name].kind in named:
            return name
    raise UserError(
        f"{cls.__module__}.{cls.__qualname__}.forward takes its KV cache under neither "
        f"{' nor '.join(repr(n) for n in CACHE_KEYWORDS)}; backend 'hf' cannot pass kvflow's cache to it",
        hint=f"backend 'hf' runs transformers' own model classes (transformers{TRANSFORMERS_RANGE}); "
             "a model with custom code may not follow their conventions")


def cache_keyword(module: Any) -> str:
    """"cache" or "past_key_values": the keyword `module.forward` takes a KV cache under
    (looked up once per class). Raises UserError if it names neither."""
    return _cache_keyword_of(type(module))
