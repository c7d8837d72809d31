"""Which GPU(s) each model of a pipeline runs on, and whether they all fit (DESIGN.md §11).

In one process with several GPUs, a model entry whose `device` is `auto` gets its GPU by the
rule below, and a pipeline whose models cannot fit is refused before any engine starts.
`place()` is the rule: a pure function of the models' demands and the GPUs' sizes.
`place_pipeline()` places the demands of a pipeline's used models (`kvflow.planning.demands`: no weights
loaded, no network); `cuda_devices()` asks torch for the GPUs (the one torch use here, imported late).

The rule (docs/backends.md, "Placement on several GPUs"):

1. An entry asked for a GPU explicitly is placed where asked and counted: `device: cuda:i`,
   or on `backend: sglang` an `engine.base_gpu_id` (SGLang's own setting; it wins over the
   device's index, as it does in SGLang). `device: cuda` without an index only asks for a
   GPU: the rule picks which. `cpu` (and any other device) is not placed.
2. Entries that need several GPUs (SGLang: tp_size x dp_size x pp_size / nnodes > 1) next,
   largest first, each on the first run of consecutive GPUs (`gpu_id_step` apart, as SGLang
   lays ranks out from `base_gpu_id`) where its claim fits on every one.
3. The rest largest first, each on the GPU with the most memory left after it (ties: the
   lowest index). A model joins another's GPU only when no GPU has more room, so two models
   share a GPU only when there are more models than GPUs, or the others are fuller.

Claims (bytes an entry asks of each GPU it occupies):

- `sglang`: `mem_fraction_static` x the GPU's total memory. SGLang keeps its weights and its
  static KV pool inside that fraction (and sizes the pool from the memory free when it
  starts, so this is an upper bound). Without the setting SGLang takes about all of a GPU
  but its activation room; it is counted as SGLANG_DEFAULT_FRACTION (0.9).
- any other backend (`hf`: in kvflow's process): its weights x HF_HEADROOM (1.2): 20% over
  the weights for activations, logits and a small KV cache. A large full-KV cache of an `hf`
  proposer comes on top (`kvflow explain` prints its bytes per sequence).

Refused with a UserError naming the field, before any engine starts: claims on one GPU over
CAPACITY_SHARE (0.95) of its memory (named at the entry placed there last: its `device`, or
`engine.mem_fraction_static` of an SGLang engine); an SGLang fraction too small for its
share of the weights (not checked for a quantized checkpoint, whose bytes per weight are not
`dtype`'s); more GPUs than the machine has; an explicit index past the last GPU.

SGLang's fractions do not compose as shares of a GPU: SGLang 0.5.23 sizes an engine's KV pool
as *free memory after its weights - free memory at its start x (1 - mem_fraction_static)*
(`mem_cache/kv_cache_configurator.py`, `_profile_available_bytes`), i.e. f x free-at-start -
weights: a share of what is free when that engine starts, not of the GPU. kvflow reads each
SGLang engine's fraction as its intended share of the GPU (that is what the claims above add
up) and passes SGLang the fraction that gives it that share where it starts (`sglang_pools`):
f' = share x total / free at its start, engines starting in the pipeline's order (proposers'
models, then the scorer's: `compile.used_models`, the order `kvflow run` starts them), the
free memory at a start being the total less the claims of the engines started before it on
that GPU and PROCESS_OVERHEAD each (CUDA context, graph buffers). An engine whose pool would
not be positive is refused, naming its fraction. An engine alone on its GPUs keeps SGLang's
own default when it set no fraction.

Without GPUs (an empty device list) nothing is placed: `auto` stays auto (the CPU).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from kvflow.backends.base import SGLANG_DEFAULT_FRACTION, backend_named
from kvflow.planning.demands import HF_HEADROOM, Demand, gib, pipeline_demands
from kvflow.errors import ConfigProblem, UserError

log = logging.getLogger(__name__)

#: share of a GPU's total memory that the claims on it may add up to (the rest: CUDA context,
#: allocator fragmentation, NCCL buffers)
CAPACITY_SHARE = 0.95
#: memory an SGLang engine process holds outside its claim (CUDA context, NCCL, graph buffers)
PROCESS_OVERHEAD = 1 * 2**30
#: (GPU index, total memory in bytes), as torch.cuda.get_device_properties(i).total_memory
Gpu = tuple[int, int]
#: makes a located problem: (dotted path, message, hint) -> ConfigProblem (LoadedPipeline.problem)
ProblemMaker = Callable[[str, str, Optional[str]], ConfigProblem]


def _plain_problem(path: str, message: str, hint: Optional[str] = None) -> ConfigProblem:
    return ConfigProblem("", 0, path, message, hint)


def _span(indices: Sequence[int]) -> str:
    if len(indices) == 1:
        return f"GPU {indices[0]}"
    step = indices[1] - indices[0]
    consecutive = all(b - a == step for a, b in zip(indices, indices[1:]))
    return (f"GPUs {indices[0]}-{indices[-1]}" if consecutive and step == 1
            else "GPUs " + ", ".join(map(str, indices)))


@dataclass(frozen=True)
class Placement:
    """The rule's answer: GPU indices per model key and the bytes each GPU is asked for."""

    gpus: tuple[Gpu, ...]
    assigned: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model key -> GPU indices
    claims: dict[int, dict[str, float]] = field(default_factory=dict)  # GPU -> {model key: bytes}
    notes: dict[str, str] = field(default_factory=dict)  # model key -> how its claim was counted
    pools: dict[str, "Pool"] = field(default_factory=dict)  # SGLang model key -> what its engine gets

    def placed_models(self, models: Mapping[str, Any]) -> dict[str, Any]:
        """`models` (ModelConfig by key) with each placed entry's device set to `cuda:i` and,
        the engine settings its backend gives for that GPU and share (`Backend.placed_settings`;
        SGLang: `base_gpu_id: i` where the entry set none, and `mem_fraction_static` as SGLang must
        be told it for the entry's share of the GPU: `sglang_pools`)."""
        out = dict(models)
        for key, indices in self.assigned.items():
            cfg = models[key]
            update: dict[str, Any] = {"device": f"cuda:{indices[0]}"}
            pool = self.pools.get(key)
            placed = backend_named(cfg.backend).placed_settings(
                cfg, indices[0], pool.passed if pool is not None else None)
            if placed:
                update["engine"] = {**(cfg.engine or {}), **placed}
            out[key] = cfg.model_copy(update=update)
        return out

    def to_dict(self) -> dict:
        """Plain data for manifest.json: per model its GPUs and claim, per GPU its bytes."""
        totals = dict(self.gpus)
        return {
            "models": {key: {"gpus": list(idx), "note": self.notes.get(key, "")} for key, idx in self.assigned.items()},
            "gpus": {str(i): {"total_bytes": totals[i], "claimed_bytes": int(sum(c.values())),
                              "models": {k: int(v) for k, v in c.items()}}
                     for i, c in self.claims.items() if c},
            "sglang_pools": {key: pool.to_dict() for key, pool in self.pools.items()},
            "rule": {"capacity_share": CAPACITY_SHARE, "hf_headroom": HF_HEADROOM,
                     "sglang_default_fraction": SGLANG_DEFAULT_FRACTION, "process_overhead": PROCESS_OVERHEAD},
        }

    def lines(self) -> list[str]:
        """The placement in words, one line per model and per GPU in use."""
        totals = dict(self.gpus)
        out = [f"  models.{key}: {_span(idx)} ({self.notes.get(key, '')})" for key, idx in self.assigned.items()]
        for key, pool in self.pools.items():
            out.append(f"  models.{key}: {pool.describe()}")
        for i, c in self.claims.items():
            if c:
                used = sum(c.values())
                out.append(f"  GPU {i}: {gib(used)} of {gib(totals[i])} ({used / totals[i]:.0%}): "
                           + ", ".join(f"{k} {gib(v)}" for k, v in c.items()))
        return out


