"""`kvflow cost`: what an evicted base plus a full-KV helper costs against a full-KV base.

Per sequence and per decoded token, from each model's shape alone (no weights are loaded):

Notation: L layers, d hidden size, n_q query heads, h_kv KV heads, d_h head dimension,
d_ffn MLP width, P parameters, T the context length (prompt + generated so far), B the
eviction budget and b the buffer, s bytes per cached element (2 for bf16/fp16).

- KV bytes per token      = 2 · L · h_kv · d_h · s            (keys and values, every layer)
- KV memory, full KV      = KV bytes per token · T
- KV memory, evicted      = KV bytes per token · min(T, B + b) (capacity is `budget + buffer`
                                                                per layer and KV head)
- decode FLOPs per token  = 2 · P                              (one multiply-add per weight;
                                                                the paper's convention)
                          + 2 · L · n_q · d_h · (2 · T')       (attention: QK scores and the
                                                                AV sum, T' attended tokens)
  with T' = T for a full-KV model and T' = min(T, B + b) for an evicted one.

KV-Rescue runs the evicted base and a full-KV helper side by side, so its cost is the sum of
the two; the table compares that sum (and the evicted base alone) with the full-KV base.
Weights are not counted in the memory columns (they do not grow with T).

Model shapes come from: the built-in presets of the paper's models (`qwen2.5-math-1.5b`,
`qwen2.5-math-7b`, `qwen2.5-math-72b`), a `config.json` (a path, a model directory, or a hub
id already in the local Hugging Face cache), or `catalog:<name>` (the converted directory
the catalog writes beside the GGUF, else the GGUF's own metadata). P is counted from the
checkpoint's tensors when they are at hand (safetensors headers, GGUF tensor infos), and
estimated from the config otherwise (embeddings, attention and MLP projections, norms).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

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


# --------------------------------------------------------------------------- the comparison


def parse_lengths(text: str) -> list[int]:
    """``"1k,2k,4k,8k"`` -> [1024, 2048, 4096, 8192]; plain integers are tokens."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        elif part.endswith("m"):
            mult, part = 1024 * 1024, part[:-1]
        try:
            value = int(float(part) * mult)
        except ValueError:
            raise UserError(f"--lengths: '{part}' is not a length", hint="e.g. --lengths 1k,2k,4k,8k or 1000,2000") from None
        if value < 1:
            raise UserError(f"--lengths: {value} must be positive")
        out.append(value)
    if not out:
        raise UserError("--lengths: no lengths given")
    return out


