"""Evicted requests in vLLM's own KV blocks, attended by vLLM's own kernel (uniform budgets).

Runs in the vLLM worker process (`evict.py` routes a request here when its evictor keeps the
same count of tokens in every (layer, KV head): R-KV, SnapKV, StreamingLLM, H2O, random...).

Layout. vLLM's per-layer cache holds, per block and KV head, one key and value per slot. Slot i
of (layer l, head h) of an evicted request holds that head's i-th kept token in time order (keys
are stored after RoPE, so a slot's index need not match a position), exactly the layout of the
`hf` cache ([rows, kv_heads, N, D] per layer) and of kvflow's SGLang compaction. An evicted
request holds `phys` slots (the same count in every layer and head) while its logical length
(`next`, the RoPE position of its next token) keeps growing.

Seams (no vLLM file is changed; `evict.install` wires them):
- the KV cache manager (scheduler side): an evicted request takes blocks from vLLM's pool for
  its physical slots only (`allocate`: at most the blocks `budget + buffer` need), never looks
  up or fills the prefix cache, and counts as computed every token its KV already holds
  (`computed`); its blocks go back to the pool when it compacts (the tail past `budget`), ends
  (unless saved as a snapshot) or is preempted (its KV then waits outside the pool, `swap`);
- the scheduler (`_reserve_prefill_lookahead`, vLLM's last say on a request's tokens this
  step): an evicted request runs at most up to its next compaction per forward, so one request
  ingests any number of tokens (chunked prefill) with compactions where `hf` makes them;
- the model runner (`_prepare_inputs`, host side, before the forward): the attention metadata of
  an evicted request carry its physical length (`seq_lens`, the slot mapping over its block
  table), its positions stay logical (RoPE). The metadata stay vLLM's persistent tensors,
  rewritten in place: what a CUDA graph replays;
- the attention backend (`forward`, per layer): vLLM's kernel attends the evicted rows as any
  other; kvflow only writes the step's post-RoPE queries into a ring (fixed-shape `index_put`
  over the batch, with the token-to-row map the host wrote: capturable), adds H2O's statistic
  (`statistic.py`: one fixed-shape op over the observing rows' slots, capturable), and for an
  evictor that observes with its own `observe()` runs it per row (eager: refused under graphs);
- after the forward (`forwarded`, before vLLM's scheduler reads the step's output): a request
  that reached `budget + buffer` is compacted in place by the very `Evictor.select` the `hf`
  cache calls (same inputs: keys and values per head, the query window, the statistic, the same
  seeded generator; the requests of one evictor that compact in the same step together, as
  `hf`'s rows), and its tail blocks are freed at once, so the next schedule can admit a
  waiting request into them.

Snapshots (`save_as`) keep a request's blocks (a reference on each) with its counters, query
ring and statistic; a request `from` a snapshot gets blocks of its own and a copy of the
snapshot's (a fork copies blocks, not tensors of the model's shapes outside the pool). A
snapshot holds pool blocks only while no request waits for them (`spill`: its blocks' content
then waits in host memory), and a request vLLM preempts keeps its KV in host memory until vLLM
runs it again (its evicted tokens cannot be recomputed).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvflow.backends.vllm.in_worker.statistic import StatTable
from kvflow.backends.vllm.settings import kept_in_table


@dataclass
class Resident:
    """An evicted request whose KV lives in vLLM's blocks."""

    evictor: Any
    rng_key: int
    n_protected: int
    save_as: Optional[str]
    row: int  # its row of the query ring (0 when no ring)
    next: int  # logical position of the next token it takes (its KV holds what the ones before left)
    phys: int = 0  # slots it holds per (layer, KV head)
    written: int = 0  # queries it wrote into the ring
    compactions: int = 0
    in_table: bool = False  # its evictor's statistic (H2O's) lives in the worker's table, row `row`
    stats: Optional[list] = None  # an evictor's own observe(): per layer [kv_heads, trigger + 1] float32
    restore: Optional[tuple] = None  # ("blocks", [ids]) or ("data", [per-layer tensors]): its first blocks' content
    allocated: bool = False  # vLLM gave it blocks (its KV is in them)
    error: Optional[str] = None
    preemptions: int = 0
    blocks_peak: int = 0  # most blocks of vLLM's pool it held


@dataclass
class Snapshot:
    """An ended request's state: its KV in blocks it still references (or in `data` after a preemption)."""

    blocks: list  # vLLM KVCacheBlock objects, one reference each held by the snapshot
    data: Optional[list]  # per layer, the blocks' content (a snapshot taken while its request was swapped out)
    phys: int
    next: int
    written: int
    compactions: int
    ring: Optional[list]  # per layer [W, q_heads, D]: the request's query ring row
    stats: Optional[list]  # per layer [kv_heads, width]: its statistic (observing evictors)


