"""`kvflow doctor`: does kvflow work on this machine, and what to do where it does not.

The first command to run on a new machine, and what to paste into a bug report. Each check
prints one line (`ok`, `warn`, `FAIL` or `skip`, what was found, and for anything but `ok`
what to do); the command exits 1 if any check failed. Checks, fastest first:

1. versions of kvflow's dependencies against kvflow's supported ranges (a failure) and the
   tested GPU set, `scripts/constraints-gpu.txt` (a warning: other versions may work);
2. the accelerator: CUDA devices and their memory as torch sees them;
3. which engines are importable (`hf` always; `sglang` where installed, at a tested version);
4. a tiny random-weight model through each available engine with an evictor: `hf` must
   reproduce plain greedy `generate` token for token with a budget past the sequence and keep
   evicting below it; `sglang` (on a GPU with its decode graphs on, as kvflow runs it) must
   decode `hf`'s tokens with R-KV evicting, and its tripwire must have counted every token;
5. with a PIPELINE: where `kvflow run` would place its models on this machine's GPUs (or on
   `--gpus`), and the KV pool each SGLang engine would get.

Seconds on the CPU for `hf`; an SGLang engine start adds tens of seconds (`--engines hf` skips it).
"""

from __future__ import annotations

import importlib.metadata
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

CONSTRAINTS = Path(__file__).resolve().parents[3] / "scripts" / "constraints-gpu.txt"
CHECKED = ("torch", "transformers", "sglang", "pydantic", "pluggy", "typer")


@dataclass
class Check:
    status: str  # ok | warn | FAIL | skip
    what: str
    todo: str = ""

    def line(self) -> str:
        return f"{self.status:>4}  {self.what}" + (f"\n      -> {self.todo}" if self.todo else "")


def tested_set() -> dict[str, str]:
    """The pinned versions of scripts/constraints-gpu.txt (empty where the file is not shipped)."""
    try:
        text = CONSTRAINTS.read_text()
    except OSError:
        return {}
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def check_versions() -> list[Check]:
    from kvflow.backends.hf.compat import check_transformers

    out = []
    pins = tested_set()
    for name in CHECKED:
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        pin = pins.get(name)
        if have is None:
            status, todo = ("skip", "optional: scripts/install.sh sglang") if name == "sglang" else \
                ("FAIL", f"install kvflow's dependencies: scripts/install.sh (missing {name})")
            out.append(Check(status, f"{name}: not installed", todo))
        elif pin and have.split("+")[0] != pin:
            out.append(Check("warn", f"{name} {have} (the tested GPU set has {pin})",
                             "other versions may work; `pip install -c scripts/constraints-gpu.txt ...` gives the tested set"))
        else:
            out.append(Check("ok", f"{name} {have}"))
    why = check_transformers()
    if why:
        out.append(Check("FAIL", f"transformers: {why}", "install a supported transformers (see the message)"))
    return out


def check_devices() -> tuple[list[Check], list[tuple[int, int]]]:
    import torch

    if not torch.cuda.is_available():
        return [Check("ok", f"no CUDA device: kvflow runs on the CPU (torch {torch.__version__}, "
                            f"{torch.get_num_threads()} threads)")], []
    gpus, out = [], []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append((i, int(p.total_memory)))
        out.append(Check("ok", f"cuda:{i} {p.name}: {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free, "
                               f"compute capability {p.major}.{p.minor}"))
    return out, gpus


def check_engines(want: tuple[str, ...]) -> tuple[list[Check], list[str]]:
    from kvflow.backends.sglang.settings import check_installed

    out = [Check("ok", "engine hf: importable (transformers, in-process)")]
    available = ["hf"]
    if "sglang" in want:
        why = check_installed()
        if why:
            out.append(Check("skip", f"engine sglang: {why}", "needed only for `backend: sglang` models"))
        else:
            out.append(Check("ok", f"engine sglang: importable (SGLang {importlib.metadata.version('sglang')})"))
            available.append("sglang")
    return out, available


def _timed(what: str, fn: Callable[[], Optional[str]], todo: str) -> Check:
    start = time.perf_counter()
    try:
        why = fn()
    except Exception as e:  # noqa: BLE001 - a doctor reports, it does not crash
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    took = f" ({time.perf_counter() - start:.1f} s)"
    return Check("ok", what + took) if why is None else Check("FAIL", f"{what}: {why}{took}", todo)


def check_tiny_models(available: list[str], device: str) -> list[Check]:
    from kvflow.testing.pipelines import tiny_model_dir

    directory = tiny_model_dir(Path(tempfile.mkdtemp(prefix="kvflow-doctor-")), "qwen2", seed=3)
    out = [_timed(f"hf on {device}: a tiny model with an evictor past the sequence equals greedy generate",
                  lambda: _hf_exact(directory, device),
                  "report it with this output: kvflow's hf cache differs from transformers here")]
    if "sglang" in available:
        out.append(_timed(f"sglang on {device}: R-KV evicting decodes hf's tokens; the tripwire counted every token",
                          lambda: _sglang_parity(directory, device),
                          "report it with this output (and the worker log it names)"))
    return out