def cost_rows(bases: Sequence[ModelShape], helper: Optional[ModelShape], budget: int, buffer: int,
              lengths: Iterable[int], bytes_per_elem: float = 2) -> list[dict]:
    """One row per (base, context length): KV bytes and decode FLOPs per token of the full-KV
    base, the evicted base, the helper (full KV) and evicted base + helper, with ratios."""
    rows = []
    for base in bases:
        for T in lengths:
            full_kv = kv_bytes(base, T, bytes_per_elem=bytes_per_elem)
            full_fl = decode_flops(base, T)
            ev_kv = kv_bytes(base, T, budget, buffer, bytes_per_elem)
            ev_fl = decode_flops(base, T, budget, buffer)
            row = {"base": base.name, "helper": helper.name if helper else None, "context": T,
                   "budget": budget, "buffer": buffer,
                   "full_kv_bytes": full_kv, "full_flops": full_fl,
                   "evicted_kv_bytes": ev_kv, "evicted_flops": ev_fl}
            if helper is not None:
                h_kv = kv_bytes(helper, T, bytes_per_elem=bytes_per_elem)
                h_fl = decode_flops(helper, T)
                row.update(helper_kv_bytes=h_kv, helper_flops=h_fl,
                           combined_kv_bytes=ev_kv + h_kv, combined_flops=ev_fl + h_fl)
            ours_kv = row.get("combined_kv_bytes", ev_kv)
            ours_fl = row.get("combined_flops", ev_fl)
            row.update(kv_ratio=ours_kv / full_kv, flops_ratio=ours_fl / full_fl)
            rows.append(row)
    return rows


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _gf(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def print_table(rows: list[dict], shapes: Sequence[ModelShape], bytes_per_elem: float, echo=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=200)  # pipes and logs: do not fold the columns
    info = Table(title="model shapes", title_justify="left")
    for col in ("model", "L", "d", "q heads", "KV heads", "head dim", "d_ffn", "params", "KV KiB/token", "source"):
        info.add_column(col, justify="left" if col in ("model", "source") else "right", overflow="fold")
    for m in shapes:
        info.add_row(m.name, str(m.n_layers), str(m.d_model), str(m.n_q_heads), str(m.n_kv_heads), str(m.head_dim),
                     str(m.d_ffn), f"{m.n_params / 1e9:.2f}B", f"{kv_bytes_per_token(m, bytes_per_elem) / 1024:g}",
                     m.source)
    console.print(info)
    has_helper = bool(rows) and rows[0]["helper"] is not None
    budget, buffer = (rows[0]["budget"], rows[0]["buffer"]) if rows else (0, 0)
    title = f"per-sequence KV memory (MiB) and decode GFLOPs/token; eviction budget {budget} + buffer {buffer}"
    table = Table(title=title, title_justify="left")
    cols = ["base", "context", "full MiB", "full GF", "evicted MiB", "evicted GF"]
    if has_helper:
        cols += ["helper MiB", "helper GF", "ev+helper MiB", "ev+helper GF"]
    cols += ["MiB ratio", "GF ratio"]
    for i, col in enumerate(cols):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        cells = [r["base"], _length(r["context"]), _mib(r["full_kv_bytes"]), _gf(r["full_flops"]),
                 _mib(r["evicted_kv_bytes"]), _gf(r["evicted_flops"])]
        if has_helper:
            cells += [_mib(r["helper_kv_bytes"]), _gf(r["helper_flops"]), _mib(r["combined_kv_bytes"]),
                      _gf(r["combined_flops"])]
        cells += [f"{r['kv_ratio']:.3f}", f"{r['flops_ratio']:.3f}"]
        table.add_row(*cells)
    console.print(table)
    what = f"evicted base + full-KV helper {rows[0]['helper']}" if has_helper else "evicted base"
    console.print(f"MiB: KV cache per sequence; GF: decode GFLOPs per token; ratios: {what} / full-KV base")


def plot(rows: list[dict], path: Path) -> Path:
    """Two panels (KV MiB, GFLOPs/token) against context length; the full-KV base dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    bases = list(dict.fromkeys(r["base"] for r in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, base in enumerate(bases):
        rs = [r for r in rows if r["base"] == base]
        x = [r["context"] for r in rs]
        c = colors[i % len(colors)]
        series = [("full KV", "full_kv_bytes", "full_flops", "--"), ("evicted", "evicted_kv_bytes", "evicted_flops", ":")]
        if rs[0]["helper"] is not None:
            series.append((f"evicted + {rs[0]['helper']} (full KV)", "combined_kv_bytes", "combined_flops", "-"))
        for label, kv_key, fl_key, style in series:
            ax_m.plot(x, [r[kv_key] / 2**20 for r in rs], style, marker="o", color=c, label=f"{base}: {label}")
            ax_f.plot(x, [r[fl_key] / 1e9 for r in rs], style, marker="o", color=c, label=f"{base}: {label}")
    budget, buffer = rows[0]["budget"], rows[0]["buffer"]
    ticks = sorted({r["context"] for r in rows})
    for ax, ylabel in ((ax_m, "KV cache per sequence (MiB)"), (ax_f, "decode GFLOPs per token")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [_length(t) for t in ticks])
        ax.minorticks_off()
        values = [v for line in ax.get_lines() for v in line.get_ydata() if v > 0]
        if values and max(values) / min(values) > 30:
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_m.set_title(f"KV memory (budget {budget} + buffer {buffer})")
    ax_f.set_title("decode compute")
    ax_f.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def check_output_file(path: Path, flag: str) -> None:
    """An output file can be written at `path`, or a UserError saying why: before any work."""
    from kvflow.outputs import output_file_problem

    why = output_file_problem(path)
    if why:
        raise UserError(f"{flag} {path}: {why}", hint="give a file name in a folder you can write to, e.g. cost.png")


def cost_command(models: Sequence[str], *, budget: int, buffer: int, lengths: str, helper: Optional[str],
                 png: Optional[Path], bytes_per_elem: float = 2, as_json: bool = False, echo=print) -> list[dict]:
    if budget < 1 or buffer < 0:
        raise UserError("--budget must be ≥ 1 and --buffer ≥ 0")
    if png is not None:
        check_output_file(Path(png), "--png")
    ctx = parse_lengths(lengths)
    problems = []
    bases = []
    for spec in models:
        try:
            bases.append(resolve_shape(spec))
        except UserError as e:
            problems.extend(e.problems)
    helper_shape = None
    if helper:
        try:
            helper_shape = resolve_shape(helper)
        except UserError as e:
            problems.extend(e.problems)
    if problems:
        raise UserError(problems)
    rows = cost_rows(bases, helper_shape, budget, buffer, ctx, bytes_per_elem)
    if as_json:
        echo(json.dumps(rows, indent=2))
    else:
        print_table(rows, bases + ([helper_shape] if helper_shape else []), bytes_per_elem)
    if png:
        written = plot(rows, png)
        if not as_json:
            echo(f"plot: {written}")
    return rows
