"""Linear layers on CPU through oneDNN (the matmul library torch ships), not MKL's sgemm.

Measured on this project's 2-core AMD EPYC (AVX-512) at the shapes of a decode step
(docs/cpu_performance.md): MKL sgemm, which ``F.linear`` uses for float32, runs 2.5-3.5x
slower than oneDNN's kernel on the same plain (unpacked) weight, at 1, 32 and 512 rows;
in bfloat16 oneDNN is ~10-20% faster too. The weight stays the model's own tensor, so a
weight update or sleep mode needs nothing extra. Both compute in the input dtype (oneDNN's
float32 math mode is left strict).

A model's weights (``nn.Parameter``s, float32 or bfloat16) are also prepacked into oneDNN's
blocked layout on first use (``_reorder_linear_weight``, what inductor's freezing pass does):
another ~28% off a float32 decode step's projections at 32 rows on 2 cores in isolation
(scripts/cpu_linear_bench.py, weights staying in cache), ~10% inside the engine. A pack is a
second copy of its weight, so packs stop at an eighth of the machine's memory, and one is
remade when its weight's storage moved. The worker
calls ``forget_packed()`` after anything that may write weights in place (load_weights, sleep,
wake_up, a collective_rpc function); ``PAGEDLLM_CPU_PACKED_WEIGHTS=0`` turns packing off.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from pagedllm import envs

DISABLE_ENV = "PAGEDLLM_CPU_ONEDNN_LINEAR"  # "0": plain F.linear on CPU

# Decided once per process (the hot path pays no lookup); set back to None to decide again.
_ENABLED: bool | None = None
_DTYPES: tuple[torch.dtype, ...] = ()
_PACKING = False  # weights prepacked (below)


def onednn_enabled() -> bool:
    """Whether oneDNN takes the CPU linears; it sets the dtypes it takes: float32, and bfloat16
    only where oneDNN has bf16 kernels for this CPU (AVX512-BF16 / AMX; on others, AVX2 ones,
    it refuses the primitive, and F.linear runs)."""
    global _ENABLED, _DTYPES, _PACKING
    if _ENABLED is None:
        _PACKING = envs.PAGEDLLM_CPU_PACKED_WEIGHTS
        _ENABLED = (envs.PAGEDLLM_CPU_ONEDNN_LINEAR and torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        _DTYPES = (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)
    return _ENABLED


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for CPU tensors, on oneDNN where it applies (float32 or
    bfloat16, nothing needing gradients)."""
    if (onednn_enabled() and x.dtype in _DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and not (x.requires_grad or weight.requires_grad)
            and x.shape[-1] == weight.shape[1] and x.numel()):
        packed = _packed(weight) if isinstance(weight, torch.nn.Parameter) and _PACKING else None
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight if packed is None else packed, bias,
                                                  "none", [None], "")
    return F.linear(x, weight, bias)


# id(weight) → (a weak reference to it, its data_ptr when packed, its pack or None, the pack's bytes)
_PACKS: dict[int, tuple[weakref.ref, int, torch.Tensor | None, int]] = {}
_PACKED_BYTES = 0


def forget_packed() -> None:
    """Drop every pack (weights may have been written in place); they are remade on use."""
    global _PACKED_BYTES
    _PACKS.clear()
    _PACKED_BYTES = 0


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKS.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == weight.data_ptr():
        return entry[2]
    global _PACKED_BYTES
    if entry is not None:  # a stale pack: its weight moved, or the id was reused
        _PACKED_BYTES -= entry[3]
    size, packed = weight.numel() * weight.element_size(), None
    if _PACKED_BYTES + size <= _pack_budget():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        except RuntimeError:  # no blocked kernels for this dtype on this CPU: the plain weight serves
            packed = None
    used = size if packed is not None else 0
    _PACKED_BYTES += used
    _PACKS[id(weight)] = (weakref.ref(weight, _dead(id(weight))), weight.data_ptr(), packed, used)
    return packed


def _dead(key: int):
    """A weight's pack goes when the weight does (a model dropped in-process): its memory and
    its share of the budget are freed."""
    def drop(ref: weakref.ref) -> None:
        global _PACKED_BYTES
        entry = _PACKS.get(key)
        if entry is not None and entry[0] is ref:
            del _PACKS[key]
            _PACKED_BYTES -= entry[3]
    return drop


def _pack_budget() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
