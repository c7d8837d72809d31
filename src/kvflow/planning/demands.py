"""What each engine of a pipeline asks of the GPUs: `Demand`, read from its model entry without
loading weights or touching the network (`kvflow.planning.placement` decides where the demands go).

Weights = parameters x bytes per element of `dtype` (`auto`: 2). Parameters are counted from
the checkpoint's safetensors headers or estimated from its config.json where those are at hand
(a local directory, a catalog model's converted copy, a hub id whose config.json is in the
local Hugging Face cache; `kvflow.models.shapes`), else the paper's presets by name
(`qwen2.5-math-72b`...), else a name-based estimate from the size in the id ("72B", "1.5B",
"500M"; also for GGUF files, whose tables take seconds to read). A model of unknown size is
counted as 0 bytes, and its note says so.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from kvflow.backends.base import GpuLayout, backend_named

log = logging.getLogger(__name__)

#: an in-process (hf) model's claim: its weights x this (activations, logits, a small KV cache)
HF_HEADROOM = 1.2
#: bytes per weight by `dtype`
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([bm])(?![a-z0-9])", re.IGNORECASE)
_GIB = 2**30
_PLACED_DEVICE = re.compile(r"auto|cuda(:\d+)?")
_QUANTIZED_NAME = re.compile(r"awq|gptq|fp8|int4|int8|[48]bit|nf4|gguf", re.IGNORECASE)



def gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


@dataclass(frozen=True)
class Demand:
    """What one engine (one or more model keys with the same settings) asks of the GPUs."""

    key: str  # the first model key it serves (problems are located there)
    backend: str
    device: str  # the entry's `device`: auto | cuda | cuda:N
    weight_bytes: Optional[float]  # all its weights (None: unknown)
    weights_from: str  # where the size came from, in words
    also: tuple[str, ...] = ()  # other model keys served by the same engine
    layout: GpuLayout = GpuLayout()
    quantized: bool = False  # a quantized checkpoint: weight_bytes (params x dtype bytes) overstates it

    @property
    def gpu_count(self) -> int:
        return self.layout.gpu_count

    @property
    def weight_shards(self) -> int:
        return self.layout.weight_shards

    @property
    def claims_fraction(self) -> bool:
        """It claims a share of each GPU's memory when it starts (else weights x headroom)."""
        return self.layout.fraction_setting is not None

    @property
    def fraction(self) -> float:
        return self.layout.fraction if self.layout.fraction is not None else self.layout.default_fraction

    def explicit_gpu(self) -> Optional[int]:
        """The first GPU the entry itself names, or None when the rule picks."""
        if self.layout.first_gpu is not None:
            return self.layout.first_gpu
        if self.device.startswith("cuda:"):
            return int(self.device.split(":", 1)[1])
        return None

    def field_to_change(self) -> str:
        """The dotted field to name when this entry's GPU is too full."""
        return f"models.{self.key}." + (f"engine.{self.layout.fraction_setting}" if self.claims_fraction else "device")

    def gpus_from(self, first: int) -> list[int]:
        return [first + i * self.layout.gpu_id_step for i in range(self.gpu_count)]

    def claim(self, total_bytes: int) -> float:
        """Bytes asked of a GPU of `total_bytes` that this entry occupies."""
        if self.claims_fraction:
            return self.fraction * total_bytes
        return (self.weight_bytes or 0.0) * HF_HEADROOM

    def how(self) -> str:
        """How the claim is counted, in words."""
        if self.claims_fraction:
            setting = self.layout.fraction_setting
            frac = (f"{setting} {self.fraction:g}" if self.layout.fraction is not None
                    else f"no {setting}: {self.layout.default_fraction:g} counted")
            return f"{self.backend}: {frac} of each GPU; {self._weights()}"
        return f"{self.backend}: weights x {HF_HEADROOM:g}; {self._weights()}"

    def _weights(self) -> str:
        if self.weight_bytes is None:
            return "weights of unknown size, counted as 0"
        return f"weights {gib(self.weight_bytes)}, from {self.weights_from}"


# --------------------------------------------------------------------------- demands of a pipeline


def parameter_count(model_cfg: Any) -> tuple[Optional[float], str]:
    """(parameters, where the number came from) of a ModelConfig, without weights or network:
    the checkpoint or config.json where at hand, else a paper preset by name, else the size
    in the id (a name-based estimate), else (None, "unknown")."""
    from kvflow.models.shapes import PRESETS, hub_cached, resolve_shape
    from kvflow.models.catalog import CatalogError, get_entry
    from kvflow.models.loading import resolve_source

    spec: Optional[str] = None
    try:
        src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
        if src.kind == "hub":
            spec = hub_cached(src.ref, "config.json", getattr(model_cfg, "revision", None))
        elif src.kind == "catalog":  # its converted copy's config, if converted already
            converted = sorted(get_entry(src.ref).path().parent.glob("hf-*/config.json"))
            spec = str(converted[0]) if converted else None
        elif src.kind == "dir" and not src.gguf_file:
            spec = src.ref
        # a GGUF file goes by its name: reading its tables (the whole vocabulary) takes seconds
    except CatalogError:
        pass
    if spec:
        try:
            shape = resolve_shape(spec)
            return shape.n_params, shape.source
        except Exception as e:  # noqa: BLE001 - not cached, unreadable: fall back to the name
            log.debug("placement: no shape for %s from %s: %s", model_cfg.id, spec, e)
    name = model_cfg.id.removeprefix("catalog:").rstrip("/").rsplit("/", 1)[-1]
    presets = [p for p in PRESETS if name.lower() == p or name.lower().startswith(p + "-")]
    if presets:
        preset = max(presets, key=len)
        return PRESETS[preset].n_params, f"preset {preset}"
    sizes = _SIZE_IN_NAME.findall(name)
    if sizes:
        number, unit = sizes[-1]
        return float(number) * (1e9 if unit.lower() == "b" else 1e6), f"a name-based estimate ('{number}{unit}' in the id)"
    return None, "unknown"


def demand_of(key: str, model_cfg: Any, also: tuple[str, ...] = ()) -> Demand:
    """A model entry's demand: its size, and the GPUs and memory share its backend says its
    engine takes (`Backend.gpu_layout`)."""
    params, source = parameter_count(model_cfg)
    weight_bytes = None if params is None else params * DTYPE_BYTES.get(model_cfg.dtype, 2)
    layout = backend_named(model_cfg.backend).gpu_layout(model_cfg)
    return Demand(key, model_cfg.backend, model_cfg.device, weight_bytes, source, also=also, layout=layout,
                  quantized=layout.quantized or bool(_QUANTIZED_NAME.search(model_cfg.id)))


def pipeline_demands(models: Mapping[str, Any], keys: Iterable[str]) -> list[Demand]:
    """One demand per engine among the used model `keys`: keys whose entries are equal share an
    engine (one copy of the weights, as the backends share them), so they are placed once."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        cfg = models[key]
        if _PLACED_DEVICE.fullmatch(cfg.device):  # not cpu (nor another kind of device)
            groups.setdefault(cfg.model_dump_json(), []).append(key)
    return [demand_of(ks[0], models[ks[0]], tuple(ks[1:])) for ks in groups.values()]
