"""The components' parameter models: frozen pydantic models, unknown keys rejected.

A component's `Params` subclasses one of these; kvflow validates a pipeline's parameters
against it (`kvflow validate`), and docs/components.md's tables are generated from the fields'
descriptions. Re-exported by `kvflow.components.base`, the import path plugins use.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Params(BaseModel):
    """Base of every component's parameter model: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- evictors


class QuantizeParams(Params):
    """KIVI-style quantization of the kept cache (BreadthKV; docs/memory.md): keys per channel
    (a scale and zero point per channel for each group of `group_size` tokens), values per
    token (a scale and zero point per group of `group_size` channels), packed `bits`-bit
    integers; the newest tokens stay at full precision. See `kvflow.backends.hf.quant`."""

    bits: Literal[2, 3, 4, 8] = Field(4, description="Bits per quantized key/value element.")
    group_size: int = Field(32, ge=1, description="Tokens per key group (per-channel scales) and channels per "
                                                  "value group (per-token scales); must divide head_dim.")
    residual: int = Field(16, ge=0, description="Newest kept tokens held at full precision (at least; the "
                                                "quantized part is a whole number of key groups).")


class AdaKVAllocation(Params):
    """Ada-KV's head-adaptive budgets around any scorer (kvpress's `AdaKVPress`; Feng et al. 2024,
    arXiv 2407.11550): a layer's `kv_heads x budget` tokens are spent across its KV heads by one
    ranking of the scorer's scores (`kvflow.components.selection.adaptive_keep`), each head
    keeping at least `safeguard x budget`. The scores must be comparable across heads."""

    kind: Literal["adakv"] = Field(description="Ada-KV's head-adaptive budgets.")
    safeguard: float = Field(0.2, ge=0.0, le=1.0, description="Every head keeps at least α × the layer budget "
                                                              "(Ada-KV's α, 0.2 in the paper's code and kvpress).")
    head_cap: Optional[float] = Field(
        None, ge=1.0, description="Most tokens one head may keep, in multiples of the layer budget (the cache "
        "stores this many per head). null: as many as the safeguard leaves, kv_heads - (kv_heads - 1) α.")


class PyramidAllocation(Params):
    """PyramidKV's per-layer budgets around any scorer (kvpress's `PyramidKVPress`; Cai et al.
    2024, arXiv 2406.02069): lower layers keep more, higher ones fewer, in an arithmetic
    sequence with the same total (`kvflow.components.allocation.pyramid_budgets`)."""

    kind: Literal["pyramid"] = Field(description="PyramidKV's per-layer budgets.")
    beta: float = Field(20.0, ge=1.0, description="PyramidKV's β: the top layer keeps (budget - window) / β "
                                                  "besides the window, the first layer about twice the mean.")


#: how an evictor's budget is spread over layers and heads; null: `budget` for every (layer, KV head)
Allocation = Annotated[Union[AdaKVAllocation, PyramidAllocation], Field(discriminator="kind")]


class EvictorParams(Params):
    budget: int = Field(64, ge=1, description="Tokens kept per (layer, KV head) after a compaction.")
    buffer: int = Field(128, ge=1, description="Tokens appended between compactions; the peak is budget + buffer.")
    window: int = Field(8, ge=0, description="Most recent tokens always kept (inside the budget).")
    protect_prompt: bool = Field(False, description="Keep the prompt (inside the budget, leaving at least one free slot).")
    budget_bytes: Optional[int] = Field(
        None, ge=1, description="Instead of `budget`: bytes of keys and values one sequence keeps after a "
        "compaction (all layers; scales and zero points included when quantized). Converted to the largest "
        "token budget that fits, from the model's shape and dtype, when the run starts.")
    quantize: Optional[QuantizeParams] = Field(
        None, description="Store the kept tokens quantized (BreadthKV / KIVI style); null keeps full precision.")
    allocation: Optional[Allocation] = Field(
        None, description="Spread the budget over heads ({kind: adakv, safeguard}) or layers ({kind: pyramid, "
        "beta}) around this evictor's scores, as kvpress's AdaKVPress / PyramidKVPress wrap a press; null: "
        "`budget` for every (layer, KV head).")

    @model_validator(mode="after")
    def _window_inside_budget(self):
        if self.budget_bytes is not None:
            if "budget" in self.model_fields_set:
                raise ValueError("give either budget (tokens) or budget_bytes, not both")
            return self  # the window is checked again once budget_bytes is converted to tokens
        if self.budget and self.window >= self.budget:
            raise ValueError(f"window ({self.window}) must be smaller than budget ({self.budget}): the recent "
                             "window is kept inside the budget")
        if self.allocation is not None and self.allocation.kind == "adakv" and self.quantize is not None:
            raise ValueError("quantize does not combine with budgets that vary by head yet (the quantized store "
                             "splits a layer's heads alike); use allocation {kind: pyramid} or none")
        q = self.quantize if self.budget else None  # budget 0: `none`, which rejects quantize itself
        if q is not None and q.residual + q.group_size > self.budget:
            raise ValueError(f"quantize.residual ({q.residual}) + quantize.group_size ({q.group_size}) must not "
                             f"exceed budget ({self.budget}): nothing would be quantized")
        if q is not None and self.buffer < q.group_size:
            raise ValueError(f"buffer ({self.buffer}) must be at least quantize.group_size ({q.group_size}): "
                             "tokens leave the full-precision region a whole key group at a time")
        return self

    def with_budget(self, budget: int) -> "EvictorParams":
        """The same parameters with a token budget in place of `budget_bytes` (validated again)."""
        data = self.model_dump(exclude_unset=True)
        data.pop("budget_bytes", None)
        data["budget"] = budget
        return type(self).model_validate(data)


# --------------------------------------------------------------------------- pruners, scorers, committers


class PrunerParams(Params):
    """Base of pruner parameters. Every detector has a `threshold` (no default here: each
    detector's signal has its own scale), a `window` and `min_tokens`; a subclass redefines a
    field to give it its own default and a description in the detector's terms."""

    window: int = Field(32, ge=1, description="Newest tokens (or text units) the detector's signal is computed "
                                              "over; a detector that needs no window ignores it.")
    threshold: float = Field(description="Value of the detector's signal at which a candidate is stopped "
                                         "(above or below it, as the detector says).")
    min_tokens: int = Field(32, ge=0, description="No check before a candidate has this many tokens.")


class ScorerParams(Params):
    """Base of scorer parameters. A scorer that combines per-step scores declares its own
    `aggregate` (e.g. `prm`); elsewhere the key is rejected, since it would mean nothing."""


class CommitterParams(Params):
    pass
