"""W4A16: int4 weights in groups along K with a scale (and zero point) per group and output
feature, activations in 16/32-bit. AWQ, GPTQ and compressed-tensors each pack differently;
after loading every layer holds one layout that the kernels and the torch path read:

- ``qweight`` int32 [K / 8, N]: eight 4-bit values along K per int32, value k at bits
  4 * (k % 8) (GPTQ's order), unsigned 0..15;
- ``scales`` [ceil(K / G), N] (float16 for AWQ and GPTQ, as they write them; the model dtype for
  compressed-tensors);
- ``qzeros`` int32 [ceil(K / G), N / 8]: the zero points (0..15) packed along N, value n at bits
  4 * (n % 8); absent for symmetric weights (zero point 8).

``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``; GGUF's Q4_1 instead carries float ``mins``
[K / G, N]: ``w = q * s + m``. On CUDA (half precision) a Triton kernel
dequantizes tiles in registers inside the GEMM; the torch path dequantizes per matmul (the
parameters stay packed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.quantization.base import QuantizationMethod
from pagedllm.ops.int4_layout import (  # noqa: F401  (re-exported: the formats and tests use them here)
    PACK, dequantize, pack_cols, pack_rows, unpack_cols, unpack_rows,
)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds column AWQ_ORDER[i] of its 8


def check_group_size(group_size: int, method: str) -> int:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{method}: group_size {group_size} is not supported; supported: {list(SUPPORTED_GROUP_SIZES)}")
    return group_size


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                group_size: int, bias: torch.Tensor | None, mins: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times the canonical int4 weight (+ bias)."""
    k = x.shape[-1]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        from pagedllm.ops import triton_ops_for

        if triton_ops_for(x) is not None:
            from pagedllm.ops.triton_int4 import w4a16_linear

            return w4a16_linear(x, qweight, scales, qzeros, group_size, bias, mins=mins)
    return F.linear(x, dequantize(qweight, scales, qzeros, group_size, k, x.dtype, mins).t(), bias)


# A W4A16 model's layer chain launches early (PDL: PAGEDLLM_DECODE_PDL) only in forwards of at most this
# many tokens. GPTQ llama3-8b on an H200 (stop 59, a36e36f, `python -m pagedllm.benchmarks.latency --shape
# llama3-8b --batch-sizes 1,8,16,32,64,128 --num-iters 3 --quantization gptq`, PAGEDLLM_DECODE_PDL=1 and 0 in
# one call), ms a step early / in stream order: batch 1 3.087 / 3.253, 8 3.317 / 3.440, 16 3.643 / 3.594
# (stop 58: 32 rows 5.388 / 4.631). The 16-bit models' early launch helps at every batch up to 128.
CHAIN_PDL_MAX_ROWS = 8


def chain_pdl_max_rows(model: nn.Module) -> int | None:
    """The most tokens of a forward whose kernels launch early, for ``model`` (the worker hands it
    to ``triton_pdl.set_chain_max_rows``): CHAIN_PDL_MAX_ROWS where a linear layer runs W4A16, else None."""
    w4a16 = any(isinstance(getattr(m, "quant_method", None), Int4LinearMethod) for m in model.modules())
    return CHAIN_PDL_MAX_ROWS if w4a16 else None


class Int4LinearMethod(QuantizationMethod):
    """Base of the W4A16 formats: ``create_weights`` registers the checkpoint's layout,
    ``to_canonical`` turns it into the one above; ``apply`` runs that."""

    method_name = "int4"

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size, self.symmetric = group_size, symmetric

    def _check_sizes(self, layer: nn.Module) -> None:
        if layer.in_features % self.group_size:
            raise ValueError(f"{self.method_name}: the input size per rank ({layer.in_features}) is not a multiple of "
                             f"group_size {self.group_size}")
        if any(size % PACK for size in layer.sizes_per_rank):
            raise ValueError(f"{self.method_name}: output sizes per rank {layer.sizes_per_rank} are not multiples of 8")

    def to_canonical(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, qzeros = self.to_canonical(layer)
        for name in ("qweight", "scales", "qzeros", "weight_packed", "weight_scale", "weight_zero_point", "g_idx"):
            if name in layer._parameters:
                delattr(layer, name)
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.contiguous(), requires_grad=False)  # in the checkpoint's dtype
        layer.qzeros = None if qzeros is None else nn.Parameter(qzeros.contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int4_linear(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales, layer.qzeros, self.group_size, bias,
                        getattr(layer, "mins", None))
        return y.view(*x.shape[:-1], -1)
