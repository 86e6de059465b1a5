"""Quantized layers under tensor (and pipeline) parallelism (CPU, gloo, two ranks): packed int4 weights, their
group scales and zero points, fp8 weights with per-tensor, per-channel and block scales are each
split on their own axes (column-parallel by output features, row-parallel by input features and
groups), so TP=2 matches the same transformers reference as TP=1 (tests/model/test_quantization.py,
same tolerances). One difference is by design (vLLM's too): dynamic per-token activation scales
of a row-parallel layer are each rank's, over the slice of the features it holds, so that
reference fake-quantizes o_proj's and down_proj's inputs per half. fp8 and int4 experts of a mixture
of experts split with their experts (intermediate rows, or whole experts under expert parallelism:
int4 experts then stay packed whole, words, scales and zero points, and give TP=1's tokens)."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.model import quant_checkpoints as qc
from tests.model.test_fp8_moe import EXPERTS, _experts, write_fp8_moe
from tests.model.test_int4_moe import GROUP, write_int4_moe
from tests.model.test_quantization import W4A16_TOL, W8A8_TOL, check_against_reference, engine_greedy, make_llm

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


def expert_parameters(worker) -> tuple:
    """(rank, each MoE layer's expert parameters by name, layer 0's expert map)."""
    experts = [layer.mlp.experts for layer in worker.model_runner.model.model.layers]
    return (worker.rank, [{n: p.detach().cpu().clone() for n, p in e.named_parameters()} for e in experts],
            experts[0].expert_map.tolist())


# int4 experts under expert parallelism (zero points included): each rank holds E / 2 whole experts,
# packed, with the intermediate size of 32 whole (one group of 32: too small to slice over two ranks).
@pytest.mark.parametrize("fmt", ["gptq", "ct"])
def test_int4_experts_under_expert_parallel_equal_tp1(tmp_path, fmt):
    write_int4_moe(str(tmp_path), fmt, symmetric=False)
    tp1 = make_llm(str(tmp_path))
    want_ids, want_lps = engine_greedy(tp1)
    whole = [{n: p.detach().cpu().clone() for n, p in e.named_parameters()} for e in _experts(tp1)]
    llm = make_llm(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        ids, lps = engine_greedy(llm)
        ranks = llm.collective_rpc(expert_parameters)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert multiprocessing.active_children() == []
    assert ids == want_ids
    for got, want in zip(lps, want_lps):
        assert got == pytest.approx(want, abs=W4A16_TOL)
    half, hidden, inter = EXPERTS // 2, 64, 32
    for rank, layers, expert_map in ranks:
        mine = slice(rank * half, (rank + 1) * half)
        assert [i for i, e in enumerate(expert_map) if e >= 0] == list(range(EXPERTS))[mine]
        for local, full in zip(layers, whole):
            assert local["gate_up_proj"].dtype == torch.int32
            assert local["gate_up_proj"].shape == (half, hidden // 8, 2 * inter)  # words [E / 2, H / 8, 2I]
            assert local["down_proj"].shape == (half, inter // 8, hidden)  # words [E / 2, I / 8, H]
            assert local["gate_up_proj_scale"].shape == local["gate_up_proj_zeros"].shape == (half, 2 * inter, 2)
            assert local["down_proj_scale"].shape == local["down_proj_zeros"].shape == (half, hidden, inter // GROUP)
            assert local.keys() == full.keys()  # no per-expert linears left
            for name, tensor in local.items():  # TP=1's experts [r E / 2, (r + 1) E / 2), bit for bit
                assert torch.equal(tensor, full[name][mine]), name
