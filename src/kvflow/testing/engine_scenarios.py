"""The scenarios of kvflow's engine contract (`engine_contract.py`): its questions and texts,
the pruners it stops rows with, the evictors it runs and `run_to_end`, which engines' own tests
use too."""

from __future__ import annotations

from kvflow.components.base import Pruner, PrunerParams
from kvflow.components.engine import Engine

QUESTIONS = ["How many clips did Natalia sell?", "Natalia sold 48 clips in April. How many in May?",
             "What is 48 / 2 + 24?"]
NO_DELIMITER = "\x00\x01\x02"  # never produced: steps end at max_step_tokens or EOS
FINISHES = {"eos", "delimiter", "max_step_tokens"}
#: committed steps whose joined text tokenizes differently ("cl" + "ips" vs "clips"): a
#: scoring session must tokenize the context step by step, as the proposers' caches hold it
SCORED_STEPS = ["In May she sold 48 / 2 = 24 cl", "ips.\n\n"]
SCORED_TEXTS = ["Altogether she sold 48 + 24 = 72 clips.\n\n", "The answer is \\boxed{72}."]
#: top-p nucleus tolerance: probability mass by which the reference's and the engine's float
#: rounding may move a token across the nucleus boundary (flat tiny models: ~1e-5 per token)
NUCLEUS_SLACK = 1e-3


class StopAt(Pruner):
    """Flags every row once it has `threshold` tokens; records what it saw (engines' own tests use it too)."""

    Params = PrunerParams
    needs_text = False

    def __init__(self, at: int) -> None:
        super().__init__(PrunerParams(threshold=at))
        self.seen: list[list[int]] = []

    def signal(self, trace):
        return trace.n_tokens.float()

    def check(self, trace):
        self.seen.append(trace.n_tokens.tolist())
        return trace.n_tokens >= int(self.params.threshold)


class _Probe(Pruner):
    """Flags nothing; its signal reads the trace's `what` (entropies, texts or token counts)."""

    Params = PrunerParams

    def __init__(self, what: str) -> None:
        super().__init__(PrunerParams(threshold=0))
        self.what = what

    def signal(self, trace):
        import torch

        n = trace.n_tokens
        if self.what == "entropy":  # the sum of the row's entropies so far
            valid = torch.arange(trace.entropies.shape[1])[None, :] < n[:, None]
            return (trace.entropies.float() * valid).sum(-1)
        if self.what == "text":
            return torch.tensor([float(len(t)) for t in trace.texts])
        return n.float()

    def check(self, trace):
        import torch

        return torch.zeros(len(trace.n_tokens), dtype=torch.bool)


def full_cache():
    """The `none` evictor: a full cache (engines' own tests use it too)."""
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", "none")
    return cls(cls.Params())


def _evicting(budget: int):
    from kvflow.registry import get_registry

    cls = get_registry().get("evictors", "random")
    return cls(cls.Params(budget=budget, buffer=16, window=4))


def run_to_end(engine: Engine, requests, max_rows=None, on_step=None) -> list:
    """Submit requests and step until each has ended: their Proposals, in request order.
    on_step(proposals that ended) is called after every `step()`."""
    engine.submit(requests)
    done = {}
    for _ in range(100_000):
        ended = engine.step(max_rows)
        if on_step is not None:
            on_step(ended)
        for p in ended:
            done[id(p.request)] = p
        if len(done) == len(requests):
            return [done[id(r)] for r in requests]
    raise AssertionError("proposals did not end")
