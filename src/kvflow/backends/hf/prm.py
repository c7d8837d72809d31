"""Loading a Qwen2.5-Math-PRM checkpoint on the `hf` backend (METHODS.md §10).

The model is a Qwen2 decoder body plus a two-class token head ``score = Sequential(Linear(h, h),
ReLU, Linear(h, 2))``; its checkpoint stores ``model.*`` and ``score.0.*`` / ``score.2.*``.
Its config names ``Qwen2ForProcessRewardModel`` and points `auto_map` at remote code, which
is written for transformers 4.x (vLLM marks it incompatible past 4.53). So:

- with ``trust_remote_code: true`` on the model entry the checkpoint's own class is tried
  first (kvflow only uses its ``.model`` body and ``.score`` head); if it does not load, a
  warning is logged and the rebuild below is used;
- otherwise (the default) kvflow rebuilds the architecture itself
  (`Qwen2ForProcessRewardModel` here, no remote code) and loads the weights into it.

A checkpoint that would silently act as a causal LM is refused: its ``config.architectures``
must name a reward/PRM class, and every ``score.*`` (and body) weight must be present, so a
randomly initialised head can never score anything.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen2Model
from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel

from kvflow.errors import UserError

log = logging.getLogger(__name__)

#: files a PRM load needs from a hub repo (weights, config, tokenizer)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_HINT = ("protocol qwen25-math-prm needs a PRM checkpoint with its score head, such as "
         "Qwen/Qwen2.5-Math-PRM-7B; to score with a causal LM use protocol math-shepherd "
         "(a Math-Shepherd PRM) or the llm_judge scorer")


class Qwen2ForProcessRewardModel(Qwen2PreTrainedModel):
    """Qwen2 body + two-class token head, with the checkpoint's module names (no remote code).

    `forward` returns the class logits [batch, T, 2]; softmax(...)[..., 1] is P(step correct).
    """

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = Qwen2Model(config)
        h = config.hidden_size
        self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 2))
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        return self.score(hidden.last_hidden_state)


def check_prm_config(config: dict, model_id: str) -> None:
    """Refuse a config that does not describe a Qwen2 process reward model."""
    archs = config.get("architectures") or []
    if not any("reward" in a.lower() or "prm" in a.lower() for a in archs):
        raise UserError(f"{model_id} is not a process reward model: config.architectures is {archs}, with no "
                        "reward/PRM head; loading it as a PRM would silently score with causal-LM logits", hint=_HINT)
    if config.get("model_type") not in ("qwen2", None):
        raise UserError(f"{model_id}: model_type {config.get('model_type')!r} is not a Qwen2 body; the "
                        "qwen25-math-prm protocol rebuilds Qwen2 PRMs only", hint=_HINT)


def check_prm_checkpoint(model_cfg: Any) -> None:
    """Refuse a model entry whose checkpoint is not a Qwen2 process reward model (before an
    engine that would serve it as a causal LM starts: backend sglang)."""
    config_file = _directory(model_cfg) / "config.json"
    if not config_file.is_file():
        raise UserError(f"{model_cfg.id}: no config.json in {config_file.parent}", hint=_HINT)
    check_prm_config(json.loads(config_file.read_text()), model_cfg.id)


def _directory(model_cfg: Any) -> Path:
    from kvflow.models.loading import resolve_source

    src = resolve_source(model_cfg.id, getattr(model_cfg, "gguf_file", None))
    if src.kind in ("catalog", "gguf") or src.gguf_file:
        raise UserError(f"{model_cfg.id} is a GGUF causal LM; a Qwen PRM needs a transformers checkpoint "
                        "(config.json + safetensors) with its score head", hint=_HINT)
    if src.kind == "dir":
        return Path(src.ref)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(src.ref, revision=getattr(model_cfg, "revision", None), allow_patterns=_HUB_PATTERNS))


def _remote(directory: Path, dtype: Any) -> Any:
    from transformers import AutoModel

    try:
        model = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=dtype)
        if not (hasattr(model, "model") and isinstance(getattr(model, "score", None), nn.Module)):
            raise TypeError(f"{type(model).__name__} has no `model` body and `score` head")
        return model
    except Exception as e:  # remote code written for transformers 4.x: fall back to the rebuild
        log.warning("remote PRM code did not load (%s: %s); using kvflow's Qwen2 PRM rebuild", type(e).__name__, e)
        return None


def load_qwen_prm(model_cfg: Any) -> tuple[Any, Any]:
    """(model with `.model` body and `.score` head, tokenizer) for a ModelConfig, in eval mode."""
    from transformers import AutoTokenizer

    from kvflow.models.loading import resolve_device

    directory = _directory(model_cfg)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise UserError(f"{model_cfg.id}: no config.json in {directory}", hint=_HINT)
    check_prm_config(json.loads(config_file.read_text()), model_cfg.id)
    dtype = model_cfg.dtype if model_cfg.dtype == "auto" else getattr(torch, model_cfg.dtype)
    model = _remote(directory, dtype) if model_cfg.trust_remote_code else None
    if model is None:
        model, info = Qwen2ForProcessRewardModel.from_pretrained(directory, dtype=dtype, output_loading_info=True)
        bad = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
        if bad:
            raise UserError(f"{model_cfg.id}: the checkpoint lacks PRM weights {bad[:6]}{' ...' if len(bad) > 6 else ''}; "
                            "a Qwen2.5-Math-PRM stores model.* and score.0/score.2", hint=_HINT)
    tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer or directory,
                                              trust_remote_code=bool(model_cfg.trust_remote_code))
    return model.to(resolve_device(model_cfg.device)).eval(), tokenizer
