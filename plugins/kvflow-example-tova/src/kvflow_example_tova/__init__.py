"""kvflow plugin `tova`: registers the TOVA evictor (see `kvflow_example_tova.evictor`).

The target is a lazy "module:Class" string, so `kvflow validate` and `kvflow ls` never
import torch for it; the class is imported when a pipeline uses `kind: tova-example`.
"""

import kvflow


@kvflow.hookimpl
def register_evictors(register):
    register("tova-example", "kvflow_example_tova.evictor:TovaEvictor")
