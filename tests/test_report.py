"""`kvflow report` on hand-built results directories (no model runs)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Optional

import pytest
import yaml

from kvflow.errors import UserError
from kvflow.report import load_runs, report_command
from kvflow.results.runs import load_run, read_samples

IDS = [f"gsm8k/{i}" for i in range(10)]


def make_run(root: Path, name: str, correct: list[bool], *, evictor: str = "rkv", budget: Optional[int] = 64,
             n: int = 8, helper: bool = True, pruners: bool = True, dataset: Optional[dict] = None,
             metrics: bool = True, steps: int = 4, helper_steps: int = 1, cap: Optional[list[bool]] = None,
             base_tokens: float = 100.0) -> Path:
    """A results directory as `kvflow run` writes it; problem i is correct iff correct[i]."""
    dataset = dataset or {"name": "gsm8k", "limit": len(correct), "offset": 0, "shuffle": False,
                          "prompt": "qwen25-math-cot"}
    ev = {"kind": evictor} if evictor == "none" else {"kind": evictor, "budget": budget, "buffer": 64}
    base = {"model": "base", "n": n, "evictor": ev,
            "pruners": [{"kind": "entropy", "threshold": 2.5}, {"kind": "gzip", "threshold": 0.25}] if pruners else []}
    config = {"kvflow": 1, "name": name, "dataset": dataset,
              "models": {"base": {"id": "b"}, "helper": {"id": "h"}},
              "proposers": {"base": base, **({"helper": {"model": "helper", "n": n}} if helper else {})}}
    path = root / f"{name}__{abs(hash(name)) % 10**8:08d}"
    path.mkdir(parents=True)
    (path / "config.resolved.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (path / "manifest.json").write_text(json.dumps({"name": name, "dataset": dataset}))
    cap = cap or [False] * len(correct)
    proposers = ["base", "helper"] if helper else ["base"]
    owners = {"entropy": ["base"], "gzip": ["base"]} if pruners else {}
    records = []
    for i, ok in enumerate(correct):
        counts = {"base": steps - (helper_steps if helper else 0)}
        if helper:
            counts["helper"] = helper_steps
        records.append({
            "id": IDS[i], "question": "q", "gold": "1", "prediction": "1" if ok else "2", "correct": ok,
            "steps": [{"text": "s", "source": src, "score": 0.5} for src, k in counts.items() for _ in range(k)],
            "step_counts": counts, "output_tokens": 10 * steps,
            "tokens_generated": {"base": base_tokens, **({"helper": 50.0} if helper else {})},
            "candidates": {"base": 10 * n, **({"helper": 10 * n} if helper else {})},
            "pruned": {"entropy": 2, "gzip": 1} if pruners else {},
            "finish": "cap_tokens" if cap[i] else "answer", "degenerate": bool(cap[i] and not ok), "seconds": 1.0})
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if metrics:
        from kvflow.results.files import compute_metrics

        (path / "metrics.json").write_text(json.dumps(compute_metrics(records, proposers, owners)))
    return path


def _table(tables, name):
    (t,) = [t for t in tables if t.name == name]
    return t


def test_run_properties(tmp_path):
    rescue = load_run(make_run(tmp_path, "rescue", [True] * 8 + [False] * 2))
    assert (rescue.variant, rescue.evictor, rescue.budget, rescue.n, rescue.full_kv) == (
        "interleave + early exit", "rkv", 64, 8, False)
    assert rescue.metrics["accuracy"] == 0.8 and rescue.complete
    bon = load_run(make_run(tmp_path, "bon", [True] * 5 + [False] * 5, helper=False, pruners=False))
    assert bon.variant == "best-of-N"
    assert load_run(make_run(tmp_path, "ee", [True], helper=False)).variant == "early exit"
    assert load_run(make_run(tmp_path, "il", [True], pruners=False)).variant == "interleave"
    full = load_run(make_run(tmp_path, "full", [True], evictor="none", helper=False, pruners=False))
    assert full.full_kv and full.budget is None and full.method == "best-of-N / full KV"


def test_metrics_recomputed_for_an_unfinished_run(tmp_path):
    path = make_run(tmp_path, "partial", [True, False, True, True], metrics=False)
    with open(path / "samples.jsonl", "a") as f:
        f.write('{"id": "gsm8k/9", "corr')  # torn tail: ignored, file untouched
    size = (path / "samples.jsonl").stat().st_size
    run = load_run(path)
    assert not run.complete and run.metrics["n_problems"] == 4 and run.metrics["accuracy"] == 0.75
    assert (path / "samples.jsonl").stat().st_size == size  # report never writes into a run


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = make_run(tmp_path, "bad", [True, True, True])
    lines = (path / "samples.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match="corrupt record"):
        read_samples(path / "samples.jsonl")


def _runs(tmp_path):
    root = tmp_path / "results"
    make_run(root, "bon_b64", [True] * 5 + [False] * 5, helper=False, pruners=False,
             cap=[False] * 5 + [True] * 3 + [False] * 2, steps=12)
    make_run(root, "ee_b64", [True] * 6 + [False] * 4, helper=False, steps=8)
    make_run(root, "il_b64", [True] * 7 + [False] * 3, pruners=False, steps=5, helper_steps=2)
    make_run(root, "rescue_b64", [True] * 8 + [False] * 2, steps=4, helper_steps=1)
    make_run(root, "rescue_b128", [True] * 9 + [False], budget=128, steps=4, helper_steps=1)
    make_run(root, "rescue_b64_n4", [True] * 7 + [False] * 3, n=4, steps=4, helper_steps=2)
    make_run(root, "full", [True] * 9 + [False], evictor="none", helper=False, pruners=False)
    return root


def test_report_tables_and_files(tmp_path):
    root = _runs(tmp_path)
    out = tmp_path / "report"
    lines: list[str] = []
    tables = report_command([str(root / "*")], out=out, echo=lines.append)
    md = lines[0]
    assert md.startswith("# kvflow report") and "7 run(s)" in md and "gsm8k offset=0 limit=10" in md

    runs = _table(tables, "runs")
    row = dict(zip(runs.columns, next(r for r in runs.rows if r[0].startswith("rescue_b64__"))))
    assert row["accuracy"] == 0.8 and row["mean steps"] == 4 and row["tokens: helper"] == 50.0
    assert row["step share: helper"] == 0.25 and row["early-exit fraction"] == pytest.approx(3 / 80)
    assert row["pruned: entropy"] == pytest.approx(2 / 80)
    bon = dict(zip(runs.columns, next(r for r in runs.rows if r[0].startswith("bon_b64__"))))
    assert bon["degeneration rate"] == 0.3 and bon["step share: helper"] is None

    acc = _table(tables, "accuracy_vs_budget")
    assert acc.columns == ["method", "N", "B=64", "B=128", "full KV"]
    by_method = {(r[0], r[1]): r[2:] for r in acc.rows}
    assert by_method[("interleave + early exit / rkv", 8)] == [0.8, 0.9, None]
    assert by_method[("interleave + early exit / rkv", 4)] == [0.7, None, None]
    assert by_method[("best-of-N / full KV", 8)] == [None, None, 0.9]

    abl = _table(tables, "ablation")
    assert abl.rows[0][:3] == ["64", 4, "interleave + early exit"]  # grouped by budget, then N
    assert [r[2] for r in abl.rows if r[:2] == ["64", 8]] == [
        "best-of-N", "early exit", "interleave", "interleave + early exit"]
    assert abl.rows[-1][2] == "best-of-N (full KV)"

    cost = _table(tables, "decode_cost")
    il = dict(zip(cost.columns, next(r for r in cost.rows if r[0].startswith("il_b64__"))))
    assert (il["base tokens"], il["helper tokens"], il["total tokens"], il["mean steps"]) == (100.0, 50.0, 150.0, 5)

    share = _table(tables, "step_share")
    assert {(r[0], r[1]) for r in share.rows} == {(8, "64"), (8, "128"), (4, "64")}
    n4 = next(r for r in share.rows if r[0] == 4)
    assert n4[share.columns.index("share: helper")] == 0.5

    names = {p.name for p in out.iterdir()}
    assert {"report.md", "runs.csv", "accuracy_vs_budget.csv", "decode_cost.csv", "ablation.csv", "step_share.csv",
            "accuracy_vs_budget.png", "step_share.png", "decode_cost.png"} <= names
    for png in out.glob("*.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(io.StringIO((out / "accuracy_vs_budget.csv").read_text())))
    assert rows[0]["method"] and "B=64" in rows[0]
    assert "![accuracy_vs_budget](accuracy_vs_budget.png)" in (out / "report.md").read_text()
    assert "| run | variant |" in md and "80.0%" in md


def test_oracle_analysis(tmp_path):
    root = tmp_path / "r"
    # evicted right on 0-3, helper right on 2-5: oracle right on 0-5; full right on 0-7
    ev = make_run(root, "evicted", [i < 4 for i in range(10)], helper=False, pruners=False)
    hp = make_run(root, "helper", [2 <= i < 6 for i in range(10)], evictor="none", helper=False, pruners=False)
    fl = make_run(root, "full", [i < 8 for i in range(10)], evictor="none", helper=False, pruners=False)
    rescue = make_run(root, "rescue", [i < 7 for i in range(10)])
    tables = report_command([str(rescue)], oracle_evicted=str(ev), oracle_helper=str(hp), oracle_full=str(fl),
                            echo=lambda s: None)
    t = _table(tables, "oracle")
    rows = {r[0]: r for r in t.rows}
    assert rows["evicted base"][1] == 0.4 and rows["full-KV helper"][1] == 0.4
    assert rows["oracle (evicted or helper)"][1] == 0.6
    assert rows["oracle (evicted or helper)"][2] == pytest.approx((0.6 - 0.4) / (0.8 - 0.4))  # 50% of the gap
    assert rows["full-KV base"][1] == 0.8
    assert rows["interleave + early exit (64)"][2] == pytest.approx(0.75)  # (0.7-0.4)/(0.8-0.4)
    assert "Oracle analysis (10 common problems)" in t.markdown()
    with pytest.raises(UserError, match="--oracle-helper"):
        report_command([], oracle_evicted=str(ev), echo=lambda s: None)


def test_mixed_problem_sets_are_refused(tmp_path, cli):
    root = tmp_path / "r"
    a = make_run(root, "a", [True, False])
    b = make_run(root, "b", [True, False, True], dataset={"name": "gsm8k", "limit": 3, "offset": 0})
    c = make_run(root, "c", [True, False], dataset={"name": "gsm8k", "limit": 2, "offset": 5})
    d = make_run(root, "d", [True, False], dataset={"name": "math500", "limit": 2, "offset": 0})
    for other in (b, c, d):
        res = cli("report", a, other)
        assert res.exit_code == 2, res.output
        assert "different problem sets" in res.stderr and "--allow-mixed" in res.stderr
        assert "Traceback" not in res.output
    res = cli("report", a, b, c, "--allow-mixed")
    assert res.exit_code == 0 and "limit=3" in res.stdout


def test_rescue_table_in_the_papers_table2_form(tmp_path):
    root = tmp_path / "r"
    full = [i < 8 for i in range(10)]  # full KV right on 0-7
    make_run(root, "full", full, evictor="none", helper=False, pruners=False)
    # evicted best-of-N right on 0-3, degenerate (wrong at the cap) on 6-9
    make_run(root, "bon", [i < 4 for i in range(10)], helper=False, pruners=False, base_tokens=400.0,
             cap=[i >= 6 for i in range(10)])
    make_run(root, "bon_random", [False] * 10, evictor="random", helper=False, pruners=False)
    make_run(root, "interleave", [i < 6 for i in range(10)], pruners=False, base_tokens=300.0)
    # KV-Rescue finished only problems 0-7 so far: every number of its row is on those 8
    make_run(root, "rescue", [i < 7 for i in range(8)], base_tokens=200.0, steps=4, helper_steps=1,
             cap=[i == 7 for i in range(8)], dataset={"name": "gsm8k", "limit": 10, "offset": 0, "shuffle": False})
    helper = make_run(root, "helper_only", [2 <= i < 6 for i in range(10)], evictor="none", helper=False,
                      pruners=False)
    cfg_path = helper / "config.resolved.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["proposers"] = {"helper": {"model": "helper", "n": 8}}
    cfg_path.write_text(yaml.safe_dump(cfg))

    t = _table(report_command([str(root / "*")], echo=lambda s: None), "rescue")
    assert len(t.rows) == 1  # one KV-Rescue run; bon_random is another evictor's baseline
    row = dict(zip(t.columns, t.rows[0]))
    assert row["setting"] == "rkv B=64 N=8" and row["problems"] == 8
    assert (row["full KV"], row["evicted"], row["KV-Rescue"]) == (1.0, 0.5, 7 / 8)
    assert row["lost to eviction"] == 0.5 and row["recovered"] == pytest.approx(0.75)
    assert row["oracle recovered"] == pytest.approx((6 / 8 - 0.5) / 0.5)  # evicted or helper: 0-5
    assert row["base tokens saved"] == pytest.approx(0.5) and row["saved by early exit"] == pytest.approx(1 / 3)
    assert row["degenerate: evicted"] == 0.25 and row["degenerate: KV-Rescue"] == 0.125
    assert row["helper steps"] == 0.25 and row["base candidates exited"] == pytest.approx(3 / 80)
    assert "Table 2 form" in t.markdown()
    assert not [t for t in report_command([str(root / "bon__*")], echo=lambda s: None) if t.name == "rescue"]


def test_cli_errors_and_csv(tmp_path, cli):
    res = cli("report", tmp_path / "nothing-here")
    assert res.exit_code == 2 and "no such results directory" in res.stderr
    (tmp_path / "plain").mkdir()
    assert "not a results directory" in cli("report", tmp_path / "plain").stderr
    assert cli("report").exit_code == 2
    run = make_run(tmp_path / "r", "one", [True, False])
    res = cli("report", run, "--csv")
    assert res.exit_code == 0
    (row,) = list(csv.DictReader(io.StringIO(res.stdout)))
    assert row["accuracy"] == "0.5" and row["variant"] == "interleave + early exit"
    assert load_runs([str(tmp_path / "r")])[0].label == run.name  # a parent dir expands to its runs


def test_report_import_is_light():
    import subprocess
    import sys

    code = ("import sys, kvflow.cli, kvflow.report; "
            "assert not {'torch', 'transformers', 'matplotlib'} & set(sys.modules), 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_budget_and_bits_of_a_byte_budget_run_come_from_the_manifest(tmp_path):
    """A `budget_bytes` run has no `budget` in its config: the report takes the converted token
    budget and the quantization bits from manifest.json `kv_memory`."""
    from kvflow.results.runs import Run

    config = {"proposers": {"base": {"evictor": {"kind": "breadthkv", "budget_bytes": 786432}}}}
    manifest = {"kv_memory": {"base": {"budget": 152, "bits": 4}}}
    run = Run(tmp_path, config, manifest, [], {}, True, ["base"])
    assert run.budget == 152 and run.evictor == "breadthkv (4-bit)"
    run = Run(tmp_path, config, {}, [], {}, True, ["base"])  # written before kv_memory existed
    assert run.evictor == "breadthkv" and run.budget == 64


def test_plot_marks_unfinished_runs(tmp_path, monkeypatch):
    from kvflow.report import plots

    root = tmp_path / "r"
    make_run(root, "full", [True] * 10, evictor="none", helper=False, pruners=False)
    make_run(root, "partial", [False] * 3, helper=False, pruners=False, metrics=False,
             dataset={"name": "gsm8k", "limit": 10, "offset": 0, "shuffle": False})
    runs = load_runs([str(root / "*")])
    partial = next(r for r in runs if r.name == "partial")
    assert not partial.complete and plots._unfinished(partial) == "unfinished: 3 of 10 problems"
    notes = []
    monkeypatch.setattr("matplotlib.axes.Axes.annotate", lambda self, text, *a, **k: notes.append(text))
    assert plots.accuracy_vs_budget(runs, tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"
    assert notes == ["unfinished: 3 of 10 problems"]  # the finished full-KV line is not annotated


def test_wilson_interval_and_paired_bootstrap_of_the_share_recovered():
    from kvflow.report.tables import recovery_interval
    from kvflow.results.stats import wilson

    # textbook Wilson 95% intervals
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    ids = [f"p{i}" for i in range(40)]
    full = {i: k % 4 != 0 for k, i in enumerate(ids)}  # 30/40
    evicted = {i: k % 4 == 1 for k, i in enumerate(ids)}  # 10/40, a subset of full's
    assert recovery_interval(full, evicted, full, ids) == (1.0, 1.0)  # recovers everything in every draw
    assert recovery_interval(evicted, evicted, full, ids) == (0.0, 0.0)
    half = {i: evicted[i] or (full[i] and k % 2 == 0) for k, i in enumerate(ids)}  # wins back 10 of 20 lost
    lo, hi = recovery_interval(half, evicted, full, ids)
    assert lo < 0.5 < hi and 0.2 < lo and hi < 0.8
    assert recovery_interval(half, evicted, evicted, ids) is None  # nothing lost, nothing to recover


def test_limit_reports_every_run_on_the_prefix_of_its_order(cli, tmp_path):
    """`--limit 16` makes a GSM8K-64 run comparable with a GSM8K-16 one of the same seeded
    order: without it they are refused as different sets. The 64-problem run is the committed
    full-KV reproduction run; the 16-problem one is made from it (its first 16 of the order)."""
    import json
    import shutil
    from pathlib import Path

    import yaml

    from kvflow.eval.datasets import load_problems

    repro = Path(__file__).parents[1] / "docs/results/repro/gsm8k/cpu_best_of_n__c01b256b"
    full64, full16 = tmp_path / "full64__a", tmp_path / "full16__b"
    shutil.copytree(repro, full64)
    shutil.copytree(repro, full16)
    first = {p.id for p in load_problems("gsm8k", limit=16, shuffle=True, seed=0)}
    records = [line for line in (full16 / "samples.jsonl").read_text().splitlines() if json.loads(line)["id"] in first]
    (full16 / "samples.jsonl").write_text("\n".join(records) + "\n")
    (full16 / "metrics.json").unlink()
    config = yaml.safe_load((full16 / "config.resolved.yaml").read_text())
    config["dataset"]["limit"] = 16
    (full16 / "config.resolved.yaml").write_text(yaml.safe_dump(config))
    manifest = json.loads((full16 / "manifest.json").read_text())
    manifest["dataset"]["limit"] = 16
    (full16 / "manifest.json").write_text(json.dumps(manifest))
    assert len(records) == 16
    refused = cli("report", full64, full16)
    assert refused.exit_code == 2 and "different problem sets" in refused.output
    result = cli("report", full64, full16, "--limit", "16", "--csv")
    assert result.exit_code == 0, result.output
    rows = {line.split(",")[0]: line.split(",") for line in result.output.splitlines()}
    for name in ("full64__a", "full16__b"):
        assert rows[name][5] == "16" and float(rows[name][7]) == 0.75  # problems, accuracy: 12 of the first 16
    too_many = cli("report", full16, "--limit", "17")
    assert too_many.exit_code == 2 and "covers 16 problems" in too_many.output


def test_leaderboard_ranks_evictors_against_full_kv(tmp_path):
    from kvflow.report import build_tables, load_runs
    from kvflow.results.stats import mcnemar_exact, wilson

    full = [True] * 6 + [False] * 2  # 6/8
    make_run(tmp_path, "lb_full", full, evictor="none", n=1, helper=False, pruners=False)
    # knorm: loses problems 0-3, gains 6: 3/8; McNemar on 4 broken / 1 rescued
    make_run(tmp_path, "lb_knorm", [False] * 4 + [True, True, True, False], evictor="knorm", n=1, helper=False,
             pruners=False, cap=[True] * 2 + [False] * 6)
    # snapkv: loses problem 0 only: 5/8
    make_run(tmp_path, "lb_snapkv", [False] + [True] * 5 + [False] * 2, evictor="snapkv", n=1, helper=False,
             pruners=False)
    make_run(tmp_path, "lb_knorm128", [True] * 8, evictor="knorm", budget=128, n=1, helper=False, pruners=False)
    runs = load_runs([str(tmp_path)])
    t = _table(build_tables(runs), "leaderboard")
    col = {c: i for i, c in enumerate(t.columns)}
    by = {(row[col["evictor"]], row[col["budget"]]): row for row in t.rows}
    # full KV first, then each budget ranked by accuracy
    assert [(row[col["evictor"]], row[col["budget"]], row[col["rank"]]) for row in t.rows] == [
        ("full KV (none)", "full", None), ("snapkv", "64", 1), ("knorm", "64", 2), ("knorm", "128", 1)]
    by = {k[0]: v for k, v in by.items() if k[1] in ("64", "full")}
    knorm = by["knorm"]
    assert knorm[col["accuracy"]] == 3 / 8 and knorm[col["accuracy 95% CI"]] == (
        f"[{wilson(3, 8)[0]:.0%}, {wilson(3, 8)[1]:.0%}]")
    assert knorm[col["broken / rescued"]] == "4 / 1" and knorm[col["McNemar p"]] == round(mcnemar_exact(1, 4), 4)
    assert knorm[col["Δ vs full KV"]] == (3 - 6) / 8 and knorm[col["hit token cap"]] == 2 / 8
    assert by["snapkv"][col["broken / rescued"]] == "1 / 0" and by["full KV (none)"][col["McNemar p"]] is None
    assert "Decode-time eviction leaderboard" in t.markdown()


def test_no_leaderboard_without_a_full_kv_run(tmp_path):
    from kvflow.report import build_tables, load_runs

    make_run(tmp_path, "a", [True, False], evictor="knorm", n=1, helper=False, pruners=False)
    assert not [t for t in build_tables(load_runs([str(tmp_path)])) if t.name == "leaderboard"]


def test_a_wrapped_evictor_is_named_with_its_allocation(tmp_path):
    from kvflow.results.runs import load_run

    path = make_run(tmp_path, "w", [True], evictor="keydiff", n=1, helper=False, pruners=False)
    config = yaml.safe_load((path / "config.resolved.yaml").read_text())
    config["proposers"]["base"]["evictor"]["allocation"] = {"kind": "adakv"}
    (path / "config.resolved.yaml").write_text(yaml.safe_dump(config))
    assert load_run(path).evictor == "keydiff+adakv"


def test_the_leaderboard_says_when_its_runs_computed_on_different_cpus(tmp_path):
    """manifest.json records the CPU (model, native bf16 instructions); a leaderboard over runs
    from two CPUs says so, since bf16 rounding, hence a problem's tokens, can differ between them."""
    import json

    from kvflow.report import build_tables, load_runs

    full = make_run(tmp_path, "c_full", [True, False], evictor="none", n=1, helper=False, pruners=False)
    evicted = make_run(tmp_path, "c_knorm", [True, True], evictor="knorm", n=1, helper=False, pruners=False)
    cpus = {full: {"model": "AMD EPYC 9R14", "cores": 2, "bf16_matmul": "avx512_bf16"},
            evicted: {"model": "Intel(R) Xeon(R) Processor", "cores": 2, "bf16_matmul": "amx_bf16"}}
    for path, cpu in cpus.items():
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "cpu": cpu}))
    note = _table(build_tables(load_runs([str(tmp_path)])), "leaderboard").note
    assert "different CPUs" in note and "AMD EPYC 9R14, bf16 matmul avx512_bf16" in note and "amx_bf16" in note
    manifest = json.loads((evicted / "manifest.json").read_text())
    (evicted / "manifest.json").write_text(json.dumps({**manifest, "cpu": cpus[full]}))
    assert "different CPUs" not in _table(build_tables(load_runs([str(tmp_path)])), "leaderboard").note


def test_a_runs_manifest_records_its_cpu():
    from kvflow.versions import cpu

    info = cpu()
    assert set(info) == {"model", "cores", "bf16_matmul"} and info["cores"] >= 1
    assert info["bf16_matmul"] in (None, "amx_bf16", "avx512_bf16")
