"""The config layer: pipeline YAML -> validated pydantic models (DESIGN.md §3, §5).

- `schema`    the pydantic models of a pipeline file (the contract);
- `loader`    safe YAML with line numbers, duplicate-key and tag checks, `include:` + deep merge;
- `overrides` ``--set a.b=VALUE`` / ``--unset a.b``;
- `validate`  `load_pipeline()`: all of the above plus per-component `Params` validation.
"""

from kvflow.config.loader import Location, Locations, load_config
from kvflow.config.validate import (
    ComponentSpec,
    LoadedPipeline,
    ProposerComponents,
    PrunerSpec,
    ResolvedComponents,
    config_hash,
    load_pipeline,
)

__all__ = [
    "ComponentSpec", "LoadedPipeline", "Location", "Locations", "ProposerComponents", "PrunerSpec",
    "ResolvedComponents", "config_hash", "load_config", "load_pipeline",
]
