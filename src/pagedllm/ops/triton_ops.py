"""Triton kernels for the per-token hot ops: RMSNorm (with the residual add), SiLU-and-mul, rotary.

Each computes what the torch code in pagedllm.model.layers computes, rounding where it rounds
(to the model dtype after the residual add, after the normalisation, after silu, after each
rotary product), so the two paths agree to the last bit up to fp32 summation order and the
hardware's rsqrt/exp. One launch and one pass over the data each, where torch takes four to
eight. Outputs are fresh contiguous tensors, as the torch code returns; inputs may be the
strided [T, H, D] views that split a fused projection (Qwen3's per-head q/k norm, rotary).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.attention.triton_kernels import check_kv_write, store_kv
from pagedllm.ops.triton_fp8 import FP8_MAX, MIN_SCALE
from pagedllm.ops.triton_gemv import MAX_ROWS, decode_config, small_m_linear
from pagedllm.ops.triton_lora import pdl_supported
from pagedllm.ops.triton_pdl import enter_args, pdl_begin, pdl_enter

# One program holds a whole row: hidden sizes of the supported models are far below this.
MAX_ROW_SIZE = 65536


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, n_inner, x_stride0, x_stride1,
                     res_stride0, res_stride1, N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     TRIGGER: tl.constexpr, FP8_OUT: tl.constexpr, ENTER: tl.constexpr):
    """FP8_OUT: the output row also quantized to fp8 per token (``q_ptr``, its scale at ``s_ptr``)
    exactly as ``triton_fp8.quantize_fp8`` quantizes the stored row: for an fp8 projection next.
    TRIGGER: a LoRA shrink after this may launch now (it waits for this kernel's output itself).
    ENTER: launched while the kernel before runs (``triton_pdl``): waits for it first."""
    pdl_begin(ENTER, TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // n_inner, row % n_inner
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + outer * x_stride0 + inner * x_stride1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * res_stride0 + inner * res_stride1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the add in the model dtype
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)  # cast to x's dtype before the weight, like HF
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + offs, out, mask=mask)
    if FP8_OUT:
        _store_fp8_row(out, q_ptr + row * N + offs, s_ptr + row, mask)


@triton.jit
def _store_fp8_row(out, q_ptrs, s_ptr, mask):
    """The stored row ``out`` quantized to fp8 per token exactly as ``triton_fp8.quantize_fp8``
    does (the floor scale for a zero row): for an fp8 projection that reads it next."""
    o = out.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(o), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr, scale)
    q = tl.minimum(tl.maximum(o / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, s_ptr, x_stride0, inter_size, BLOCK: tl.constexpr,
                         TRIGGER: tl.constexpr, FP8_OUT: tl.constexpr, ENTER: tl.constexpr):
    """FP8_OUT (one program holds the whole row): the output row also quantized as ``_rms_norm_kernel``'s.
    TRIGGER, ENTER: as ``_rms_norm_kernel``'s."""
    pdl_begin(ENTER, TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    gate = tl.load(x_ptr + row * x_stride0 + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride0 + inter_size + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)  # F.silu rounds here
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * inter_size + offs, out, mask=mask)
    if FP8_OUT:
        _store_fp8_row(out, q_ptr + row * inter_size + offs, s_ptr + row, mask)


@triton.jit
def _rotate_heads(x_ptr, w_ptr, t, x_stride0, x_stride1, head0, cos, sin, offs_d, mask_d, eps,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads [head0, head0 + BLOCK_H) of token t rotated: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin],
    returned as (heads, mask, first half, second half) in the model dtype; with HAS_NORM each head
    is first RMS-normed with weight w (Qwen3's q/k norm), rounded as RMSNorm."""
    dtype = x_ptr.dtype.element_ty
    heads = head0 + tl.arange(0, BLOCK_H)
    mask = (heads < NUM_HEADS)[:, None] & mask_d[None, :]
    src = x_ptr + t * x_stride0 + heads[:, None] * x_stride1 + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # Each product and sum rounded to the model dtype, as torch computes it in that dtype.
    x1c, x2s = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    x2c, x1s = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    return heads, mask, (x1c - x2s).to(dtype), (x2c + x1s).to(dtype)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr, pos_ptr, q_stride0, q_stride1,
                   k_stride0, k_stride1, cos_sin_stride0, eps,
                   v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr, v_stride0, v_stride1,
                   stride_c_block, stride_c_slot, stride_c_head,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
                   ENTER: tl.constexpr, WRITE_KV: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """q's and k's heads rotated (grid axis 1: q's head blocks, then k's). WRITE_KV: k's programs
    store the rotated k, and v's same heads, into the paged cache at the token's slot (-1: none),
    as ``reshape_and_cache`` stores them, instead of writing k out."""
    pdl_enter(ENTER)  # launched early: wait for the kernel before, then let the next launch
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    table = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * cos_sin_stride0
    # The float32 table cast to the model dtype first, like torch's cos.to(x.dtype).
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(table + offs_d, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(table + HALF + offs_d, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(NUM_Q_HEADS, BLOCK_H)
    if head_block < q_blocks:
        heads, mask, o1, o2 = _rotate_heads(q_ptr, qw_ptr, t, q_stride0, q_stride1, head_block * BLOCK_H, cos, sin,
                                            offs_d, mask_d, eps, NUM_Q_HEADS, HALF, BLOCK_H, HAS_NORM)
        dst = q_out_ptr + (t * NUM_Q_HEADS + heads[:, None]) * (2 * HALF) + offs_d[None, :]
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    else:
        heads, mask, o1, o2 = _rotate_heads(k_ptr, kw_ptr, t, k_stride0, k_stride1, (head_block - q_blocks) * BLOCK_H,
                                            cos, sin, offs_d, mask_d, eps, NUM_K_HEADS, HALF, BLOCK_H, HAS_NORM)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                v_src = v_ptr + t * v_stride0 + heads[:, None] * v_stride1 + offs_d[None, :]
                v1, v2 = tl.load(v_src, mask=mask), tl.load(v_src + HALF, mask=mask)  # before any store
                dst = (slot // CACHE_BLOCK) * stride_c_block + (slot % CACHE_BLOCK) * stride_c_slot \
                    + heads[:, None] * stride_c_head + offs_d[None, :]
                store_kv(k_cache_ptr + dst, o1, kv_scale_ptr, FP8_MAX, mask)
                store_kv(k_cache_ptr + dst + HALF, o2, kv_scale_ptr, FP8_MAX, mask)
                store_kv(v_cache_ptr + dst, v1, kv_scale_ptr + 1, FP8_MAX, mask)
                store_kv(v_cache_ptr + dst + HALF, v2, kv_scale_ptr + 1, FP8_MAX, mask)
        else:
            dst = k_out_ptr + (t * NUM_K_HEADS + heads[:, None]) * (2 * HALF) + offs_d[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF, o2, mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as (tensor, rows per outer index, outer stride, inner stride) over rows of its last dim;
    no copy for up to 3 dims with a unit last stride (the [T, H, D] views of a fused qkv)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-1])
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


def _row_launch(n: int) -> tuple[int, int]:
    if n > MAX_ROW_SIZE:
        raise ValueError(f"row size {n} is larger than the kernels' maximum of {MAX_ROW_SIZE}")
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              fp8_out: bool = False):
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n},)")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    num_rows = x.numel() // n if n else 0
    fp8_out = fp8_out and out.dtype in (torch.bfloat16, torch.float16) and num_rows > 0
    q, scales = _fp8_rows(out, num_rows) if fp8_out else (out, out)
    if num_rows == 0:
        return out, res_out
    xr, n_inner, xs0, xs1 = _rows(x)
    # residual has x's shape, so it comes out of _rows with the same rows per outer index.
    rr, _, rs0, rs1 = _rows(residual) if residual is not None else (xr, n_inner, xs0, xs1)
    block, num_warps = _row_launch(n)
    _rms_norm_kernel[(num_rows,)](xr, rr, weight, out, res_out, q, scales, n_inner, xs0, xs1, rs0, rs1, n, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
                                  TRIGGER=pdl_supported(x.device), FP8_OUT=fp8_out,
                                  **enter_args(x.device, x.shape[0]))
    if fp8_out:
        attach_fp8(out, q, scales)
    return out, res_out


def _fp8_rows(out: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a kernel writes ``out``'s per-token fp8 rows and their float32 scales."""
    return (torch.empty(out.shape, dtype=torch.float8_e4m3fn, device=out.device),
            torch.empty(num_rows, 1, dtype=torch.float32, device=out.device))


def attach_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Hands ``x``'s per-token fp8 quantization (made by the kernel that made ``x``) to the fp8
    projection that reads ``x`` next (``model.quantization.fp8.fp8_linear``), which then skips its
    own quantize launch. Taken once (``attached_fp8``), and only while ``x`` is unchanged where
    ``x`` counts its versions (inference tensors do not: nothing writes a norm's output in place)."""
    x._pagedllm_fp8 = (q, scales, None if x.is_inference() else x._version)


def attached_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 rows [M, K], float32 scales [M, 1]) that ``attach_fp8`` gave ``x``, or None; taken
    off ``x`` (a second reader quantizes for itself)."""
    held = x.__dict__.pop("_pagedllm_fp8", None)
    if held is None or (held[2] is not None and held[2] != x._version):
        return None
    return held[0].view(-1, x.shape[-1]), held[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_out: bool = False) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` over the last dim;
    ``fp8_out``: also its per-token fp8 quantization, attached (``attach_fp8``) for half types."""
    return _rms_norm(x, None, weight, eps, fp8_out)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, fp8_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the add in x's dtype; one read of each input."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, "
                         f"x is {tuple(x.shape)} {x.dtype}")
    return _rms_norm(x, residual, weight, eps, fp8_out)


def silu_and_mul(x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x of last dim 2I; ``fp8_out`` as ``rms_norm``'s."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x must be even (gate and up halves), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    fp8_out = fp8_out and x.dtype in (torch.bfloat16, torch.float16)
    if fp8_out:  # the row's scale needs the whole row in one program
        block, num_warps = _row_launch(inter)
        q, scales = _fp8_rows(out, num_rows)
    else:
        block, num_warps = min(triton.next_power_of_2(inter), 1024), 4
        q = scales = out
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        x2, out, q, scales, x2.stride(0), inter, BLOCK=block, TRIGGER=pdl_supported(x.device), FP8_OUT=fp8_out,
        num_warps=num_warps, **enter_args(x.device, num_rows))
    if fp8_out:
        attach_fp8(out, q, scales)
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0, kv_write: KVWrite | None = None, block_h: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox-style rotary of q [T, Hq, D] and k [T, Hk, D] at ``positions`` [T], from the float32
    ``cos_sin_cache`` [max_position, D] (cos then sin halves); one launch for both. With norm
    weights, each head is RMS-normed first (Qwen3's q/k norm) in the same launch. With
    ``kv_write`` the rotated k and ``kv_write.value`` go into the paged cache in the same launch
    (the attention backend's fused KV write) and no k is returned: (q_out, None). ``block_h``:
    heads per program (default: up to 8; a benchmark's override)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype:
        raise ValueError(f"q and k must be [T, H, D] of one dtype with equal T and D, got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(k.shape)} {k.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"head_dim {head_dim} must be even and match cos_sin_cache {tuple(cos_sin_cache.shape)}; "
                         f"positions {tuple(positions.shape)} must be [{num_tokens}]")
    has_norm = q_norm_weight is not None
    if has_norm and (k_norm_weight is None or any(w.shape != (head_dim,) or w.dtype != q.dtype
                                                  for w in (q_norm_weight, k_norm_weight))):
        raise ValueError(f"q/k norm weights must both be [{head_dim}] in the model dtype")
    positions = positions.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if kv_write is not None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_h = block_h or min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 8)
    head_blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h)
    kv = kv_write.launch_args(k) if kv_write is not None else dict(
        v=q, k_cache=q, v_cache=q, slots=positions, scale=q, strides=(0,) * 5, block=1, fp8_max=0.0)
    _rotary_kernel[(num_tokens, head_blocks)](
        q, k, q_norm_weight if has_norm else q, k_norm_weight if has_norm else k, q_out,
        k if k_out is None else k_out, cos_sin_cache, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), eps, kv["v"], kv["k_cache"], kv["v_cache"], kv["slots"], kv["scale"], *kv["strides"],
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half, BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(half), HAS_NORM=has_norm, WRITE_KV=kv_write is not None,
        CACHE_BLOCK=kv["block"], FP8_MAX=kv["fp8_max"], num_warps=4, **enter_args(q.device, num_tokens))
    return q_out, k_out


@dataclasses.dataclass
class KVWrite:
    """Where ``rotary_embedding`` stores the rotated keys and ``value`` [T, Hk, D]: a layer's paged
    cache [2, num_blocks, block_size, Hk, D] at ``slot_mapping`` (-1: none), fp8 with ``kv_scale``."""
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_scale: torch.Tensor | None = None

    def launch_args(self, key: torch.Tensor) -> dict:
        v, cache = self.value, self.kv_cache
        bound = check_kv_write(key, v, cache, self.slot_mapping, self.kv_scale)  # reshape_and_cache's checks
        return dict(v=v, k_cache=cache[0], v_cache=cache[1], slots=self.slot_mapping,
                    scale=self.slot_mapping if self.kv_scale is None else self.kv_scale,
                    strides=(v.stride(0), v.stride(1), cache.stride(1), cache.stride(2), cache.stride(3)),
                    block=cache.shape[2], fp8_max=bound)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k followed by rotary, in one launch: the same values
    as ``rotary_embedding(positions, rms_norm(q, q_weight), rms_norm(k, k_weight))``."""
    return rotary_embedding(positions, q, k, cos_sin_cache, q_weight, k_weight, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """``F.linear``; decode batches of up to ``triton_gemv.MAX_ROWS`` rows in half precision go to the small-row kernels
    where they read the weight faster than cuBLAS does: the tiling (K split or not) and the
    choice against cuBLAS per (N, K, row bucket) come from ``triton_gemv.decode_config`` (the tuned
    table, else the measured default rule). ``lora``: a ``triton_lora.LoRADelta`` whose expand is
    added, in the small-row kernel's epilogue where one runs, else by its own launch."""
    m = x.shape[0]
    config = None
    if x.dim() == 2 and 1 <= m <= MAX_ROWS and x.dtype != torch.float32 and x.dtype == weight.dtype \
            and x.stride(-1) == 1 and weight.is_contiguous():
        config = decode_config(m, weight.shape[0], x.shape[1])
    fuse = config is not None and lora is not None and lora.token_slots is not None and lora.b.dtype == weight.dtype
    if config is not None:
        y = small_m_linear(x, weight, bias, **config, lora=lora if fuse else None)
    else:
        y = F.linear(x, weight, bias)
    return y if lora is None or fuse else lora.expand_into(y)
