"""Model shapes from their configs alone (no weights loaded): layers, widths, heads, parameters,
RoPE base, and the KV bytes and decode FLOPs those imply.

Shapes come from: the built-in presets of the paper's models (`qwen2.5-math-1.5b`,
`qwen2.5-math-7b`, `qwen2.5-math-72b`), a `config.json` (a path, a model directory, or a hub id
already in the local Hugging Face cache), or `catalog:<name>` (the converted directory the
catalog writes beside the GGUF, else the GGUF's own metadata). P is counted from the
checkpoint's tensors when they are at hand (safetensors headers, GGUF tensor infos), and
estimated from the config otherwise (embeddings, attention and MLP projections, norms).
Used by the `cost` command, `explain`, the KV-memory admission and every backend.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from kvflow.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    d_model: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    n_params: float
    source: str = ""  # where the numbers came from
    #: plain RoPE's base (None: the config names another RoPE type, or none; see `rope_of`)
    rope_theta: Optional[float] = None
    rope_note: str = ""  # why rope_theta is None, for messages


def rope_of(cfg: dict) -> tuple[Optional[float], str]:
    """(base, "") of a config's plain RoPE over the whole head (Llama, Qwen2, Mistral: the
    `default` rope type, transformers 5's `rope_parameters` or the older `rope_theta` /
    `rope_scaling`), else (None, why not)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if kind != "default":
        return None, f"RoPE type '{kind}' (only plain RoPE is supported)"
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        return None, f"partial rotary factor {cfg['partial_rotary_factor']} (only RoPE over the whole head)"
    if theta is None:
        return None, "no rope_theta in the config"
    return float(theta), ""


def _preset(name: str, L: int, d: int, h_kv: int, d_h: int, d_ffn: int, P: float) -> ModelShape:
    return ModelShape(name, L, d, d // d_h, h_kv, d_h, d_ffn, P, "preset (paper constants)")


#: the paper's models (Qwen2.5-Math; P as published)
PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _preset("qwen2.5-math-1.5b", 28, 1536, 2, 128, 8960, 1.54e9),
        _preset("qwen2.5-math-7b", 28, 3584, 4, 128, 18944, 7.62e9),
        _preset("qwen2.5-math-72b", 80, 8192, 8, 128, 29568, 72.7e9),
    )
}


# --------------------------------------------------------------------------- formulas


def kv_bytes_per_token(m: ModelShape, bytes_per_elem: float = 2) -> float:
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * bytes_per_elem


def attended(context: int, budget: Optional[int] = None, buffer: int = 0) -> int:
    """Tokens a model attends to at context length `context`: all of them, or at most
    `budget + buffer` for an evicted cache (budget None = full KV)."""
    return context if budget is None else min(context, budget + buffer)


def kv_bytes(m: ModelShape, context: int, budget: Optional[int] = None, buffer: int = 0,
             bytes_per_elem: float = 2) -> float:
    return kv_bytes_per_token(m, bytes_per_elem) * attended(context, budget, buffer)


def decode_flops(m: ModelShape, context: int, budget: Optional[int] = None, buffer: int = 0) -> float:
    return 2 * m.n_params + 2 * m.n_layers * m.n_q_heads * m.head_dim * (2 * attended(context, budget, buffer))


# --------------------------------------------------------------------------- shapes


_NON_GATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "gpt_bigcode", "starcoder2", "bert"}


