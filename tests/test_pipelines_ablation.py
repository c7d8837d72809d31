"""Baselines and ablations: the YAML mechanism (a null deletes a key on include), what each
shipped file resolves to, and what each does when run on tiny models through the real
compile step; helper-step ingestion into an evicted base; determinism; recovery metrics."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO
from kvflow.backends.hf.decode import HFEngine
from kvflow.components.base import Trajectory
from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest, SyncRequest
from kvflow.config.loader import deep_merge, load_config
from kvflow.config.validate import load_pipeline
from kvflow.runtime.compile import build_plan
from kvflow.runtime.scheduler import run as run_scheduler
from kvflow.results.files import ResultsDir, compute_metrics
from kvflow.testing import propose_now, tiny_runner, tiny_tokenizer
from kvflow_builtin.evictors.none import NoEviction
from kvflow_builtin.evictors.random import RandomEvictor


PIPES = REPO / "pipelines"
QUESTIONS = ["How many clips did Natalia sell?", "Natalia sold 48 clips in April. How many in May?"]

# file -> (proposers in order, base pruner kinds, base evictor kind)
EXPECTED = {
    "kv_rescue.yaml": (["base", "helper"], ["entropy", "gzip"], "rkv"),
    "baselines/full_kv.yaml": (["base", "helper"], ["entropy", "gzip"], "none"),
    "baselines/best_of_n.yaml": (["base"], [], "rkv"),
    "baselines/helper_only.yaml": (["helper"], None, None),
    "ablations/interleave_only.yaml": (["base", "helper"], [], "rkv"),
    "ablations/early_exit_only.yaml": (["base"], ["entropy", "gzip"], "rkv"),
    "ablations/confidence_detector.yaml": (["base", "helper"], ["confidence", "gzip"], "rkv"),
}


# --------------------------------------------------------------------------- null deletes on include


def test_deep_merge_null_deletes_a_key():
    base = {"proposers": {"base": {"n": 8, "pruners": [1]}, "helper": {"n": 8}}, "dataset": {"limit": 5}}
    over = {"proposers": {"helper": None, "base": {"pruners": []}}, "dataset": {"limit": None}, "missing": None}
    assert deep_merge(base, over) == {"proposers": {"base": {"n": 8, "pruners": []}}, "dataset": {}}
    assert base["proposers"]["helper"] == {"n": 8}  # inputs untouched


def test_null_on_include_removes_a_proposer_with_locations(write):
    write("main.yaml", """
        kvflow: 1
        name: main
        models: {m: {id: some/model}}
        proposers:
          base: {model: m, n: 2}
          helper: {model: m, n: 3}
        """)
    path = write("child.yaml", """
        include: main.yaml
        name: child
        proposers:
          helper: null
        """)
    data, locs = load_config(path)
    assert list(data["proposers"]) == ["base"]
    assert ("proposers", "helper") not in locs and locs.at("proposers.base.n").file.endswith("main.yaml")
    loaded = load_pipeline(path)
    assert list(loaded.pipeline.proposers) == ["base"]


# --------------------------------------------------------------------------- the shipped files


@pytest.mark.parametrize("rel", sorted(EXPECTED))
@pytest.mark.parametrize("cpu", [False, True])
def test_shipped_baselines_and_ablations_resolve_as_intended(rel, cpu):
    proposers, pruners, evictor = EXPECTED[rel]
    loaded = load_pipeline(PIPES / ("cpu" if cpu else "") / rel)
    pipe = loaded.pipeline
    assert list(pipe.proposers) == proposers
    assert pipe.name == ("cpu_" if cpu else "") + rel.split("/")[-1][:-5]
    if pruners is not None:
        assert [p.kind for p in pipe.proposers["base"].pruners] == pruners
        cpu_evictor = "none" if evictor == "none" else "random"
        assert pipe.proposers["base"].evictor.kind == (cpu_evictor if cpu else evictor)
    if "helper" in pipe.proposers:
        assert pipe.proposers["helper"].evictor.kind == "none"
    if cpu:
        assert pipe.models[pipe.proposers[proposers[0]].model].id.startswith("catalog:qwen2.5-coder")
        assert "prm" not in pipe.models and pipe.scorer.kind == "likelihood"
        assert pipe.dataset.name == "gsm8k" and pipe.limits.max_tokens == 768
    else:
        assert pipe.scorer.kind == "prm" and pipe.scorer.params == {
            "model": "prm", "protocol": "qwen25-math-prm", "aggregate": "last"}
        assert pipe.models["prm"].id == "Qwen/Qwen2.5-Math-PRM-7B"


# --------------------------------------------------------------------------- running them on tiny models


class TinyModels:
    """A registry stand-in for `build_plan`: backend `load()` hands out engines over tiny models
    by model id (counting their forwards), every other lookup goes to the real registry."""

    def __init__(self):
        from kvflow.registry import get_registry

        self.real = get_registry()
        self.runners = {"tiny-base": tiny_runner("qwen2", seed=1), "tiny-helper": tiny_runner("llama", seed=2)}
        self.engines = {k: HFEngine(r) for k, r in self.runners.items()}
        self.loaded: list[str] = []
        self.forwards = {k: 0 for k in self.runners}
        for key, runner in self.runners.items():
            for method in ("forward", "decode_step"):
                def counted(*args, _f=getattr(runner, method), _k=key, **kw):
                    self.forwards[_k] += 1
                    return _f(*args, **kw)
                setattr(runner, method, counted)

    def get(self, kind, name):
        return self if kind == "backends" else self.real.get(kind, name)

    def load(self, model_cfg):
        self.loaded.append(model_cfg.id)
        return self.engines[model_cfg.id]


def tiny_sets(path, seed=0):
    """Overrides that shrink a shipped pipeline to tiny models and a few short steps; the
    base keeps its pruners (entropy fires at token 32 on a random model) and evictor kind."""
    data, _ = load_config(path)
    sets = ["models.base.id=tiny-base", "models.helper.id=tiny-helper", "scorer={kind: random}",
            "limits.max_tokens=90", "limits.max_steps=8", f"run.seed={seed}"]
    props = data["proposers"]
    if "base" in props:
        sets += ["proposers.base.n=2", "proposers.base.sampling.max_step_tokens=40"]
        if props["base"].get("evictor", {}).get("kind", "none") != "none":  # small, and cheap on tiny models
            sets.append("proposers.base.evictor={kind: random, budget: 16, buffer: 8, window: 4}")
    if "helper" in props:
        sets += ["proposers.helper.n=2", "proposers.helper.sampling.max_step_tokens=12"]
    return sets


def run_tiny(rel, seed=0, sets=()):
    path = PIPES / rel
    models = TinyModels()
    loaded = load_pipeline(path, sets=tiny_sets(path, seed) + list(sets))
    plan, _ = build_plan(loaded, models)
    tok = tiny_tokenizer()
    trajs = [Trajectory(f"p{i}", q, tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True))
             for i, q in enumerate(QUESTIONS)]
    done = []
    run_scheduler(plan, trajs, done.append)
    assert len(done) == len(trajs)
    return trajs, models, plan


def test_kv_rescue_on_tiny_models_prunes_and_interleaves():
    trajs, models, _ = run_tiny("kv_rescue.yaml")
    assert sum(sum(t.pruned.values()) for t in trajs) > 0  # the control for interleave_only
    assert "helper" in {s.source for t in trajs for s in t.steps}


def test_interleave_only_never_prunes():
    trajs, models, plan = run_tiny("ablations/interleave_only.yaml")
    assert plan.proposers[0].spec.pruners == ()
    for t in trajs:
        assert sum(t.pruned.values()) == 0 and not any(s.fallback for s in t.steps)
    assert {s.source for t in trajs for s in t.steps} == {"base", "helper"}


def test_confidence_detector_prunes_by_confidence_and_records_its_signal():
    """The detector ablation swaps entropy for confidence: its base candidates are pruned by
    `confidence` (a random tiny model's distributions are flat: low confidence), never by
    `entropy`, and, with signals recorded, each pruned candidate's confidence trace ends
    below the threshold."""
    trajs, _, plan = run_tiny("ablations/confidence_detector.yaml", sets=["run.record_signals=true",
                                                                          "proposers.base.pruners[0].threshold=6.5"])
    assert [name for name, _ in plan.proposers[0].spec.pruners] == ["confidence", "gzip"]
    assert sum(t.pruned.get("confidence", 0) for t in trajs) > 0 and not any(t.pruned.get("entropy") for t in trajs)
    traced = [c for t in trajs for c in t.signals if c["finish"] == "pruned:confidence"]
    assert traced and all(c["signals"]["confidence"][-1] < 6.5 for c in traced)


def test_early_exit_only_never_commits_a_helper_step():
    trajs, models, _ = run_tiny("ablations/early_exit_only.yaml")
    assert "tiny-helper" not in models.loaded and models.forwards["tiny-helper"] == 0
    for t in trajs:
        assert t.steps and all(s.source == "base" for s in t.steps)
        assert set(t.candidates) == {"base"} and sum(t.pruned.values()) > 0


def test_helper_only_never_runs_the_base():
    trajs, models, _ = run_tiny("baselines/helper_only.yaml")
    assert "tiny-base" not in models.loaded and models.forwards["tiny-base"] == 0
    for t in trajs:
        assert t.steps and all(s.source == "helper" for s in t.steps)
        assert set(t.tokens_generated) == {"helper"}


def test_best_of_n_and_full_kv_on_tiny_models(monkeypatch):
    """best-of-N evicts (its base caches compact), full-KV never does: the run itself, not
    only the evictor's type (breaking full_kv.yaml's `evictor: none` fails the second part)."""
    from kvflow.backends.hf.cache import BudgetedCache

    compacted = []
    original = BudgetedCache.compact
    monkeypatch.setattr(BudgetedCache, "compact", lambda self, rows: (compacted.append(len(rows)),
                                                                      original(self, rows))[1])
    trajs, models, _ = run_tiny("baselines/best_of_n.yaml")
    assert all(s.source == "base" for t in trajs for s in t.steps) and models.forwards["tiny-helper"] == 0
    assert all(sum(t.pruned.values()) == 0 for t in trajs)
    assert compacted, "best-of-N's evicted base never compacted"
    compacted.clear()
    trajs, _, plan = run_tiny("baselines/full_kv.yaml")
    assert isinstance(plan.proposers[0].evictor, NoEviction)
    assert not compacted and sum(t.committed_tokens for t in trajs) > 2 * (16 + 8)  # long enough to have evicted


def test_runs_are_deterministic_under_the_seed():
    first = [t.text for t in run_tiny("ablations/interleave_only.yaml", seed=3)[0]]
    again = [t.text for t in run_tiny("ablations/interleave_only.yaml", seed=3)[0]]
    other = [t.text for t in run_tiny("ablations/interleave_only.yaml", seed=4)[0]]
    assert first == again and first != other


# --------------------------------------------------------------------------- helper step into an evicted base


def test_helper_step_is_ingested_with_eviction_and_the_base_continues_from_it():
    runner = tiny_runner("qwen2", seed=1)
    engine = HFEngine(runner)
    tok = tiny_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[1]}], tokenize=False,
                                     add_generation_prompt=True)
    helper_text = "Step 1: In May she sold 48 / 2 = 24 clips.\n\nStep 2: Altogether 48 + 24 = 72 clips.\n\n"
    p_ids, h_ids = runner.encode(prompt), runner.encode(helper_text)
    spec = SamplingSpec(1, 0.0, 1.0, 12, "\n\n")
    conts = {}
    for name, ev in [("evicted", RandomEvictor(RandomEvictor.Params(budget=16, buffer=8, window=4))),
                     ("full", NoEviction(NoEviction.Params()))]:
        (state,) = engine.start([StartRequest(prompt, ev, 7)])
        (state,) = engine.sync([SyncRequest(state, None, None, helper_text)])  # the helper's step was committed
        rows = state.cache.rows
        assert int(rows.positions[0]) == len(p_ids) + len(h_ids) - 1  # the last token is pending
        assert state.pending == h_ids[-1]
        if name == "evicted":
            assert int(rows.lengths[0]) <= 16 + 8 and int(rows.compactions[0]) > 0
        else:
            assert int(rows.lengths[0]) == len(p_ids) + len(h_ids) - 1
        proposal = propose_now(engine, ProposeRequest(state, "base", spec, 0, 100))
        (c,) = proposal.candidates
        conts[name] = c.token_ids
        (state,) = engine.sync([SyncRequest(state, proposal, 0, c.text)])  # adopt the base's own next step
        assert int(state.cache.rows.positions[0]) == len(p_ids) + len(h_ids) + len(c.token_ids) - 1
        if name == "evicted":
            assert int(state.cache.rows.lengths[0]) <= 16 + 8
    # with full KV the next base step is exactly greedy generation from prompt + helper step
    ids = torch.tensor([p_ids + h_ids])
    ref = runner.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(conts["full"]),
                                do_sample=False, pad_token_id=0, eos_token_id=sorted(runner.eos_ids))
    assert ref[0, ids.shape[1]:].tolist() == conts["full"]


# --------------------------------------------------------------------------- metrics


def record(i, correct, *, base_tokens=100, steps=("base", "helper"), finish="eos", pruned=0):
    return {"id": f"p{i}", "correct": correct, "steps": [{"source": s} for s in steps],
            "step_counts": {"base": list(steps).count("base"), "helper": list(steps).count("helper")},
            "output_tokens": 50, "tokens_generated": {"base": base_tokens, "helper": 40},
            "candidates": {"base": 4, "helper": 4}, "pruned": {"entropy": pruned}, "finish": finish,
            "degenerate": finish == "cap_tokens" and not correct, "seconds": 1.0}


def test_metrics_have_the_paper_columns_and_recovery(tmp_path):
    for name, acc in [("full_kv__aaaa", 0.8), ("best_of_n__bbbb", 0.2)]:
        d = ResultsDir(tmp_path / name)
        d.path.mkdir()
        d.write_metrics({"accuracy": acc})
    records = [record(0, True, pruned=1), record(1, True, steps=("base",)), record(2, False, finish="cap_tokens"),
               record(3, True, base_tokens=300, pruned=2)]
    baselines = {"full": str(tmp_path / "full_kv__*"), "evicted": str(tmp_path / "best_of_n__bbbb")}
    m = compute_metrics(records, ["base", "helper"], {"entropy": ["base"]}, baselines=baselines)
    assert m["accuracy"] == 0.75 and m["degeneration_rate"] == 0.25
    assert m["mean_base_tokens"] == 150 and m["mean_steps"] == 1.75 and m["mean_output_tokens"] == 50
    assert m["early_exit_fraction"] == pytest.approx(3 / 16)
    assert m["step_share"] == {"base": 4 / 7, "helper": 3 / 7}
    assert m["recovery"] == pytest.approx((0.75 - 0.2) / (0.8 - 0.2))
    assert m["baselines"]["full"] == {"dir": str(tmp_path / "full_kv__aaaa"), "accuracy": 0.8}
    missing = compute_metrics(records, ["base", "helper"], {}, baselines={"full": "nope", "evicted": "nope2"})
    assert missing["recovery"] is None and missing["baselines"]["full"]["accuracy"] is None
    assert "recovery" not in compute_metrics(records, ["base", "helper"], {})
    json.dumps(m)


def test_run_baselines_field_validates():
    loaded = load_pipeline(PIPES / "kv_rescue.yaml", sets=["run.baselines={full: results/a, evicted: results/b}"])
    assert loaded.pipeline.run.baselines.full == "results/a"
    with pytest.raises(Exception, match="evicted"):
        load_pipeline(PIPES / "kv_rescue.yaml", sets=["run.baselines={full: results/a}"])
