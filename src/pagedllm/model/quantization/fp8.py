"""FP8 (e4m3) weights: ``quant_method: "fp8"`` checkpoints (per-tensor ``weight_scale`` with
static or dynamic activations; block-wise ``weight_scale_inv``, DeepSeek/Qwen3-FP8), and
``quantization="fp8"`` online (a 16/32-bit checkpoint quantized at load, per output channel).

W8A8: activations are quantized too (dynamic per token, static per tensor, or per token and
128-column group with block-wise weights), so the product is an fp8 GEMM with fp32
accumulation: ``torch._scaled_mm`` on GPUs that have it (sm89+), a Triton block-scaled GEMM
for block-wise scales. Elsewhere (the CPU included) the weights stay fp8 in memory and each
matmul computes the same products in float32 from the fp8 values and their scales.

Under tensor parallelism a row-parallel layer's dynamic per-token scales are each rank's, over
the slice of the features it holds (no extra collective; vLLM does the same).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.quantization.base import (
    QuantizationConfig, QuantizationMethod, fill_const, matches_ignore, quant_param,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The smallest dynamic scale: an all-zero row must not divide by zero (vLLM's floor too).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

ACT_SCHEMES = ("dynamic", "static")


# ---- quantization of activations and weights (the CPU path and the references) ---------------

def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M, K], float32 scales [M, 1]): each row's absmax maps to 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K a multiple of ``group``) -> (fp8 [M, K], float32 scales [M, K / group])."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = (g.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (fp8 [N, K], float32 scales [N])."""
    q, scale = quantize_per_token(w)
    return q, scale.view(-1)


def block_scales_to_elements(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """[ceil(N / bn), ceil(K / bk)] block scales -> [N, K], each element its block's scale."""
    return scale.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]


# ---- the matmuls ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _fp8_mma(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_fp8_tensor_cores(x.device.index if x.device.index is not None
                                               else torch.cuda.current_device())


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dtype not in (torch.bfloat16, torch.float16) or not hasattr(torch, "_scaled_mm") or not _fp8_mma(x):
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def _triton_ok(x: torch.Tensor) -> bool:
    from pagedllm.ops import triton_ops_for

    return x.is_cuda and triton_ops_for(x) is not None


