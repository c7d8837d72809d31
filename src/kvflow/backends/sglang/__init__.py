"""The `sglang` backend: full-context proposers and scorers served by SGLang's engine.

- `engine.py`   the kvflow engine protocol over an SGLang worker (`SGLangEngine`);
- `worker.py`   the worker process that owns `sglang.Engine` (SGLang kills its parent when
                one of its processes dies, so that parent is not kvflow's own process);
- `client.py`   starting and talking to workers, one per set of engine arguments;
- `plugin.py`   kvflow's SGLang plugin (seeded sampling on every attention backend);
- `settings.py` the engine arguments: defaults per device, a model entry's `engine:`
                settings checked against SGLang's own server arguments.

Install: `scripts/install.sh sglang` (docs/backends.md). Evicted proposers stay on `hf`.
"""

from __future__ import annotations

from typing import Any, Optional

SUPPORTED_VERSIONS = ("0.5.23",)


class SGLangBackend:
    """SGLang's offline engine in a worker process (GPU, or CPU through kvflow's CPU platform).

    Registered as backend `sglang`; `load()` returns an `SGLangEngine`. Runs full-context
    proposers (evictor `none`) and the scorers that need prompt log-probabilities."""

    name = "sglang"
    evicts = False  # proposers with an evictor other than `none` are refused at validation

    @staticmethod
    def check(model_cfg) -> Optional[Any]:
        """None if the model can be served here, else why not: a sentence, or a
        (field under the model entry, sentence) pair."""
        from kvflow.backends.sglang.settings import check_installed, check_model, check_settings

        return check_installed() or check_settings(model_cfg) or check_model(model_cfg)

    @staticmethod
    def load(model_cfg):
        from kvflow.backends.sglang.settings import load_engine

        return load_engine(model_cfg)
