"""The step scheduler on tiny real models: exactness against `generate`, state sync, pruning,
scheduling independence."""

from __future__ import annotations

import pytest
import torch

from kvflow.backends.hf.decode import HFEngine
from kvflow.components.base import CommitterParams, ScorerContext, Trajectory
from kvflow.components.engine import SamplingSpec
from kvflow.config.schema import LimitsConfig
from kvflow.runtime.scheduler import Plan, Proposer, run as run_scheduler
from kvflow.testing import tiny_runner as _tiny_runner, tiny_tokenizer
from kvflow_builtin.committers.best import BestCommitter
from kvflow_builtin.evictors.none import NoEviction
from kvflow_builtin.evictors.random import RandomEvictor
from kvflow_builtin.scorers.random import RandomScorer

QUESTIONS = ["How many clips did Natalia sell?", "Natalia sold 48 clips in April. How many in May?"]


def prompts():
    tok = tiny_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


def tiny_runner(*args, **kwargs):
    """An engine over a tiny model (the name stays: these tests drive it like the runner)."""
    return HFEngine(_tiny_runner(*args, **kwargs))


def make_plan(proposers, *, max_tokens=60, max_steps=256, seed=0, on_all_pruned="fallback", batch_problems=16,
              live_problems=None):
    names = [p.name for p in proposers]
    ctx = ScorerContext(load_session=None, proposers=names, seed=seed)
    return Plan(proposers, RandomScorer(RandomScorer.Params(), ctx), BestCommitter(CommitterParams(), names),
                LimitsConfig(max_tokens=max_tokens, max_steps=max_steps, on_all_pruned=on_all_pruned), seed,
                batch_problems=batch_problems, live_problems=live_problems)


def spec(name="base", n=1, temperature=0.0, max_step_tokens=512, pruners=()):
    return SamplingSpec(n, temperature, 1.0, max_step_tokens, "\n\n", tuple(pruners))


def run(plan, texts, questions=QUESTIONS):
    trajs = [Trajectory(f"p{i}", q, p) for i, (q, p) in enumerate(zip(questions, texts))]
    done = []
    run_scheduler(plan, trajs, done.append)
    return trajs, done


def greedy_reference(engine, prompt, max_new):
    runner = engine.runner
    ids = torch.tensor([runner.encode(prompt)])
    out = runner.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=sorted(runner.eos_ids), pad_token_id=0)[0, ids.shape[1]:].tolist()
    if out and out[-1] in runner.eos_ids:
        out = out[:-1]
    return runner.decode(out)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mha"])
@pytest.mark.parametrize("evictor", ["none", "random-large-budget", "random-small-budget"])
def test_greedy_base_equals_generate(arch, evictor, monkeypatch):
    """Exactness: full KV, and an evicting cache whose budget exceeds the sequence (its bounded
    storage, never compacted), reproduce `generate`. The small-budget case is the control: it
    must compact, and eviction must then change the text (else this test could not fail)."""
    from kvflow.backends.hf.cache import BudgetedCache

    compactions = []
    original = BudgetedCache.compact
    monkeypatch.setattr(BudgetedCache, "compact", lambda self, rows: (compactions.append(len(rows)),
                                                                      original(self, rows))[1])
    runner = tiny_runner(arch)
    ev = {"none": NoEviction(NoEviction.Params()),
          "random-large-budget": RandomEvictor(RandomEvictor.Params(budget=400, buffer=16)),
          "random-small-budget": RandomEvictor(RandomEvictor.Params(budget=12, buffer=4, window=2))}[evictor]
    plan = make_plan([Proposer("base", runner, ev, spec())], max_tokens=60)
    trajs, done = run(plan, prompts())
    assert len(done) == 2
    same = [t.text == greedy_reference(runner, t.prompt, 60) for t in trajs]
    if evictor == "random-small-budget":
        assert compactions and not all(same)
        return
    assert not compactions and all(same)
    for t in trajs:
        assert t.finish in ("eos", "cap_tokens")
        assert len(t.steps) >= 1


