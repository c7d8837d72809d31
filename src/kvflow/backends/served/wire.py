"""The one message format between kvflow and an engine's worker process (SGLang's, vLLM's).

One JSON value per line, in both directions: stdin carries requests, stdout replies (the engine's
own prints go to stderr). Everything that crosses is plain data (lists, numbers, strings, null;
NaN and infinities as Python's json writes them), so a worker can run in another environment
(vLLM's) and nothing a worker sends is unpickled here. This module imports the standard library
only: vLLM's interpreter imports it from kvflow's import path.

The messages every worker speaks (a backend may add its own, e.g. SGLang's "state"):

    -> {"engine": kwargs, ...}                 first line: build the engine (backend's own fields)
    <- ["ready", info]                         info: the engine's version and resolved settings
    -> ["generate", rid, input_ids, params, ...]
    <- ["tokens", rid, ids, logprobs, top]     new tokens (deltas), each one's log p and its top-k
                                               [[logprob, id], ...] at temperature 1
    <- ["end", rid, finish, meta]              finish: one of FINISHES; meta: token counts (META_COUNTS)
                                               and counters of the engine's own
    -> ["score", rid, input_ids, start]        <- ["scored", rid, logprobs of input_ids[start:], meta]
    -> ["values", rid, input_ids, start, labels, need]
                                               <- ["scored", rid, {"first", "values"}, meta]
    -> ["abort", rid]                          the request ends soon with finish "abort"
    -> ["shutdown"]
    <- ["error", rid, message]                 a request failed (rid null: the worker failed)
"""

from __future__ import annotations

import json
from typing import Any, Optional

#: why a generate request ended, the same words on every engine
STOP_TOKEN = "stop_token"  # an end-of-sequence token (kvflow asks every engine to stop on EOS)
STOP_STRING = "stop_string"  # a stop string the engine matched (SGLang's, given the delimiter)
LENGTH = "length"  # the request's token cap
ABORT = "abort"  # aborted (by kvflow, or by the engine)
FINISHES = (STOP_TOKEN, STOP_STRING, LENGTH, ABORT)

#: the `meta` counts of an end or scored message (missing ones are 0); `*_peak` ones are maxima
META_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens")


def write_message(stream, msg: Any) -> None:
    """One message as one line (text stream). Tensors and arrays an engine hands back (hidden
    states, numpy scalars) go as their plain values (`tolist()`)."""
    stream.write(json.dumps(msg, default=_plain) + "\n")
    stream.flush()


def _plain(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} cannot cross to kvflow's process")


def read_message(stream) -> Optional[Any]:
    """The next message, or None at end of stream (blank lines skipped)."""
    for line in stream:
        if line.strip():
            return json.loads(line)
    return None