def _config(directory: Path, backend: str, device: str):
    from kvflow.config.schema import ModelConfig

    return ModelConfig(backend=backend, id=str(directory), dtype="float32", device=device)


def _hf_exact(directory: Path, device: str) -> Optional[str]:
    import torch

    from kvflow.backends.hf import HFBackend
    from kvflow.components.engine import ProposeRequest, SamplingSpec, StartRequest
    from kvflow.registry import get_registry
    from kvflow.testing.engine_contract import run_to_end

    engine = HFBackend.load(_config(directory, "hf", device))
    rkv = get_registry().get("evictors", "rkv")
    prompt = "Natalia sold clips to 48 of her friends."
    spec = SamplingSpec(1, 0.0, 1.0, 24, "\x00never\x00")
    got = []
    for ev in (rkv(rkv.Params(budget=512, buffer=8, window=4)), rkv(rkv.Params(budget=16, buffer=8, window=4))):
        (state,) = engine.start([StartRequest(prompt, ev, 7)])
        (p,) = run_to_end(engine, [ProposeRequest(state, "base", spec, 0, 400)])
        got.append(list(p.candidates[0].token_ids))
        engine.release([state])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    want = model.generate(ids, max_new_tokens=len(got[0]), do_sample=False)[0, ids.shape[1]:].tolist()
    if got[0] != want:
        return f"tokens differ from generate at position {next(i for i, (a, b) in enumerate(zip(got[0], want)) if a != b)}"
    if not got[1]:
        return "the evicting run produced no token"
    return None


def _sglang_parity(directory: Path, device: str) -> Optional[str]:
    from kvflow.backends.sglang import SGLangBackend
    from kvflow.backends.hf import HFBackend
    from kvflow.registry import get_registry
    from kvflow.testing.engine_parity import greedy_steps

    rkv = get_registry().get("evictors", "rkv")
    params = rkv.Params(budget=16, buffer=8, window=4)
    engine = SGLangBackend.load(_config(directory, "sglang", device), evictors=[(rkv, params)])
    try:
        got, state = greedy_steps(engine, rkv(params))
        engine.release([state])
        info = engine.server_state()
    finally:
        engine.worker.close()  # the doctor's own engine: no SGLang process left behind
    want, _ = greedy_steps(HFBackend.load(_config(directory, "hf", device)), rkv(params))
    if [[t for t, _, _ in s] for s in got] != [[t for t, _, _ in s] for s in want]:
        return "SGLang's tokens differ from hf's with the same evictor"
    graphs = (engine.resolved or {}).get("cuda_graph_config")
    if not info.get("observed_tokens"):
        return "the tripwire counted no observed token"
    if device.startswith("cuda") and not _decode_graphs(graphs, engine.resolved):
        return f"SGLang resolved no decode graphs here ({graphs}): kvflow's captured hook was not exercised"
    return None


def _decode_graphs(config, resolved) -> bool:
    from kvflow.backends.sglang.settings import graphs_on

    return not (resolved or {}).get("disable_cuda_graph") and config is not None and graphs_on(config, "decode")


def check_pipeline(path: str, gpus: list[tuple[int, int]]) -> list[Check]:
    from kvflow.config import load_pipeline
    from kvflow.errors import UserError
    from kvflow.tools.explain import placement_lines

    try:
        loaded = load_pipeline(path)
    except UserError as e:
        return [Check("FAIL", f"{path}: " + "; ".join(p.format() for p in e.problems), "fix the pipeline (kvflow validate)")]
    if not gpus:
        return [Check("ok", f"{path}: valid; no GPU here, every model runs on the CPU (`--gpus 1x80` shows a placement)")]
    lines = placement_lines(loaded, gpus)
    refused = any("does not fit" in line for line in lines)
    return [Check("FAIL" if refused else "ok", "\n      ".join(lines),
                  "lower the fractions or move models (the lines above name the field)" if refused else "")]


def run_doctor(pipeline: Optional[str], *, engines: tuple[str, ...] = ("hf", "sglang"), gpus=None,
               echo: Callable[[str], None] = print) -> int:
    """Run every check, echoing each line as it completes; 1 if any failed, else 0."""
    checks: list[Check] = []

    def say(items: list[Check]) -> None:
        for c in items:
            checks.append(c)
            echo(c.line())

    echo("versions")
    say(check_versions())
    echo("devices")
    device_checks, cuda = check_devices()
    say(device_checks)
    echo("engines")
    engine_checks, available = check_engines(engines)
    say(engine_checks)
    echo("a tiny model through each engine")
    say(check_tiny_models(available, "cuda" if cuda else "cpu"))
    if pipeline:
        echo(f"pipeline {pipeline}")
        say(check_pipeline(pipeline, gpus if gpus is not None else cuda))
    failed = sum(c.status == "FAIL" for c in checks)
    echo(f"{'FAILED' if failed else 'ok'}: {len(checks)} checks, {failed} failed, "
         f"{sum(c.status == 'warn' for c in checks)} warnings")
    return 1 if failed else 0
