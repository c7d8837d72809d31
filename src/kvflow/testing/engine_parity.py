"""One evictor on every engine: the same greedy steps, log-probabilities and kept keys as `hf`.

The evictor contract (`kvflow.testing.evictor_contract`) runs `assert_same_as_hf` for every
registered backend that evicts (`evicts = True`, `hf` being the reference), so a built-in or
third-party evictor is checked on each engine it may run on. Usable on its own too:

    from kvflow.testing.engine_parity import assert_same_as_hf
    assert_same_as_hf("sglang", MyEvictor(MyEvictor.Params(budget=16, buffer=8, window=4)))

The scenario, on one tiny random-weight Qwen2 (float32, greedy, shared by every caller in the
process, so an SGLang engine starts once): a chat prompt, four steps of two candidates that
run to the step cap (several compactions each), adopting candidate 0, then candidate 1, then
ingesting candidate 0's text twice (another proposer's path). Compared with `hf`: every
candidate's tokens and finish, log-probabilities within 1e-4, and the final state's kept keys
and values per (layer, KV head) and its compaction count (`engine.kept_kv(state)`: keys[l][h]
in time order, so budgets that vary by layer or head compare too, whatever each engine's
layout), and for an evictor that observes attention on an engine that shows it
(`engine.kept_statistic(state)`: hf and vLLM), the kept slots' statistic within 1e-4.

Ties that hold only in exact arithmetic (docs/components.md, "Ties": the key norms of one token
at two positions) are broken by rounding, and another engine's kernels round differently (vLLM's
fused QKV projection and rotary kernel): from such a compaction on, the two engines may keep
different tokens, and nothing after it is compared. A difference is accepted only where `hf`'s
own run met such a near-tie (a kept score above an evicted one of a (layer, head) by at most
`NEAR_TIE` of their magnitude, `Evictor.ranked_scores`; equal scores, such as max pooling's
plateaus, are equal on every engine and are not near-ties) at a compaction no later than the
step that differs; any other difference fails.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from kvflow.backends.base import backend_named

#: the backend every other is compared with: transformers' own forward, kvflow's reference
REFERENCE = "hf"


def compared_backends(*, evicting: bool = False) -> list[str]:
    """The registered backends compared with the reference (`evicting`: those that evict)."""
    from kvflow.registry import get_registry

    names = [n for n in get_registry().names("backends") if n != REFERENCE]
    return [n for n in names if backend_named(n).evicts] if evicting else names

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
NEVER = "\x00\x01"  # a delimiter the tiny model never writes: steps run to the cap


@functools.lru_cache(maxsize=None)
def shared_model_dir(arch: str = "qwen2", seed: int = 3) -> Path:
    """A tiny model directory per (arch, seed) for this process (one SGLang engine per model)."""
    from kvflow.testing.pipelines import tiny_model_dir

    return tiny_model_dir(Path(tempfile.mkdtemp(prefix="kvflow-parity-")), arch, seed=seed)


def contract_arch(backend: str) -> str:
    """The tiny architecture (a key of `kvflow.testing.models.ARCHITECTURES`) the contract suites
    run `backend` on: the backend's optional `contract_arch` attribute, else "qwen2" (an engine
    whose kernels do not serve the smallest shapes names a larger one: vLLM's CPU attention
    takes head_dim 32 and up)."""

    return backend_named(backend).contract_arch


def backend_model_dir(backend: str) -> Path:
    """The shared tiny model `backend` is compared with `hf` on (`contract_arch`, seed 3)."""
    return shared_model_dir(contract_arch(backend), seed=3)


def load_engine(backend: str, model_dir: Path | None = None):
    """The engine of `backend` on the shared tiny model (float32, CPU; `backend_model_dir` by
    default); pytest skips when the backend cannot run here (its own `check()` says why)."""
    import pytest

    from kvflow.config.schema import ModelConfig

    loader = backend_named(backend)
    cfg = ModelConfig(backend=backend, id=str(model_dir or backend_model_dir(backend)), dtype="float32", device="cpu")
    why = loader.check(cfg)
    if why:
        pytest.skip(f"backend {backend!r} cannot run here: {why[1] if isinstance(why, tuple) else why}")
    return loader.load(cfg)


def chat_prompt(engine) -> str:
    """The scenario's prompt: one GSM8K-style question in the engine's chat template."""
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                add_generation_prompt=True)


def greedy_steps(engine, evictor, *, rng_key: int = 7, n_steps: int = 4, max_step_tokens: int = 30,
                 on_step=None):
    """The scenario of the module docstring. Returns ([per step: [(tokens, finish, logprobs)]],
    the final state). `on_step()` is called after each step's proposal."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest, SyncRequest
    from kvflow.testing.engine_contract import run_to_end

    spec = SamplingSpec(2, 0.0, 1.0, max_step_tokens, NEVER)
    (state,) = engine.start([StartRequest(chat_prompt(engine), evictor, rng_key)])
    steps = []
    for k in range(n_steps):
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, k, 400)])
        steps.append([(c.token_ids, c.finish, c.logprobs) for c in p.candidates])
        if on_step is not None:
            on_step()
        (state,) = engine.sync([SyncRequest(state, p, k if k < 2 else None, p.candidates[0].text)])
    return steps, state