def test_two_proposers_sync_and_helper_commit_ingested_by_base():
    base_runner, helper_runner = tiny_runner("qwen2", seed=1), tiny_runner("llama", seed=2)
    base = Proposer("base", base_runner, RandomEvictor(RandomEvictor.Params(budget=24, buffer=8, window=4)),
                    spec("base", n=2, temperature=1.0, max_step_tokens=12))
    helper = Proposer("helper", helper_runner, NoEviction(NoEviction.Params()),
                      spec("helper", n=2, temperature=1.0, max_step_tokens=12))
    plan = make_plan([base, helper], max_tokens=60, seed=3)
    trajs, done = run(plan, prompts())
    sources = {s.source for t in trajs for s in t.steps}
    assert sources == {"base", "helper"}  # random scores: both kinds get committed over 10+ steps
    for t in trajs:
        assert t.tokens_generated["base"] > 0 and t.tokens_generated["helper"] > 0
    # determinism under the seed
    trajs2, _ = run(make_plan([base, helper], max_tokens=60, seed=3), prompts())
    assert [t.text for t in trajs] == [t.text for t in trajs2]


class _PruneEverything:
    """A pruner that stops every candidate after its first token."""

    def signal(self, trace):
        return torch.ones(len(trace.texts))

    def check(self, trace):
        return torch.ones(len(trace.texts), dtype=torch.bool)


def test_all_candidates_pruned_fallback_commits_best_pruned_candidate():
    runner = tiny_runner("qwen2")
    base = Proposer("base", runner, NoEviction(NoEviction.Params()),
                    spec("base", n=3, temperature=1.0, pruners=[("always", _PruneEverything())]))
    trajs, done = run(make_plan([base], max_tokens=10, on_all_pruned="fallback"), prompts())
    for t in trajs:
        # every step but possibly the last (EOS or the token cap end a candidate before pruning)
        assert len(t.steps) >= 5 and all(s.fallback and s.n_tokens == 1 for s in t.steps[:-1])
        assert t.pruned["always"] >= 3 * (len(t.steps) - 1)
        assert t.finish in ("cap_tokens", "eos")


def test_all_candidates_pruned_stop_ends_the_trajectory():
    runner = tiny_runner("qwen2")
    base = Proposer("base", runner, NoEviction(NoEviction.Params()),
                    spec("base", n=2, temperature=1.0, pruners=[("always", _PruneEverything())]))
    trajs, done = run(make_plan([base], max_tokens=10, on_all_pruned="stop"), prompts())
    assert len(done) == 2
    for t in trajs:
        assert t.finish == "pruned" and t.steps == []


def test_helper_rescues_when_base_candidates_are_pruned():
    base = Proposer("base", tiny_runner("qwen2"), NoEviction(NoEviction.Params()),
                    spec("base", n=2, temperature=1.0, pruners=[("always", _PruneEverything())]))
    helper = Proposer("helper", tiny_runner("llama"), NoEviction(NoEviction.Params()),
                      spec("helper", n=1, temperature=1.0, max_step_tokens=8))
    trajs, _ = run(make_plan([base, helper], max_tokens=24), prompts())
    for t in trajs:
        assert t.steps and all(s.source == "helper" and not s.fallback for s in t.steps)


@pytest.mark.parametrize("quantized", [False, True])
def test_proposers_sharing_a_model_decode_in_one_batch_exactly(quantized):
    """An evicted base and a full helper on one model decode in one forward per step; the
    trajectories equal those of separate engines on a copy of the model. Also with the base's
    kept cache quantized (BreadthKV) next to the full-precision helper."""
    import copy

    from kvflow.backends.hf.engine import HFRunner
    from kvflow_builtin.evictors.breadthkv import BreadthKVEvictor

    runner = tiny_runner("llama")
    if quantized:
        evictor = BreadthKVEvictor(BreadthKVEvictor.Params(budget=24, buffer=8, window=4, kernel=3,
                                                           quantize=dict(bits=4, group_size=8, residual=4)))
    else:
        evictor = RandomEvictor(RandomEvictor.Params(budget=24, buffer=8, window=4))
    base = Proposer("base", runner, evictor, spec("base", n=2, temperature=0.7, max_step_tokens=12))
    joint = [Proposer("helper", runner, NoEviction(NoEviction.Params()), spec("helper", n=2, temperature=0.7, max_step_tokens=12))]
    apart = [Proposer("helper", HFEngine(HFRunner(copy.deepcopy(runner.runner.model), runner.tokenizer)),
                      NoEviction(NoEviction.Params()), spec("helper", n=2, temperature=0.7, max_step_tokens=12))]
    calls = []
    original = HFRunner.decode_step

    def counting(self, parts, tokens):
        calls.append({p.evictor.bounded for p, _ in parts})
        return original(self, parts, tokens)

    HFRunner.decode_step = counting
    try:
        together, _ = run(make_plan([base] + joint, max_tokens=60, seed=5), prompts())
    finally:
        HFRunner.decode_step = original
    separate, _ = run(make_plan([base] + apart, max_tokens=60, seed=5), prompts())
    assert calls and {True, False} in calls  # evicted and full rows in one forward
    assert [(s.text, s.source) for t in together for s in t.steps] == [(s.text, s.source) for t in separate for s in t.steps]
    assert {s.source for t in together for s in t.steps} == {"base", "helper"}


