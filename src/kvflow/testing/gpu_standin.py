"""What SGLang would resolve on a GPU, computed on a machine without one.

SGLang picks many settings itself per device (sampling backend, attention backend, page size,
memory fraction...). kvflow reads them back from a running engine and refuses what its hooks
cannot serve (`kvflow.backends.sglang.settings.refusal`); this module runs SGLang's own
resolution (`ServerArgs.resolve_once`) for a CUDA device that is not there, through SGLang's
platform stand-in (`sglang.srt.runtime_context.override_platform`), so that tests on a CPU see
the settings a user's GPU would get -- e.g. `sampling_backend: flashinfer` on a Hopper, which
refuses kvflow's per-request seeds, or `trtllm_mha` with `page_size` 64 on a Blackwell.

    python -m kvflow.testing.gpu_standin '[[<engine kwargs>, "h100"], ...]'   # prints the resolved list

Run it in a process of its own (`resolve()` and `resolve_many()` do): SGLang chooses its platform class once per
process at import, and kvflow's CPU platform (plugins/kvflow-sglang-cpu) must stay out of it
(`KVFLOW_SGLANG_CPU=0`), as it is on a machine with a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: platform facts SGLang reads (sglang/srt/runtime_context.py `_PLATFORM_PROBES`) per GPU kind
PLATFORMS = {
    "h100": {"is_cuda": True, "has_flashinfer": True, "is_sm90": True, "is_hopper_with_cuda_12_3": True,
             "is_sm100": False, "is_sm100_or_sm110": False, "is_blackwell": False, "device_sm": 90,
             "device_capability": (9, 0)},
    "b200": {"is_cuda": True, "has_flashinfer": True, "is_sm90": False, "is_hopper_with_cuda_12_3": False,
             "is_sm100": True, "is_sm100_or_sm110": True, "is_blackwell": True, "device_sm": 100,
             "device_capability": (10, 0)},
    "a100": {"is_cuda": True, "has_flashinfer": True, "is_sm90": False, "is_hopper_with_cuda_12_3": False,
             "is_sm100": False, "is_sm100_or_sm110": False, "is_blackwell": False, "device_sm": 80,
             "device_capability": (8, 0)},
}


def resolve(engine_kwargs: dict, gpu: str, timeout: float = 300) -> dict:
    """SGLang's resolved server arguments for `engine_kwargs` (what kvflow passes to
    `sglang.Engine`) on a GPU of kind `gpu` (a key of PLATFORMS), plain values only."""
    return resolve_many([(engine_kwargs, gpu)], timeout)[0]


def resolve_many(cases: list[tuple[dict, str]], timeout: float = 300) -> list[dict]:
    """`resolve` for several (engine kwargs, gpu) cases in one process (SGLang imports once)."""
    for _, gpu in cases:
        if gpu not in PLATFORMS:
            raise ValueError(f"unknown GPU stand-in {gpu!r}; known: {', '.join(PLATFORMS)}")
    env = {**os.environ, "KVFLOW_SGLANG_CPU": "0"}
    out = subprocess.run([sys.executable, "-m", __name__, json.dumps([[k, g] for k, g in cases])],
                         capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"SGLang's resolution on a GPU stand-in failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _main(cases_json: str) -> None:
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    from kvflow.backends.sglang.in_worker.worker import resolved_settings

    resolved = []
    for kwargs, gpu in json.loads(cases_json):
        with override_platform(**PLATFORMS[gpu]):
            args = ServerArgs(**kwargs)
            args.resolve_once()
            resolved.append(resolved_settings(args))
    print(json.dumps(resolved))


if __name__ == "__main__":
    _main(sys.argv[1])
