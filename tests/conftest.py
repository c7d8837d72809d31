"""Shared test fixtures: fixture paths, a YAML-writing helper, a CLI runner, and fake plugin
distributions (a dist-info with an entry_points.txt) for subprocess tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
VALID = DATA / "pipelines" / "valid.yaml"


@pytest.fixture
def write(tmp_path):
    """write("name.yaml", text) -> path of a dedented file under tmp_path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return _write


@pytest.fixture
def cli():
    """cli("validate", "x.yaml") -> click Result (exit_code, stdout, stderr), in-process."""
    from typer.testing import CliRunner

    from kvflow.cli import app

    # transformers' logger binds its handler to the sys.stderr of its first use; inside a
    # CliRunner that is a stream closed after the invocation, and a later warning then prints
    # "--- Logging error ---" with a traceback. Bind it to the session's stderr first.
    import transformers.utils.logging as hf_logging

    hf_logging.get_logger("transformers")
    runner = CliRunner()
    return lambda *args, **kw: runner.invoke(app, [str(a) for a in args], **kw)


def wait_for_first_record(out: Path, proc, timeout: float = 300) -> None:
    """Wait until a `kvflow run` subprocess has written a record under `out`, or has exited."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        files = list(out.glob("*/samples.jsonl"))
        if files and files[0].read_bytes().count(b"\n") >= 1:
            return
        time.sleep(0.02)


def require_sglang() -> None:
    """Skip a test that needs SGLang where it is not installed, except in CI (`CI` set), where
    `make test` installs it and a skipped SGLang test would hide a broken install."""
    from kvflow.backends.sglang.settings import check_installed

    why = check_installed()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the SGLang tests, but: {why}")
        pytest.skip(why)


def require_vllm() -> None:
    """Skip a test that needs vLLM's environment (`.venv-vllm`, or `KVFLOW_VLLM_PYTHON`) where it
    is missing, except in CI (`CI` set), where `make test` installs it."""
    from kvflow.backends.vllm.settings import check_installed

    why = check_installed()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the vLLM tests, but: {why}")
        pytest.skip(why)


_PINNED: dict[int, object] = {}  # worker id -> an engine this test process holds until it ends


def pin_for_session(engine):
    """Hold `engine`'s worker for the rest of this test process (once per worker): the engines
    the session reuses across modules (SGLang's and vLLM's on the shared tiny models) are then
    never idle, so another backend's start does not close them (the served core's one registry
    closes every idle worker before a new one starts) and the next module need not start them
    again. Released at the session's end (`_release_pinned`)."""
    if id(engine.worker) not in _PINNED:
        engine.worker.holders += 1
        _PINNED[id(engine.worker)] = engine
    return engine


@pytest.fixture(scope="session", autouse=True)
def _release_pinned():
    yield
    for engine in _PINNED.values():
        engine.close()
    _PINNED.clear()


@pytest.fixture(scope="session")
def shared_tiny_qwen():
    """One tiny Qwen2 directory for the whole session, so that every SGLang test on it shares
    one engine (an SGLang engine takes ~20 s to start on a CPU)."""
    from kvflow.testing.engine_parity import shared_model_dir

    return shared_model_dir("qwen2", seed=3)  # the evictor contract's engine axis uses the same one


def committed_steps(run_dir) -> dict:
    """Per problem of a results directory: its committed steps as (text, source, score to 4
    places), for comparing two runs' trajectories."""
    out = {}
    for r in map(json.loads, (Path(run_dir) / "samples.jsonl").read_text().splitlines()):
        out[r["id"]] = [(s["text"], s["source"], None if s["score"] is None else round(s["score"], 4))
                        for s in r["steps"]]
    return out


