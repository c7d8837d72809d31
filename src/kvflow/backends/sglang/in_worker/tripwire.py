"""The tripwire: every token SGLang wrote into an evicted request's row went through kvflow's
hooks, or the scheduler stops (a mixin of `evict.Runtime`, called after each forward and before
a row is released). The evidence is `graph.Tables.seen`, a per-row counter the hook's own tensor
ops advance once per layer and forward -- in a replayed decode graph too.
"""

from __future__ import annotations

from typing import Optional


class TripwireError(RuntimeError):
    """An evicted request's token went through a forward without kvflow's hooks."""


class Tripwire:
    """The tripwire of `evict.Runtime`."""

    def check_observed(self, req, live, seen: Optional[list] = None) -> None:
        """The tripwire, after each forward and before a request's row is released: every token
        SGLang wrote into an evicted request's row went through kvflow's hooks (positions
        planned, and the hook's per-row counter -- `Tables.seen`, incremented by the hook's own
        tensor ops, in the decode graph too -- advanced by one per layer and forward). A stale or
        skipped graph, a compiled forward that dropped the hook or an attention path that bypasses
        `AttentionBackend.forward` leaves the counter behind; the evicted state would then be
        silently wrong, so the scheduler stops instead."""
        written, counted = int(req.kv.kv_committed_len), live.resident + live.pending
        layers = self.tables.layers
        missed = None
        if written != counted:
            missed = f"SGLang holds {written} tokens in its row, kvflow's hooks planned {counted}"
        elif live.pending:
            live.checked += layers
            got = seen[live.row] if seen is not None else int(self.tables.seen[live.row])
            if got != live.checked:
                missed = (f"kvflow's attention hook counted {got - live.checked + layers} of {layers} layers in its "
                          f"last forward ({live.pending} token(s))")
                live.checked = got
        if missed is not None:
            raise TripwireError(
                f"kvflow tripwire: evicted request {req.rid}: {missed}. Its query window, attention statistics and "
                "hole masks would be stale, so the engine stops rather than decode on. Cause: the forward ran "
                "without kvflow's hooks (a decode graph replayed without them: with KVFLOW_SGLANG_HOOKS=eager, "
                "models.<entry>.engine.disable_cuda_graph must be true; enable_torch_compile; an attention backend "
                "that bypasses AttentionBackend.forward). Rerun `kvflow run` to resume once the setting is fixed.")
        self.observed_tokens += live.pending