def place(demands: Iterable[Demand], gpus: Sequence[Gpu], problem: ProblemMaker = _plain_problem) -> Placement:
    """Place `demands` on `gpus` by the module's rule; a UserError (one problem per entry to
    change, located by `problem`) when they do not fit. No GPUs: nothing is placed."""
    demands = list(demands)
    if not gpus:
        return Placement(())
    totals = dict(gpus)
    claims: dict[int, dict[str, float]] = {i: {} for i in sorted(totals)}
    by_key = {d.key: d for d in demands}
    assigned: dict[str, tuple[int, ...]] = {}
    problems: list[ConfigProblem] = []

    def left(i: int) -> float:  # bytes a GPU may still be asked for
        return CAPACITY_SHARE * totals[i] - sum(claims[i].values())

    def put(d: Demand, indices: Sequence[int]) -> None:
        for key in (d.key, *d.also):
            assigned[key] = tuple(indices)
        for i in indices:
            claims[i][d.key] = d.claim(totals[i])

    biggest = max(totals.values())
    largest_first = lambda d: -d.claim(biggest) * d.gpu_count  # noqa: E731 - a sort key; sorted() is stable
    fixed = [d for d in demands if d.explicit_gpu() is not None]
    auto = sorted((d for d in demands if d.explicit_gpu() is None), key=largest_first)
    for d in fixed:
        indices = d.gpus_from(d.explicit_gpu())
        if all(i in totals for i in indices):
            put(d, indices)
            continue
        where = (f"models.{d.key}.engine.{d.layout.first_gpu_setting}" if d.layout.first_gpu is not None
                 else f"models.{d.key}.device")
        problems.append(problem(where, f"asks for {_span(indices)}, but this machine has {_span(sorted(totals))}",
                                "set `device: auto` (the placement rule picks a GPU) or an index that exists"))
    for d in [d for d in auto if d.gpu_count > 1] + [d for d in auto if d.gpu_count == 1]:
        windows = [w for w in (d.gpus_from(first) for first in sorted(totals)) if all(i in totals for i in w)]
        if not windows:
            problems.append(problem(f"models.{d.key}.engine.tp_size",
                                    f"this SGLang engine needs {d.gpu_count} GPUs (tp_size x dp_size x pp_size), "
                                    f"but this machine has {len(totals)}",
                                    "lower tp_size or dp_size, or run on a machine with more GPUs"))
            continue
        room_after = lambda w: min(left(i) - d.claim(totals[i]) for i in w)  # noqa: E731
        if d.gpu_count > 1:  # the first run where it fits, else the roomiest (refused below)
            put(d, next((w for w in windows if room_after(w) >= 0), max(windows, key=room_after)))
        else:  # the GPU with the most room left after it; max() keeps the lowest index on ties
            put(d, max(windows, key=room_after))

    problems += _overfull(claims, totals, by_key, problem)
    problems += _weights_too_big(demands, assigned, totals, problem)
    pools: dict[str, Pool] = {}
    if not problems:
        pools, more = sglang_pools(demands, assigned, totals, problem)
        problems += more
    if problems:
        raise UserError(problems)
    notes = {key: by_key[key].how() if key in by_key else "" for key in assigned}
    for d in demands:  # keys served by one engine share its note
        for key in d.also:
            notes[key] = f"same engine as models.{d.key}"
    return Placement(tuple(sorted(gpus)), assigned, claims, notes, pools)


