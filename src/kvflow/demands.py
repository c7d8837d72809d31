"""What each engine of a pipeline asks of the GPUs: `Demand`, read from its model entry without
loading weights or touching the network (`kvflow.placement` decides where the demands go).

Weights = parameters x bytes per element of `dtype` (`auto`: 2). Parameters are counted from
the checkpoint's safetensors headers or estimated from its config.json where those are at hand
(a local directory, a catalog model's converted copy, a hub id whose config.json is in the
local Hugging Face cache; `kvflow.cost`), else the paper's presets by name
(`qwen2.5-math-72b`...), else a name-based estimate from the size in the id ("72B", "1.5B",
"500M"; also for GGUF files, whose tables take seconds to read). A model of unknown size is
counted as 0 bytes, and its note says so.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

#: an in-process (hf) model's claim: its weights x this (activations, logits, a small KV cache)
HF_HEADROOM = 1.2
#: an SGLang engine without `mem_fraction_static` on a GPU: about what SGLang takes for itself
SGLANG_DEFAULT_FRACTION = 0.9
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
    gpu_count: int = 1  # GPUs it occupies (SGLang: tp x dp x pp / nnodes)
    weight_shards: int = 1  # the weights are split over this many GPUs (SGLang: tp x pp)
    mem_fraction: Optional[float] = None  # SGLang's mem_fraction_static as set (None: not set)
    base_gpu_id: Optional[int] = None  # SGLang's base_gpu_id as set
    gpu_id_step: int = 1
    quantized: bool = False  # a quantized checkpoint: weight_bytes (params x dtype bytes) overstates it

    @property
    def sglang(self) -> bool:
        return self.backend == "sglang"

    @property
    def fraction(self) -> float:
        return self.mem_fraction if self.mem_fraction is not None else SGLANG_DEFAULT_FRACTION

    def explicit_gpu(self) -> Optional[int]:
        """The first GPU the entry itself names, or None when the rule picks."""
        if self.sglang and self.base_gpu_id is not None:
            return self.base_gpu_id
        if self.device.startswith("cuda:"):
            return int(self.device.split(":", 1)[1])
        return None

    def field_to_change(self) -> str:
        """The dotted field to name when this entry's GPU is too full."""
        return f"models.{self.key}." + ("engine.mem_fraction_static" if self.sglang else "device")

    def gpus_from(self, first: int) -> list[int]:
        return [first + i * self.gpu_id_step for i in range(self.gpu_count)]

    def claim(self, total_bytes: int) -> float:
        """Bytes asked of a GPU of `total_bytes` that this entry occupies."""
        if self.sglang:
            return self.fraction * total_bytes
        return (self.weight_bytes or 0.0) * HF_HEADROOM

    def how(self) -> str:
        """How the claim is counted, in words."""
        if self.sglang:
            frac = (f"mem_fraction_static {self.fraction:g}" if self.mem_fraction is not None
                    else f"no mem_fraction_static: {SGLANG_DEFAULT_FRACTION:g} counted")
            return f"sglang: {frac} of each GPU; {self._weights()}"
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
    from kvflow.cost import PRESETS, resolve_shape
    from kvflow.models.catalog import CatalogError, get_entry
    from kvflow.models.loading import resolve_source

    spec: Optional[str] = None
    try:
        src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
        if src.kind == "hub":
            spec = _hub_config(src.ref, getattr(model_cfg, "revision", None))
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


def _hub_config(repo: str, revision: Optional[str]) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        got = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a valid repo id
        return None
    return got if isinstance(got, str) else None


def demand_of(key: str, model_cfg: Any, also: tuple[str, ...] = ()) -> Demand:
    """A model entry's demand: its size and, on SGLang, the GPUs and fraction it asks for."""
    params, source = parameter_count(model_cfg)
    weight_bytes = None if params is None else params * DTYPE_BYTES.get(model_cfg.dtype, 2)
    engine = dict(model_cfg.engine or {}) if model_cfg.backend == "sglang" else {}

    def setting(name: str, default: int = 1) -> int:
        value = engine.get(name)
        return int(value) if value is not None else default

    tp, dp, pp, nodes = setting("tp_size"), setting("dp_size"), setting("pp_size"), setting("nnodes")
    fraction = engine.get("mem_fraction_static")
    return Demand(key, model_cfg.backend, model_cfg.device, weight_bytes, source, also=also,
                  gpu_count=max(1, tp * dp * pp // max(1, nodes)), weight_shards=max(1, tp * pp),
                  mem_fraction=None if fraction is None else float(fraction),
                  base_gpu_id=None if engine.get("base_gpu_id") is None else int(engine["base_gpu_id"]),
                  gpu_id_step=setting("gpu_id_step"),
                  quantized=bool(engine.get("quantization") or _QUANTIZED_NAME.search(model_cfg.id)))


def pipeline_demands(models: Mapping[str, Any], keys: Iterable[str]) -> list[Demand]:
    """One demand per engine among the used model `keys`: keys whose entries are equal share an
    engine (one copy of the weights, as the backends share them), so they are placed once."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        cfg = models[key]
        if _PLACED_DEVICE.fullmatch(cfg.device):  # not cpu (nor another kind of device)
            groups.setdefault(cfg.model_dump_json(), []).append(key)
    return [demand_of(ks[0], models[ks[0]], tuple(ks[1:])) for ks in groups.values()]
