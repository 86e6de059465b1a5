"""Tensor parallelism (CPU, gloo, two ranks) for issue 16's dense families: Phi-3's fused
checkpoint tensors (``qkv_proj``, ``gate_up_proj``) are split into each rank's heads and rows,
and Gemma 2 (soft caps, local/global layers), Phi-3 and OLMo 2 (q/k norms over the whole
projection: the mean square is all-reduced) give TP=1's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import build_tiny_model
from tests.distributed.conftest import reused_llm
from tests.distributed.test_tensor_parallel import PROMPTS, generate_with_logprobs
from tests.engine.test_correctness import _hf_model, make_llm


@pytest.fixture(scope="module")
def tp_arch_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return {arch: build_tiny_model(arch, str(tmp_path_factory.mktemp(f"tp-{arch}")), smollm2_tokenizer_dir)
            for arch in ("phi3", "gemma2", "olmo2")}


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "olmo2"])
def test_tp2_greedy_outputs_equal_tp1(tp_arch_models, module_llms, arch):
    model_dir = tp_arch_models[arch]
    ref_ids, ref_lps = generate_with_logprobs(make_llm(model_dir), PROMPTS)
    llm = reused_llm(module_llms, arch, model_dir, tensor_parallel_size=2)
    ids, lps = generate_with_logprobs(llm, PROMPTS)
    assert ids == ref_ids
    for got, want in zip(lps, ref_lps):
        assert got == pytest.approx(want, abs=1e-4)


def fused_weights(worker) -> tuple:
    layer = worker.model_runner.model.model.layers[0]
    return (worker.rank, layer.self_attn.qkv_proj.weight.detach().cpu().clone(),
            layer.mlp.gate_up_proj.weight.detach().cpu().clone())


def test_tp2_splits_phi3_fused_checkpoint_tensors_by_heads_and_rows(tp_arch_models, module_llms):
    model_dir = tp_arch_models["phi3"]
    llm = reused_llm(module_llms, "phi3", model_dir, tensor_parallel_size=2)
    hf_layer = _hf_model(model_dir).model.layers[0]
    qkv, gate_up = hf_layer.self_attn.qkv_proj.weight, hf_layer.mlp.gate_up_proj.weight
    head_dim, q_size, kv_size, inter = 16, 64, 32, 128  # 4 query heads, 2 KV heads, intermediate 128
    for rank, local_qkv, local_gate_up in llm.collective_rpc(fused_weights):
        q = qkv[rank * 32:(rank + 1) * 32]  # two query heads each
        k = qkv[q_size + rank * head_dim:q_size + (rank + 1) * head_dim]  # one KV head each
        v = qkv[q_size + kv_size + rank * head_dim:q_size + kv_size + (rank + 1) * head_dim]
        assert torch.equal(local_qkv, torch.cat([q, k, v]))
        half = inter // 2
        gate, up = gate_up[rank * half:(rank + 1) * half], gate_up[inter + rank * half:inter + (rank + 1) * half]
        assert torch.equal(local_gate_up, torch.cat([gate, up]))
