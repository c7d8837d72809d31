"""Smaller things a newcomer hit (issue 34, 7), each pinned by a test that failed before."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO, run_kvflow

from kvflow.testing import tiny_pipeline


def test_validate_refuses_an_unknown_catalog_name_as_run_does(write, cli):
    """`kvflow validate` said ok to a catalog name that `kvflow run` then refused."""
    path = write("p.yaml", f"""
        include: {REPO / 'pipelines' / 'quickstart.yaml'}
        name: typo
        models:
          base: {{id: "catalog:smollm3-nope"}}
        """)
    result = cli("validate", path)
    assert result.exit_code == 2, result.output
    assert (f"{path}:4: models.base.id: unknown catalog model 'smollm3-nope'. "
            "Did you mean 'smollm2-135m-instruct'?") in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_runs_hint_names_a_pipeline_that_exists_from_the_current_directory(tmp_path):
    """The 'run a CPU pipeline instead' hint gave `pipelines/quickstart.yaml`, a path relative
    to the repository, also to a user running kvflow from anywhere else."""
    path = tiny_pipeline(tmp_path / "p", problems=1, model="kvflow-test/not-cached-anywhere")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_kvflow("run", str(path), cwd=elsewhere, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "is not available" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    (shown,) = set(re.findall(r"`kvflow run (\S+)`", proc.stderr))
    assert (elsewhere / shown).is_file(), shown  # an absolute path stays absolute under /
    assert Path(shown).is_absolute()
    inside = run_kvflow("run", str(path), cwd=REPO, env={"HF_HUB_OFFLINE": "1"})
    assert "`kvflow run pipelines/quickstart.yaml`" in inside.stderr  # from the checkout: relative


def test_report_does_not_compare_parameters_of_different_components_at_one_index():
    """`pruners[1].window` of a gzip pruner and of an n-gram pruner is not one field: the
    report named runs by it (`pruners[1].window=256` vs `64`) as if one setting had changed."""
    from kvflow.report.labels import differing_paths

    def config(second: dict, threshold: float = 2.5) -> dict:
        return {"proposers": {"base": {"pruners": [{"kind": "entropy", "threshold": threshold, "window": 32},
                                                   second]}}}

    gzip = {"kind": "gzip", "threshold": 0.25, "window": 256}
    ngram = {"kind": "ngram", "threshold": 4, "window": 64, "n": 3}
    assert differing_paths([config(gzip), config(ngram)]) == ["proposers.base.pruners[1].kind"]
    # the same component at that index: its parameters are compared as before
    assert differing_paths([config(gzip), config({**gzip, "window": 128}, threshold=3.0)]) == [
        "proposers.base.pruners[0].threshold", "proposers.base.pruners[1].window"]