class _PruneNothing:
    def signal(self, trace):
        return torch.zeros(len(trace.texts))

    def check(self, trace):
        return torch.zeros(len(trace.texts), dtype=torch.bool)


def test_timing_phases_sum_to_the_problem_wall_time():
    """Per-problem timing: exclusive phases that add up to the wall time from the start of the
    batch until the problem finished, with model forwards and pruning nested where they ran."""
    import time

    from kvflow.results.files import timing_summary
    from kvflow.timing import categories

    base = Proposer("base", tiny_runner("qwen2", seed=1), RandomEvictor(RandomEvictor.Params(budget=24, buffer=8, window=4)),
                    spec("base", n=2, temperature=1.0, max_step_tokens=12, pruners=[("never", _PruneNothing())]))
    helper = Proposer("helper", tiny_runner("llama", seed=2), NoEviction(NoEviction.Params()),
                      spec("helper", n=2, temperature=1.0, max_step_tokens=12))
    plan = make_plan([base, helper], max_tokens=60, seed=3)
    trajs = [Trajectory(f"p{i}", q, p) for i, (q, p) in enumerate(zip(QUESTIONS, prompts()))]
    timings, finished = {}, {}
    t0 = time.perf_counter()
    run_scheduler(plan, trajs, lambda t: finished.setdefault(t.problem_id, time.perf_counter() - t0), timings=timings)
    assert set(timings) == {"p0", "p1"}
    for pid, timing in timings.items():
        phases = timing["phases"]
        assert all(v >= 0 for v in phases.values())
        assert abs(sum(phases.values()) - timing["wall"]) < 1e-3  # rounding only
        assert timing["wall"] <= finished[pid] + 1e-3 and finished[pid] - timing["wall"] < 0.05
        assert phases["other"] < 0.2 * timing["wall"]  # the phases cover the loop
        for key in ("prefill/forward:base", "prefill/forward:helper", "propose/forward:base",
                    "propose/forward:helper", "propose/prune", "propose", "score", "commit", "sync"):
            assert key in phases, key
        cats = categories(phases)
        assert {"model:base", "model:helper", "scorer", "kvflow"} <= set(cats)
        assert abs(sum(cats.values()) - timing["wall"]) < 1e-3
    # without a timings dict nothing is measured and nothing changes
    again = [Trajectory(f"p{i}", q, p) for i, (q, p) in enumerate(zip(QUESTIONS, prompts()))]
    run_scheduler(make_plan([base, helper], max_tokens=60, seed=3), again, lambda t: None)
    assert [t.text for t in again] == [t.text for t in trajs]
    summary = timing_summary([{"timing": t} for t in timings.values()])
    assert abs(sum(summary["share"].values()) - 1) < 1e-3


def test_a_forced_pick_is_not_scored():
    """One candidate per problem: nothing to choose, so the scorer is not called (a PRM or a
    likelihood forward would be wasted) and the committed step's score is None."""
    calls = []

    class CountingScorer(RandomScorer):
        def score(self, requests):
            calls.append(len(requests))
            return super().score(requests)

    def plan_with(n):
        base = Proposer("base", tiny_runner("qwen2"), NoEviction(NoEviction.Params()),
                        spec("base", n=n, temperature=1.0, max_step_tokens=6))
        plan = make_plan([base], max_tokens=18)
        plan.scorer = CountingScorer(RandomScorer.Params(), ScorerContext(load_session=None, proposers=["base"], seed=0))
        return plan

    trajs, _ = run(plan_with(1), prompts())
    assert calls == [] and all(s.score is None for t in trajs for s in t.steps)
    trajs, _ = run(plan_with(2), prompts())
    assert calls and all(s.score is not None for t in trajs for s in t.steps)


