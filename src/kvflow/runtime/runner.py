"""`kvflow run`: a validated pipeline over its dataset, into a results directory.

`run_pipeline` picks the run's executor (`run.executor`: `local`, this process's engines,
kvflow.runtime.local; `ray`, kvflow workers on a Ray cluster, kvflow.runtime.ray_executor) and
hands it to the run core (kvflow.runtime.core.run): check that every model is obtainable
(nothing loaded yet), open or resume the results directory, decode the problems not yet
recorded (each graded and appended the moment it finishes, in any order), then write metrics
and print a summary.
"""

from __future__ import annotations

from typing import Optional

from kvflow.config.validate import LoadedPipeline
from kvflow.errors import UserError
from kvflow.runtime import core, local
from kvflow.runtime.core import load_dataset, results_path, torch_run_settings

__all__ = ["run_pipeline", "load_dataset", "results_path", "torch_run_settings"]


def run_pipeline(loaded: LoadedPipeline, *, force: bool = False, registry=None, quiet: bool = False,
                 decode: Optional[core.Decode] = None, ray_address: Optional[str] = None) -> int:
    """`decode(loaded, registry, store, todo, quiet)` decodes the problems to do into the
    results directory (kvflow.runtime.core.Decode): by default this process's engines
    (`kvflow.runtime.local.decode`), or with `run.executor: ray` kvflow workers on a Ray
    cluster (`ray_address`, else RAY_ADDRESS, else a local one)."""
    pipe = loaded.pipeline
    if decode is None and pipe.run.executor == "ray":  # checked before anything is written
        from kvflow.runtime import ray_executor

        ray_executor.check(loaded, ray_address)
        decode = ray_executor.decoder(ray_address)
    elif ray_address and pipe.run.executor != "ray":
        raise UserError(loaded.problem("run.executor", "--ray-address is given, but the run's executor is local",
                                       "add --set run.executor=ray (docs/cluster.md)"))
    return core.run(loaded, decode or local.decode, force=force, registry=registry, quiet=quiet)
