"""Quantized layers under tensor (and pipeline) parallelism (CPU, gloo, two ranks): packed int4 weights, their
group scales and zero points, fp8 weights with per-tensor, per-channel and block scales are each
split on their own axes (column-parallel by output features, row-parallel by input features and
groups), so TP=2 matches the same transformers reference as TP=1 (tests/model/test_quantization.py,
same tolerances). One difference is by design (vLLM's too): dynamic per-token activation scales
of a row-parallel layer are each rank's, over the slice of the features it holds, so that
reference fake-quantizes o_proj's and down_proj's inputs per half. fp8 experts of a mixture of
experts split with their experts (intermediate rows, or whole experts under expert parallelism)."""
from __future__ import annotations

import multiprocessing

import pytest

from tests.model import quant_checkpoints as qc
from tests.model.test_fp8_moe import write_fp8_moe
from tests.model.test_int4_moe import write_int4_moe
from tests.model.test_quantization import W4A16_TOL, W8A8_TOL, check_against_reference, make_llm

CASES = {
    "gptq-asym-g32": (lambda d: qc.write_gptq(d, group=32, symmetric=False), W4A16_TOL),
    "awq-g32": (lambda d: qc.write_awq(d, group=32), W4A16_TOL),
    "ct-int4-asym-g32": (lambda d: qc.write_ct_int4(d, group=32, symmetric=False), W4A16_TOL),
    "fp8-static": (lambda d: qc.write_fp8(d, "static"), W8A8_TOL),
    "fp8-block32": (lambda d: qc.write_fp8_block(d, 32), W8A8_TOL),
    "ct-fp8-channel-dynamic": (lambda d: qc.write_ct_fp8(d, "channel", dynamic=True, tp=2), W8A8_TOL),
    # fp8 experts (W8A16, exact dequant math): block scales sliced with each expert's intermediate
    # rows; under expert parallelism per-tensor scales travel with their whole experts.
    "moe-fp8-block16": (lambda d: write_fp8_moe(d, 16), W4A16_TOL),
    "moe-fp8-tensor-ep": (lambda d: write_fp8_moe(d, None), W4A16_TOL, {"enable_expert_parallel": True}),
    # int4 experts sliced like linears (an intermediate size of 64: a whole group of 32 per rank)
    "moe-gptq-asym-g32": (lambda d: write_int4_moe(d, "gptq", moe_intermediate_size=64), W4A16_TOL),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_quantized_matches_reference(tmp_path, case):
    write, tol, *kwargs = CASES[case]
    reference = write(str(tmp_path))
    llm = make_llm(str(tmp_path), tensor_parallel_size=2, **(kwargs[0] if kwargs else {}))
    try:
        check_against_reference(llm, reference, tol, exact_greedy=tol == W4A16_TOL)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert multiprocessing.active_children() == []


def test_pp2_quantized_matches_reference(tmp_path):
    """Pipeline stages build and load only their layers' quantized parameters."""
    reference = qc.write_gptq(str(tmp_path), group=64, symmetric=True)
    llm = make_llm(str(tmp_path), pipeline_parallel_size=2)
    try:
        check_against_reference(llm, reference, W4A16_TOL, exact_greedy=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert multiprocessing.active_children() == []