@dataclass(frozen=True)
class Pool:
    """What one SGLang engine gets on its GPU(s): the fraction kvflow passes and the KV pool
    SGLang 0.5.23's sizing gives it with that fraction where it starts (bytes per GPU)."""

    share: float  # of the GPU, as the pipeline meant it (its mem_fraction_static, or SGLang's default)
    passed: Optional[float]  # what SGLang is told (None: left unset, SGLang's own default)
    free_at_start: float  # bytes free on its (fullest) GPU when it starts
    pool_bytes: Optional[float]  # f x free at start - its weights per GPU (None: weights unknown)
    order: int  # its place in the start order
    bytes_per_token: Optional[float] = None  # KV bytes per token per GPU, where the model's shape is known

    @property
    def tokens(self) -> Optional[int]:
        if self.pool_bytes is None or not self.bytes_per_token:
            return None
        return int(self.pool_bytes // self.bytes_per_token)

    def describe(self) -> str:
        told = f"mem_fraction_static {self.passed:g} passed to SGLang" if self.passed is not None else \
            "SGLang's own mem_fraction_static"
        pool = "KV pool of unknown size (weights unknown)" if self.pool_bytes is None else \
            f"KV pool {gib(self.pool_bytes)}" + (f" = {self.tokens:,} tokens" if self.tokens is not None else "")
        return (f"starts #{self.order + 1} with {gib(self.free_at_start)} free: {told} "
                f"(a {self.share:g} share of the GPU) -> {pool}")

    def to_dict(self) -> dict:
        return {"share": self.share, "passed": self.passed, "free_at_start_bytes": int(self.free_at_start),
                "pool_bytes": None if self.pool_bytes is None else int(self.pool_bytes), "tokens": self.tokens,
                "order": self.order}


def sglang_pools(demands: Sequence[Demand], assigned: Mapping[str, Sequence[int]], totals: Mapping[int, int],
                 problem: ProblemMaker = _plain_problem) -> tuple[dict[str, Pool], list[ConfigProblem]]:
    """The fraction to pass each SGLang engine so that it gets its share of its GPU(s) where it
    starts (`demands` in start order), and the KV pool SGLang sizes from it: pool = f x free at
    start - weights per GPU (SGLang 0.5.23). Problems for an engine whose pool is not positive."""
    pools: dict[str, Pool] = {}
    problems: list[ConfigProblem] = []
    started: dict[int, float] = {i: 0.0 for i in totals}  # bytes held on each GPU by engines started so far
    engines_on = {i: sum(1 for d in demands if i in assigned.get(d.key, ())) for i in totals}
    for order, d in enumerate(demands):
        indices = assigned.get(d.key, ())
        if not indices:
            continue
        if d.claims_fraction:
            free = min(totals[i] - started[i] for i in indices)
            share = d.fraction
            alone = all(engines_on[i] == 1 for i in indices)
            passed = None if alone and d.layout.fraction is None else round(share * min(totals[i] for i in indices) / free, 4)
            f = passed if passed is not None else share
            weights = None if d.weight_bytes is None else d.weight_bytes / d.weight_shards
            pool_bytes = None if weights is None else f * free - weights
            pools[d.key] = Pool(share, passed, free, pool_bytes, order)
            if f >= 1 or (pool_bytes is not None and pool_bytes <= 0 and not d.quantized):
                problems.append(problem(
                    d.field_to_change(),
                    f"this SGLang engine starts with {gib(free)} free on {_span(indices)} after the engines before it; "
                    f"its share {share:g} of the GPU ({gib(share * min(totals[i] for i in indices))}) "
                    + ("is more than that" if f >= 1 else f"leaves no KV pool after its weights ({gib(weights)})"),
                    "raise its mem_fraction_static and lower the others' on that GPU, or put it on another GPU"))
        for i in indices:
            started[i] += d.claim(totals[i]) + (PROCESS_OVERHEAD if d.claims_fraction else 0)
    return pools, problems


def _overfull(claims, totals, by_key, problem: ProblemMaker) -> list[ConfigProblem]:
    """One problem per entry placed last on a GPU whose claims exceed CAPACITY_SHARE of it."""
    over: dict[str, list[int]] = {}  # the entry to move or shrink -> its overfull GPUs
    for i, c in claims.items():
        if c and sum(c.values()) > CAPACITY_SHARE * totals[i] * (1 + 1e-9):
            over.setdefault(list(c)[-1], []).append(i)
    problems = []
    for key, indices in over.items():
        i = indices[0]
        c = claims[i]
        on_gpu = [by_key[k] for k in c]
        where = "each of " + _span(indices) if len(indices) > 1 else _span(indices)
        if all(d.claims_fraction for d in on_gpu):
            total = sum(d.fraction for d in on_gpu)
            message = (f"the SGLang engines on {where} ask for mem_fraction_static "
                       + " + ".join(f"{d.fraction:g} (models.{d.key})" for d in on_gpu)
                       + f" = {total:.2f} of it, over {CAPACITY_SHARE:g}")
            hint = ("lower mem_fraction_static so that the engines sharing a GPU add up to "
                    f"{CAPACITY_SHARE:g} at most, or give this engine a GPU of its own (`device: cuda:<i>`)")
        else:
            used = sum(c.values())
            message = (f"{where} ({gib(totals[i])}) is asked for {gib(used)}, over {CAPACITY_SHARE:.0%} of it "
                       f"({gib(CAPACITY_SHARE * totals[i])}): "
                       + "; ".join(f"models.{d.key} {gib(c[d.key])} ({d.how()})" for d in on_gpu))
            hint = ("the models do not fit these GPUs by kvflow's placement rule (docs/backends.md, \"Placement on "
                    "several GPUs\"): use a machine with more or larger GPUs, a smaller dtype or model, lower "
                    "mem_fraction_static on SGLang engines, or `device: cpu` for a model that may run slowly")
        problems.append(problem(by_key[key].field_to_change(), message, hint))
    return problems


def _weights_too_big(demands, assigned, totals, problem: ProblemMaker) -> list[ConfigProblem]:
    """An SGLang engine whose share of the weights does not fit in its fraction of a GPU."""
    problems = []
    for d in demands:
        if not d.claims_fraction or d.weight_bytes is None or d.quantized or d.key not in assigned:
            continue
        shard = d.weight_bytes / d.weight_shards
        smallest = min(totals[i] for i in assigned[d.key])
        if shard >= d.fraction * smallest:
            problems.append(problem(
                d.field_to_change(),
                f"{gib(shard)} of weights per GPU ({gib(d.weight_bytes)} over tp_size x pp_size = "
                f"{d.weight_shards}; {d.weights_from}) do not fit in {d.fraction:g} of a {gib(smallest)} GPU, "
                "and SGLang keeps weights and KV pool inside that fraction",
                "raise mem_fraction_static, or tp_size (more GPUs share the weights)"))
    return problems


def place_pipeline(loaded: Any, gpus: Sequence[Gpu], keys: Iterable[str]) -> Placement:
    """The placement of a LoadedPipeline's used model `keys` (`compile.used_models`) on `gpus`,
    with problems located in its file."""
    if not gpus:
        return Placement(())
    demands = pipeline_demands(loaded.pipeline.models, keys)
    return place(demands, gpus, problem=loaded.problem)


def cuda_devices() -> list[Gpu]:
    """This machine's CUDA GPUs as (index, total bytes); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(i, int(torch.cuda.get_device_properties(i).total_memory)) for i in range(torch.cuda.device_count())]


def parse_gpus(text: str) -> list[Gpu]:
    """`8x80` (8 GPUs of 80 GB, 10^9 bytes) or `80,80,24` (one size per GPU; a `GiB` suffix
    means 2^30 bytes) -> [(0, 80e9), ...], a stand-in device list for `kvflow explain --gpus`."""
    text = text.strip().lower().replace(" ", "")
    match = re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)(gb|gib)?", text)
    sizes = ([match.group(2) + (match.group(3) or "")] * int(match.group(1)) if match
             else [s for s in text.split(",") if s])
    out = []
    for i, size in enumerate(sizes):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(gb|gib)?", size)
        if not m or float(m.group(1)) <= 0:
            raise UserError(f"--gpus {text!r}: '{size}' is not a GPU size",
                            hint="e.g. --gpus 8x80 (8 GPUs of 80 GB) or --gpus 80,80,24")
        out.append((i, int(float(m.group(1)) * (2**30 if m.group(2) == "gib" else 10**9))))
    if not out:
        raise UserError("--gpus: no GPUs given", hint="e.g. --gpus 8x80")
    return out
