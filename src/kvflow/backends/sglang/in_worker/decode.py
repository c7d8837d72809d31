"""The decode graph's host side: how each decode layer reaches `graph.decode_step`.

A mixin of `evict.Runtime`. In `graph` mode (the default) every decode layer runs
`graph.decode_step` over the whole batch (what SGLang's decode graph captures; under
`KVFLOW_SGLANG_REPLAY_PROXY=1`, as a replayed graph would: `replay.py`); rows whose evictor
observes with its own observe() are observed after it, eagerly (`observing.py`). In `eager`
mode (`KVFLOW_SGLANG_HOOKS=eager`, the old hooks) decode forwards take the extend path.
The tables are made at the first forward, before SGLang captures (`_ensure`).
"""

from __future__ import annotations

import contextlib

import torch

from kvflow.backends.sglang.in_worker.graph import Tables, decode_step


def capturing() -> bool:
    """Is SGLang capturing its decode graphs (engine start: two eager warm-up forwards, in
    which kvflow's tables are made, then the capture)?"""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return get_is_capture_mode() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class DecodeHost:
    """Decode forwards of `evict.Runtime`."""

    def hooked(self, backend, q, out, layer, forward_batch):
        """kvflow's part of one layer's attention (the AROUND hook's body); returns the output."""
        decode = forward_batch.forward_mode.is_decode()
        if self.mode == "graph" and decode:
            if not self.captured and capturing():
                self.captured = True
            if not (self.live or self.proxy is not None or self.captured):
                return out  # no kvflow request and nothing being captured: nothing to observe
            t = self._ensure(backend, layer, q)
            if self.skip:  # the fault injection: a stale graph, none of kvflow's ops
                return out
            kv = self.kv
            lid = layer.layer_id
            shapes = dict(lid=lid, scaling=layer.scaling, q_heads=layer.tp_q_head_num, kv_heads=layer.tp_k_head_num,
                          head_dim=layer.qk_head_dim, v_dim=layer.v_head_dim)
            k_buf, v_buf = kv.get_key_buffer(lid), kv.get_value_buffer(lid)
            req_to_token = self.req_to_token_pool.req_to_token

            def step(q_, out_, rpi, seq_lens):
                return decode_step(t, q_, out_, k_buf, v_buf, req_to_token, rpi, seq_lens, **shapes)

            out = self._run(step, lid, q, out, forward_batch)
            if self.own_observers:  # an eager forward (check_fits refused such evictors where graphs run)
                self.observe_rows(q, layer, self.own_observers)
            return out
        if self.proxy is not None and decode:  # `eager` hooks as a replayed graph runs them
            if self.tables is None:
                return out

            def per_row(q_, out_, rpi, seq_lens):
                if self.rows and not self.skip:
                    self.attended(q_, layer, forward_batch)
                    self.masked_attention(q_, out_, layer)
                return out_

            return self._run(per_row, layer.layer_id, q, out, forward_batch)
        if self.rows and not self.skip:
            self._ensure(backend, layer, q)

            def per_row_eager(q_, out_, rpi, seq_lens):
                self.attended(q_, layer, forward_batch)
                self.masked_attention(q_, out_, layer)
                return out_

            return self._run(per_row_eager, layer.layer_id, q, out, forward_batch, replayed=False)
        return out

    def _run(self, fn, lid, q, out, forward_batch, replayed: bool = True):
        counter = self.ops
        if counter is not None:
            counter.in_hook = True
        try:
            if self.proxy is None or not replayed:
                return fn(q, out, forward_batch.req_pool_indices, forward_batch.seq_lens)
            return self.proxy.run(lid, fn, q, out, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  self._as_at_capture)
        finally:
            if counter is not None:
                counter.in_hook = False

    @contextlib.contextmanager
    def _as_at_capture(self):
        """kvflow's Python state as SGLang's graph capture finds it: no kvflow rows planned."""
        rows, self.rows = self.rows, None
        try:
            yield
        finally:
            self.rows = rows

    def _ensure(self, backend, layer, q) -> Tables:
        t = self.tables
        if t is None:
            t = self.make_tables(getattr(backend, "req_to_token_pool", None) or self.req_to_token_pool,
                                 getattr(backend, "token_to_kv_pool", None) or self.kv)
        t.ensure(layer.layer_id, layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, q.dtype)
        return t
