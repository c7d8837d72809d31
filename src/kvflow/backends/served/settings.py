"""What every served backend does with a model entry's settings, before its worker starts.

A model entry's `engine:` mapping is passed to the engine over kvflow's defaults for the
device; kvflow sets the model, tokenizer, dtype, revision and remote-code arguments from the
entry itself (`RESERVED` per backend: refused under `engine:`), and refuses the settings its
hooks cannot run under (`REFUSED` rule tables: (key, bad(value), why)). Each backend's own
`settings.py` holds its names, defaults and rules; this module the shared steps.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

Rule = tuple[str, Callable[[Any], bool], str]  # (engine argument, bad(value), why)


def reserved_problem(engine: dict, reserved: dict) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first key under `engine:` that kvflow sets itself, or None.
    `reserved` maps the engine's argument name to the model entry's key of the same meaning
    (None: kvflow's own), or to a pipeline field ("run.deterministic")."""
    for key in engine:
        if key in reserved:
            own = reserved[key]
            source = f" from `{own}`" if own and "." in own else f" from the model entry's `{own}`" if own else ""
            return (f"engine.{key}", f"`{key}` is set by kvflow{source}")
    return None


def refused(settings: dict, rules: Iterable[tuple[Rule, str]]) -> Optional[tuple[str, str]]:
    """(field, sentence) for the first setting a rule refuses, or None. `rules`: (rule, what
    cannot run: "under kvflow", "an evicted proposer"); only the keys present are judged, so
    the same table judges what a user wrote and what the engine resolved for the device."""
    for (key, bad, why), what in rules:
        if key in settings and bad(settings[key]):
            return (f"engine.{key}", f"`{key}: {settings[key]}` cannot run {what}: {why}")
    return None


def model_problem(model_cfg, backend: str) -> Optional[str]:
    """Why a served backend cannot load this entry's weights, or None: they must be available
    here, and a transformers directory or catalog model (no engine here reads GGUF)."""
    from kvflow.models.loading import check_available, resolve_source

    why = check_available(model_cfg)
    if why:
        return why
    src = resolve_source(model_cfg.id, model_cfg.gguf_file)
    if src.kind == "gguf" or (src.kind == "dir" and src.gguf_file):
        return f"backend {backend!r} serves transformers directories and catalog models, not GGUF files"
    return None


def entry_kwargs(model_cfg, *, model: str, tokenizer: str, device: Optional[str] = None) -> dict:
    """The engine arguments kvflow takes from the entry itself (its directory must exist), under
    the engine's own names for the model and tokenizer paths (and the device, where it has one)."""
    from kvflow.models.loading import model_directory

    kwargs: dict[str, Any] = {model: str(model_directory(model_cfg)), "dtype": model_cfg.dtype,
                              "trust_remote_code": bool(model_cfg.trust_remote_code)}
    if device is not None:
        kwargs["device"] = device
    if model_cfg.tokenizer:
        kwargs[tokenizer] = str(model_directory(model_cfg, tokenizer=True))
    if model_cfg.revision:
        kwargs["revision"] = model_cfg.revision
    return kwargs
