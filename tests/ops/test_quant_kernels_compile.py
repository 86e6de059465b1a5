"""The quantization kernels compile for an H100 (sm_90: TTIR -> PTX -> cubin with the ptxas Triton
ships) without a GPU: what Triton's interpreter accepts but the compiler refuses (globals read
as non-constexprs, fp8 dots of unsupported shapes, layout conversions of the packed-load reshape)
fails here, not in the GPU pass (tests/triton_env.compile_for_sm90: one fresh process, a fresh
Triton cache)."""
from __future__ import annotations

import pytest

from tests.triton_env import HAS_TRITON, compile_for_sm90

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_BODY = r"""
from pagedllm.ops import triton_fp8, triton_int4, triton_int4_swap
w4 = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i32", "b_ptr": "*bf16", "y_ptr": "*bf16",
      "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "GROUP": c, "HAS_ZP": c,
      "HAS_BIAS": c, "BLOCK_M": c, "BLOCK_N": c, "BLOCK_K": c, "PACKED_LOAD": c, "HAS_MIN": c}
for packed in (False, True):
    for zp in (False, True):
        compile_(f"w4a16 decode packed={packed} zp={zp}", triton_int4._w4a16_gemm_kernel, w4,
                 {"GROUP": 128, "HAS_ZP": zp, "HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
                  "PACKED_LOAD": packed, "HAS_MIN": False})
compile_("w4a16 decode GGUF Q4_1 mins", triton_int4._w4a16_gemm_kernel, w4,
         {"GROUP": 32, "HAS_ZP": False, "HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32,
          "PACKED_LOAD": False, "HAS_MIN": True})
compile_("w4a16 prefill", triton_int4._w4a16_gemm_kernel, w4,
         {"GROUP": 32, "HAS_ZP": True, "HAS_BIAS": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32,
          "PACKED_LOAD": False, "HAS_MIN": False}, num_warps=8)
compile_("w4a16 dequantize", triton_int4._w4a16_dequant_kernel,
         {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i32", "w_ptr": "*fp16", "N": "i32", "K": "i32",
          "GROUP": c, "HAS_ZP": c, "BLOCK_N": c, "BLOCK_K": c, "HAS_MIN": c},
         {"GROUP": 64, "HAS_ZP": True, "BLOCK_N": 128, "BLOCK_K": 32, "HAS_MIN": False})
compile_("w4a16 dequantize GGUF Q4_1 mins", triton_int4._w4a16_dequant_kernel,
         {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "w_ptr": "*bf16", "N": "i32", "K": "i32",
          "GROUP": c, "HAS_ZP": c, "BLOCK_N": c, "BLOCK_K": c, "HAS_MIN": c},
         {"GROUP": 32, "HAS_ZP": False, "BLOCK_N": 128, "BLOCK_K": 32, "HAS_MIN": True})
splitk = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i32", "b_ptr": "*bf16", "y_ptr": "*bf16",
          "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
          "stride_ym": "i32", "K_TILES_PER_SPLIT": "i32", "SPLIT_K": "i32", "GROUP": c, "HAS_ZP": c, "HAS_BIAS": c,
          "HAS_MIN": c, "BLOCK_M": c, "BLOCK_N": c, "BLOCK_K": c, "USE_SPLIT": c, "USE_DOT": c, "ENTER": c}
for dot, block_m, split, zp, group in [(True, 16, 4, True, 128), (True, 32, 1, False, 128), (False, 1, 8, True, 128),
                                       (False, 4, 2, False, 32)]:
    compile_(f"w4a16 split-K dot={dot} rows={block_m} split={split}", triton_int4._w4a16_splitk_kernel, splitk,
             {"GROUP": group, "HAS_ZP": zp, "HAS_BIAS": True, "HAS_MIN": False, "BLOCK_M": block_m, "BLOCK_N": 128,
              "BLOCK_K": min(group, 128), "USE_SPLIT": split > 1, "USE_DOT": dot, "ENTER": split == 4},
             options={"launch_pdl": split == 4})
compile_("w4a16 split-K GGUF Q4_1 mins", triton_int4._w4a16_splitk_kernel, {**splitk, "z_ptr": "*fp16"},
         {"GROUP": 32, "HAS_ZP": False, "HAS_BIAS": False, "HAS_MIN": True, "BLOCK_M": 2, "BLOCK_N": 64,
          "BLOCK_K": 32, "USE_SPLIT": True, "USE_DOT": False, "ENTER": False})
swap = {k: v for k, v in splitk.items() if k not in ("HAS_MIN", "USE_DOT")}
for block_m, block_n, split, zp in [(16, 64, 4, False), (32, 128, 1, True)]:  # Hopper's wgmma, not mma.sync
    compile_(f"w4a16 split-K transposed rows={block_m} zp={zp}", triton_int4_swap._w4a16_swap_kernel, swap,
             {"GROUP": 128, "HAS_ZP": zp, "HAS_BIAS": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128,
              "USE_SPLIT": split > 1, "ENTER": split == 4}, options={"launch_pdl": split == 4},
             want_ptx="wgmma.mma_async")
quant = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_s_ptr": "*fp32", "K": "i32",
         "stride_xm": "i32", "n_groups": "i32", "GROUP": c, "STATIC": c, "BLOCK": c, "PDL": c}
compile_("fp8 quantize per token", triton_fp8._quant_fp8_kernel, quant,
         {"GROUP": 4096, "STATIC": False, "BLOCK": 4096, "PDL": True})
compile_("fp8 quantize static", triton_fp8._quant_fp8_kernel, quant,
         {"GROUP": 4096, "STATIC": True, "BLOCK": 4096, "PDL": False})
compile_("fp8 quantize per group", triton_fp8._quant_fp8_kernel, quant,
         {"GROUP": 128, "STATIC": False, "BLOCK": 128, "PDL": False})
block = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32",
         "N": "i32", "K": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_bn": "i32", "stride_bsn": "i32",
         "stride_cm": "i32", "GROUP_N": c, "BLOCK_M": c, "BLOCK_N": c, "BLOCK_K": c}
compile_("fp8 block gemm prefill", triton_fp8._fp8_block_gemm_kernel, block,
         {"GROUP_N": 128, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128})
compile_("fp8 block gemm decode", triton_fp8._fp8_block_gemm_kernel, block,
         {"GROUP_N": 128, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128})
small = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16",
         "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
         "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "K_TILES_PER_SPLIT": "i32", "SPLIT_K": "i32",
         "HAS_BIAS": c, "BLOCK_M": c, "BLOCK_N": c, "BLOCK_K": c, "USE_SPLIT": c, "PDL": c}
compile_("fp8 small-row", triton_fp8._fp8_small_m_kernel, small,
         {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "USE_SPLIT": False, "PDL": False})
compile_("fp8 small-row, K split, launched early", triton_fp8._fp8_small_m_kernel, small,
         {"HAS_BIAS": True, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 512, "USE_SPLIT": True, "PDL": True}, num_warps=8)
compile_("fp8 small-row, row tiles of 128, K split", triton_fp8._fp8_small_m_kernel, small,
         {"HAS_BIAS": False, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 256, "USE_SPLIT": True, "PDL": True},
         options={"num_stages": 4})
"""


def test_quantization_kernels_compile_for_sm90(tmp_path):
    results = compile_for_sm90(_BODY, tmp_path)
    assert len(results) == 23
    assert {name: ok for name, ok in results.items() if ok is not True} == {}
