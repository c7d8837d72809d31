"""Loading a `VLLMEngine` for a model entry: its arguments (`settings.py`), vLLM's interpreter,
one shared worker per set of arguments, and the tokenizer, EOS ids and KV shape kvflow's side needs."""

from __future__ import annotations

import sys
from pathlib import Path

_START_TIMEOUT_S = 900
WORKER = Path(__file__).parent / "in_worker" / "worker.py"


def load_engine(model_cfg):
    """The engine of a model entry; entries with the same engine arguments share one (one vLLM
    worker, one set of weights)."""
    from kvflow.backends.served.loading import model_facts
    from kvflow.backends.served.worker import hold
    from kvflow.backends.vllm.engine import VLLMEngine
    from kvflow.backends.vllm.settings import check_installed, engine_kwargs
    from kvflow.errors import EngineError
    from kvflow.models.loading import resolve_device

    where = f"models entry {model_cfg.id!r} (backend vllm)"
    why = check_installed()
    if why:
        raise EngineError(f"{where}: {why}")
    kwargs = engine_kwargs(model_cfg)
    worker = shared_worker(kwargs, where)

    def build() -> VLLMEngine:
        facts = model_facts(model_cfg, kwargs["model"], kwargs.get("tokenizer"), kwargs["trust_remote_code"])
        return VLLMEngine(worker, facts.tokenizer, vocab_size=facts.vocab_size, kv_shape=facts.kv_shape,
                          eos_ids=facts.eos_ids, device=resolve_device(model_cfg.device))

    return hold(worker, build)


def shared_worker(engine_kwargs: dict, where: str):
    """The running vLLM worker for these engine arguments (kvflow's OpenMP settings aside:
    `served.settings.engine_arguments`), started on first use with vLLM's interpreter
    (`settings.vllm_python()`)."""
    from kvflow.backends.served.settings import engine_arguments
    from kvflow.backends.served.worker import Worker, shared
    from kvflow.backends.vllm.settings import vllm_python, worker_env

    python = vllm_python()
    key = ("vllm", str(python), *sorted((k, repr(v)) for k, v in engine_arguments(engine_kwargs).items()))

    def start() -> Worker:
        return Worker.start([str(python), str(WORKER)], worker_env(engine_kwargs),
                            {"engine": engine_kwargs, "paths": import_roots()},
                            where=where, engine_name="vLLM", timeout=_START_TIMEOUT_S)

    return shared(key, start)


def import_roots() -> list[str]:
    """The directories the worker appends to its `sys.path`: this process's own import path but
    the standard library (kvflow's source, its plugins, editable installs, its environment's
    packages), so that kvflow's in-worker modules and an evictor's module import in the worker as
    they do here. Appended: vLLM's own packages (torch, transformers, pydantic) stay first."""
    base = str(Path(sys.base_prefix).resolve()) + "/"  # the interpreter's own installation: its standard library
    roots = []
    for entry in sys.path:
        path = Path(entry).resolve() if entry else None
        if path is None or not path.is_dir():
            continue
        if str(path).startswith(base) and path.name not in ("site-packages", "dist-packages"):
            continue
        roots.append(str(path))
    return list(dict.fromkeys(roots))