#: relative gap between the lowest kept and the highest evicted score of a (layer, KV head) at
#: or under which a compaction is a near-tie another engine's rounding may break the other way
NEAR_TIE = 1e-6


def _recording(evictor):
    """A copy of `evictor` whose select() calls record each row's smallest margin between kept
    and evicted scores, relative to its largest score: (the copy, the list of margins)."""
    import torch

    from kvflow.testing.evictor_decode import row_record, scores_of

    margins: list[float] = []
    base = type(evictor)

    class Recording(base):
        def select(self, keys, values, queries, **kw):
            states = [g.get_state() for g in kw.get("generators") or []]
            keep = super().select(keys, values, queries, **kw)
            record = {"keys": keys, "values": values, "queries": queries, "gen_states": states, "keep": keep,
                      **{k: v for k, v in kw.items() if k != "generators"}}
            for i in range(keys.shape[0]):
                scores, valid = scores_of(evictor, row_record(record, i))
                kept = torch.zeros_like(valid)
                idx = keep[i]
                kept.scatter_(1, idx.clamp(min=0).long(), idx >= 0)
                margin = float("inf")
                for h in range(scores.shape[0]):
                    a, b = scores[h][valid[h] & kept[h]], scores[h][valid[h] & ~kept[h]]
                    if len(a) and len(b):
                        margin = min(margin, _fragile_gap(a, b))
                margins.append(margin)
            return keep

    Recording.__name__ = Recording.__qualname__ = base.__name__
    copy = Recording.__new__(Recording)
    copy.__dict__.update(evictor.__dict__)
    return copy, margins


def _fragile_gap(kept, evicted) -> float:
    """The smallest positive difference between a kept and an evicted score, relative to the
    larger of the two (inf: none). Equal
    scores are not fragile: a plateau (max pooling) is equal on every engine, and the earlier
    slot wins it; nor are scores that differ only below float32's smallest normal number
    (underflowed probabilities); a kept score just above an evicted one is, for rounding can swap them."""
    import torch

    tiny = torch.finfo(torch.float32).tiny  # differences below it are underflow (exp of very negative logits): equal
    top = float(evicted.max())
    above = kept[kept - top > tiny]
    low = float(kept.min())
    below = evicted[low - evicted > tiny]

    def relative(a: float, b: float) -> float:  # rounding noise scales with the two scores themselves
        return (a - b) / max(abs(a), abs(b))

    return min(relative(float(above.min()), top) if len(above) else float("inf"),
               relative(low, float(below.max())) if len(below) else float("inf"))