def _first(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def shape_from_config(cfg: dict, name: str, n_params: Optional[float] = None, source: str = "config.json") -> ModelShape:
    """A `ModelShape` from a transformers config dict (text_config for multimodal ones)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    L = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    d = _first(cfg, "hidden_size", "n_embd", "d_model")
    n_q = _first(cfg, "num_attention_heads", "n_head")
    missing = [k for k, v in (("num_hidden_layers", L), ("hidden_size", d), ("num_attention_heads", n_q)) if v is None]
    if missing:
        raise UserError(f"{name}: config has no {', '.join(missing)}; cannot size the model",
                        hint="pass a decoder-only transformers config.json")
    L, d, n_q = int(L), int(d), int(n_q)
    h_kv = int(_first(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads", default=n_q))
    d_h = int(_first(cfg, "head_dim", default=d // n_q))
    d_ffn = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * d))
    if n_params is None:
        vocab = int(_first(cfg, "vocab_size", default=0))
        gated = 3 if str(cfg.get("model_type", "")).lower() not in _NON_GATED else 2
        qkv_bias = (n_q + 2 * h_kv) * d_h if (cfg.get("attention_bias") or cfg.get("model_type") == "qwen2") else 0
        layer = d * n_q * d_h + 2 * d * h_kv * d_h + n_q * d_h * d + qkv_bias + gated * d * d_ffn + 2 * d
        emb = vocab * d * (1 if cfg.get("tie_word_embeddings", False) else 2)
        n_params = float(L * layer + emb + d)
        source += " (P estimated)"
    theta, note = rope_of(cfg)
    return ModelShape(name, L, d, n_q, h_kv, d_h, d_ffn, float(n_params), source, theta, note)


def _safetensors_params(directory: Path) -> Optional[float]:
    """Parameter count from the safetensors headers in `directory` (no tensor data read)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for key, info in header.items():
            if key != "__metadata__":
                total += math.prod(info.get("shape", []))
    return float(total)


def _from_config_file(path: Path, name: str) -> ModelShape:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{name}: cannot read {path}: {e}") from None
    params = _safetensors_params(path.parent)
    if params:
        return shape_from_config(cfg, name, params, f"{path} (P from safetensors)")
    return shape_from_config(cfg, name, None, str(path))


def shape_from_gguf(path: Path, name: str) -> ModelShape:
    from gguf import GGUFReader  # no torch

    reader = GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    arch = field("general.architecture")
    L, d, n_q = field(f"{arch}.block_count"), field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    if None in (L, d, n_q):
        raise UserError(f"{name}: {path} lacks the {arch}.* shape metadata")
    h_kv = field(f"{arch}.attention.head_count_kv") or n_q
    d_h = field(f"{arch}.attention.key_length") or d // n_q
    d_ffn = field(f"{arch}.feed_forward_length") or 4 * d
    params = float(sum(int(t.n_elements) for t in reader.tensors))
    theta = field(f"{arch}.rope.freq_base")
    plain = arch in ("llama", "qwen2", "mistral") and field(f"{arch}.rope.scaling.type") in (None, "none")
    return ModelShape(name, int(L), int(d), int(n_q), int(h_kv), int(d_h), int(d_ffn), params,
                      f"{path.name} (GGUF metadata)", float(theta) if theta and plain else None,
                      "" if theta and plain else f"no plain RoPE base in the {arch} GGUF metadata")


def resolve_shape(spec: str) -> ModelShape:
    """A preset name, a config.json path, a model directory, a .gguf file, `catalog:<name>`,
    or a hub id whose config.json is in the local Hugging Face cache."""
    key = spec.strip()
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    if key.startswith("catalog:"):
        from kvflow.models.catalog import CatalogError, get_entry

        try:
            entry = get_entry(key)
        except CatalogError as e:
            raise UserError(f"{spec}: {e.message}") from None
        gguf_path = entry.path()
        for conv in sorted(gguf_path.parent.glob("hf-*/config.json")):
            return replace(_from_config_file(conv, spec), source=f"{conv} (converted catalog model)")
        if gguf_path.is_file():
            return shape_from_gguf(gguf_path, spec)
        raise UserError(f"{spec}: not in the cache ({gguf_path})", hint=f"kvflow models pull {entry.name}")
    p = Path(os.path.expanduser(key))
    if p.is_file() and p.suffix.lower() == ".gguf":
        return shape_from_gguf(p, spec)
    if p.is_file():
        return _from_config_file(p, spec)
    if p.is_dir():
        if (p / "config.json").is_file():
            return _from_config_file(p / "config.json", spec)
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return shape_from_gguf(ggufs[0], spec)
        raise UserError(f"{spec}: no config.json in {p}")
    if "/" in key and not key.startswith((".", "/", "~")):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(key, "config.json")
        except Exception:  # not a valid repo id
            cached = None
        if isinstance(cached, str):
            return _from_config_file(Path(cached), spec)
        raise UserError(f"{spec}: config.json is not in the local Hugging Face cache",
                        hint="download it (huggingface-cli download REPO config.json), or pass a directory, "
                             "a config.json, catalog:<name> or a preset")
    raise UserError(f"{spec}: not a preset, file, directory, catalog:<name> or hub id",
                    hint=f"presets: {', '.join(PRESETS)}")


def kv_shape(cfg: dict, model_cfg) -> tuple[int, int, int, int]:
    """(layers, kv_heads, head_dim, bytes per element) of a model entry's config dict: the
    shape an engine's KV cache has (float32: 4 bytes, anything else 2)."""
    shape = shape_from_config(cfg, model_cfg.id)
    return (shape.n_layers, shape.n_kv_heads, shape.head_dim, 4 if model_cfg.dtype == "float32" else 2)


# --------------------------------------------------------------------------- a model entry's shape, offline


def hub_cached(repo: str, filename: str, revision: Optional[str] = None) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        got = try_to_load_from_cache(repo, filename, revision=revision)
    except Exception:  # noqa: BLE001 - not a valid repo id, or no huggingface_hub
        return None
    return got if isinstance(got, str) else None


def _preset_for(model_id: str) -> Optional[str]:
    """A cost preset (paper constants) whose name the hub id's basename starts with, if any."""
    base = model_id.rsplit("/", 1)[-1].lower()
    matches = [p for p in PRESETS if base == p or base.startswith(p + "-")]
    return max(matches, key=len) if matches else None


def entry_shape(model_cfg: Any) -> tuple[Optional[ModelShape], str]:
    """(shape, note): the model's dimensions from its config when they can be read offline
    without weights, else (None, why not)."""
    from kvflow.errors import UserError
    from kvflow.models.catalog import CatalogError
    from kvflow.models.loading import resolve_source

    try:
        src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
    except CatalogError:
        return None, "unknown (not a catalog model)"
    spec = model_cfg.id
    if src.kind == "hub":
        cached = hub_cached(src.ref, "config.json", getattr(model_cfg, "revision", None))
        if cached:
            spec = cached
        else:
            preset = _preset_for(src.ref)
            if preset:
                return PRESETS[preset], f"preset {preset} (config not available offline; paper constants)"
            return None, "unknown (config not available offline)"
    elif src.kind == "dir" and src.gguf_file:
        spec = str(Path(src.ref) / src.gguf_file)
    try:
        shape = resolve_shape(spec)
    except UserError as e:
        if src.kind == "catalog":
            return None, f"unknown (catalog model not cached: kvflow models pull {src.ref})"
        return None, f"unknown ({e.problems[0].message if getattr(e, 'problems', None) else e})"
    except Exception as e:  # noqa: BLE001 - an unreadable file must not stop `explain`
        return None, f"unknown (cannot read the model config: {type(e).__name__}: {e})"
    return shape, shape.source
