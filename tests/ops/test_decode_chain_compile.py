"""The kernels of a decode layer's chain compile for an H100 (sm_90) launched early
(programmatic dependent launch, ``ENTER``): each waits for the kernel before it
(griddepcontrol.wait) and lets the next launch (griddepcontrol.launch_dependents). The
interpreter never takes that branch (no GPU, ``decode_pdl`` is off), so it is compiled here
(tests/triton_env.compile_for_sm90). The attention kernel itself runs with it in the GPU pass."""
from __future__ import annotations

import pytest

from tests.triton_env import HAS_TRITON, SM90_NORM_SILU, compile_for_sm90

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_BODY = r"""
from pagedllm.attention import triton_kernels
from pagedllm.ops import triton_ops

pdl = {"launch_pdl": True}
both = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
compile_("rms norm", triton_ops._rms_norm_kernel, norm,
         {"HAS_RESIDUAL": True, "BLOCK": 4096, "TRIGGER": False, "FP8_OUT": False, "ENTER": True}, options=pdl,
         want_ptx=both)
compile_("silu-and-mul", triton_ops._silu_and_mul_kernel, silu,
         {"BLOCK": 16384, "TRIGGER": False, "FP8_OUT": True, "ENTER": True}, options=pdl, want_ptx=both)
rotary = {"q_ptr": "*bf16", "k_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "q_out_ptr": "*bf16",
          "k_out_ptr": "*bf16", "cos_sin_ptr": "*fp32", "pos_ptr": "*i64", "q_stride0": "i32", "q_stride1": "i32",
          "k_stride0": "i32", "k_stride1": "i32", "cos_sin_stride0": "i32", "eps": "fp32",
          "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64", "kv_scale_ptr": "*fp32",
          "v_stride0": "i32", "v_stride1": "i32", "stride_c_block": "i32", "stride_c_slot": "i32",
          "stride_c_head": "i32", "NUM_Q_HEADS": c, "NUM_K_HEADS": c, "HALF": c, "BLOCK_H": c, "BLOCK_D": c,
          "HAS_NORM": c, "ENTER": c, "WRITE_KV": c, "CACHE_BLOCK": c, "FP8_MAX": c}
shape = {"NUM_Q_HEADS": 16, "NUM_K_HEADS": 8, "HALF": 64, "BLOCK_H": 8, "BLOCK_D": 64, "HAS_NORM": True,
         "ENTER": True, "CACHE_BLOCK": 16, "FP8_MAX": 0.0}
compile_("rotary with q/k norm", triton_ops._rotary_kernel, rotary, dict(shape, WRITE_KV=False), options=pdl,
         want_ptx=both)
compile_("rotary with q/k norm and the KV write", triton_ops._rotary_kernel, dict(rotary, k_cache_ptr="*fp8e4nv",
         v_cache_ptr="*fp8e4nv"), dict(shape, WRITE_KV=True, FP8_MAX=448.0), options=pdl, want_ptx=both)
cache = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
         "slot_ptr": "*i64", "kv_scale_ptr": "*fp32", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32",
         "stride_vh": "i32", "stride_c_block": "i32", "stride_c_slot": "i32", "stride_c_head": "i32",
         "BLOCK_SIZE": c, "NUM_KV_HEADS": c, "HEAD_DIM": c, "HEADS_PAD": c, "DIM_PAD": c, "FP8_MAX": c, "ENTER": c}
compile_("KV write", triton_kernels._reshape_and_cache_kernel, cache,
         {"BLOCK_SIZE": 16, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HEADS_PAD": 8, "DIM_PAD": 128, "FP8_MAX": 0.0,
          "ENTER": True}, options=pdl, want_ptx=both)
attn = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "kv_scale_ptr": "*fp32",
        "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "cnt_ptr": "*i32",
        "min_split_tiles": "i32", "scale_log2": "fp32", "num_seqs": "i32", "window": "i32", "num_heads": "i32",
        "softcap_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
        "stride_c_block": "i32", "stride_c_slot": "i32", "stride_c_head": "i32", "stride_bt": "i32"}
attn.update({k: c for k in ("NUM_KV_HEADS", "GROUP", "GROUP_PAD", "BLOCK_Q", "BLOCK_M", "BLOCK_N", "BLOCK_SIZE",
                            "HEAD_DIM", "DIM_PAD", "USE_WINDOW", "IEEE", "SPLIT", "Q_LEN_FILTER", "Q_LEN_THRESHOLD",
                            "SOFTCAP", "KV_FP8", "CAUSAL", "ENTER", "F16_DOTS", "FP8_WORDS", "SELF_MERGE")})
split = {"NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": 1, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_SIZE": 16,
         "HEAD_DIM": 128, "DIM_PAD": 128, "USE_WINDOW": False, "IEEE": False, "SPLIT": True, "Q_LEN_FILTER": 0,
         "Q_LEN_THRESHOLD": 1, "SOFTCAP": False, "KV_FP8": False, "CAUSAL": True, "ENTER": True, "F16_DOTS": False,
         "FP8_WORDS": False, "SELF_MERGE": True}
# split decodes that merge in their own last program: a release/acquire count, partials read past L1
merge = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
         "qsl_ptr": "*i32", "num_seqs": "i32", "num_heads": "i32", "num_splits": "i32", "stride_ot": "i32",
         "stride_oh": "i32", "HEAD_DIM": c, "DIM_PAD": c, "MAX_SPLITS": c, "ENTER": c, "BY_SEQ": c}
compile_("split merge", triton_kernels._merge_splits_kernel, merge,
         {"HEAD_DIM": 128, "DIM_PAD": 128, "MAX_SPLITS": 16, "ENTER": True, "BY_SEQ": 0}, options=pdl, want_ptx=both)
compile_("split merge of a mixed step", triton_kernels._merge_splits_kernel, merge,
         {"HEAD_DIM": 128, "DIM_PAD": 128, "MAX_SPLITS": 16, "ENTER": True, "BY_SEQ": 8}, options=pdl, want_ptx=both)
compile_("split decode attention", triton_kernels._attention_kernel, attn, split, options=pdl,
         want_ptx=both + ["atom.global.gpu.acq_rel.add", "ld.global.cg"])
compile_("split short runs of a mixed step", triton_kernels._attention_kernel, attn,
         dict(split, Q_LEN_FILTER=3, BLOCK_Q=4, Q_LEN_THRESHOLD=4), options=pdl,
         want_ptx=both + ["atom.global.gpu.acq_rel.add", "ld.global.cg"])
"""


def test_decode_chain_kernels_compile_for_sm90_launched_early(tmp_path):
    assert compile_for_sm90(SM90_NORM_SILU + _BODY, tmp_path) == {
        "rms norm": True, "silu-and-mul": True, "rotary with q/k norm": True,
        "rotary with q/k norm and the KV write": True, "KV write": True, "split merge": True,
        "split merge of a mixed step": True, "split decode attention": True, "split short runs of a mixed step": True}