def assert_same_as_hf(backend: str, evictor: Any, tmp_dir: Path | None = None) -> None:
    """`backend` runs the scenario exactly as `hf` does with this evictor (see the module
    docstring); an AssertionError says what differed."""
    import torch

    reference, other = load_engine("hf", backend_model_dir(backend)), load_engine(backend)
    if hasattr(other, "dump_dir"):  # the engine keeps its states elsewhere: have them saved for kept_kv
        other.dump_dir = str(tmp_dir or tempfile.mkdtemp(prefix="kvflow-parity-kv-"))
    recording, margins = _recording(evictor)
    marks: list[int] = []  # compactions hf had made by the end of each step's proposal
    try:
        want, want_state = greedy_steps(reference, recording, on_step=lambda: marks.append(len(margins)))
        got, got_state = greedy_steps(other, evictor)
        near_tie = [any(m <= NEAR_TIE for m in margins[:end]) for end in marks]
        for k, (a, b) in enumerate(zip(want, got)):
            same = [(t, f) for t, f, _ in b] == [(t, f) for t, f, _ in a] and all(
                max((abs(u - v) for u, v in zip(x[2], y[2])), default=0.0) < 1e-4 for x, y in zip(a, b))
            if same:
                continue
            if near_tie[k]:
                return  # a near-tie of hf's run was broken the other way: nothing after it is compared
            assert [(t, f) for t, f, _ in b] == [(t, f) for t, f, _ in a], f"step {k}: tokens differ from hf's"
            raise AssertionError(f"step {k}: log-probabilities differ from hf's")
        keys_a, values_a, compactions_a = reference.kept_kv(want_state)
        keys_b, values_b, compactions_b = other.kept_kv(got_state)
        assert compactions_a > 0, "the scenario never compacted: nothing was compared"
        assert compactions_b == compactions_a, f"compactions: {compactions_b} on {backend}, {compactions_a} on hf"
        try:
            torch.testing.assert_close(keys_b, keys_a, atol=1e-4, rtol=1e-4, msg=lambda m: f"kept keys differ: {m}")
            torch.testing.assert_close(values_b, values_a, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"kept values differ: {m}")
        except AssertionError:
            if not (near_tie and near_tie[-1]):
                raise
        if evictor.observes_attention and hasattr(other, "kept_statistic") and not (near_tie and near_tie[-1]):
            # the statistic itself (H2O's): kept keys alone can miss a wrong one, for a random
            # model's accumulated attention ranks tokens by age whatever each step adds
            for layer, (a, b) in enumerate(zip(other.kept_statistic(got_state), reference.kept_statistic(want_state),
                                               strict=True)):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, layer=layer: f"layer {layer}'s kept statistic differs: {m}")
        other.release([got_state])
    finally:
        if hasattr(other, "dump_dir"):
            other.dump_dir = None


# --------------------------------------------------------------------------- pruners


def _field_probe(field_name: str):
    """A pruner that flags nothing; its signal is the trace's `field_name` at each row's newest token."""
    import torch

    from kvflow.components.base import Pruner, PrunerParams

    class _Field(Pruner):
        Params = PrunerParams
        needs_text = False

        def __init__(self) -> None:
            super().__init__(PrunerParams(threshold=0))

        def signal(self, trace):
            values = getattr(trace, field_name)  # [rows, T]
            assert values is not None, f"the engine's StepTrace has no {field_name}"
            return values.float().gather(1, (trace.n_tokens - 1)[:, None].to(values.device))[:, 0].cpu()

        def check(self, trace):
            return torch.zeros(len(trace.n_tokens), dtype=torch.bool)

    return _Field()


PROBES = ("logprobs", "confidences")
PRUNER_PROMPTS = (QUESTION, "What is 48 / 2 + 24? Explain each step.")


def pruned_greedy(engine, name: str, pruner: Any, *, max_step_tokens: int = 48) -> list:
    """One greedy candidate per prompt of PRUNER_PROMPTS through `pruner` (named `name`) and
    the field probes (`PROBES`, recorded as `probe:<field>`), signals recorded."""
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.registry import get_registry
    from kvflow.testing.engine_contract import run_to_end

    none = get_registry().get("evictors", "none")
    pruners = ((name, pruner),) + tuple((f"probe:{f}", _field_probe(f)) for f in PROBES)
    spec = SamplingSpec(1, 0.0, 1.0, max_step_tokens, NEVER, pruners=pruners, record_signals=True)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                     add_generation_prompt=True) for q in PRUNER_PROMPTS]
    states = engine.start([StartRequest(p, none(none.Params()), 7) for p in prompts])
    proposals = run_to_end(engine, [ProposeRequest(s, "base", spec, 0, 400) for s in states])
    engine.release(states, proposals)
    return [p.candidates[0] for p in proposals]