class Paged:
    """vLLM's per-layer KV tensors ([blocks, kv_heads, block_size, 2 * D] each, vLLM's logical
    layout) seen per slot: read and write keys and values at (block, offset), copy whole blocks.
    Where a slot's key and value are inside a (block, head) depends on the attention backend:
    - "split" (FLASH_ATTN): each slot's content is its key, then its value;
    - "cpu" (CPU_ATTN): the block's keys, then its values, each laid out as vLLM's CPU kernel
      for this machine's ISA lays them out (AMX and AVX-512 tile them): `maps` give, for (slot
      offset, dim), the element's place in the (block, head)'s key (value) region, as learnt
      from vLLM's own write op (`evict.cpu_layout`).
    """

    LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "split"}

    def __init__(self, caches: list, layout: str, block_size: int, maps=None) -> None:
        self.caches, self.layout, self.block_size = caches, layout, block_size
        self.kmap, self.vmap = maps if maps is not None else (None, None)  # [block_size, D] int64 each
        # "cpu": each region's tiling as axes of (slot, dim) (`tiling`), so that compaction reads
        # whole blocks and untiles them with strided copies; None where a map is no such tiling
        tilings = [tiling(m) for m in (self.kmap, self.vmap)] if self.kmap is not None else [None, None]
        self.tilings = tilings if all(tilings) else None

    def _regions(self, layer: int):
        """(keys, values) of a layer: [blocks, kv_heads, block_size * D] (cpu) or [blocks, kv_heads, block_size, D] views."""
        kv = self.caches[layer]
        nb, h, bs, d2 = kv.shape
        if self.layout == "cpu":
            view = kv.view(nb, h, 2 * bs * (d2 // 2))
            return view[:, :, : bs * (d2 // 2)], view[:, :, bs * (d2 // 2):]
        return kv[..., : d2 // 2], kv[..., d2 // 2:]

    def read(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor):
        """keys, values of these slots: [kv_heads, n, D] each."""
        k, v = self._regions(layer)
        if self.layout == "cpu":
            b = blocks[:, None]
            return (k[b, :, self.kmap[offsets]].permute(2, 0, 1), v[b, :, self.vmap[offsets]].permute(2, 0, 1))
        return k[blocks, :, offsets].transpose(0, 1), v[blocks, :, offsets].transpose(0, 1)

    def keys_by_row(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Keys of rows of slots in one gather, heads second: blocks, offsets [M, s] -> [M, kv_heads, s, D]."""
        k, _ = self._regions(layer)
        heads = torch.arange(k.shape[1], device=k.device)[None, :, None]  # [1, Hkv, 1]
        if self.layout == "cpu":
            return k[blocks[:, None, :, None], heads[..., None], self.kmap[offsets][:, None]]
        return k[blocks[:, None, :], heads, offsets[:, None, :]]

    def read_rows(self, layer: int, ids: torch.Tensor, n: int):
        """Rows' first n slots, each row's in its blocks ids [rows, nb] (whole blocks gathered at
        once, untiled by one strided copy): keys, values [rows, kv_heads, n, D] each."""
        kv = self.caches[layer]
        rows, nb = ids.shape
        _, h, bs, d2 = kv.shape
        if self.layout == "cpu" and self.tilings is None:  # slot by slot
            j = torch.arange(n, device=kv.device)
            k, v = self.read(layer, ids[:, j // bs].reshape(-1), (j % bs).repeat(rows))
            return k.unflatten(1, (rows, n)).transpose(0, 1), v.unflatten(1, (rows, n)).transpose(0, 1)
        blocks = kv.index_select(0, ids.reshape(-1)).view(rows, nb, h, bs * d2)  # [rows, nb, h, block content]
        out = []
        for part in range(2):
            if self.layout == "cpu":
                region = blocks[..., part * bs * d2 // 2: (part + 1) * bs * d2 // 2]  # [rows, nb, h, bs * D]
                sizes, perm = self.tilings[part]
                grid = region.unflatten(-1, sizes).permute(0, 2, 1, *(3 + p for p in perm))  # [rows, h, nb, A, B, C, E]
            else:
                grid = blocks.view(rows, nb, h, bs, 2, d2 // 2)[:, :, :, :, part].transpose(1, 2)  # [rows, h, nb, bs, D]
            out.append(grid.reshape(rows, h, nb * bs, d2 // 2)[:, :, :n])
        return out[0], out[1]

    def row_writer(self, ids: torch.Tensor, m: int):
        """A writer of keys, values [rows, kv_heads, m, D] into each row's first m slots of every
        layer, the rows' blocks ids [rows, ceil(m / block_size)]: write(layer, keys, values).
        "split": whole blocks (slots past m get zeros); "cpu": one scatter per region over the
        flat cache (measured faster there than the tiles' strided copies or a (block, slot)
        index), its index computed once for all layers (the layers' caches share one shape)."""
        kv = self.caches[0]
        rows, nb = ids.shape
        _, h, bs, d2 = kv.shape
        d = d2 // 2
        if self.layout == "cpu":
            j = torch.arange(m, device=kv.device)
            base = (ids[:, j // bs] * (h * bs * d2))[:, None, :, None] \
                + (torch.arange(h, device=kv.device) * (bs * d2))[None, :, None, None]  # [rows, h, m, 1]
            at_keys = (base + self.kmap[j % bs][None, None]).flatten()  # [rows * h * m * D] flat places
            at_values = (base + (self.vmap[j % bs] + bs * d)[None, None]).flatten()

            def write(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
                flat = self.caches[layer].view(-1)
                flat.index_copy_(0, at_keys, keys.to(flat.dtype).flatten())
                flat.index_copy_(0, at_values, values.to(flat.dtype).flatten())
            return write
        index = ids.reshape(-1)

        def write(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            cache = self.caches[layer]
            blocks = torch.zeros(rows, nb, h, bs, 2, d, dtype=cache.dtype, device=cache.device)
            for part, x in enumerate((keys, values)):
                x = torch.nn.functional.pad(x, (0, 0, 0, nb * bs - m)).view(rows, h, nb, bs, d)  # [rows, h, nb, bs, D]
                blocks[..., part, :].copy_(x.transpose(1, 2))
            cache.index_copy_(0, index, blocks.view(rows * nb, h, bs, d2))
        return write

    def read_blocks(self, ids: list[int]) -> list:
        """These blocks' content per layer, in host memory (outside the pool: what a swap holds)."""
        index = torch.tensor(ids, dtype=torch.int64, device=self.caches[0].device)
        return [kv.index_select(0, index).cpu() for kv in self.caches]

    def write_blocks(self, ids: list[int], data: list) -> None:
        index = torch.tensor(ids, dtype=torch.int64, device=self.caches[0].device)
        for kv, part in zip(self.caches, data):
            kv.index_copy_(0, index, part[: len(ids)].to(kv.device))

    def over(self, data: list) -> "Paged":
        """The same layout over swapped-out blocks (`read_blocks`' result): block i is data's i-th."""
        return Paged(data, self.layout, self.block_size, (self.kmap, self.vmap))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.int64, device=self.caches[0].device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.caches[0].device)
        for kv in self.caches:
            kv.index_copy_(0, d, kv.index_select(0, s))


def tiling(where: torch.Tensor):
    """A region's layout as a tiling of (slot, dim), or None: `where` [block_size, D] gives each
    (slot, dim)'s place. A tiling splits slot t into (A, B) = (t // T, t % T) and dim d into
    (C, E) = (d // P, d % P) and lays the four axes out in some order (vLLM's CPU kernels: AMX's
    VNNI tiles, AVX-512's). Returns (the axes' sizes in layout order, the layout position of
    each logical axis A, B, C, E), such that region.unflatten(-1, sizes).permute(...) untiles."""
    import itertools

    bs, d = where.shape
    t, dim = torch.arange(bs)[:, None], torch.arange(d)[None, :]
    for tt in [x for x in range(1, bs + 1) if bs % x == 0]:
        for p in [x for x in range(1, d + 1) if d % x == 0]:
            digits = [(t // tt, bs // tt), (t % tt, tt), (dim // p, d // p), (dim % p, p)]  # A, B, C, E
            for order in itertools.permutations(range(4)):
                pos = torch.zeros(bs, d, dtype=torch.int64)
                for axis in order:
                    value, size = digits[axis]
                    pos = pos * size + value
                if torch.equal(pos, where.cpu()):
                    return tuple(digits[a][1] for a in order), tuple(order.index(a) for a in range(4))
    return None


class InBlocks:
    """Every evicted request of one vLLM worker whose KV is in vLLM's blocks (see the module docstring)."""

    def __init__(self, window: int, rows: int, span: int = 0) -> None:
        self.window, self.rows = window, rows  # W: the ring's length (the longest query window served); E rows
        self.live: dict[str, Resident] = {}  # vLLM's internal request id -> state, while vLLM has the request
        self.ended: dict[str, Resident] = {}  # requests vLLM freed, until the worker reads them (`end`)
        self.snapshots: dict[str, Snapshot] = {}
        self.free_rows = list(range(rows, 0, -1))
        self.paged: Optional[Paged] = None
        self.manager = self.pool = self.group = self.runner = None
        self.block_size = 0
        self.ring: list = []  # per layer [E + 1, W, q_heads, D] (row 0: the sink), made at the first forward
        self.tok_row = self.tok_pos = None  # [max tokens] int64: each token's ring row and position (0: not written)
        self.plan: list[tuple[str, Resident, int, int, int]] = []  # this forward: (rid, state, first token, end, phys before)
        self.last_tokens = 0
        self.compactions = 0
        self.stalls = 0  # steps in a row that scheduled nothing while nothing ran (`watch`)
        self.spills = 0  # snapshots swapped out of the pool for a waiting request
        self.proxy = None  # `replay.ReplayProxy`: the capturable part run as a replayed graph would
        self.table = StatTable(rows, span)  # H2O's statistic of rows up to S = span slots, kept in the forward

    # ------------------------------------------------------------------ admission and snapshots

    @torch.inference_mode()
    def take_row(self) -> int:
        if not self.window and not self.table.span:
            return 0
        if not self.free_rows:
            raise RuntimeError(f"more than {self.rows} evicted requests at once in this vLLM worker "
                               "(KVFLOW_VLLM_EVICTED_ROWS)")
        row = self.free_rows.pop()
        for ring in self.ring:
            ring[row].zero_()
        self.table.clear_row(row)
        return row

    @torch.inference_mode()
    def admit(self, rid: str, spec: dict, evictor, kv_heads: int, layers: int) -> None:
        if evictor.query_window > self.window:
            raise RuntimeError(f"the evictor's query window {evictor.query_window} is past this engine's "
                               f"{self.window} (KVFLOW_VLLM_QUERY_WINDOW)")
        for snap in spec.get("drop") or ():
            self.drop(snap)
        base = None
        if spec.get("from"):
            base = self.snapshots.get(spec["from"])
            if base is None:
                raise RuntimeError(f"snapshot {spec['from']!r} does not exist (dropped, or never made)")
            if base.next != int(spec["first"]):
                raise RuntimeError(f"snapshot holds {base.next} tokens, the request starts its evicted part "
                                   f"at {spec['first']}")
        elif int(spec["first"]) != 0:
            raise RuntimeError("an evicted request without a snapshot starts at its first token")
        r = Resident(evictor, int(spec["rng_key"]), int(spec["n_protected"]), spec.get("save_as"), self.take_row(),
                     int(spec["first"]))
        if evictor.observes_attention:
            if not evictor.bounded:
                raise RuntimeError("an unbounded evictor that observes attention cannot live in vLLM's blocks")
            r.in_table = kept_in_table(evictor)
            if not r.in_table:
                r.stats = [torch.zeros(kv_heads, evictor.trigger + 1) for _ in range(layers)]
            elif not r.row or evictor.trigger > self.table.span:
                raise RuntimeError(f"H2O's statistic of a row compacted at {evictor.trigger} slots: past the table's "
                                   f"{self.table.span} (KVFLOW_VLLM_STAT_SPAN)")
        if base is not None:
            r.phys, r.written, r.compactions = base.phys, base.written, base.compactions
            r.restore = ("blocks", [b.block_id for b in base.blocks]) if base.data is None else ("data", base.data)
            if base.ring is not None and r.row:
                for ring, part in zip(self.ring, base.ring):
                    ring[r.row].copy_(part)
            mine = self.stats_of(r)
            if base.stats is not None and mine is not None:
                for dst, src in zip(mine, base.stats):
                    w = min(dst.shape[-1], src.shape[-1])
                    dst.zero_()
                    dst[:, :w] = src[:, :w].to(dst.device)
        self.live[rid] = r

    def drop(self, snap: str) -> None:
        s = self.snapshots.pop(snap, None)
        if s is not None and s.blocks:
            self.pool.free_blocks(s.blocks)

    def end(self, rid: str) -> Optional[Resident]:
        r = self.ended.pop(rid, None)
        if r is None and rid in self.live:  # vLLM never had it (refused before scheduling)
            r = self.live.pop(rid)
            self._release_row(r)
        return r

    @torch.inference_mode()
    def kept(self, snap: str) -> dict:
        """A snapshot's resident keys and values per (layer, KV head), in time order (plain lists)."""
        s = self.snapshots[snap]
        keys, values = [], []
        if s.data is not None:  # swapped out: its blocks' content in host memory
            paged = self.paged.over(s.data)
            blocks, offsets = self._slots(list(range(s.data[0].shape[0])), s.phys, device=s.data[0].device)
        else:
            paged = self.paged
            blocks, offsets = self._slots([b.block_id for b in s.blocks], s.phys)
        for layer in range(len(paged.caches)):
            k, v = paged.read(layer, blocks, offsets)
            keys.append(k.float().tolist())
            values.append(v.float().tolist())
        stats = [x[:, : s.phys].float().tolist() for x in s.stats] if s.stats is not None else None
        return {"keys": keys, "values": values, "compactions": s.compactions, "stats": stats}

    def stats_of(self, r: Resident) -> Optional[list]:
        """The request's statistic per layer ([kv_heads, width] views), or None (its evictor observes nothing)."""
        if r.in_table:
            return self.table.row(r.row)
        return r.stats

    def _release_row(self, r: Resident) -> None:
        if r.row:
            self.free_rows.append(r.row)
            r.row = 0

    # ------------------------------------------------------------------ the KV cache manager (scheduler side)

    def computed(self, request) -> int:
        """Tokens of the request vLLM need not compute: those its KV (blocks, snapshot or swap) holds."""
        r = self.live[request.request_id]
        if r.next > request.num_tokens - 1:
            r.error = f"vLLM asked an evicted request for tokens it holds already ({r.next} of {request.num_tokens})"
        return min(r.next, request.num_tokens - 1)

    @torch.inference_mode()
    def allocate(self, request, num_new_tokens: int, num_lookahead_tokens: int):
        """Blocks for the request's physical slots after this step (None: the pool is short,
        vLLM then preempts or waits, as for any request)."""
        rid = request.request_id
        r = self.live[rid]
        ev = r.evictor
        if ev.bounded and r.phys + num_new_tokens > ev.trigger and r.error is None:
            r.error = (f"vLLM ran {num_new_tokens} tokens of an evicted request in one step, past budget + buffer "
                       f"({r.phys} held, compaction at {ev.trigger})")
        need = math.ceil((r.phys + num_new_tokens + num_lookahead_tokens) / self.block_size)
        held = self.group.req_to_blocks[rid]
        more = need - len(held)
        if more > self.pool.get_num_free_blocks() and not self.spill(more):
            return None
        new = self.pool.get_new_blocks(more) if more > 0 else []
        held.extend(new)
        r.blocks_peak = max(r.blocks_peak, len(held))
        if not r.allocated:
            r.allocated = True
            if r.restore is not None:  # its KV from the snapshot or the swap: into its own first blocks
                kind, content = r.restore
                ids = [b.block_id for b in held[: math.ceil(r.phys / self.block_size)]]
                if kind == "blocks":
                    self.paged.copy_blocks(content[: len(ids)], ids)
                else:
                    self.paged.write_blocks(ids, content)
                r.restore = None
        return self.manager.create_kv_cache_blocks((new,))

    @torch.inference_mode()
    def freed(self, request) -> None:
        """vLLM frees the request's blocks: it ended (keep a snapshot), or vLLM preempts it (its
        KV waits outside the pool until vLLM runs it again)."""
        rid = request.request_id
        r = self.live.get(rid)
        if r is None:
            return
        held = self.group.req_to_blocks.get(rid, [])
        used = held[: math.ceil(r.phys / self.block_size)] if r.allocated else []
        if not request.is_finished():
            if r.allocated:
                r.restore = ("data", self.paged.read_blocks([b.block_id for b in used]))
                r.allocated = False
            r.preemptions += 1
            return
        self.live.pop(rid)
        if r.save_as and r.error is None:
            if r.allocated:
                blocks, data = list(used), None
            elif r.restore is not None and r.restore[0] == "blocks":  # never ran: the snapshot it came from
                ids = set(r.restore[1])
                blocks, data = [b for b in self._snapshot_blocks() if b.block_id in ids], None
            else:
                blocks, data = [], (r.restore[1] if r.restore else None)
            for b in blocks:
                b.ref_cnt += 1  # the snapshot's reference: vLLM's free leaves these blocks taken
            ring = [ring[r.row].clone() for ring in self.ring] if r.row else None
            stats = self.stats_of(r)
            self.snapshots[r.save_as] = Snapshot(blocks, data, r.phys, r.next, r.written, r.compactions, ring,
                                                 [s.clone() for s in stats] if stats else None)
        self._release_row(r)
        self.ended[rid] = r

    def spill(self, need: int) -> bool:
        """Swap snapshots out of vLLM's pool (oldest first) until `need` blocks are free: a
        snapshot holds blocks only while nobody waits for them (as the prefix cache does), so
        finished candidates never keep a waiting request out. True when `need` blocks are free."""
        while self.pool.get_num_free_blocks() < need and self.spill_one():
            pass
        return self.pool.get_num_free_blocks() >= need

    @torch.inference_mode()
    def spill_one(self) -> bool:
        """Swap the oldest snapshot that holds blocks out of the pool (False: none does)."""
        s = next((s for s in self.snapshots.values() if s.blocks), None)
        if s is None:
            return False
        ids = [b.block_id for b in s.blocks]
        s.data = self.paged.read_blocks(ids)
        for r in self.live.values():  # requests forked from it, not yet in blocks of their own
            if r.restore is not None and r.restore[0] == "blocks" and r.restore[1] == ids:
                r.restore = ("data", s.data)
        self.pool.free_blocks(s.blocks)
        s.blocks = []
        self.spills += 1
        return True

    def _snapshot_blocks(self):
        for s in self.snapshots.values():
            yield from s.blocks

    # ------------------------------------------------------------------ forwards (runner side)

    @torch.inference_mode()
    def prepared(self, runner, num_scheduled) -> None:
        """After vLLM's `_prepare_inputs`: evicted rows get their physical lengths and slots."""
        self.plan = []
        batch = runner.input_batch
        n = batch.num_reqs
        qsl = runner.query_start_loc.cpu[: n + 1].tolist()
        if self.window and (self.tok_row is None or qsl[-1] > self.tok_row.shape[0]):
            raise RuntimeError(f"a step of {qsl[-1]} tokens, past the query ring's token map "
                               f"({0 if self.tok_row is None else self.tok_row.shape[0]}: KVFLOW_VLLM_STEP_TOKENS)")
        shift = [0] * n
        rows, poss, at = [], [], []
        observed = []  # the step's one-token rows whose statistic the table keeps (`statistic.StatTable.fill`)
        slot_tokens, slot_rows, slot_phys = [], [], []  # each evicted token: its index, batch row, physical slot
        for i, rid in enumerate(batch.req_ids[:n]):
            r = self.live.get(rid)
            if r is None:
                continue
            a, b = qsl[i], qsl[i + 1]
            start = int(batch.num_computed_tokens_cpu[i])
            if start != r.next and r.error is None:
                r.error = (f"vLLM ran tokens {start}.. of an evicted request whose KV ends at token {r.next}: "
                           "kvflow cannot follow")
            shift[i] = start - r.phys
            w = r.evictor.query_window if r.evictor.bounded else 0
            # only the queries its next compaction reads reach the ring: the last w before `trigger`
            first = max(a, b - self.window, a + r.evictor.trigger - w - r.phys) if w else b
            if r.row and self.window and first < b:
                j = torch.arange(first - a, b - a)
                at.append(torch.arange(first, b))
                rows.append(torch.full_like(j, r.row))
                poss.append((r.written + j) % self.window)
            if b - a == 1 and r.error is None and r.in_table:
                observed.append((a, r.row, r.phys + 1, self._ids(rid)))
            slot_tokens.append(torch.arange(a, b))
            slot_rows.append(torch.full((b - a,), i))
            slot_phys.append(torch.arange(r.phys, r.phys + b - a))
            self.plan.append((rid, r, a, b, r.phys))
        if self.table.stats:
            self.table.fill(observed, self.block_size)
        if not self.plan:
            return
        if at:
            index = torch.cat(at).to(self.tok_row.device)
            self.tok_row[index] = torch.cat(rows).to(self.tok_row.device)
            self.tok_pos[index] = torch.cat(poss).to(self.tok_pos.device)
            self.last_tokens = qsl[-1]
        dev = runner.seq_lens.device
        s = torch.tensor(shift, dtype=runner.seq_lens.dtype)
        runner.seq_lens[:n] -= s.to(dev)
        runner.optimistic_seq_lens_cpu[:n] -= s.to(runner.optimistic_seq_lens_cpu.dtype)
        # evicted tokens' slots: their physical positions over their block tables (vLLM wrote the
        # others' and the block tables, committed to the device, in `_prepare_inputs`)
        tokens, row, phys = torch.cat(slot_tokens), torch.cat(slot_rows), torch.cat(slot_phys)
        for table in batch.block_table.block_tables:
            bs, bt, slots = table.block_size, table.block_table.gpu, table.slot_mapping.gpu
            row_d, phys_d = row.to(bt.device), phys.to(bt.device)
            slots[tokens.to(slots.device)] = (bt[row_d, phys_d // bs].long() * bs + phys_d % bs).to(slots.dtype)

    def ensure_tables(self, layers: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        """The ring, the token map and the statistic's table exist (made before vLLM profiles
        its memory, before any graph is captured; a graph holds them as static buffers)."""
        if self.table.span and not self.table.stats:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kvflow's statistic table must exist before vLLM captures a CUDA graph")
            self.table.make(layers, kv_heads, device)
        if self.window and not self.ring:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kvflow's query ring must exist before vLLM captures a CUDA graph")
            size = int(os.environ.get("KVFLOW_VLLM_STEP_TOKENS", "65536") or 65536)
            self.tok_row = torch.zeros(size, dtype=torch.int64, device=device)
            self.tok_pos = torch.zeros(size, dtype=torch.int64, device=device)
            self.ring = [torch.zeros(self.rows + 1, self.window, q_heads, head_dim, dtype=dtype, device=device)
                         for _ in range(layers)]

    def write_ring(self, lid: int, query: torch.Tensor) -> None:
        """The step's post-RoPE queries into the ring: the same ops whatever the batch (capturable)."""
        t = query.shape[0]
        ring = self.ring[lid]
        ring.index_put_((self.tok_row[:t], self.tok_pos[:t]), query.reshape(t, *ring.shape[2:]).to(ring.dtype))

    def attended(self, impl, lid: int, query: torch.Tensor, layers: int) -> None:
        """kvflow's part of one layer's attention (after vLLM's kernel wrote and attended the step's KV)."""
        if self.window and self.ring and (self.last_tokens or self.table.fixed):  # eagerly: steps that write it
            if self.proxy is not None:
                self.proxy.run(lid, lambda q: self.write_ring(lid, q), query)
            else:
                self.write_ring(lid, query)
        if self.table.stats:  # H2O's statistic of the step's one-token rows (capturable)
            heads, scale = impl.num_heads, impl.scale
            if self.proxy is not None:
                self.proxy.run(("stat", lid), lambda q: self.table.accumulate(lid, q, self.paged, heads, scale), query,
                               self.table.as_at_capture)
            else:
                self.table.accumulate(lid, query, self.paged, heads, scale)
        for rid, r, a, b, p0 in self.plan:  # observing rows not in the table's entries: their own observe(), eagerly
            if r.error or not r.evictor.observes_attention or (r.in_table and b - a == 1):
                continue
            n = b - a  # a table row's prompt or chunk: its queries together, causally, as `hf` observes a prefill
            span = p0 + n
            blocks, offsets = self._slots(self._ids(rid), span)
            keys, _ = self.paged.read(lid, blocks, offsets)  # [Hkv, span, D]
            q = query[a:b].reshape(n, impl.num_heads, impl.head_size).transpose(0, 1)[None]  # [1, Hq, n, D]
            mask = torch.arange(span)[None, None, :] <= (p0 + torch.arange(n))[None, :, None]  # [1, n, span]
            r.evictor.observe(self.stats_of(r)[lid][None, :, :span], q, keys[None], mask.to(q.device), layer_idx=lid,
                              scaling=impl.scale)

    @torch.inference_mode()
    def forwarded(self) -> None:
        """After the forward, before vLLM's scheduler reads its output: counters, compactions."""
        plan, self.plan = self.plan, []
        due: dict[tuple, list] = {}  # requests that compact now, by (evictor, slots held): compacted together
        for rid, r, a, b, p0 in plan:
            n = b - a
            r.phys, r.next, r.written = p0 + n, r.next + n, r.written + n
            ev = r.evictor
            if ev.bounded and r.phys >= ev.trigger and r.error is None:
                due.setdefault((id(ev), r.phys), []).append((rid, r))
        for group in due.values():
            self.compact(group)
        if self.last_tokens:  # no token map or statistic entry outlives its forward (a replayed graph reads them)
            self.tok_row[: self.last_tokens].zero_()
            self.last_tokens = 0
        if self.table.entries:
            self.table.fill([], self.block_size)

    #: steps in a row that schedule nothing, nothing running, before waiting evicted requests fail
    STALL_STEPS = 64

    def watch(self, scheduled_tokens: int, running: int) -> None:
        """A tripwire, not a hang: an evicted request vLLM can never give its blocks (the pool
        smaller than `budget + buffer` needs, nothing left to free) fails with the reason."""
        self.stalls = self.stalls + 1 if scheduled_tokens == 0 and running == 0 else 0
        if self.stalls < self.STALL_STEPS:
            return
        free = self.pool.get_num_free_blocks()
        for r in self.live.values():
            if not r.allocated and r.error is None:
                r.error = (f"vLLM's KV pool has {free} free blocks of {self.block_size} tokens and nothing runs: "
                           f"this evicted request (compacted at {r.evictor.trigger} tokens) cannot get its blocks "
                           "(a larger `engine.kv_cache_memory_bytes`, or a smaller budget)")

    # ------------------------------------------------------------------ compaction (eager, between forwards)

    def _ids(self, rid: str) -> list[int]:
        return [b.block_id for b in self.group.req_to_blocks[rid]]

    def _slots(self, ids: list[int], n: int, device=None):
        j = torch.arange(n)
        dev = device if device is not None else self.paged.caches[0].device
        return torch.tensor(ids, dtype=torch.int64)[j // self.block_size].to(dev), (j % self.block_size).to(dev)

    def windows(self, rs: list[Resident]):
        """Where the requests' last W queries sit in the ring, oldest first (a position past what
        a request wrote holds zeros): (ring rows [rows, 1], positions [rows, W]), or None (W = 0)."""
        w = rs[0].evictor.query_window
        if not w:
            return None
        dev = self.ring[0].device
        rows = torch.tensor([r.row for r in rs], device=dev)[:, None]
        pos = (torch.tensor([r.written for r in rs])[:, None] - w + torch.arange(w)[None, :]) % self.window
        return rows, pos.to(dev)

    def compact(self, group: list[tuple[str, Resident]]) -> None:
        """Evict requests of one evictor holding the same slot count down to `budget` slots per
        (layer, KV head), as the `hf` cache does (its rows together, one `select` per layer),
        and give their tail blocks back to vLLM's pool."""
        rs = [r for _, r in group]
        ev, n, rows = rs[0].evictor, rs[0].phys, len(group)
        budget = ev.params.budget
        dev = self.paged.caches[0].device
        ids = torch.tensor([self._ids(rid)[: math.ceil(n / self.block_size)] for rid, _ in group], device=dev)
        kept_ids = ids[:, : math.ceil(budget / self.block_size)]  # [rows, blocks budget slots need]
        gens = [torch.Generator().manual_seed((r.rng_key * 1_000_003 + r.compactions) % 2**63) for r in rs]
        at = self.windows(rs)  # the query window's place in the ring
        lengths, protected = torch.full((rows,), n), torch.tensor([r.n_protected for r in rs])
        own = [self.stats_of(r) for r in rs] if ev.observes_attention else None

        def read(lid: int):
            keys, values = self.paged.read_rows(lid, ids, n)  # [rows, kv_heads, n, D]
            window = self.ring[lid][at].transpose(1, 2) if at is not None else None  # [rows, Hq, W, D]
            stats = torch.stack([x[lid][:, :n] for x in own]) if own else None  # [rows, kv_heads, n]
            return keys, values, window, stats

        write = self.paged.row_writer(kept_ids, budget)
        for lid, keep, (keys, values, _, stats) in ev.select_layers(
                len(self.paged.caches), read, lengths=lengths, n_protected=protected, generators=gens):
            idx = keep.to(keys.device)[..., None]  # [rows, kv_heads, budget, 1]
            write(lid, keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1])),
                  values.gather(2, idx.expand(-1, -1, -1, values.shape[-1])))
            if stats is not None:
                for i, x in enumerate(own):
                    kept = stats[i].gather(1, keep[i].to(stats.device))
                    x[lid].zero_()
                    x[lid][:, :budget] = kept
        for rid, r in group:
            r.phys = budget
            r.compactions += 1
            self.compactions += 1
            self.shrink(rid, math.ceil(budget / self.block_size))

    def shrink(self, rid: str, keep: int) -> None:
        """Free the request's blocks past its first `keep`, in vLLM's pool and in the runner's block table."""
        held = self.group.req_to_blocks[rid]
        tail = held[keep:]
        if not tail:
            return
        del held[keep:]
        self.pool.free_blocks(reversed(tail))
        batch = self.runner.input_batch
        index = batch.req_id_to_index.get(rid)
        if index is not None:
            for table in batch.block_table.block_tables:
                table.block_table.np[index, keep: table.num_blocks_per_row[index]] = 0
                table.num_blocks_per_row[index] = keep
        state = self.runner.requests.get(rid)
        if state is not None:
            for ids in state.block_ids:
                del ids[keep:]
