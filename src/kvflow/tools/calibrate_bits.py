"""`kvflow calibrate-bits PIPELINE`: pick the bit-width of a quantized (BreadthKV) base by
accuracy, end to end, at one byte budget (METHODS.md §8).

The paper picks bits per (model, budget) on 60 problems because offline attention error did
not predict accuracy. Here every bit-width runs the pipeline's base alone (the first
proposer, without its pruners or the other proposers: the best-of-N baseline) with
`quantize.bits = b` at the same `budget_bytes`, so more bits buy fewer tokens. Bits 16 means
no quantization: eviction alone at the same bytes, the reference row.

The calibration split is disjoint from the pipeline's evaluation split: the `--problems`
problems right after it (dataset.offset + dataset.limit onward, in the same order), or from
`--offset`; the problem ids of both splits are compared and any overlap is an error. Each
bit-width is an ordinary run with its own results directory, so an interrupted calibration
resumes. The choice: highest accuracy; ties go to the lower length-cap rate, then to fewer
bits (more tokens for the same bytes).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvflow import jsonfile
from kvflow.errors import UserError

FULL_PRECISION = 16


@dataclass
class BitsRow:
    bits: int
    budget_tokens: Optional[int]
    accuracy: float
    n_correct: int
    n_problems: int
    length_cap_rate: float
    mean_output_tokens: float
    results: str


def _byte_budget(loaded, base: str) -> tuple[int, str]:
    """The base's byte budget: its budget_bytes, else the bytes of its token budget at full precision."""
    from kvflow.models.shapes import entry_shape as model_shape
    from kvflow.kv_memory import DTYPE_BYTES, full_token_bytes

    pipe = loaded.pipeline
    spec = loaded.components.proposers[base].evictor
    params = spec.params
    where = f"proposers.{base}.evictor"
    if "quantize" not in type(params).model_fields or not getattr(spec.cls, "bounded", True):
        raise UserError(loaded.problem(where, "calibrate-bits needs an evicting method with `quantize` "
                                              "(e.g. kind: breadthkv or snapkv)"))
    if params.budget_bytes is not None:
        return params.budget_bytes, "budget_bytes"
    model = pipe.models[pipe.proposers[base].model]
    shape, note = model_shape(model)
    if shape is None:
        raise UserError(loaded.problem(where, f"cannot convert budget {params.budget} to bytes: model shape {note}",
                                       "give the evictor budget_bytes instead of budget"))
    per_token = shape.n_layers * shape.n_kv_heads * full_token_bytes(shape.head_dim, DTYPE_BYTES.get(model.dtype, 2))
    return params.budget * per_token, f"budget {params.budget} tokens at full precision"


def point_overrides(loaded, bits: int, byte_budget: int, offset: int, n_problems: int) -> tuple[list[str], list[str]]:
    """The (--set, --unset) overrides that turn the pipeline into the calibration run of one bit-width."""
    pipe = loaded.pipeline
    base, *others = list(pipe.proposers)
    params = loaded.components.proposers[base].evictor.params
    ev = f"proposers.{base}.evictor"
    if bits == FULL_PRECISION:
        quant = "null"
    else:
        q = params.quantize.model_dump() if params.quantize is not None else {}
        q["bits"] = bits
        quant = json.dumps(q)
    sets = [f"proposers.{o}=null" for o in others]
    unsets = [f"{ev}.budget"] if "budget" in loaded.resolved["proposers"][base].get("evictor", {}) else []
    sets += [f"proposers.{base}.pruners=[]", f"{ev}.budget_bytes={byte_budget}",
             f"{ev}.quantize={quant}", f"dataset.offset={offset}", f"dataset.limit={n_problems}",
             f"name={pipe.name}-calib-bits{bits}"]
    if "proposers" in pipe.scorer.params:  # a scorer restricted to proposers that are gone
        sets.append("scorer.proposers=null")
    return sets, unsets


def choose(rows: Sequence[BitsRow]) -> BitsRow:
    return sorted(rows, key=lambda r: (-r.accuracy, r.length_cap_rate, r.bits))[0]