MORE_QUESTIONS = QUESTIONS + ["What is 48 / 2?", "Natalia sold 72 clips. How many in April?", "What is 24 + 48?"]


def _kv_rescue_like(seed=7, batch_problems=16, live_problems=None):
    base = Proposer("base", tiny_runner("qwen2", seed=1),
                    RandomEvictor(RandomEvictor.Params(budget=20, buffer=6, window=4)),
                    spec("base", n=2, temperature=1.0, max_step_tokens=10))
    helper = Proposer("helper", tiny_runner("llama", seed=2), NoEviction(NoEviction.Params()),
                      spec("helper", n=2, temperature=1.0, max_step_tokens=10))
    return make_plan([base, helper], max_tokens=40, seed=seed, batch_problems=batch_problems,
                     live_problems=live_problems)


def _trajectories(plan, indices):
    tok = tiny_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": MORE_QUESTIONS[i]}], tokenize=False,
                                     add_generation_prompt=True) for i in indices]
    trajs = [Trajectory(f"p{i}", MORE_QUESTIONS[i], t) for i, t in zip(indices, texts)]
    order = []
    run_scheduler(plan, trajs, lambda t: order.append(t.problem_id))
    return {t.problem_id: [(s.text, s.source, s.fallback) for s in t.steps] for t in trajs}, order


def test_a_problems_trajectory_does_not_depend_on_scheduling():
    """Sampled candidates (n = 2 + 2), an evicted base that compacts, a helper on another model:
    problem p1's committed steps are the same decoded alone, among 4 problems at once, and
    admitted mid-run behind others in a one-problem room (float32, tiny models)."""
    alone, _ = _trajectories(_kv_rescue_like(), [1])
    together, _ = _trajectories(_kv_rescue_like(), [0, 1, 2, 3])
    behind, order = _trajectories(_kv_rescue_like(batch_problems=1, live_problems=2), [3, 2, 0, 1, 4])
    assert len(alone["p1"]) >= 3
    assert together["p1"] == alone["p1"]
    assert behind["p1"] == alone["p1"]
    assert together["p0"] == behind["p0"] and together["p3"] == behind["p3"]
    assert sorted(order) == ["p0", "p1", "p2", "p3", "p4"]


def test_problems_advance_on_their_own_and_finish_out_of_order():
    """A short problem finishes and the next is admitted while a long one is still decoding:
    problems finish in a different order than they were given, and the decode batch stays
    fuller than lockstep rounds would keep it."""
    from kvflow.runtime.scheduler import Occupancy

    plan = _kv_rescue_like(batch_problems=2, live_problems=2)
    plan.limits = LimitsConfig(max_tokens=80, max_steps=256)
    tok = tiny_tokenizer()
    trajs = [Trajectory(f"p{i}", q, tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                            add_generation_prompt=True))
             for i, q in enumerate(MORE_QUESTIONS)]
    order, occupancy = [], Occupancy()
    admitted_before_done = []

    def on_done(t):
        order.append(t.problem_id)

    run_scheduler(plan, trajs, on_done, occupancy=occupancy)
    assert sorted(order) == [t.problem_id for t in trajs]
    assert order != [t.problem_id for t in trajs]
    summary = occupancy.summary()
    assert set(summary) == {"base", "helper"}
    for entry in summary.values():
        assert entry["bound"] == 4 and 0 < entry["occupancy"] <= 1
        assert entry["mean_rows"] == pytest.approx(entry["occupancy"] * 4, abs=1e-2)


