"""The canonical int4 layout's packing and math (``model/quantization/int4.py`` describes the
layout): int32 words of eight 4-bit fields, and the dequantization the kernels are tested
against. Here, below the model, so that the fused-MoE torch path reads int4 experts too."""
from __future__ import annotations

import torch

PACK = 8  # int4 values per int32


# ---- packing (int32 words, 4-bit fields) ---------------------------------------------------

def _shifts(device: torch.device) -> torch.Tensor:
    """The 8 nibbles' bit offsets, made on ``device`` (no host copy: a CUDA graph may be capturing)."""
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] int32 -> [R, 8 C] values 0..15; column 8 c + j from bits of nibble ``order.index(j)``
    (sequential without ``order``)."""
    vals = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 0xF  # [R, C, nibble]
    if order is not None:
        vals = vals[..., [order.index(j) for j in range(PACK)]]
    return vals.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [8 R, C]: value 8 r + i from nibble i of row r."""
    vals = (packed.unsqueeze(1) >> _shifts(packed.device).view(1, -1, 1)) & 0xF  # [R, nibble, C]
    return vals.reshape(-1, packed.shape[1])


def pack_cols(vals: torch.Tensor) -> torch.Tensor:
    """[R, 8 C] values 0..15 -> [R, C] int32, sequential nibbles."""
    v = vals.to(torch.int32).reshape(vals.shape[0], -1, PACK)
    return (v << _shifts(vals.device)).sum(dim=-1, dtype=torch.int32)


def pack_rows(vals: torch.Tensor) -> torch.Tensor:
    """[8 R, C] values 0..15 -> [R, C] int32: nibble i of row r holds value 8 r + i."""
    v = vals.to(torch.int32).reshape(-1, PACK, vals.shape[1])
    return (v << _shifts(vals.device).view(1, -1, 1)).sum(dim=1, dtype=torch.int32)


# ---- the canonical layout's math -----------------------------------------------------------

def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
               k: int, dtype: torch.dtype, mins: torch.Tensor | None = None) -> torch.Tensor:
    """[K, N] weight in ``dtype`` from the canonical layout (the reference of the kernels);
    with ``mins`` (GGUF Q4_1) ``q * s + m`` instead of ``(q - z) * s``."""
    q = unpack_rows(qweight)[:k]
    s = scales.float().repeat_interleave(group_size, 0)[:k]
    if mins is not None:
        return (q.float() * s + mins.float().repeat_interleave(group_size, 0)[:k]).to(dtype)
    z = unpack_cols(qzeros)[:, :q.shape[1]] if qzeros is not None else torch.full_like(scales, 8, dtype=torch.int32)
    z = z.repeat_interleave(group_size, 0)[:k]
    return ((q - z).float() * s).to(dtype)
