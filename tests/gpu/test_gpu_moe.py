"""GPU-only: the mixtures of experts on the fused-MoE Triton kernel and CUDA graphs give
transformers' greedy tokens in fp32 (eager with chunked prefill and prefix hits too), and the
routed experts the graphs record equal transformers' router's choices. Skipped without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import build_tiny_model
from tests.engine.test_correctness import hf_greedy, mixed_prompts, shared_prefix_prompts
from tests.engine.test_routed_experts import check_against_transformers
from tests.gpu.test_gpu_engine import _greedy, _ids, _llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_moe_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return {arch: build_tiny_model(arch, str(tmp_path_factory.mktemp(f"gpu-{arch}")), smollm2_tokenizer_dir)
            for arch in ("qwen3_moe_many", "qwen2_moe", "mixtral")}


@pytest.mark.parametrize("arch", ["qwen3_moe_many", "qwen2_moe", "mixtral"])
def test_fused_moe_kernel_and_cuda_graphs_match_transformers_fp32(gpu_moe_models, arch, monkeypatch):
    prompts = mixed_prompts() + shared_prefix_prompts()
    ref = hf_greedy(gpu_moe_models[arch], prompts)
    fast = _llm(gpu_moe_models[arch], monkeypatch)
    runner = fast.llm_engine.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs
    assert _ids(_greedy(fast, prompts)) == ref
    assert runner.graphs.piecewise.replays > 0  # the prefill steps replayed piecewise graphs
    del fast
    eager = _llm(gpu_moe_models[arch], monkeypatch, enforce_eager=True, max_num_batched_tokens=32, block_size=8)
    assert _ids(_greedy(eager, prompts)) == ref


def test_routed_experts_recorded_under_cuda_graphs(gpu_moe_models, monkeypatch):
    model_dir = gpu_moe_models["qwen3_moe_many"]
    prompts = mixed_prompts(6)
    llm = _llm(model_dir, monkeypatch, enable_return_routed_experts=True)
    outs = _greedy(llm, prompts, max_tokens=8)
    check_against_transformers(model_dir, prompts, outs)
    assert llm.llm_engine.engine_core.executor.worker.model_runner.graphs.piecewise.replays > 0
    assert all(isinstance(o.outputs[0].routed_experts, np.ndarray) for o in outs)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block128", "int4-g128", "int4-g128-symmetric"])
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_quantized_expert_kernel_in_bf16_matches_the_dequantized_experts(num_tokens, fmt):
    """fp8 (W8A16: per channel, or blocks that cut the K tile to 128) and int4 (W4A16, groups of
    128) experts on the device's kernel in bf16 with the table's tiles: the torch path over the
    same weights dequantized to bf16, within bf16's rounding."""
    from pagedllm.ops.fused_moe import fused_experts_torch, route
    from pagedllm.ops.moe_scales import ExpertScales
    from pagedllm.ops.triton_fused_moe import fused_experts_triton
    from tests.ops.test_fused_moe import _fp8_experts, _int4_experts

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    experts, hidden, inter = 16, 512, 256
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter ** 0.5
    weights, ids = route(torch.randn(num_tokens, experts, device="cuda", generator=g), 4, renormalize=True)
    if fmt.startswith("fp8"):
        block = (128, 128) if fmt == "fp8-block128" else None
        (q13, s13, dq13), (q2, s2, dq2) = _fp8_experts(w13, block), _fp8_experts(w2, block)
        scales = ExpertScales(s13, s2, block=block)
    else:
        symmetric = fmt.endswith("symmetric")
        (q13, s13, z13, dq13), (q2, s2, z2, dq2) = _int4_experts(w13, 128, symmetric), _int4_experts(w2, 128, symmetric)
        scales = ExpertScales(s13, s2, group=128, w13_zeros=z13, w2_zeros=z2)
    got = fused_experts_triton(x, q13, q2, weights, ids, scales=scales)
    want = fused_experts_torch(x, dq13.bfloat16(), dq2.bfloat16(), weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert (got.float() - want.float()).abs().mean() < 3e-3


@pytest.mark.parametrize("block", [None, 16])
def test_fp8_expert_checkpoints_on_gpu_match_the_dequantized_reference(tmp_path, block):
    """The engine on the GPU in fp32 (IEEE dots, CUDA graphs) over an fp8-expert checkpoint: the
    transformers reference holding the dequantized experts, as on the CPU."""
    from pagedllm import LLM
    from tests.model.test_fp8_moe import write_fp8_moe
    from tests.model.test_quantization import W4A16_TOL, check_against_reference

    reference = write_fp8_moe(tmp_path, block)
    llm = LLM(str(tmp_path), dtype="float32", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              device="cuda")
    assert llm.llm_engine.engine_core.executor.worker.model_runner.cuda_graphs
    check_against_reference(llm, reference, W4A16_TOL, exact_greedy=True)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_expert_checkpoints_on_gpu_match_the_dequantized_reference(tmp_path, fmt):
    """GPTQ / AWQ experts on the GPU in fp32 (CUDA graphs): the transformers reference holding the
    dequantized weights, as on the CPU."""
    from pagedllm import LLM
    from tests.model.test_int4_moe import write_int4_moe
    from tests.model.test_quantization import W4A16_TOL, check_against_reference

    reference = write_int4_moe(tmp_path, fmt)
    llm = LLM(str(tmp_path), dtype="float32", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              device="cuda")
    assert llm.llm_engine.engine_core.executor.worker.model_runner.cuda_graphs
    check_against_reference(llm, reference, W4A16_TOL, exact_greedy=True)