def quantize_activations(x: torch.Tensor, act_scheme: str, input_scale: torch.Tensor | None = None,
                         group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, float32 scales [M, 1] or [M, K / group]); one Triton launch on CUDA."""
    if _triton_ok(x):
        from pagedllm.ops.triton_fp8 import quantize_fp8

        from pagedllm.ops.triton_pdl import decode_pdl

        rows = x.numel() // x.shape[-1]
        return quantize_fp8(x, group, input_scale if act_scheme == "static" else None, pdl=decode_pdl(x.device, rows))
    if act_scheme == "static":
        return quantize_static(x, input_scale), input_scale.reshape(1, 1).expand(x.shape[0], 1)
    if group is not None:
        return quantize_per_token_group(x, group)
    return quantize_per_token(x)


def _small_row_config(x: torch.Tensor, weight: torch.Tensor, decode: dict | bool | None) -> dict | None:
    """Decode batches (up to ``triton_fp8.MAX_ROWS`` rows) on fp8 tensor cores: the Triton small-row
    kernel's config (``decode`` a config of its own; None: ``triton_fp8``'s tuning table, which may
    name ``torch._scaled_mm`` instead; False: never), or None."""
    if decode is False or not _fp8_mma(x) or not _triton_ok(x):
        return None
    from pagedllm.ops import triton_fp8

    if x.shape[0] > triton_fp8.MAX_ROWS:
        return None
    return dict(decode) if isinstance(decode, dict) else triton_fp8.decode_config(x.shape[0], *weight.shape)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               act_scheme: str | None, input_scale: torch.Tensor | None = None,
               decode: dict | bool | None = None, quantized: tuple | None = None) -> torch.Tensor:
    """``x`` [M, K] times the fp8 ``weight`` [N, K] with per-channel float32 ``weight_scale`` [N].
    ``act_scheme`` "dynamic": per-token activation scales; "static": ``input_scale`` (one value);
    None: weight-only (the activations stay in their dtype). ``decode``: see ``_small_row_config``.
    ``quantized``: ``x``'s per-token (fp8, scales) as the kernel that made ``x`` quantized it
    (dynamic activations; ``triton_ops.attached_fp8``), used instead of a quantize launch."""
    if act_scheme is None:
        w = (weight.to(x.dtype) * weight_scale[:, None].to(x.dtype)) if x.is_cuda else \
            (weight.float() * weight_scale[:, None]).to(x.dtype)
        return F.linear(x, w, bias)
    config = _small_row_config(x, weight, decode)
    xq, x_scale = quantized or quantize_activations(x, act_scheme, input_scale)
    if config is not None:
        from pagedllm.ops.triton_fp8 import fp8_small_m_linear
        from pagedllm.ops.triton_pdl import decode_pdl

        return fp8_small_m_linear(xq, x_scale, weight, weight_scale, bias, x.dtype, block_n=config["BLOCK_N"],
                                  block_k=config["BLOCK_K"], split_k=config["SPLIT_K"],
                                  num_warps=config["num_warps"], num_stages=config["num_stages"],
                                  block_m=config.get("BLOCK_M"), pdl=decode_pdl(x.device, xq.shape[0]))
    if _scaled_mm_ok(x, weight):
        # Row-wise scaled fp8 GEMM (both scales applied in its epilogue; the row-wise variant writes
        # bfloat16). Fast accumulation (Hopper's fp8 tensor-core sums, not promoted to fp32 every few
        # K steps, as vLLM's CUTLASS kernels run): 1-13% faster on an H200 from 512 rows (median 8%),
        # relative error 2.1e-3 against 1.7e-3 of the exact products (scripts/fp8_scaled_mm_probe.py).
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16, use_fast_accum=True)
        y = y.to(x.dtype)
    elif x.is_cuda:  # no fp8 tensor cores: the same products from dequantized operands
        y = F.linear(xq.to(x.dtype) * x_scale.to(x.dtype), weight.to(x.dtype) * weight_scale[:, None].to(x.dtype))
    else:
        y = ((xq.float() @ weight.float().t()) * (x_scale * weight_scale.view(1, -1))).to(x.dtype)
    return y if bias is None else y + bias


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     block: tuple[int, int]) -> torch.Tensor:
    """Block-wise fp8: ``weight`` [N, K] with one float32 scale per ``block`` (bn x bk) tile,
    activations quantized per token and bk-column group."""
    block_n, block_k = block
    xq, x_scale = quantize_activations(x, "dynamic", group=block_k)
    if _triton_ok(x) and x.dtype in (torch.bfloat16, torch.float16) and _fp8_mma(x):
        from pagedllm.ops.triton_fp8 import fp8_block_matmul

        y = fp8_block_matmul(xq, x_scale, weight, weight_scale, block, x.dtype)
    else:
        m, k = x.shape
        n = weight.shape[0]
        dtype = x.dtype if x.is_cuda else torch.float32
        x_dq = (xq.to(dtype).view(m, k // block_k, block_k) * x_scale[..., None].to(dtype)).view(m, k)
        w_dq = weight.to(dtype) * block_scales_to_elements(weight_scale, n, k, block_n, block_k).to(dtype)
        y = (x_dq @ w_dq.t()).to(x.dtype)
    return y if bias is None else y + bias


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ---- methods -------------------------------------------------------------------------------

class Fp8LinearMethod(QuantizationMethod):
    """Per-tensor or per-channel fp8 weight scales (after loading: always per channel, float32
    [N]); ``serialized`` False: the checkpoint is 16/32-bit and is quantized at load."""

    def __init__(self, serialized: bool, act_scheme: str | None, weight_strategy: str = "tensor",
                 scale_name: str = "weight_scale"):
        self.serialized, self.act_scheme, self.weight_strategy = serialized, act_scheme, weight_strategy
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module) -> None:
        if not self.serialized:
            layer.weight = layer._dense_weight()  # quantized in process_after_loading
            return
        quant_param(layer, [("out", 1), ("in", 1)], FP8_DTYPE, name="weight")
        if self.weight_strategy == "channel":
            quant_param(layer, [("out", 1), 1], torch.float32, dummy=fill_const(0.02), name=self.scale_name)
        else:
            quant_param(layer, [], torch.float32, per_shard=True, dummy=fill_const(0.02), name=self.scale_name)
        if self.act_scheme == "static":
            quant_param(layer, [], torch.float32, per_shard=True, dummy=fill_const(0.05), name="input_scale")

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            q, scale = quantize_weight_per_channel(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return
        scale = getattr(layer, self.scale_name).data
        if self.weight_strategy != "channel":  # one value per fused projection -> per row
            sizes = torch.tensor(layer.sizes_per_rank, device=scale.device)
            scale = torch.repeat_interleave(scale.float(), sizes)
        if self.scale_name != "weight_scale":
            delattr(layer, self.scale_name)
        layer.weight_scale = nn.Parameter(scale.reshape(-1).float().contiguous(), requires_grad=False)
        if self.act_scheme == "static":
            # One input, one scale: the largest of the fused projections' (none clips).
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(()).float(), requires_grad=False)

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether this projection takes its input's per-token fp8 quantization from the norm before."""
        return self.act_scheme == "dynamic"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        quantized = None
        if self.act_scheme == "dynamic" and x.is_cuda:
            from pagedllm.ops.triton_ops import attached_fp8

            quantized = attached_fp8(x)
        y = fp8_linear(_flat(x), layer.weight, layer.weight_scale, bias, self.act_scheme,
                       getattr(layer, "input_scale", None), quantized=quantized)
        return y.view(*x.shape[:-1], -1)


