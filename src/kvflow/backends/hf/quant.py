"""KIVI-style quantization of cached keys and values, stored packed (BreadthKV, METHODS.md §8).

Paper: "Precision for breadth" (BreadthKV, 2026): a fixed byte budget buys more tokens at
lower precision. The quantizer is KIVI's (Liu et al., ICML 2024, arXiv:2402.02750):

- keys per channel: for each group of `group` consecutive tokens, every channel gets its own
  scale and zero point (key outliers live in a few channels);
- values per token: every token gets a scale and zero point per group of `group` channels;
- asymmetric min/max: scale = (max - min) / (2^bits - 1), zero = min,
  code = round((x - zero) / scale) in [0, 2^bits - 1], x̂ = code * scale + zero, so
  |x - x̂| <= scale / 2 (plus the rounding of scale and zero to the cache dtype).

Codes are packed by bit plane along head_dim: plane j holds bit j of 8 consecutive codes in
one byte, so b-bit codes of a head_dim vector take exactly b * head_dim / 8 bytes for every
b in {2, 3, 4, 8} (head_dim must be a multiple of 8). Scales and zero points are stored in
the cache dtype. The byte accounting is `kvflow.kv_memory`; `QuantizedStore` allocates
exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BIT = torch.arange(8, dtype=torch.uint8)  # bit position within a packed byte


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] uint8 < 2^bits (D % 8 == 0) -> [..., bits * D // 8] uint8."""
    *lead, d = codes.shape
    groups = codes.view(*lead, d // 8, 8)  # [..., D/8, 8]
    bit = _BIT.to(codes.device)
    planes = [(((groups >> j) & 1) << bit).sum(dim=-1, dtype=torch.uint8) for j in range(bits)]  # bits x [..., D/8]
    return torch.cat(planes, dim=-1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., bits * D // 8] uint8 -> codes [..., D] uint8."""
    *lead, n = packed.shape
    planes = packed.view(*lead, bits, n // bits)  # [..., bits, D/8]
    bit = _BIT.to(packed.device)
    bitvals = (planes[..., None] >> bit) & 1  # [..., bits, D/8, 8]
    shift = torch.arange(bits, dtype=torch.uint8, device=packed.device)[:, None, None]
    codes = (bitvals << shift).sum(dim=-3, dtype=torch.uint8)  # [..., D/8, 8]
    return codes.reshape(*lead, (n // bits) * 8)


def _minmax_quantize(x: torch.Tensor, dim: int, bits: int, dtype: torch.dtype):
    """Asymmetric quantization of x along `dim`; scale and zero rounded to `dtype` first, so
    the codes are the best ones for the scales actually stored."""
    levels = 2**bits - 1
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).to(dtype)
    zero = lo.to(dtype)
    safe = scale.float().clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((x - zero.float()) / safe).round().clamp(0, levels).to(torch.uint8)
    return codes, scale, zero


def quantize_keys(k: torch.Tensor, bits: int, group: int):
    """Per-channel key quantization over token groups.

    k: [rows, heads, N, D] with N % group == 0
    returns codes [rows, heads, N, bits*D/8] uint8, scale and zero [rows, heads, N/group, D]
    """
    rows, heads, n, d = k.shape
    x = k.float().view(rows, heads, n // group, group, d)
    codes, scale, zero = _minmax_quantize(x, dim=3, bits=bits, dtype=k.dtype)
    return pack(codes.view(rows, heads, n, d), bits), scale.squeeze(3), zero.squeeze(3)


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group: int) -> torch.Tensor:
    """Inverse of `quantize_keys`: [rows, heads, N, D] in scale's dtype."""
    codes = unpack(packed, bits)  # [rows, heads, N, D]
    rows, heads, n, d = codes.shape
    x = codes.view(rows, heads, n // group, group, d).to(scale.dtype) * scale[:, :, :, None] + zero[:, :, :, None]
    return x.view(rows, heads, n, d)


def quantize_values(v: torch.Tensor, bits: int, group: int):
    """Per-token value quantization over channel groups.

    v: [rows, heads, N, D] with D % group == 0
    returns codes [rows, heads, N, bits*D/8] uint8, scale and zero [rows, heads, N, D/group]
    """
    rows, heads, n, d = v.shape
    x = v.float().view(rows, heads, n, d // group, group)
    codes, scale, zero = _minmax_quantize(x, dim=4, bits=bits, dtype=v.dtype)
    return pack(codes.view(rows, heads, n, d), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                      group: int) -> torch.Tensor:
    """Inverse of `quantize_values`: [rows, heads, N, D] in scale's dtype."""
    codes = unpack(packed, bits)
    rows, heads, n, d = codes.shape
    x = codes.view(rows, heads, n, d // group, group).to(scale.dtype) * scale[..., None] + zero[..., None]
    return x.view(rows, heads, n, d)


@dataclass
class QuantizedStore:
    """The quantized part of one layer's cache: slots [0, n_quantized[row]) of every row.

    key_codes, value_codes: [rows, kv_heads, capacity, bits*D/8] uint8
    key_scale, key_zero:    [rows, kv_heads, capacity/group, D]
    value_scale, value_zero: [rows, kv_heads, capacity, D/group]
    """

    bits: int
    group: int
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor

    FIELDS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")

    @classmethod
    def empty(cls, rows: int, kv_heads: int, capacity: int, head_dim: int, bits: int, group: int,
              dtype: torch.dtype, device) -> "QuantizedStore":
        if head_dim % 8 or head_dim % group:
            raise ValueError(f"quantize: head_dim {head_dim} must be a multiple of 8 and of group_size {group}")
        codes = torch.zeros(rows, kv_heads, capacity, bits * head_dim // 8, dtype=torch.uint8, device=device)
        kscale = torch.zeros(rows, kv_heads, capacity // group, head_dim, dtype=dtype, device=device)
        vscale = torch.zeros(rows, kv_heads, capacity, head_dim // group, dtype=dtype, device=device)
        return cls(bits, group, codes, kscale, kscale.clone(), codes.clone(), vscale, vscale.clone())

    @property
    def capacity(self) -> int:
        return self.key_codes.shape[2]

    def nbytes(self) -> int:
        return sum(getattr(self, f).numel() * getattr(self, f).element_size() for f in self.FIELDS)

    def map_rows(self, fn) -> "QuantizedStore":
        """A store whose every tensor is fn(tensor) along the row dim (select / cat helpers)."""
        return QuantizedStore(self.bits, self.group, *(fn(getattr(self, f)) for f in self.FIELDS))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every slot: two [rows, kv_heads, capacity, D] tensors."""
        keys = dequantize_keys(self.key_codes, self.key_scale, self.key_zero, self.bits, self.group)
        values = dequantize_values(self.value_codes, self.value_scale, self.value_zero, self.bits, self.group)
        return keys, values

    def write(self, rows: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize keys/values [len(rows), kv_heads, n, D] into slots [start, start + n) of
        `rows`; start and n are multiples of the group size."""
        g = self.group
        kc, ks, kz = quantize_keys(keys, self.bits, g)
        vc, vs, vz = quantize_values(values, self.bits, g)
        n = keys.shape[2]
        self.key_codes[rows, :, start:start + n] = kc
        self.key_scale[rows, :, start // g:(start + n) // g] = ks
        self.key_zero[rows, :, start // g:(start + n) // g] = kz
        self.value_codes[rows, :, start:start + n] = vc
        self.value_scale[rows, :, start:start + n] = vs
        self.value_zero[rows, :, start:start + n] = vz