def run_shrunk_quickstart(tmp_path, cli, pipeline: Path) -> dict:
    """Run a shipped quickstart (`pipeline`, e.g. pipelines/sglang/quickstart.yaml) shrunk to 2
    problems on SmolLM2-135M (a real tokenizer, chat template and GGUF-converted weights)
    through the CLI; check its records (both problems committed steps, by base or helper, the
    helper proposed) and return its manifest."""
    from kvflow.testing import tiny_pipeline

    path = tiny_pipeline(tmp_path, include=pipeline, model="catalog:smollm2-135m-instruct", problems=2, n=2,
                         max_step_tokens=24, max_tokens=48)
    result = cli("run", path)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "results").iterdir()
    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["steps"] for r in records)
    assert {s["source"] for r in records for s in r["steps"]} <= {"base", "helper"}
    assert all(r["candidates"]["helper"] >= 1 for r in records)
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.fixture(scope="module")
def sglang_engine(shared_tiny_qwen):
    """The SGLang engine on `shared_tiny_qwen` (float32, CPU): one worker for the session,
    held by each module that uses it (released at the module's end: idle, it is reused by the
    next module that asks for it, or closed when another worker has to start)."""
    require_sglang()
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.config.schema import ModelConfig

    engine = pin_for_session(SGLangBackend.load(ModelConfig(backend="sglang", id=str(shared_tiny_qwen),
                                                            dtype="float32", device="cpu")))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(shared_tiny_qwen):
    """The `hf` engine on `shared_tiny_qwen` (float32, CPU), to compare SGLang with."""
    from kvflow.backends.hf import HFBackend
    from kvflow.config.schema import ModelConfig

    return HFBackend.load(ModelConfig(id=str(shared_tiny_qwen), dtype="float32", device="cpu"))


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Tests that install their own process-wide registry must not leak it."""
    yield
    from kvflow.registry import set_registry

    set_registry(None)


def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """A minimal installed distribution under `root` (put `root` on PYTHONPATH): modules as
    top-level .py files and a <dist>-0.1.dist-info with entry points in the `kvflow` group."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvflow]\n{eps}")
    return root


