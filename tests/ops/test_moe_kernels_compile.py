"""The fused-MoE chain (routing, pair alignment, the two expert GEMMs, the top-k sum) compiles
for an H100 (sm_90: TTIR -> PTX -> cubin) with programmatic dependent launch: each kernel
waits for the one before it (griddepcontrol.wait) before it touches memory, and lets the one
after it launch (griddepcontrol.launch_dependents). What Triton's interpreter cannot run fails
here, not in the GPU pass (tests/triton_env.compile_for_sm90: one fresh process, a fresh cache)."""
from __future__ import annotations

import pytest

from tests.triton_env import HAS_TRITON, compile_for_sm90

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_BODY = r"""
from pagedllm.ops import triton_fused_moe as m
from pagedllm.ops import triton_moe_routing as r


def compile_both(name, fn, signature, constexprs, **kw):  # PTX with both griddepcontrol instructions
    compile_(name, fn, signature, {**constexprs, "PDL": True}, options={"launch_pdl": True},
             want_ptx=("griddepcontrol.wait", "griddepcontrol.launch_dependents"), **kw)


compile_both("route", r._route_kernel,
             {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "num_experts": "i32", "stride_l": "i32",
              "TOP_K": c, "K_PAD": c, "E_PAD": c, "SIGMOID": c, "RENORMALIZE": c, "ROUND_BF16": c, "ROUND_FP16": c,
              "PDL": c},
             {"TOP_K": 8, "K_PAD": 8, "E_PAD": 128, "SIGMOID": False, "RENORMALIZE": True, "ROUND_BF16": True,
              "ROUND_FP16": False}, num_warps=1)
compile_both("align", r._moe_align_kernel,
             {"ids_ptr": "*i64", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "cursor_ptr": "*i32",
              "num_pairs": "i32", "num_experts": "i32", "max_blocks": "i32", "BLOCK_M": c, "E_PAD": c, "CHUNK": c,
              "CHUNK_B": c, "PDL": c},
             {"BLOCK_M": 16, "E_PAD": 128, "CHUNK": 1024, "CHUNK_B": 64})
gemm = {"sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "N": "i32", "K": "i32",
        "stride_we": "i32", "stride_wn": "i32", "stride_om": "i32", "stride_se": "i32", "stride_sn": "i32",
        "stride_ze": "i32", "stride_zn": "i32", "BLOCK_M": c, "BLOCK_N": c, "BLOCK_K": c, "IEEE": c, "PDL": c,
        "SCALE": c, "SCALE_BN": c, "SCALE_BK": c, "INT4": c, "HAS_ZEROS": c}
tiles = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "IEEE": False, "SCALE": 0, "SCALE_BN": 1, "SCALE_BK": 1,
         "INT4": False, "HAS_ZEROS": False}
gate_up = {"x_ptr": "*bf16", "out_ptr": "*bf16", "top_k": "i32", "stride_xm": "i32", **gemm}
down = {"a_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*fp32", "stride_am": "i32", **gemm}
plain = {"w_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16"}
compile_both("gate/up", m._moe_gate_up_kernel, {**gate_up, **plain}, tiles, num_warps=8)
compile_both("down", m._moe_down_kernel, {**down, **plain}, tiles, num_warps=8)
# fp8 experts (W8A16): per-channel scales in the epilogue, block scales per K tile.
fp8 = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "z_ptr": "*fp32"}
compile_both("gate/up fp8 channel", m._moe_gate_up_kernel, {**gate_up, **fp8}, {**tiles, "SCALE": 1}, num_warps=8)
compile_both("down fp8 block", m._moe_down_kernel, {**down, **fp8},
             {**tiles, "SCALE": 2, "SCALE_BN": 128, "SCALE_BK": 128}, num_warps=8)
# int4 experts (W4A16): words unpacked in-kernel, zero points per row and group, group scales per K tile.
int4 = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}
compile_both("gate/up int4", m._moe_gate_up_kernel, {**gate_up, **int4},
             {**tiles, "SCALE": 2, "SCALE_BK": 128, "INT4": True, "HAS_ZEROS": True}, num_warps=8)
compile_both("down int4 symmetric", m._moe_down_kernel, {**down, **int4},
             {**tiles, "SCALE": 2, "SCALE_BK": 128, "INT4": True, "HAS_ZEROS": False}, num_warps=8)
compile_both("top-k sum", m._sum_pairs_kernel,
             {"per_pair_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "TOP_K": c, "BLOCK": c, "PDL": c},
             {"TOP_K": 8, "BLOCK": 1024})
"""


def test_moe_kernels_compile_for_sm90_with_programmatic_dependent_launch(tmp_path):
    results = compile_for_sm90(_BODY, tmp_path)
    assert results == {"route": True, "align": True, "gate/up": True, "down": True, "gate/up fp8 channel": True,
                       "down fp8 block": True, "gate/up int4": True, "down int4 symmetric": True, "top-k sum": True}