def calibrate_bits(file, bits: Sequence[int], n_problems: int, *, sets: Sequence[str] = (),
                   unsets: Sequence[str] = (), offset: Optional[int] = None, out: Optional[Path] = None,
                   force: bool = False, registry=None,
                   say: Optional[Callable[[str], None]] = None) -> tuple[list[BitsRow], BitsRow, Path]:
    from kvflow.config.validate import load_pipeline
    from kvflow.runtime import runner
    from kvflow.results.files import ResultsDir

    say = say or (lambda m: print(f"kvflow: {m}", file=sys.stderr, flush=True))
    loaded = load_pipeline(file, sets=sets, unsets=unsets, registry=registry)
    pipe = loaded.pipeline
    base = next(iter(pipe.proposers))
    byte_budget, source = _byte_budget(loaded, base)
    ds = pipe.dataset
    if offset is None:
        if ds.limit is None:
            raise UserError(loaded.problem("dataset.limit", "the pipeline evaluates every problem of its dataset, so "
                                           "no problems are left for calibration",
                                           "set dataset.limit, or give --offset to calibrate on other problems"))
        offset = ds.offset + ds.limit
    eval_ids = {p.id for p in runner.load_dataset(loaded)}

    points = []
    for b in bits:
        more_sets, more_unsets = point_overrides(loaded, b, byte_budget, offset, n_problems)
        point = load_pipeline(file, sets=[*sets, *more_sets], unsets=[*unsets, *more_unsets], registry=registry)
        cal = runner.load_dataset(point)
        overlap = eval_ids & {p.id for p in cal}
        if overlap:
            raise UserError(loaded.problem("dataset", f"the calibration split (offset {offset}) overlaps the "
                                           f"evaluation split in {len(overlap)} problem(s), e.g. {sorted(overlap)[0]}",
                                           "give --offset past the evaluation problems"))
        if len(cal) < n_problems:
            say(f"calibration split has only {len(cal)} problems (asked for {n_problems})")
        points.append((b, point, cal))

    rows = []
    for b, point, cal in points:
        label = "no quantization (eviction only)" if b == FULL_PRECISION else f"{b} bits"
        say(f"calibrate-bits: {label} at {byte_budget} bytes on {len(cal)} problems -> {runner.results_path(point)}")
        rc = runner.run_pipeline(point, force=force, registry=registry, quiet=True)
        if rc:
            raise UserError(f"calibration run for {label} failed (exit {rc})")
        m = ResultsDir(runner.results_path(point)).metrics() or {}
        n = m.get("n_problems", 0)
        rows.append(BitsRow(b, _budget_tokens(point, base), m.get("accuracy", 0.0), m.get("n_correct", 0), n,
                            m.get("finish", {}).get("cap_tokens", 0) / n if n else 0.0,
                            m.get("mean_output_tokens", 0.0), str(runner.results_path(point))))
    chosen = choose(rows)
    out = Path(out) if out else Path(pipe.run.output) / f"{pipe.name}__calibrate_bits"
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "pipeline": str(loaded.path), "proposer": base, "byte_budget": byte_budget, "byte_budget_from": source,
        "calibration": {"dataset": ds.name, "offset": offset, "limit": n_problems,
                        "ids": [p.id for p in points[0][2]]},
        "evaluation": {"offset": ds.offset, "limit": ds.limit},
        "rule": "highest accuracy; ties: lower length-cap rate, then fewer bits",
        "rows": [asdict(r) for r in rows], "chosen_bits": chosen.bits,
    }
    tmp = out / "calibrate_bits.json.tmp"
    tmp.write_text(jsonfile.dumps(report, indent=2) + "\n")  # strict JSON (no NaN)
    tmp.replace(out / "calibrate_bits.json")
    return rows, chosen, out


def _budget_tokens(point, base: str) -> Optional[int]:
    """The token budget the byte budget buys for this bit-width (from the model's shape)."""
    from kvflow.models.shapes import entry_shape as model_shape
    from kvflow.kv_memory import DTYPE_BYTES, budget_for_bytes

    pipe = point.pipeline
    model = pipe.models[pipe.proposers[base].model]
    shape, _ = model_shape(model)
    if shape is None:
        return None
    params = point.components.proposers[base].evictor.params
    try:
        return budget_for_bytes(params, shape.n_layers, shape.n_kv_heads, shape.head_dim,
                                DTYPE_BYTES.get(model.dtype, 2), evictor_cls=point.components.proposers[base].evictor.cls)
    except ValueError:
        return None