def test_rows_leave_the_batch_without_copies(monkeypatch):
    """The hot path: a proposal's fork is one copy of the state's row into n rows of the
    engine's row pool, and nothing else is copied while rows end at different steps; every
    decode step is one forward over the live rows of all proposals (no per-row forwards),
    with one part (one attention call per layer) for all of them; released proposals give
    their rows back, and later forks reuse them instead of growing the pool."""
    from kvflow.backends.hf.cache import BudgetedCache
    from kvflow.backends.hf.engine import HFRunner
    from kvflow.components.engine import ProposeRequest, StartRequest

    engine = tiny_runner("qwen2", seed=3)
    ev = RandomEvictor(RandomEvictor.Params(budget=24, buffer=8, window=4))
    tok = tiny_tokenizer()
    states = engine.start([StartRequest(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                add_generation_prompt=True), ev, i)
                           for i, q in enumerate(MORE_QUESTIONS[:4])])
    copies, selects, forwards = [], [], []
    original_copy, original_select, original_step = BudgetedCache.copy_rows, BudgetedCache.select, HFRunner.decode_step
    monkeypatch.setattr(BudgetedCache, "copy_rows", lambda self, dst, src, rows: (copies.append(len(rows)),
                                                                                   original_copy(self, dst, src, rows))[1])
    monkeypatch.setattr(BudgetedCache, "select", lambda self, rows: (selects.append(len(rows)),
                                                                       original_select(self, rows))[1])
    monkeypatch.setattr(HFRunner, "decode_step", lambda self, parts, tokens: (forwards.append((len(parts), len(tokens))),
                                                                               original_step(self, parts, tokens))[1])
    s = spec("base", n=3, temperature=1.0, max_step_tokens=12)
    engine.submit([ProposeRequest(st, "base", s, 10 + i, 3 + 2 * i) for i, st in enumerate(states)])  # rooms 3..9
    done = []
    while engine.busy_rows():
        done += engine.step()
    assert len(done) == 4 and sorted(len(p.candidates) for p in done) == [3, 3, 3, 3]
    assert copies == [3, 3, 3, 3] and selects == []  # the forks, and nothing while rows ended
    assert {parts for parts, _ in forwards} == {1}  # four proposals, one part
    widths = [rows for _, rows in forwards]
    assert widths[0] == 12 and widths == sorted(widths, reverse=True) and len(widths) <= 9
    assert min(widths) < 12  # rows really left as they ended
    (pool,) = [p for _, p in engine.pools.values()]
    assert pool.cache.n_rows == 12  # the burst of four forks: grown once, to what they need
    adopted = done[0].handle.select([1])  # adoption copies one row out
    assert selects == [1] and adopted.n_rows == 1
    engine.release([], done)
    del done
    engine.submit([ProposeRequest(st, "base", s, 20 + i, 3) for i, st in enumerate(states)])
    while engine.busy_rows():
        engine.step()
    assert pool.cache.n_rows == 12  # the released rows were reused


def test_finished_and_cancelled_problems_leave_nothing_for_the_cyclic_gc():
    """Problems decoded to their end, and problems cancelled mid-step (the hf engine's `cancel`,
    as `kvflow serve` cancels a request whose client went away), leave no KV cache with rows and
    no scheduler problem alive once the run is over, with Python's cyclic GC off: every state is
    freed with its last reference (issue 40: caches in reference cycles made a server's memory
    creep between the GC's rare full collections)."""
    import gc

    from kvflow.backends.hf.cache import BudgetedCache
    from kvflow.runtime import scheduler

    base_runner, helper_runner = tiny_runner("qwen2", seed=1), tiny_runner("llama", seed=2)
    base = Proposer("base", base_runner, RandomEvictor(RandomEvictor.Params(budget=24, buffer=8, window=4)),
                    spec("base", n=2, temperature=1.0, max_step_tokens=12))
    helper = Proposer("helper", helper_runner, NoEviction(NoEviction.Params()),
                      spec("helper", n=2, temperature=1.0, max_step_tokens=12))
    plan = make_plan([base, helper], max_tokens=40, seed=3)
    trajs = [Trajectory(f"p{i}", QUESTIONS[i % 2], prompts()[i % 2]) for i in range(4)]
    gone = {"p1", "p3"}  # cancelled after their first step, mid-way through the second
    ticks: dict[str, int] = {}

    def cancelled(traj):
        ticks[traj.problem_id] = ticks.get(traj.problem_id, 0) + (len(traj.steps) == 1)
        return traj.problem_id in gone and ticks[traj.problem_id] > 3

    done = []
    gc.collect()
    gc.disable()
    # what an earlier test in this process still holds is not this test's
    before = {id(o) for o in gc.get_objects() if isinstance(o, (BudgetedCache, scheduler.Problem))}
    try:
        run_scheduler(plan, trajs, done.append, cancelled=cancelled)
        assert sorted(t.finish == "cancelled" for t in done) == [False, False, True, True]
        for engine in (base_runner, helper_runner):
            engine.step()  # idle: its row pools emptied
        alive = [o for o in gc.get_objects() if isinstance(o, BudgetedCache) and o.n_rows and id(o) not in before]
        problems = [o for o in gc.get_objects() if isinstance(o, scheduler.Problem) and id(o) not in before]
        assert not alive and not problems, (len(alive), len(problems))
    finally:
        gc.enable()