def _close(a: float, b: float, tol: float) -> bool:
    return (a != a and b != b) or abs(a - b) <= tol  # nan equals nan (before warm-up)


def assert_pruner_same_as_hf(backend: str, name: str, make_pruner, tol: float = 1e-4) -> None:
    """The pruner on `backend` sees and records what it does on `hf` (greedy, the shared tiny
    model; `make_pruner()` gives a fresh pruner per engine): the trace's log-probabilities and
    confidences at every live token within `tol`; its own signal within `tol` (on an engine
    whose entropies are estimates, `exact_entropy = False`, compared with the signal of hf's
    trace given that engine's entropies); where the signals agree, the same tokens and finish."""
    import torch

    from kvflow.components.base import StepTrace

    reference, other = load_engine("hf", backend_model_dir(backend)), load_engine(backend)
    want = pruned_greedy(reference, name, make_pruner())
    got = pruned_greedy(other, name, make_pruner())
    pruner = make_pruner()
    records = pruner.has_signal() if hasattr(pruner, "has_signal") else True
    for i, (a, b) in enumerate(zip(want, got)):
        live = min(len(a.signals["probe:confidences"]), len(b.signals["probe:confidences"]))
        assert live, f"prompt {i}: no live token recorded"
        assert b.token_ids[:live] == a.token_ids[:live], f"prompt {i}: greedy tokens differ from hf's"
        for f in PROBES:
            x, y = a.signals[f"probe:{f}"][:live], b.signals[f"probe:{f}"][:live]
            bad = [k for k in range(live) if not _close(x[k], y[k], tol)]
            assert not bad, (f"prompt {i}: StepTrace.{f} differs from hf's at token {bad[0] + 1}: "
                             f"{y[bad[0]]} on {backend}, {x[bad[0]]} on hf")
            for c in (a, b):
                assert all(_close(u, v, tol) for u, v in zip(getattr(c, f), c.signals[f"probe:{f}"])), (
                    f"prompt {i}: Candidate.{f} is not what the StepTrace showed")
        if not records:
            assert name not in a.signals and name not in b.signals, (
                f"pruner {name!r} has no signal(), yet a signal was recorded for it")
            agree = other.exact_entropy  # its verdicts may read estimated entropies
        else:
            x, y = a.signals[name][:live], b.signals[name][:live]
            if other.exact_entropy:
                expect = x
            else:  # hf's trace (tokens, texts, logprobs, confidences) with the other engine's entropies
                pieces = [reference.tokenizer.decode([t]) for t in a.token_ids]
                expect = [float(pruner.signal(StepTrace(
                    torch.tensor([b.entropies[: k + 1]]), torch.tensor([k + 1]), ["".join(pieces[: k + 1])],
                    logprobs=torch.tensor([a.logprobs[: k + 1]]), confidences=torch.tensor([a.confidences[: k + 1]])
                ))[0]) for k in range(live)]
            bad = [k for k in range(live) if not _close(expect[k], y[k], tol)]
            assert not bad, (f"prompt {i}: {name!r}'s signal differs from hf's at token {bad[0] + 1}: {y[bad[0]]} "
                             f"on {backend}, {expect[bad[0]]} expected")
            agree = all(_close(u, v, tol) for u, v in zip(x, y))
        if agree:
            assert (b.token_ids, b.finish) == (a.token_ids, a.finish), (
                f"prompt {i}: on {backend} the candidate ended {b.finish!r} after {b.n_tokens} tokens, on hf "
                f"{a.finish!r} after {a.n_tokens}, with the same signals")
