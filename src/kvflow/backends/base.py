"""`Backend`: what kvflow asks of a backend, in one place, with the answer of a backend that says
nothing (the defaults).

A backend is a class registered through `register_backends` (built-ins through the same hook).
kvflow's compiler, `explain`, the GPU placement and the scorers never compare a backend's name:
they ask the backend, through these members. A backend need not subclass `Backend`:
`as_backend(cls)` (what `Registry.backend(name)` returns) gives a registered class the defaults
it leaves out, and adapts a `load(model_cfg)` that takes no keywords.

This module imports no torch and no engine: the registry, `kvflow validate` and `explain` read
backends cheaply.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from dataclasses import dataclass

#: an engine that claims a share of each GPU's memory at start, without its setting: about what
#: SGLang takes for itself
SGLANG_DEFAULT_FRACTION = 0.9


@dataclass(frozen=True)
class GpuLayout:
    """How a backend's engine for one model entry occupies GPUs (`Backend.gpu_layout`): how many,
    over how many its weights are split, and, for an engine that claims a share of each GPU's
    memory when it starts (SGLang's `mem_fraction_static`), the setting that says how much."""

    gpu_count: int = 1  # GPUs it occupies (SGLang: tp x dp x pp / nnodes)
    weight_shards: int = 1  # the weights are split over this many GPUs (SGLang: tp x pp)
    gpu_id_step: int = 1
    fraction_setting: Optional[str] = None  # the engine setting of its share of each GPU (None: weights x headroom)
    fraction: Optional[float] = None  # that setting as the entry sets it (None: not set)
    default_fraction: float = SGLANG_DEFAULT_FRACTION  # what it takes without the setting
    first_gpu_setting: Optional[str] = None  # the engine setting that names its first GPU (SGLang: base_gpu_id)
    first_gpu: Optional[int] = None  # that setting as the entry sets it
    quantized: bool = False  # the engine settings quantize the weights


class Backend:
    """The members kvflow reads of a backend, and their defaults."""

    #: the name it is registered under (`models.<key>.backend`)
    name = ""
    #: runs evicted proposers (kvflow's evictors on its KV cache); False: full-context only
    evicts = True
    #: the tiny model kvflow's contract suites run it on (kvflow.testing.engine_parity.contract_arch)
    contract_arch = "qwen2"
    #: its engines answer the `prm` and `llm_judge` scorers' per-position values from their own
    #: prefix cache (`engine.position_values(...)`), always reusing the committed prefix
    serves_position_values = False

    @staticmethod
    def check(model_cfg) -> Optional[Any]:
        """None if the model can be served here (nothing loaded), else why not: a sentence, or
        a (field under the model entry, sentence) pair."""
        return None

    @staticmethod
    def check_evictor(model_cfg, params, evictor_cls=None) -> Optional[tuple[str, str]]:
        """None if an evicted proposer with these evictor params (of `evictor_cls`) can run on
        this model entry, else (field, sentence): `params.<name>` of the evictor, or a field of
        the model entry (`engine.<name>`, `device`, `id`)."""
        return None

    @staticmethod
    def batch_invariant(model_cfg) -> tuple[Optional[dict], Optional[str]]:
        """`run.deterministic` on this entry: (engine settings for it, None), or (None, why not)."""
        return None, (f"runs on backend {model_cfg.backend!r}, which does not declare batch-invariant decoding "
                      "(`batch_invariant(model_cfg)`)")

    @staticmethod
    def load(model_cfg, *, evicting: bool = True, evictors=None):
        """The model's engine. `evicting`: whether an evicted proposer runs on it; `evictors`:
        the (class, params) of the evictors it serves (None: any)."""
        raise NotImplementedError

    @staticmethod
    def kv_pool_settings(model_cfg, kv_bytes: int, bytes_per_token: float) -> Optional[dict]:
        """Engine settings that bound this entry's KV pool to `kv_bytes` (`run.kv_memory`), where
        the engine sizes a pool of its own at start and the entry does not size it already;
        None: nothing to set (kvflow's own admission bounds it)."""
        return None

    @staticmethod
    def cpu_settings(model_cfg, engines: int) -> dict:
        """Engine settings for an entry that computes on the CPU, given how many engines of the
        run compute on it (`engines`, this one included; kvflow's compiler counts them): a worker
        process alone may let its idle threads wait actively between ops; engines that share
        the cores should split them rather than each take them all. The entry's own `engine:`
        settings win."""
        return {}

    @staticmethod
    def gpu_layout(model_cfg) -> GpuLayout:
        """How this entry's engine occupies GPUs (the placement's input)."""
        return GpuLayout()

    @staticmethod
    def placed_settings(model_cfg, first_gpu: int, fraction: Optional[float]) -> dict:
        """Engine settings that put this entry's engine on GPU `first_gpu` with `fraction` of each
        GPU's memory (None: as it would take), beyond the entry's `device: cuda:<first_gpu>`."""
        return {}

    @staticmethod
    def position_value_settings(head: bool) -> dict:
        """Engine settings a scorer's model needs for per-position values: a process reward
        model's head outputs (`head=True`) or label log-probabilities."""
        return {}

    @staticmethod
    def describe(model_cfg, *, evicted: dict[str, str], full: list[str], scores: bool) -> list[str]:
        """Lines for `kvflow explain` under the engine of this entry: how it serves the evicted
        proposers `evicted` (name -> evictor kind), the full-context ones `full` and (`scores`)
        a scorer, and the defaults it sets."""
        return []


def as_backend(cls: type) -> type[Backend]:
    """The registered class with `Backend`'s defaults for what it leaves out, and a `load` that
    takes `evicting` and `evictors` (dropped for a `load(model_cfg)` that takes neither)."""
    if isinstance(cls, type) and issubclass(cls, Backend):
        return cls
    if cls not in _ADAPTED:
        _ADAPTED[cls] = _adapt(cls)
    return _ADAPTED[cls]


_ADAPTED: dict[type, type] = {}


def _adapt(cls: Any) -> type[Backend]:
    """A subclass of `cls` and `Backend` (for a registered instance: a class of its members)."""
    members: dict[str, Any] = {}
    if not isinstance(cls, type):  # an instance registered as a backend (tests do)
        members = {k: (staticmethod(v) if callable(v) else v) for k in dir(cls) if not k.startswith("_")
                   for v in [getattr(cls, k)]}
        bases: tuple = (Backend,)
        name = type(cls).__name__
    else:
        bases, name = (cls, Backend), cls.__name__
    load = getattr(cls, "load", None)
    if load is not None:
        accepted = inspect.signature(load).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            def adapted_load(model_cfg, **kwargs):
                return load(model_cfg, **{k: v for k, v in kwargs.items() if k in accepted})

            members["load"] = staticmethod(adapted_load)
    check = getattr(cls, "check_evictor", None)
    if check is not None and "evictor_cls" not in inspect.signature(check).parameters:
        members["check_evictor"] = staticmethod(lambda model_cfg, params, evictor_cls=None: check(model_cfg, params))
    return type(name, bases, {**members, "__doc__": getattr(cls, "__doc__", None),
                              "__module__": getattr(cls, "__module__", __name__)})


def backend_named(name: str, registry=None) -> type[Backend]:
    """The backend registered as `name` (`as_backend`: with the defaults of what it leaves out)."""
    from kvflow.registry import get_registry

    return as_backend((registry or get_registry()).get("backends", name))
