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

Model shapes (`kvflow.models.shapes`) come from: the built-in presets of the paper's models (`qwen2.5-math-1.5b`,
`qwen2.5-math-7b`, `qwen2.5-math-72b`), a `config.json` (a path, a model directory, or a hub
id already in the local Hugging Face cache), or `catalog:<name>` (the converted directory
the catalog writes beside the GGUF, else the GGUF's own metadata). P is counted from the
checkpoint's tensors when they are at hand (safetensors headers, GGUF tensor infos), and
estimated from the config otherwise (embeddings, attention and MLP projections, norms).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from kvflow.errors import UserError
from kvflow.models.shapes import ModelShape, decode_flops, kv_bytes, kv_bytes_per_token, resolve_shape


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
