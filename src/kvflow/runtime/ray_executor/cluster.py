"""The Ray cluster a run's workers run on: whether Ray is installed and the address reachable
(checked before anything is written), the connection, and how many workers of how many GPUs
and CPUs it holds (docs/cluster.md)."""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from kvflow.errors import ConfigProblem, KvflowError, UserError

RAY_HINT = "install it with `pip install 'kvflow[ray]'` (or `scripts/install.sh ray`), or set run.executor: local"


class RayWorkerError(KvflowError):
    """The Ray workers could not decode the run (all died, or one failed outside a problem)."""


# --------------------------------------------------------------------------- checks and connection


def ray_address(flag: Optional[str]) -> tuple[Optional[str], str]:
    """(address, where it came from): `--ray-address`, else RAY_ADDRESS, else (None, "") for a
    local cluster started by this process."""
    if flag:
        return flag, "--ray-address"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env, "RAY_ADDRESS"
    return None, ""


def check(loaded, flag: Optional[str] = None) -> None:
    """What can be known before anything is written: Ray is installed, and the cluster address
    (if any) is reachable. A UserError naming `run.executor`, RAY_ADDRESS or `--ray-address`."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UserError(loaded.problem("run.executor", "`executor: ray` needs Ray, which is not installed in this "
                                       "environment", RAY_HINT))
    address, source = ray_address(flag)
    if address:
        why = unreachable(address)
        if why:
            raise UserError(ConfigProblem(f"<{source}>", 0, "", f"no Ray cluster at {address!r}: {why}",
                                          "start one (`ray start --head`) and give its address (host:6379), "
                                          f"or unset {source} to start a local cluster (docs/cluster.md)"))


def unreachable(address: str) -> Optional[str]:
    """Why a Ray address cannot be used, or None. `auto`/`local` are Ray's own words (checked
    by `ray.init`); `ray://host:port` is Ray Client; `host:port` is a cluster's GCS, tried
    with one TCP connection (Ray itself would retry for minutes)."""
    if address in ("auto", "local"):
        return None
    target = address.split("://", 1)[1] if "://" in address else address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return "not host:port (e.g. 10.0.0.1:6379), `auto`, or ray://host:10001"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return None
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e})"


def connect(flag: Optional[str] = None) -> tuple[bool, str]:
    """ray.init (unless this process is connected already). Returns (whether this call
    started the connection, and so must end it; the address in words)."""
    import ray

    if ray.is_initialized():
        return False, "this process's Ray"
    address, source = ray_address(flag)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    if address:
        kwargs["address"] = address
    else:
        kwargs["include_dashboard"] = False
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(ConfigProblem(f"<{source or 'ray.init'}>", 0, "", f"cannot connect to Ray: {e}",
                                      "check the address (docs/cluster.md)")) from None
    return True, address or "a local cluster"


# --------------------------------------------------------------------------- worker resources


def worker_gpus(loaded, cluster_gpus: float) -> int:
    """GPUs each worker asks Ray for: `run.worker_gpus`, else 0 on a cluster without GPUs, else
    one per GPU the used model entries occupy on their own (kvflow.planning.placement: an SGLang engine
    tp_size x dp_size x pp_size, any other entry 1; entries on `cpu` none)."""
    run = loaded.pipeline.run
    if run.worker_gpus is not None:
        return run.worker_gpus
    if cluster_gpus <= 0:
        return 0
    from kvflow.planning.placement import pipeline_demands
    from kvflow.runtime.compile import used_models

    return sum(d.gpu_count for d in pipeline_demands(loaded.pipeline.models, used_models(loaded)))


def worker_count(loaded, resources: dict, gpus: int, cpus: int) -> int:
    """`run.workers`, else as many as the cluster's GPUs (or, with none asked, CPUs) hold."""
    if loaded.pipeline.run.workers is not None:
        return loaded.pipeline.run.workers
    if gpus > 0:
        return max(1, int(resources.get("GPU", 0) // gpus))
    return max(1, int(resources.get("CPU", 1) // max(1, cpus)))
