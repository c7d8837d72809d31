"""What every benchmark script shares: the machine a result names, writing results, and the
scenarios several scripts run. Scripts run as `python bench/<script>.py`, so this directory is
on their import path: `from _common import machine_line, write_json`.

The machine is read from `lscpu` (the CPU's model name and logical cores; `/proc/cpuinfo` where
lscpu is missing) with its native bf16 matrix instructions (`kvflow.versions.cpu`: what decides
kvflow's numerics), the load average when the run started (the machines are shared: a ratio
measured in one run is comparable, an absolute figure across runs is not), and the GPU, if any.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name, from lscpu (else /proc/cpuinfo, else the platform's word)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("Model name", "").strip():
            return fields["Model name"].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from kvflow.versions import cpu

    return cpu()["model"] or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a run measured on (see the module docstring)."""
    from kvflow.versions import cpu

    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA: no GPU to name
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "bf16_matmul": cpu()["bf16_matmul"],
            "load": [round(x, 2) for x in load] if load else None, "gpu": gpu}


def machine_line(m: dict | None = None) -> str:
    """The machine in one line, for tables and prints."""
    m = m or machine()
    bf16 = f", {m['bf16_matmul']}" if m.get("bf16_matmul") else ", no native bf16"
    load = f", load {m['load'][0]:g}" if m.get("load") else ""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    return f"{m['cpu']}, {m['cores']} cores{bf16}{load}{gpu}"


def write_json(path: Path, obj: Any, indent: int = 1) -> None:
    """Write a JSON results file whole (its directory made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent) + "\n")


# --------------------------------------------------------------------------- shared scenarios


class StandInTokenizer:
    """A stand-in tokenizer for random-weight models: token i's text is "a" (no delimiter, no EOS)."""

    eos_token_id = None

    def __len__(self):
        return 8

    def decode(self, ids, **kw):
        return "a" * len(ids)


def dataset_prompts(engine, n: int) -> list[str]:
    """The first `n` GSM8K questions in the engine's chat template, asking for a boxed answer."""
    from kvflow.eval.datasets import load_problems

    problems = load_problems("gsm8k", limit=n)
    return [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": p.question + "\nPlease reason step by step, and put your final answer within \\boxed{}."}],
        tokenize=False, add_generation_prompt=True) for p in problems]


def never_stop_at_eos(engine) -> None:
    """Every run decodes to the same length: a greedy full-context candidate would end its
    answer with EOS long before an evicted one (which degenerates). Benchmark-only: the
    engine's EOS rule is switched off here (hf: its EOS table; a served engine: its EOS ids, and
    `ignore_eos` on every generate request it sends)."""
    import torch

    if hasattr(engine, "_eos"):  # hf's decode loop reads its EOS table
        engine._eos = torch.tensor([-1], dtype=torch.long)
        return
    engine.eos_ids = set()
    send = engine.worker.send

    def send_ignoring_eos(*msg):
        if msg[0] == "generate":  # ("generate", rid, ids, params, ...): SGLang's and vLLM's params
            msg = msg[:3] + ({**msg[3], "ignore_eos": True},) + msg[4:]
        return send(*msg)

    engine.worker.send = send_ignoring_eos

