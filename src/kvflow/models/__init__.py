"""Model sources: the PyPI-backed GGUF catalog (`catalog`) and loading (`loading`).

Importing this package does not import torch; only `load_model` does.
"""

from kvflow.models.catalog import (
    BASE_MODELS,
    CATALOG,
    CatalogEntry,
    CatalogError,
    CatalogListing,
    get_entry,
    list_catalog,
    ls_command,
    pull,
    pull_command,
)
from kvflow.models.loading import (
    ModelSource,
    check_available,
    clear_model_cache,
    load_model,
    resolve_device,
    resolve_source,
)

__all__ = [
    "BASE_MODELS", "CATALOG", "CatalogEntry", "CatalogError", "CatalogListing", "ModelSource",
    "check_available", "clear_model_cache", "get_entry", "list_catalog", "load_model", "ls_command",
    "pull", "pull_command", "resolve_device", "resolve_source",
]
