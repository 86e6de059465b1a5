"""FP8 KV cache with tensor and pipeline parallelism (CPU, gloo, two ranks): each rank's cache holds
its KV heads (or its stage's layers) in fp8; calculate_kv_scales takes the max over the tensor
ranks, so both get the scales one rank computes, and the greedy tokens equal one rank's."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import reused_llm
from tests.engine.test_correctness import generate_ids, make_llm, mixed_prompts


def _scales_and_dtype(worker) -> tuple:
    runner = worker.model_runner
    return [layer.kv_scale.tolist() for layer in runner.attn_layers], str(runner.kv_caches[0].dtype)


def test_tp2_fp8_cache_with_calculated_scales_equals_tp1(tiny_models, module_llms):
    prompts = mixed_prompts(4)
    kwargs = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    tp1 = make_llm(tiny_models["llama"], **kwargs)
    want = generate_ids(tp1, prompts)
    want_scales = _scales_and_dtype(tp1.llm_engine.engine_core.executor.worker)
    tp2 = reused_llm(module_llms, "llama-fp8", tiny_models["llama"], tensor_parallel_size=2, **kwargs)
    assert generate_ids(tp2, prompts) == want
    ranks = tp2.collective_rpc(_scales_and_dtype)
    assert len(ranks) == 2
    for scales, dtype in ranks:
        assert dtype == str(torch.float8_e4m3fn)
        assert scales == [pytest.approx(s, rel=1e-6) for s in want_scales[0]]


def test_pp2_fp8_cache_with_calculated_scales_equals_pp1(tiny_models, module_llms):
    """Each pipeline stage allocates its layers' fp8 caches and computes their scales in the first
    step: the same scales and tokens as one stage."""
    prompts = mixed_prompts(4)
    kwargs = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    pp1 = make_llm(tiny_models["llama"], **kwargs)
    want = generate_ids(pp1, prompts)
    want_scales = _scales_and_dtype(pp1.llm_engine.engine_core.executor.worker)[0]
    pp2 = reused_llm(module_llms, "llama-fp8-pp", tiny_models["llama"], pipeline_parallel_size=2, **kwargs)
    assert generate_ids(pp2, prompts) == want
    stages = pp2.collective_rpc(_scales_and_dtype)
    assert [s for scales, _ in stages for s in scales] == [pytest.approx(s, rel=1e-6) for s in want_scales]
    assert {dtype for _, dtype in stages} == {str(torch.float8_e4m3fn)}