def run_kvflow(*args: str, pythonpath: Path | None = None, env: dict | None = None, cwd: Path | None = None,
               check_no_torch: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI's main() in a fresh interpreter. With check_no_torch, the interpreter then
    exits 99 if torch or transformers got imported."""
    code = (
        "import sys\nfrom kvflow.cli import main\nsys.argv = ['kvflow'] + sys.argv[1:]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code or 0\nelse:\n    rc = 0\n"
    )
    if check_no_torch:
        code += "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n" \
                "if heavy:\n    print('HEAVY IMPORTS:', heavy, file=sys.stderr); rc = 99\n"
    code += "sys.exit(rc)\n"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=120)


def pytest_configure(config):
    # Tiny models gain nothing from a second thread, and on a shared 2-core machine torch's
    # spinning worker threads slow them ~10x. Subprocess runs (e2e) keep the default.
    import torch

    torch.set_num_threads(1)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs two workers on two cores: the engines and `kvflow run` subprocesses a
        # test starts get one thread each too, instead of two workers' worth of spinning threads
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # every SGLang engine the tests start runs kvflow's decode hooks as a replayed CUDA graph
    # would (captured once per batch size, replayed after: kvflow.backends.sglang.in_worker.replay), so
    # that hooks a GPU's decode graphs would skip fail here (tests/test_sglang_replay.py)
    os.environ.setdefault("KVFLOW_SGLANG_REPLAY_PROXY", "1")
    config.addinivalue_line("markers", "slow: left out of the quick tier, `make test-fast` (see SLOW_FILES)")


# --------------------------------------------------------------------------- two tiers
# `make test` runs everything; `make test-fast` (`pytest -m "not slow"`) leaves out what starts
# an SGLang engine, a Ray cluster, a browser or a `kvflow run` subprocess on a real checkpoint,
# or builds the docs: the tests that make the full suite take many minutes. What stays covers
# every module at unit level, hf engines on tiny random models in-process included. A test is
# slow if its file is in SLOW_FILES (suites of engine or end-to-end runs), it uses a fixture of
# SLOW_FIXTURES, its function is in SLOW_TESTS (measured: seconds each, or an engine start), its
# class, name or parameters name SGLang (`[rkv-sglang]`, `...OnSGLang`), vLLM (`[vllm]`) or mkdocs, or it is `e2e`.
SLOW_FILES = {
    "test_deterministic.py", "test_e2e.py", "test_placement_pools.py", "test_scheduler_runs.py",
    "test_sglang.py", "test_sglang_data_parallel.py", "test_sglang_evicted.py", "test_sglang_gpu_settings.py",
    "test_sglang_scoring.py", "test_tutorials.py", "test_view_browser.py", "test_serve.py", "test_serve_sglang.py",
    "test_vllm.py", "test_vllm_evicted.py", "test_vllm_scoring.py", "test_serve_harness.py",
    "test_serve_deterministic.py",
}
SLOW_FIXTURES = {"sglang_engine", "hf_engine", "ray_cluster", "shared_tiny_qwen"}
SLOW_TESTS = {
    "test_every_catalog_checkpoint_greedy_decodes_the_same_on_hf_and_sglang",
    "test_the_general_hook_costs_what_the_specialised_one_saves",
    "test_an_own_observer_under_gpu_decode_graphs_is_refused_at_validation",
    "test_the_decode_step_replayed_on_new_tables_equals_it_run_eagerly",
    "test_the_proxy_replays_a_hooks_python_decisions_as_they_were_at_capture",  # 15 s
    "test_calibrate_bits_end_to_end",  # 22 s, a subprocess (the quick tier: test_cli's refusal)
    "test_an_engine_built_for_rkv_reads_no_kv_in_its_hook_and_keeps_hfs_tokens",  # an SGLang engine, 30 s
    "test_every_component_example_passes_its_contract_suite",  # 172 s: every contract suite, SGLang's too
    "test_sigkill_at_random_moments_resumes_exactly", "test_sigint_stops_cleanly_with_exit_130_and_resumes",
    "test_a_catalog_checkpoint_in_bf16_gives_each_problem_the_same_run_alone_and_among_3_others",  # 2 runs, 25 s
}
_SLOW_ID = re.compile(r"sglang|vllm|mkdocs", re.I)  # in the test's class, name or parameters (not its file)


def _slow(item) -> bool:
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    return (Path(str(item.fspath)).name in SLOW_FILES or name in SLOW_TESTS
            or bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))
            or bool(_SLOW_ID.search(item.nodeid.split("::", 1)[-1])) or item.get_closest_marker("e2e") is not None)


#: seconds a file's tests took (both workers of `make test` busy, 2-core Xeon, 2026-12-06:
#: `pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=0`), for the order below; a
#: file not listed counts 0. A file's share moves with what ran before it in its worker (an
#: SGLang engine another file left idle is reused, one of other arguments is closed first)
FILE_SECONDS = {
    "test_sglang.py": 185, "test_sglang_gpu_settings.py": 155, "test_catalog_engines.py": 105,
    "test_sglang_evicted.py": 100, "test_sglang_profiles.py": 100, "test_sglang_scoring.py": 95,
    "test_serve_sglang.py": 80, "test_ray_executor.py": 70, "test_sglang_data_parallel.py": 65,
    "test_evictor_contract_kvpress.py": 70, "test_serve.py": 60, "test_evictor_contract.py": 60, "test_vllm.py": 55, "test_scorer_contract.py": 55,
    "test_vllm_evicted.py": 55, "test_pruner_contract.py": 55, "test_reliability.py": 50,
    "test_sglang_replay.py": 50, "test_e2e.py": 45, "test_doctor.py": 45, "test_batch_invariant.py": 45, "test_serve_deterministic.py": 35, "test_serve_harness.py": 40,
}


def pytest_collection_modifyitems(config, items):
    slow_files = set()
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
            slow_files.add(item.fspath)
    # The longest files first, then the other files with slow tests (stable otherwise): `make
    # test` hands whole files to its two workers in this order (xdist's loadfile, with
    # --no-loadscope-reorder: xdist would order files by their number of tests, which put the
    # catalog's four engine tests last), a file to whichever worker is free, so the long ones
    # started first finish together instead of one worker running a late engine suite alone.
    items.sort(key=lambda item: (-FILE_SECONDS.get(Path(str(item.fspath)).name, 0), item.fspath not in slow_files))


def require_ray() -> None:
    """Skip a test that needs Ray where it is not installed, except in CI (`CI` set), where
    `make test` installs it (the `ray` extra) and a skipped Ray test would hide a broken install."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        why = "Ray is not installed (pip install 'kvflow[ray]', or scripts/install.sh ray)"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Ray tests, but: {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the test session (2 CPUs), joined by every in-process
    `executor: ray` run; yields its address, for `kvflow run` subprocesses (RAY_ADDRESS)."""
    require_ray()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
