"""Batch-invariant mode (`run.deterministic`) on `hf`: a row's bits do not depend on its batch.

A tiny random Qwen2 wide enough for the matrix kernels to block by rows, in bfloat16 (where
a last-bit difference flips sampled tokens): with the mode off a row's logits differ alone and
batched (the control: else these tests could not fail); with it on they are equal bit for bit
alone and among 1, 3 and 8 others, through prefill, decode, compaction, an observing evictor
(H2O), a per-layer allocation and a quantized cache; and so are whole trajectories, sampled and greedy, evicted
and full; and on a catalog checkpoint through `kvflow run`.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from kvflow.backends.hf import invariant
from kvflow.backends.hf.engine import HFRunner
from kvflow.testing import models as testing_models
from kvflow.testing import tiny_pipeline, tiny_tokenizer

PROMPTS = ["How many clips did Natalia sell in April and May?", "What is 7 * 8?", "Half of 90?",
           "Tom has 3 apples and buys 5 more. How many apples does he have now?", "What is 100 - 37?",
           "Natalia sold 48 clips in April.", "What is 24 + 48?", "A train leaves at 3 pm. When?",
           "Write 12 in binary."]
WIDE = ("Qwen2Config", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=512, intermediate_size=1536))


@pytest.fixture(scope="module")
def runner():
    testing_models.ARCHITECTURES.setdefault("qwen2-wide", WIDE)
    return HFRunner(testing_models.tiny_model("qwen2-wide", seed=1, num_layers=2, dtype="bfloat16"),
                    tiny_tokenizer())


@contextlib.contextmanager
def mode(on: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def evictor(kind: str):
    from kvflow.components.params import PyramidAllocation, QuantizeParams
    from kvflow_builtin.evictors.breadthkv import BreadthKVEvictor
    from kvflow_builtin.evictors.h2o import H2OEvictor
    from kvflow_builtin.evictors.none import NoEviction
    from kvflow_builtin.evictors.random import RandomEvictor
    from kvflow_builtin.evictors.snapkv import SnapKVEvictor

    return {"none": lambda: NoEviction(NoEviction.Params()),
            "random": lambda: RandomEvictor(RandomEvictor.Params(budget=12, buffer=4, window=2)),
            "h2o": lambda: H2OEvictor(H2OEvictor.Params(budget=12, buffer=4)),
            "snapkv+pyramid": lambda: SnapKVEvictor(SnapKVEvictor.Params(
                budget=12, buffer=4, window=2, allocation=PyramidAllocation(kind="pyramid", beta=4))),
            "breadthkv-quantized": lambda: BreadthKVEvictor(BreadthKVEvictor.Params(
                budget=16, buffer=8, window=2, quantize=QuantizeParams(bits=4, group_size=8, residual=8)))}[kind]()


def logits(runner, kind: str, which: list[int], steps: int = 6) -> torch.Tensor:
    """[rows, steps, vocab]: row r prefilled with PROMPTS[which[r]] (its evictor seed: which[r]),
    then `steps` greedy decode steps of all rows in one forward each (bounded evictors compact
    along the way)."""
    ids = [runner.encode(PROMPTS[i]) for i in which]
    cache = runner.new_cache(evictor(kind), len(ids), rng_keys=which)
    tokens = runner.prefill(cache, ids)
    rows = torch.arange(len(ids))
    out = []
    for _ in range(steps):
        step = runner.decode_step([(cache, rows)], tokens)  # [rows, vocab]
        out.append(step)
        tokens = step.argmax(-1)
    return torch.stack(out, 1)


KINDS = ["none", "random", "h2o", "snapkv+pyramid", "breadthkv-quantized"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_logits_are_the_same_bits_alone_and_among_others_with_the_mode_on(runner, kind):
    with mode(True):
        alone = [logits(runner, kind, [i]) for i in range(len(PROMPTS))]
        for size in (2, 4, 9):
            batch = logits(runner, kind, list(range(size)))
            for r in range(size):
                assert torch.equal(batch[r], alone[r][0]), (kind, size, r)
        # a row's place in its batch does not matter either
        assert torch.equal(logits(runner, kind, [3, 2, 1])[2], alone[1][0])


def test_the_control_without_the_mode_a_rows_logits_change_with_its_batch(runner):
    """Without this the test above could not fail: the same rows, mode off, differ somewhere."""
    with mode(False):
        alone = [logits(runner, "random", [i]) for i in range(len(PROMPTS))]
        batch = logits(runner, "random", list(range(len(PROMPTS))))
    assert any(not torch.equal(batch[r], alone[r][0]) for r in range(len(PROMPTS)))


def test_tiled_linear_is_the_plain_product_per_tile_whatever_the_rows():
    torch.manual_seed(0)
    w, b = torch.randn(40, 24), torch.randn(40)
    for rows in (1, invariant.TILE_ROWS, invariant.TILE_ROWS + 3):
        x = torch.randn(rows, 24)
        out = invariant.tiled_linear(x[None], w, b, upcast=False)[0]
        padded = torch.cat([x, x.new_zeros((-rows) % invariant.TILE_ROWS, 24)])
        expect = torch.cat([torch.nn.functional.linear(t, w, b) for t in padded.split(invariant.TILE_ROWS)])[:rows]
        assert out.shape == (rows, 40) and torch.equal(out, expect)


def test_a_kernel_that_treats_rows_by_place_stops_the_run(runner, monkeypatch):
    """The tripwire: where a GEMM gives a row other bits at another place of the call whatever
    the tile, the mode cannot hold and says so (a UserError naming run.deterministic); where
    only some tiles do (a partial row block on another micro-kernel), the first tile whose
    rows are alike is kept."""
    from kvflow.errors import UserError

    real = torch.nn.functional.linear

    def by_place(x, w, b=None):  # row i gets i thousandths more: a kernel whose rows are not alike
        out = real(x, w, b)
        return out + torch.arange(out.shape[0], dtype=out.dtype)[:, None] * 1e-3 if out.dim() == 2 else out

    monkeypatch.setattr(invariant, "_CHOSEN", {})
    monkeypatch.setattr(invariant.F, "linear", by_place)
    with pytest.raises(UserError, match="run.deterministic"):
        invariant.choose_tile(runner.model, upcast=False)

    def tail_of_32(x, w, b=None):  # a 32-row call computes its last rows on another kernel
        out = real(x, w, b)
        if out.dim() == 2 and out.shape[0] == 32:
            out = out.clone()
            out[-8:] += 1e-3
        return out

    monkeypatch.setattr(invariant, "_CHOSEN", {})
    monkeypatch.setattr(invariant.F, "linear", tail_of_32)
    assert invariant.choose_tile(runner.model, upcast=False) == invariant.TILE_CANDIDATES[1]
    monkeypatch.setattr(invariant.F, "linear", real)
    monkeypatch.setattr(invariant, "_CHOSEN", {})
    assert invariant.choose_tile(runner.model, upcast=False) in invariant.TILE_CANDIDATES  # this machine's kernels


# ------------------------------------------------------------------ whole trajectories


def _trajectories(runner, kind: str, temperature: float, indices: list[int]) -> dict:
    from kvflow.backends.hf.decode import HFEngine
    from kvflow.components.base import CommitterParams, ScorerContext, Trajectory
    from kvflow.components.engine import SamplingSpec
    from kvflow.config.schema import LimitsConfig
    from kvflow.runtime.scheduler import Plan, Proposer, run as run_scheduler
    from kvflow_builtin.committers.best import BestCommitter
    from kvflow_builtin.scorers.random import RandomScorer

    engine = HFEngine(runner)
    engine.reset()
    proposer = Proposer("base", engine, evictor(kind), SamplingSpec(2, temperature, 1.0, 8, "\n\n", ()))
    plan = Plan([proposer], RandomScorer(RandomScorer.Params(), ScorerContext(None, ["base"], seed=7)),
                BestCommitter(CommitterParams(), ["base"]), LimitsConfig(max_tokens=24, max_steps=64), 7)
    tok = tiny_tokenizer()
    trajs = [Trajectory(f"p{i}", PROMPTS[i], tok.apply_chat_template([{"role": "user", "content": PROMPTS[i]}],
                                                                     tokenize=False, add_generation_prompt=True))
             for i in indices]
    run_scheduler(plan, trajs, lambda t: None)
    return {t.problem_id: [s.text for s in t.steps] for t in trajs}


@pytest.mark.parametrize("kind,temperature", [("random", 1.0), ("none", 1.0), ("random", 0.0)])
def test_every_trajectory_is_the_same_alone_and_among_1_3_and_8_others(runner, kind, temperature):
    with mode(True):
        alone = {f"p{i}": _trajectories(runner, kind, temperature, [i])[f"p{i}"] for i in (0, 3, 8)}
        for size in (2, 4, 9):
            together = _trajectories(runner, kind, temperature, list(range(size)))
            for pid, steps in alone.items():
                if pid in together:
                    assert together[pid] == steps, (kind, temperature, size, pid)
    assert len(alone["p0"]) >= 2


def test_a_catalog_checkpoint_in_bf16_gives_each_problem_the_same_run_alone_and_among_3_others(tmp_path, cli):
    """`kvflow run` with run.deterministic on SmolLM2-135M in bfloat16 (sampled, evicted base,
    its own likelihood as scorer): gsm8k-like problem 1 alone and in a batch of 4."""
    runs = {}
    for name, offset, limit in (("alone", 1, 1), ("among", 0, 4)):
        path = tiny_pipeline(tmp_path / name, model="catalog:smollm2-135m-instruct", problems=4, n=2, helper=False,
                             max_step_tokens=16, max_tokens=40,
                             evictor={"kind": "random", "budget": 24, "buffer": 8},
                             extra={"run": {"deterministic": True}, "models": {"base": {"dtype": "bfloat16"}},
                                    "dataset": {"offset": offset, "limit": limit}})
        result = cli("run", path)
        assert result.exit_code == 0, result.output
        (run_dir,) = (tmp_path / name / "results").iterdir()
        runs[name] = {json.loads(x)["id"]: json.loads(x)["steps"] for x in (run_dir / "samples.jsonl").read_text().splitlines()}
        settings = json.loads((run_dir / "manifest.json").read_text())["engine_settings"]["base"]
        assert settings["batch_invariant"] is True and settings["dtype"] == "torch.bfloat16"
    (pid,) = runs["alone"]
    assert len(runs["among"]) == 4 and runs["among"][pid] == runs["alone"][pid]
