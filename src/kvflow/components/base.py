"""The component protocols: the base classes of evictors, pruners, scorers and committers.

A component is a small class with a frozen pydantic `Params` model and one main method:

- `Evictor.score()`   which cached tokens matter (the base class turns scores into a kept set);
- `Pruner.check()`    which live candidates to stop now;
- `Scorer.score()`    how good each surviving candidate is;
- `Committer.pick()`  which candidate of a problem becomes the next step.

Their parameter models (`kvflow.components.params`) and the records that flow between them
(`kvflow.components.records`) live in modules of their own and are re-exported here: plugins
import every component name from `kvflow.components.base`.

Nothing here imports torch at module import time, so `kvflow validate` and `kvflow ls` stay
fast; tensors are only touched inside methods that run during `kvflow run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence


from kvflow._lazy import torch
from kvflow.components.params import (
    CommitterParams, EvictorParams, Params, PrunerParams, QuantizeParams, ScorerParams,
)
from kvflow.components.records import (
    CONFIDENCE_TOP_K, Candidate, ScoreRequest, Step, StepTrace, Trajectory,
)
from kvflow.components.selection import adaptive_keep, head_capacity, keep_top, pyramid_budgets
from kvflow.faults import guard

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch

__all__ = [
    "CONFIDENCE_TOP_K", "Candidate", "Committer", "CommitterParams", "Evictor", "EvictorParams", "Params",
    "Pruner", "PrunerParams", "QuantizeParams", "ScoreRequest", "Scorer", "ScorerContext", "ScorerParams",
    "Step", "StepTrace", "Trajectory",
]


# --------------------------------------------------------------------------- evictors


class Evictor:
    """Base class of KV eviction methods.

    Subclasses implement `score()`; the base class adds the parts every method shares
    (docs/components.md): the recent `window` and the protected prompt are always kept, padding
    slots never are, exactly `budget` tokens survive per (row, KV head), in time order.

    Two optional inputs, both kept per layer by the cache and asked for by class attributes:

    - `query_window` > 0: the last W post-RoPE queries of each row ([rows, q_heads, W,
      head_dim]), for methods that score with recent attention (SnapKV, R-KV, VaSE);
    - `observes_attention = True`: a per-token statistic `stats` [rows, kv_heads, capacity]
      float32 that `observe()` updates at every forward with the attention the new queries
      pay to the cached keys (H2O's accumulated attention). The cache gathers it with the
      kept slots at every compaction and copies it with rows when they are forked or joined.
      Caches of evictors that do not ask for it never compute any attention weights.

    `score()` is called with keyword arguments; implementations should accept `**kwargs` so
    that later kvflow versions can pass more context without breaking them.

    Allocation (`kvflow.components.allocation`): by default every (layer, KV head) keeps
    `budget` tokens. `layer_budgets()` may give each layer its own (PyramidKV), summing to
    `budget x layers`; `adaptive_heads = True` ranks a layer's tokens across its KV heads, so
    head h keeps k_h tokens with sum_h k_h = kv_heads x the layer's budget (Ada-KV). Either
    way `select()` still enforces the window, the protected prompt, time order and the totals.
    Compactions happen for all layers at once, when a row's nominal length (the budget plus
    the tokens appended since the last compaction) reaches `budget + buffer`.
    """

    Params: ClassVar[type[EvictorParams]] = EvictorParams
    #: False only for `none`: the cache then grows instead of compacting.
    bounded: ClassVar[bool] = True
    #: True for methods that need `observe()` at every forward (see the class docstring).
    observes_attention: ClassVar[bool] = False
    #: the standard statistic `observe()` computes, which an engine may compute itself (in a
    #: captured decode graph) instead of calling it: "accumulated_attention" (H2O: the attention
    #: the new queries pay each cached key, summed over the query heads of its KV head and over
    #: time). None: only this class's own `observe()` computes it. A subclass that overrides
    #: `observe()` without declaring it again declares nothing (`observed_statistic()`).
    observed_statistic: ClassVar[Optional[str]] = None
    #: True when `score()` reads neither `layer_idx` nor `generators`: a layer's scores are a
    #: function of its rows' tensors alone, so a compaction may score several layers' rows in
    #: one call (`select_layers` stacks them on the rows axis). The evictor contract checks the
    #: kept slots are those of one layer at a time. A subclass that overrides `score()`,
    #: `ranked_scores()` or `select()` without declaring it again declares nothing
    #: (`scores_layers_alike()`).
    layer_invariant: ClassVar[bool] = False
    #: `select_layers`' bound on one stacked call's largest intermediate (rows x kv_heads x N x
    #: max(N, head_dim) float32): past a few MiB a stacked call leaves the CPU's caches and got
    #: slower than one call per layer (R-KV on a 2-core Xeon: 4 rows x 15 layers 2x slower than x 10)
    STACK_BYTES: ClassVar[int] = 3 << 20

    def __init__(self, params: EvictorParams) -> None:
        """kvflow builds one evictor per proposer as `Evictor(params)`, `params` its validated
        `Params` (kept as `self.params`); per-sequence state lives in the cache, not here."""
        self.params = params

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard(cls, "Evictor")  # a wrong return value raises kvflow.faults.ComponentFault, naming the component

    @property
    def query_window(self) -> int:
        """How many recent post-RoPE queries per layer the cache must buffer for `score()`."""
        return 0

    @property
    def adaptive_heads(self) -> bool:
        """True: a layer's kept tokens are ranked across its KV heads (Ada-KV: `allocation:
        {kind: adakv}`, or the `AdaptiveHeads` mixin; see the class docstring)."""
        return getattr(getattr(self.params, "allocation", None), "kind", None) == "adakv"

    @property
    def trigger(self) -> int:
        """Resident length at which a row is compacted."""
        return self.params.budget + self.params.buffer

    def layer_budgets(self, num_layers: int) -> list[int]:
        """Tokens each layer keeps per KV head after a compaction (a layer of an adaptive
        evictor keeps kv_heads x this in all). Must sum to `budget x num_layers`, each above
        `window` and at most `budget + buffer`; `allocation()` checks. Default: `budget`, or
        PyramidKV's sequence with `allocation: {kind: pyramid}`."""
        p = self.params
        spread = getattr(p, "allocation", None)
        if getattr(spread, "kind", None) == "pyramid":
            return pyramid_budgets(p.budget, p.window, num_layers, spread.beta, self.trigger)
        return [p.budget] * num_layers

    def head_floor(self, layer_budget: int) -> int:
        """Fewest tokens one KV head keeps under an adaptive allocation (Ada-KV's safeguard)."""
        return int(self.params.allocation.safeguard * layer_budget) if self.adaptive_heads else 0

    def head_capacity(self, layer_budget: int, kv_heads: int) -> int:
        """Most tokens one KV head of a layer with `layer_budget` may keep: the width the
        cache stores per head (see `allocation.head_capacity`)."""
        if not self.adaptive_heads:
            return layer_budget
        spread = self.params.allocation
        return head_capacity(layer_budget, kv_heads, spread.safeguard, spread.head_cap)

    def allocation(self, num_layers: int) -> list[int]:
        """`layer_budgets(num_layers)`, checked: exact total, each layer above the window and
        within what a layer holds at a compaction. ValueError says which rule failed."""
        budgets = [int(b) for b in self.layer_budgets(num_layers)]
        p = self.params
        if len(budgets) != num_layers:
            raise ValueError(f"layer_budgets gave {len(budgets)} budgets for {num_layers} layers")
        if sum(budgets) != p.budget * num_layers:
            raise ValueError(f"layer budgets sum to {sum(budgets)}, not budget x layers = {p.budget * num_layers}")
        for layer, b in enumerate(budgets):
            if not p.window < b <= self.trigger:
                raise ValueError(f"layer {layer} would keep {b} tokens per head: it must keep more than the window "
                                 f"({p.window}) and at most budget + buffer ({self.trigger})")
        return budgets

    def layer_widths(self, num_layers: int, kv_heads: int) -> list[int]:
        """Slots per (sequence, KV head) each layer's cache stores between compactions: the
        longest head it may keep (never below `budget`, which every layer holds before its
        first compaction) + `buffer`. The hf cache allocates this plus a scratch slot, and
        `kvflow.kv_memory` counts it."""
        p = self.params
        if not self.varies(num_layers):
            return [p.budget + p.buffer] * num_layers
        return [max(p.budget, self.head_capacity(b, kv_heads)) + p.buffer for b in self.allocation(num_layers)]

    def varies(self, num_layers: int) -> bool:
        """True when kept counts differ across layers or heads (the cache then tracks them)."""
        return self.adaptive_heads or len(set(self.allocation(num_layers))) > 1

    def n_protected(self, prompt_len: int) -> int:
        """Leading slots that are never evicted for a prompt of `prompt_len` cached tokens."""
        if not self.params.protect_prompt:
            return 0
        return max(0, min(prompt_len, self.params.budget - self.params.window - 1))

    def observe(
        self,
        stats: "_torch.Tensor",
        query: "_torch.Tensor",
        keys: "_torch.Tensor",
        mask: "_torch.Tensor",
        *,
        layer_idx: int,
        scaling: float,
    ) -> None:
        """Update the per-token statistic after a forward wrote its keys (only called when
        `observes_attention` is True). Runs on the hot path: tensor ops only, no host syncs.

        stats: [rows, kv_heads, span] float32, a view into the cache's storage: update in place
        query: [rows, q_heads, T, head_dim] the forward's post-RoPE queries (right padded)
        keys:  [rows, kv_heads, span, head_dim] cached keys, the new ones included
        mask:  [rows, T, span] bool, True where query t of the row may attend to the slot
               (padding queries have an all-False row); [rows, kv_heads, T, span] when the
               heads' slots differ (a varying allocation leaves each head a hole of evicted slots)
        scaling: the model's softmax scale (usually 1/sqrt(head_dim))
        """
        raise NotImplementedError

    def score(
        self,
        keys: "_torch.Tensor",
        values: "_torch.Tensor",
        queries: Optional["_torch.Tensor"],
        *,
        layer_idx: int,
        lengths: "_torch.Tensor",
        n_protected: "_torch.Tensor",
        generators: Sequence["_torch.Generator"],
        stats: Optional["_torch.Tensor"] = None,
        **kwargs: Any,
    ) -> "_torch.Tensor":
        """Importance of every cached token; higher is kept.

        keys, values: [rows, kv_heads, N, head_dim], keys after RoPE; slots >= lengths[row] are padding
        queries:      [rows, q_heads, W, head_dim] last W post-RoPE queries, oldest first, the
                      newest being the query of the row's newest cached token (None if
                      query_window == 0). A row has always seen at least `trigger` >= W tokens.
        lengths:      [rows] int64 resident tokens per row
        n_protected:  [rows] int64 leading slots the base class keeps anyway
        generators:   one seeded torch.Generator per row, for stochastic methods; a row must
                      draw the same numbers alone as in any batch (draw over its own length)
        stats:        [rows, kv_heads, N] float32 per-token statistic (observes_attention only)
        returns:      [rows, kv_heads, N] float32. Slots the base class forces (window, protected
                      prompt, padding) may hold anything but NaN.
        """
        raise NotImplementedError

    def ranked_scores(
        self,
        keys: "_torch.Tensor",
        values: "_torch.Tensor",
        queries: Optional["_torch.Tensor"],
        *,
        layer_idx: int,
        lengths: "_torch.Tensor",
        n_protected: "_torch.Tensor",
        generators: Sequence["_torch.Generator"],
        stats: Optional["_torch.Tensor"] = None,
        head_lengths: Optional["_torch.Tensor"] = None,
    ) -> "_torch.Tensor":
        """The scores `select()` ranks: [rows, kv_heads, N] float32, `score()` called as
        `select()` calls it (all heads at once, or one KV head at a time for adaptive evictors),
        before the forced slots and padding are set. For inspection and the evictor contract."""
        rows, kv_heads, n, _ = keys.shape
        if not self.adaptive_heads:
            extra = {"stats": stats} if self.observes_attention else {}
            return self.score(keys, values, queries, layer_idx=layer_idx, lengths=lengths,
                              n_protected=n_protected, generators=generators, **extra).float()
        per_head = lengths[:, None].expand(-1, kv_heads) if head_lengths is None else head_lengths
        g = queries.shape[1] // kv_heads if queries is not None else 0
        return torch.cat([
            self.score(keys[:, h : h + 1], values[:, h : h + 1],
                       queries[:, h * g : (h + 1) * g] if queries is not None else None, layer_idx=layer_idx,
                       lengths=per_head[:, h].contiguous(), n_protected=n_protected, generators=generators,
                       **({"stats": stats[:, h : h + 1]} if self.observes_attention else {})).float()
            for h in range(kv_heads)], dim=1)

    def select(
        self,
        keys: "_torch.Tensor",
        values: "_torch.Tensor",
        queries: Optional["_torch.Tensor"],
        *,
        layer_idx: int,
        lengths: "_torch.Tensor",
        n_protected: "_torch.Tensor",
        generators: Sequence["_torch.Generator"],
        stats: Optional["_torch.Tensor"] = None,
        budget: Optional[int] = None,
        head_lengths: Optional["_torch.Tensor"] = None,
    ) -> "_torch.Tensor":
        """Slots to keep: [rows, kv_heads, budget] int64, ascending (time order): the `budget`
        highest scores, forced slots first; among equal scores the earlier slot is kept.

        budget: this layer's (`layer_budgets()`; default `params.budget`). head_lengths:
        [rows, kv_heads] resident tokens per head, which differ after an adaptive compaction
        (head h's slots >= head_lengths[row, h] are padding). Adaptive evictors score each KV
        head on its own (`score()` with kv_heads = 1, that head's query heads and
        `lengths = head_lengths[:, h]`), so any scorer sees a row's own valid slots, and return
        [rows, kv_heads, head_capacity]: head h's k_h kept slots ascending, then -1 (see
        `kvflow.components.selection.adaptive_keep`).

        Ties: among equal scores the earlier slot is kept (across heads, the lower head), in a
        batch as alone: the kept set depends on the scores only. Scores that tie only in exact
        arithmetic (and differ by rounding) are not ties here: see docs/components.md, "Ties"."""
        rows, kv_heads, n, _ = keys.shape
        budget = self.params.budget if budget is None else budget
        if budget < self.params.budget:  # a smaller layer budget protects what still fits
            n_protected = n_protected.clamp(max=max(0, budget - self.params.window - 1))
        scores = self.ranked_scores(keys, values, queries, layer_idx=layer_idx, lengths=lengths,
                                    n_protected=n_protected, generators=generators, stats=stats,
                                    head_lengths=head_lengths).clone()
        if self.adaptive_heads:
            per_head = lengths[:, None].expand(-1, kv_heads) if head_lengths is None else head_lengths
        else:
            per_head = lengths[:, None]
        slot = torch.arange(n, device=keys.device)[None, None, :]  # [1, 1, N]
        length = per_head.to(keys.device)[:, :, None]  # [rows, kv_heads or 1, 1]
        valid = slot < length
        always = (slot >= length - self.params.window) | (slot < n_protected.to(keys.device)[:, None, None])
        scores = scores.masked_fill(~valid, float("-inf"))
        scores = scores.masked_fill(always & valid, float("inf"))
        # ties: the earlier slot wins (kvflow.components.selection), so that the kept set is a
        # function of the scores alone; torch.topk's order among equal scores is unspecified
        # (it varies with shape, device and torch version: R-KV's topk kept the later slot of
        # SnapKV's tied pairs on a CPU). docs/components.md ("Ties") has the measurements.
        if self.adaptive_heads:
            return adaptive_keep(scores, kv_heads * budget, self.head_capacity(budget, kv_heads),
                                 self.head_floor(budget))
        return keep_top(scores, budget)  # [rows, kv_heads, budget]

    def select_layers(self, num_layers: int, read: Callable[[int], tuple], *, lengths: "_torch.Tensor",
                      n_protected: "_torch.Tensor", generators: Sequence["_torch.Generator"]):
        """`select()` for the same rows in every layer of a compaction, in layer order: yields
        (layer, keep [rows, kv_heads, budget], read(layer)), so that the caller writes each
        layer's kept slots from the tensors it read.

        read(layer) -> (keys, values, queries, stats) as `select()` takes them (queries and
        stats may be None). An evictor whose layers keep the same budget and score alike
        (`scores_layers_alike`) has consecutive layers scored in one call, stacked on the rows
        axis, as many as keep the call's largest intermediate under `STACK_BYTES`; any other
        is called once per layer, its `generators` drawn layer after layer. The kept slots are
        the same either way (rows are scored independently: `select()`'s contract). Why: on a
        CPU a compaction of a few rows is per-op overhead times the layers (R-KV: ~0.6 ms of
        ~100 small ops per layer on two cores, ~0.15 ms per layer stacked; docs/benchmarks.md)."""
        rows = int(lengths.shape[0])
        per_call, pending = 1, {}
        if scores_layers_alike(self) and not self.varies(num_layers):
            pending[0] = read(0)  # its shape sizes the stacked calls
            _, kv_heads, n, d = pending[0][0].shape
            per_call = max(1, self.STACK_BYTES // (rows * kv_heads * n * max(n, d) * 4))
        for start in range(0, num_layers, per_call):
            layers = range(start, min(start + per_call, num_layers))
            got = [pending.pop(layer, None) or read(layer) for layer in layers]
            if len(got) == 1:
                keys, values, queries, stats = got[0]
                keep = self.select(keys, values, queries, layer_idx=start, lengths=lengths,
                                   n_protected=n_protected, generators=generators, stats=stats)
            else:  # [k x rows, ...]: layer i's rows at [i x rows, (i + 1) x rows)
                k = len(got)
                cat = lambda i: torch.cat([g[i] for g in got]) if got[0][i] is not None else None  # noqa: E731
                keep = self.select(cat(0), cat(1), cat(2), layer_idx=start, lengths=lengths.repeat(k),
                                   n_protected=n_protected.repeat(k), generators=list(generators) * k, stats=cat(3))
            for i, layer in enumerate(layers):
                yield layer, keep[i * rows: (i + 1) * rows], got[i]


def scores_layers_alike(evictor: "Evictor") -> bool:
    """Whether a compaction may score several layers' rows of this evictor in one `select()`
    call: its class declares `layer_invariant` and no class below that declaration overrides
    `score()`, `ranked_scores()` or `select()` (an override may read `layer_idx` or draw from
    `generators`)."""
    for klass in type(evictor).__mro__:
        if "layer_invariant" in vars(klass):
            return bool(evictor.layer_invariant)
        if any(name in vars(klass) for name in ("score", "ranked_scores", "select")):
            return False
    return False


def observed_statistic(evictor: "Evictor") -> Optional[str]:
    """The standard statistic `evictor.observe()` computes (`Evictor.observed_statistic`), where
    the class that declares it is also the one whose `observe()` runs; else None."""
    for klass in type(evictor).__mro__:
        if "observed_statistic" in vars(klass):
            return klass.observed_statistic if type(evictor).observe is klass.observe else None
    return None


# --------------------------------------------------------------------------- pruners


class Pruner:
    """Base class of online degeneration detectors: `check()` runs after every decoded token
    of every live candidate row of the proposers it is attached to.

    "Live" means not ended: after each token an engine applies its stop rules first (EOS, the
    delimiter, the step's token cap), and a row that ends on this token is not shown to the
    pruners (its finish is the stop rule's); the rows still going are, and those flagged stop
    at once, with finish `pruned:<name>`. Rows leave the trace as they end, in any order, so
    a pruner decides from the trace alone (`kvflow.testing.pruner_contract`).
    """

    Params: ClassVar[type[PrunerParams]] = PrunerParams
    #: name of the per-token signal `signal()` returns, recorded for `kvflow calibrate`.
    signal_name: ClassVar[str] = ""
    #: False: `check()` and `signal()` never read `trace.texts`, so an engine may skip
    #: decoding the candidates' texts for them (the `hf` engine then does; added in kvflow 0.1).
    needs_text: ClassVar[bool] = True
    #: the `StepTrace` fields added after kvflow's first engine protocol that `check()` or
    #: `signal()` reads (`"logprobs"`, `"confidences"`: engine protocol 0.2): on an engine of an
    #: older protocol, which does not fill them, the pipeline is refused before it decodes,
    #: naming the pruner (`kvflow.components.engine.protocol_problem`; added with engine protocol 0.2).
    trace_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: PrunerParams) -> None:
        """kvflow builds one pruner per proposer as `Pruner(params)`, `params` its validated
        `Params` (kept as `self.params`); a verdict must come from the trace alone."""
        self.params = params

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard(cls, "Pruner")  # a wrong return value raises kvflow.faults.ComponentFault, naming the component

    def signal(self, trace: StepTrace) -> "_torch.Tensor":
        """Optional. Current value of the detector's signal per row: [rows] float32 (nan
        before warm-up). With `run.record_signals` the engine calls it on the same trace as
        `check()`, and each candidate's `signals[name]` lists the values of the tokens at
        which it was live. A pruner that does not override it still runs with signals
        recorded: it records nothing (`has_signal`), and the run warns once."""
        raise NotImplementedError

    def check(self, trace: StepTrace) -> "_torch.Tensor":
        """Required. Rows to stop now: [rows] bool."""
        raise NotImplementedError

    @classmethod
    def has_signal(cls) -> bool:
        """True when the class overrides `signal()` (the one optional method of a pruner)."""
        return cls.signal is not Pruner.signal


# --------------------------------------------------------------------------- scorers


@dataclass
class ScorerContext:
    """What a scorer may use at run time.

    load_session(model_key) returns a backend scoring session for `models.<model_key>`
    (full context); proposers lists the pipeline's proposer names in order; seed is the run seed;
    models maps each `models` key to its ModelConfig, for scorers that load a checkpoint their
    own way (a PRM with a classification head is not a causal LM).
    """

    load_session: Callable[[str], Any]
    proposers: Sequence[str]
    seed: int
    delimiter: str = "\n\n"
    models: Mapping[str, Any] = field(default_factory=dict)


class Scorer:
    """Base class of scorers: `score()` gets every surviving candidate of a round, batched.

    kvflow builds one scorer per run as `Scorer(params, context)`: `params` its validated
    `Params`, `context` a `ScorerContext` (scoring sessions by model key, the proposer
    names, the run's seed). A subclass that takes more in `__init__` still accepts these two.
    """

    Params: ClassVar[type[ScorerParams]] = ScorerParams

    def __init__(self, params: ScorerParams, context: ScorerContext) -> None:
        """Keep `params` as `self.params` and `context` as `self.context`."""
        self.params = params
        self.context = context

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard(cls, "Scorer")  # a wrong return value raises kvflow.faults.ComponentFault, naming the component

    @classmethod
    def models_needed(cls, params: ScorerParams) -> list[str]:
        """Keys of `models` this scorer loads (checked at compile time)."""
        return []

    def can_score(self, proposer: str) -> bool:
        """Whether this scorer scores the candidates of `proposer` (default: every one). The
        others are not sent to `score()` and keep the score None."""
        return True

    def score(self, requests: Sequence[ScoreRequest]) -> list[float]:
        """Required. One score per request, in request order: higher is better.

        Called once per round with every surviving (unpruned) candidate of every problem that
        has more than one (a lone candidate is committed unscored), from proposers for which
        `can_score()` is True; problems are mixed in one batch, so read a candidate's problem
        from `request.trajectory`. Return a list of floats of `len(requests)` (an empty list
        for none); a wrong type or length stops the run naming the scorer
        (`kvflow.faults`). A score must be finite for a non-empty candidate; `nan` or `-inf`
        may mark one that cannot be scored (an empty step), and the committer ranks it below
        every scored candidate. Scores must not depend on the batch or its order.
        """
        raise NotImplementedError

    def release(self, problem_ids: Sequence[str]) -> None:
        """Problems that finished: drop any per-problem state."""


# --------------------------------------------------------------------------- committers


class Committer:
    """Base class of committers: picks one candidate per problem from scored candidates.

    kvflow builds one committer per run as `Committer(params, proposers)`: `params` its
    validated `Params`, `proposers` the pipeline's proposer names in order (the first is the
    base, whatever it is called).
    """

    Params: ClassVar[type[CommitterParams]] = CommitterParams

    def __init__(self, params: CommitterParams, proposers: Sequence[str]) -> None:
        """Keep `params` as `self.params` and the proposer names as the list `self.proposers`."""
        self.params = params
        self.proposers = list(proposers)  # pipeline order: the first is the base

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard(cls, "Committer")  # a wrong return value raises kvflow.faults.ComponentFault, naming the component

    def pick(self, candidates: Sequence[Candidate]) -> int:
        """Required. The index into `candidates` of the step to commit.

        Called once per problem per round with that problem's candidates in proposer order
        (pipeline order, then candidate index): the unpruned ones, or all of them when every
        one was pruned and `limits.on_all_pruned` is `fallback`. Also called with a single
        candidate (return 0) and with candidates of one proposer only.

        Scores (`candidate.score`) may be:

        - **None**: not scored, because the scorer does not score that proposer
          (`Scorer.can_score`) or the problem had a single candidate;
        - **nan** or **-inf**: the scorer could not score it (an empty step, say);
        - a finite float: higher is better.

        A committer must return a valid index whatever the scores are, with no candidate
        scored too, and should rank None and nan below every scored candidate (the built-in
        `best` ranks them below even -inf, and breaks ties by proposer order, then index).
        Return an `int` in `range(len(candidates))`; anything else stops the run naming the
        committer (`kvflow.faults`). Do not change the candidates, and keep no state that
        changes a later pick (the committer contract checks both).
        """
        raise NotImplementedError
