"""`none`: full KV cache, no eviction. The baseline for "full" rows."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvflow.components.base import Evictor, EvictorParams


class NoEvictionParams(EvictorParams):
    budget: int = Field(0, ge=0, description="Unused: a full cache keeps every token.")
    buffer: int = Field(0, ge=0, description="Unused.")
    window: int = Field(0, ge=0, description="Unused.")

    @model_validator(mode="after")
    def _nothing_to_budget(self):
        if self.budget_bytes is not None or self.quantize is not None or self.allocation is not None:
            raise ValueError("`none` keeps every token at full precision: budget_bytes, quantize and allocation "
                             "need an evicting method (e.g. kind: snapkv)")
        return self


class NoEviction(Evictor):
    """Full KV cache: keeps every token; the cache grows with the sequence."""

    Params = NoEvictionParams
    bounded = False

    @property
    def trigger(self) -> int:
        return 2**62

    def score(self, keys, values, queries, *, layer_idx, lengths, generators, **kwargs):  # pragma: no cover
        raise RuntimeError("NoEviction never compacts")