class Fp8BlockLinearMethod(QuantizationMethod):
    """Block-wise fp8 (``weight_block_size`` [bn, bk]): one float32 scale per weight tile."""

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv"):
        self.block, self.scale_name = (int(block[0]), int(block[1])), scale_name

    def create_weights(self, layer: nn.Module) -> None:
        block_n, block_k = self.block
        if layer.in_features % block_k:
            raise ValueError(f"block-wise fp8: the input size per rank ({layer.in_features}) is not a multiple of the "
                             f"block size {block_k}")
        if len(layer.sizes_per_rank) > 1 and any(s % block_n for s in layer.sizes_per_rank):
            raise ValueError(f"block-wise fp8: fused projections of sizes {layer.sizes_per_rank} (per rank) are not "
                             f"multiples of the block size {block_n}")
        quant_param(layer, [("out", 1), ("in", 1)], FP8_DTYPE, name="weight")
        quant_param(layer, [("out", block_n), ("in", block_k)], torch.float32, dummy=fill_const(0.02),
                    name=self.scale_name)

    def process_after_loading(self, layer: nn.Module) -> None:
        if self.scale_name != "weight_scale":
            scale = getattr(layer, self.scale_name)
            delattr(layer, self.scale_name)
            layer.weight_scale = nn.Parameter(scale.data.float().contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = fp8_block_linear(_flat(x), layer.weight, layer.weight_scale, bias, self.block)
        return y.view(*x.shape[:-1], -1)


class Fp8Config(QuantizationConfig):
    """``quant_method: "fp8"`` in config.json (serialized), or ``quantization="fp8"`` over an
    unquantized checkpoint (online: per-channel weights, dynamic per-token activations)."""

    name = "fp8"

    def __init__(self, serialized: bool, act_scheme: str = "dynamic", block: list[int] | None = None,
                 ignored: list[str] | None = None):
        if act_scheme not in ACT_SCHEMES:
            raise ValueError(f"fp8 activation_scheme {act_scheme!r} is not supported; supported: {list(ACT_SCHEMES)}")
        if block is not None:
            if len(block) != 2 or any(int(b) < 16 for b in block):
                raise ValueError(f"fp8 weight_block_size must be two sizes of 16 or more, got {block}")
            if act_scheme != "dynamic":
                raise ValueError("fp8 weight_block_size needs activation_scheme 'dynamic' (activations are quantized "
                                 "per token and block)")
        self.serialized, self.act_scheme, self.block, self.ignored = serialized, act_scheme, block, ignored or []

    @classmethod
    def from_config(cls, qc: dict | None) -> "Fp8Config":
        if qc is None:
            return cls(serialized=False)
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported; supported: ['e4m3']")
        ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        return cls(serialized=True, act_scheme=qc.get("activation_scheme", "dynamic"),
                   block=qc.get("weight_block_size"), ignored=ignored)

    def method_for(self, layer, prefix, checkpoint_prefixes):
        if matches_ignore(checkpoint_prefixes, self.ignored, substring=True):
            return None
        if self.block is not None:
            return Fp8BlockLinearMethod(tuple(self.block))
        return Fp8LinearMethod(self.serialized, self.act_scheme)

    experts_supported = True

