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
    assert fast.llm_engine.engine_core.executor.worker.model_runner.cuda_graphs
    assert _ids(_greedy(fast, prompts)) == ref
    del fast
    eager = _llm(gpu_moe_models[arch], monkeypatch, enforce_eager=True, max_num_batched_tokens=32, block_size=8)
    assert _ids(_greedy(eager, prompts)) == ref


def test_routed_experts_recorded_under_cuda_graphs(gpu_moe_models, monkeypatch):
    model_dir = gpu_moe_models["qwen3_moe_many"]
    prompts = mixed_prompts(6)
    llm = _llm(model_dir, monkeypatch, enable_return_routed_experts=True)
    outs = _greedy(llm, prompts, max_tokens=8)
    check_against_transformers(model_dir, prompts, outs)
    assert all(isinstance(o.outputs[0].routed_experts, np.ndarray) for o in outs)
