"""Memory traffic of kvflow's decode hook, counted on meta tensors: the GPU cost no CPU shows.

On a GPU a decode step is bound by the bytes it moves, not by its arithmetic: SGLang's own
decode attention reads each row's keys and values once. `ByteCounter` is a dispatch mode that
sums, per aten operator, the bytes it reads and writes, so `decode_step` can be run on meta
tensors at a 7B's or a 72B's shapes (no memory, no GPU) and its traffic compared with one pass
of SGLang's attention over the same rows (`attention_pass_bytes`). Counting rules:

- views (view, permute, transpose, expand, slice, ...) move nothing;
- gathers (`index`, `index_select`, `gather`) read what they gather and their indices and
  write their output (not the whole source: a KV pool is mostly other requests' tokens);
- scatters (`index_put_`, `index_add_`, ...) read their values and indices and write (and, for
  accumulating ones, read) the elements they touch;
- any other operator reads its tensor inputs and writes its outputs, once each.

It is an accounting of what the ops ask for, not a cache model: a fused kernel could do
better, an unfused one no worse. `bench/sglang_decode_bytes.py` prints it per evictor and
shape; tests/test_sglang_decode_bytes.py bounds it.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_VIEWS = {aten.view, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.expand, aten.slice, aten.select,
          aten.unsqueeze, aten.squeeze, aten.alias, aten.as_strided, aten.reshape, aten.detach, aten.lift_fresh,
          aten.split, aten.unbind, aten.view_as, aten.expand_as, aten.narrow, aten._reshape_alias}
_GATHERS = {aten.index, aten.index_select, aten.gather}
_ACCUMULATE = {aten.index_add_, aten.index_add, aten.scatter_add_, aten.scatter_add}
_SCATTERS = {aten.index_put_, aten.index_put, aten._index_put_impl_, aten.scatter_, aten.scatter, aten.index_copy_,
             aten.index_copy, *_ACCUMULATE}


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(xs):
    for x in xs:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _tensors(x)


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by the operators dispatched under it (`read`, `written`,
    `by_op`: op name -> bytes). Works on any device; meant for meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0
        self.by_op: dict[str, int] = {}

    @property
    def total(self) -> int:
        return self.read + self.written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _VIEWS:
            return out
        if packet in _GATHERS:
            index_bytes = sum(_bytes(t) for t in _tensors(args[1:]))
            read, written = _bytes(out) + index_bytes, _bytes(out)
        elif packet in _SCATTERS:
            target = args[0]
            if packet in (aten.index_put_, aten.index_put, aten._index_put_impl_):
                indices = [i for i in args[1] if i is not None]
                touched = math.prod(torch.broadcast_shapes(*(i.shape for i in indices))) if indices else target.numel()
                elems = touched * math.prod(target.shape[len(args[1]):])
                index_bytes = sum(_bytes(i) for i in indices)
            else:  # (self, dim, index, source/src)
                source = args[3] if len(args) > 3 else kwargs.get("source", kwargs.get("src"))
                elems = source.numel() if isinstance(source, torch.Tensor) else _bytes(args[2]) // 8
                index_bytes = _bytes(args[2])
            touched_bytes = elems * target.element_size()
            read = touched_bytes + index_bytes + (touched_bytes if packet in _ACCUMULATE else 0)
            written = touched_bytes
        else:
            read = sum(_bytes(t) for t in _tensors(args)) + sum(_bytes(t) for t in _tensors(kwargs.values()))
            written = sum(_bytes(t) for t in _tensors(out if isinstance(out, (list, tuple)) else [out]))
        self.read += read
        self.written += written
        name = packet.__name__
        self.by_op[name] = self.by_op.get(name, 0) + read + written
        return out


def attention_pass_bytes(seq_lens, kv_heads: int, head_dim: int, v_dim: int, elem: int) -> int:
    """Bytes one decode attention pass reads from the KV pool for rows of these lengths (one
    layer): every resident key and value once. What SGLang's own decode kernel moves, at least."""
    return int(sum(seq_lens)) * kv_heads * (head_dim + v_dim) * elem


def hook_bytes(profile, *, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int, layers: int = 1,
               dtype=torch.bfloat16, pool_tokens: int = 1 << 20, context: int = 4096) -> ByteCounter:
    """Run one layer's `decode_step` for `batch` kvflow rows of `seq_len` slots each on meta
    tensors under a ByteCounter (the last layer of `layers`, which also moves the ring on).
    The tables are made outside the count (once per engine, not per step)."""
    from kvflow.backends.sglang.in_worker.graph import Tables, decode_step

    meta = torch.device("meta")
    req_to_token = torch.zeros(batch + 1, context, dtype=torch.int32, device=meta)
    t = Tables(req_to_token, layers, profile)
    lid = layers - 1
    t.ensure(lid, q_heads, kv_heads, head_dim, dtype)
    k_buffer = torch.empty(pool_tokens, kv_heads, head_dim, dtype=dtype, device=meta)
    v_buffer = torch.empty(pool_tokens, kv_heads, head_dim, dtype=dtype, device=meta)
    q = torch.empty(batch, q_heads * head_dim, dtype=dtype, device=meta)
    out = torch.empty(batch, q_heads * head_dim, dtype=dtype, device=meta)
    rpi = torch.arange(1, batch + 1, device=meta)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int64, device=meta)
    counter = ByteCounter()
    with counter:
        decode_step(t, q, out, k_buffer, v_buffer, req_to_token, rpi, seq_lens, lid=lid, scaling=head_dim ** -0.5,
                    q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=head_dim)
    return counter
