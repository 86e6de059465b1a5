"""The LoRA shrink, the small-row GEMMs that carry its expand and the kernels before a shrink
(and the small-row GEMM's split-K form) compile for an H100 (sm_90: TTIR -> PTX -> cubin) with programmatic dependent launch: the norm
and SiLU-and-mul kernels let the shrink launch early, the shrink waits for their output and lets
its GEMM launch early (griddepcontrol.launch_dependents), and the GEMM waits for the shrink's
output in its epilogue (griddepcontrol.wait). What Triton's interpreter cannot run fails here,
not in the GPU pass (tests/triton_env.compile_for_sm90: one fresh process, a fresh cache)."""
from __future__ import annotations

import pytest

from tests.triton_env import HAS_TRITON, SM90_NORM_SILU, compile_for_sm90

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_BODY = r"""
from pagedllm.ops import triton_gemv, triton_lora, triton_ops

pdl = {"launch_pdl": True}
compile_("shrink", triton_lora._shrink_kernel,
         {"x_ptr": "*bf16", "a_ptr": "*bf16", "ids_ptr": "*i64", "tile_slot_ptr": "*i64", "t_ptr": "*fp32", "K": "i32",
          "R": "i32", "K_PER_SPLIT": "i32", "stride_xm": "i32", "stride_as": "i32", "stride_ar": "i32",
          "stride_ts": "i32", "stride_tm": "i32", "IEEE": c, "BLOCK_M": c, "BLOCK_R": c, "BLOCK_K": c, "PDL": c},
         {"IEEE": False, "BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_K": 128, "PDL": True}, options=pdl,
         want_ptx="griddepcontrol.launch_dependents")
lora = {"t_ptr": "*fp32", "lb_ptr": "*bf16", "ls_ptr": "*i64", "R": "i32"}
gemv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
        "stride_wn": "i32", **lora, "stride_ts": "i32", "stride_lbs": "i32", "stride_lbn": "i32", "HAS_BIAS": c,
        "BLOCK_N": c, "BLOCK_K": c, "HAS_LORA": c, "SPLIT": c, "BLOCK_R": c, "PDL": c, "ENTER": c}
compile_("gemv with the expand", triton_gemv._gemv_kernel, gemv,
         {"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 512, "HAS_LORA": True, "SPLIT": 4, "BLOCK_R": 64, "PDL": True,
          "ENTER": False}, options=pdl, want_ptx="griddepcontrol.wait")
compile_("gemv launched early", triton_gemv._gemv_kernel, gemv,
         {"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 512, "HAS_LORA": False, "SPLIT": 1, "BLOCK_R": 16, "PDL": False,
          "ENTER": True}, options=pdl, want_ptx="griddepcontrol.wait")
dot = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", **lora, "NUM_SLOTS": "i32", "stride_ts": "i32",
       "stride_tm": "i32", "stride_lbs": "i32", "stride_lbn": "i32", "part_ptr": "*fp32", "cnt_ptr": "*i32",
       "K_TILES_PER_SPLIT": "i32", "SPLIT_K": "i32", "HAS_BIAS": c, "BLOCK_M": c, "BLOCK_N": c,
       "BLOCK_K": c, "HAS_LORA": c, "SPLIT": c, "BLOCK_R": c, "PDL": c, "ENTER": c, "USE_SPLIT": c}
compile_("small-row dot with the expand", triton_gemv._small_m_gemm_kernel, dot,
         {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "HAS_LORA": True, "SPLIT": 2, "BLOCK_R": 32,
          "PDL": True, "ENTER": False, "USE_SPLIT": False}, options=pdl, want_ptx="griddepcontrol.wait")
compile_("small-row dot split-K", triton_gemv._small_m_gemm_kernel, dot,
         {"HAS_BIAS": True, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 256, "HAS_LORA": False, "SPLIT": 1, "BLOCK_R": 16,
          "PDL": False, "ENTER": True, "USE_SPLIT": True}, options=pdl, want_ptx="atom")
compile_("rms norm letting the shrink launch", triton_ops._rms_norm_kernel, norm,
         {"HAS_RESIDUAL": True, "BLOCK": 4096, "TRIGGER": True, "FP8_OUT": False, "ENTER": False}, options=pdl,
         want_ptx="griddepcontrol.launch_dependents")
compile_("rms norm quantizing its rows to fp8", triton_ops._rms_norm_kernel, norm,
         {"HAS_RESIDUAL": False, "BLOCK": 4096, "TRIGGER": True, "FP8_OUT": True, "ENTER": False}, options=pdl)
compile_("silu-and-mul letting the shrink launch", triton_ops._silu_and_mul_kernel, silu,
         {"BLOCK": 1024, "TRIGGER": True, "FP8_OUT": False, "ENTER": False}, options=pdl, want_ptx="griddepcontrol.launch_dependents")
compile_("silu-and-mul quantizing its rows to fp8", triton_ops._silu_and_mul_kernel, silu,
         {"BLOCK": 16384, "TRIGGER": True, "FP8_OUT": True, "ENTER": False}, options=pdl)
"""


def test_lora_kernels_compile_for_sm90_with_programmatic_dependent_launch(tmp_path):
    results = compile_for_sm90(SM90_NORM_SILU + _BODY, tmp_path)
    assert results == {"shrink": True, "gemv with the expand": True, "gemv launched early": True,
                       "small-row dot with the expand": True, "small-row dot split-K": True,
                       "rms norm letting the shrink launch": True, "rms norm quantizing its rows to fp8": True,
                       "silu-and-mul letting the shrink launch": True, "silu-and-mul quantizing its rows to fp8": True}
