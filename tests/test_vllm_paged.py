"""`blocks.Paged`: reading and writing vLLM's KV blocks per slot and per row, on every layout kvflow meets.

Compaction reads the rows that compact together by whole blocks (`read_rows`: one gather of the
blocks, untiled by strided copies) and writes their kept slots back (`row_writer`); both must
agree slot for slot with the per-slot `read` for FLASH_ATTN's layout ("split"), vLLM's
CPU kernel's tiled layout (a VNNI-like tiling of slots and dims, found by `tiling`) and a CPU
layout that is no tiling (a random permutation: the per-slot fallback). No vLLM needed.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.backends.vllm.in_worker.blocks import Paged, tiling

BS, D, HEADS, BLOCKS = 32, 8, 2, 10


def _vnni(t: int, p: int) -> torch.Tensor:
    """A tiling's map: slot t, dim d -> (t // T, d // P, t % T, d % P) in row-major order (AMX's key layout)."""
    s, d = torch.arange(BS)[:, None], torch.arange(D)[None, :]
    return (s // t) * (t * D) + (d // p) * (t * p) + (s % t) * p + d % p


def _paged(kind: str) -> Paged:
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g) for _ in range(2)]
    if kind == "split":
        return Paged(caches, "split", BS)
    if kind == "tiled":
        return Paged(caches, "cpu", BS, (_vnni(16, 2), _vnni(2, 4)))
    perm = (torch.randperm(BS * D, generator=g).view(BS, D), torch.randperm(BS * D, generator=g).view(BS, D))
    return Paged(caches, "cpu", BS, perm)


def test_tiling_finds_vnni_maps_and_not_a_random_permutation():
    assert tiling(_vnni(16, 2)) is not None and tiling(torch.arange(BS * D).view(BS, D)) is not None
    assert tiling(torch.randperm(BS * D, generator=torch.Generator().manual_seed(1)).view(BS, D)) is None
    assert _paged("tiled").tilings is not None and _paged("random").tilings is None


@pytest.mark.parametrize("kind", ["split", "tiled", "random"])
def test_rows_read_and_written_as_slot_by_slot(kind):
    paged = _paged(kind)
    ids = torch.tensor([[3, 7], [1, 9], [4, 0]])  # three rows of two blocks each
    n, m = 50, 20  # the slots held, then kept
    j = torch.arange(n)
    keys, values = paged.read_rows(1, ids, n)  # [rows, h, n, D]
    for r in range(3):
        k, v = paged.read(1, ids[r, j // BS], j % BS)  # [h, n, D]
        assert torch.equal(keys[r], k) and torch.equal(values[r], v)
    new_k, new_v = keys[:, :, :m].flip(2) + 1, values[:, :, :m].flip(2) - 1
    other = [c.clone() for c in paged.caches]
    paged.row_writer(ids[:, :1], m)(1, new_k, new_v)
    for r in range(3):
        k, v = paged.read(1, ids[r, :1].expand(m), torch.arange(m))
        assert torch.equal(k, new_k[r]) and torch.equal(v, new_v[r])
    assert torch.equal(paged.caches[0], other[0])  # another layer untouched
    untouched = [b for b in range(BLOCKS) if b not in (3, 1, 4)]
    assert torch.equal(paged.caches[1][untouched], other[1][untouched])  # blocks past the kept ones untouched
