"""Tensor parallelism (CPU, gloo, two ranks) for issue 16's families: Phi-3's fused
checkpoint tensors (``qkv_proj``, ``gate_up_proj``) are split into each rank's heads and rows,
and Gemma 2 (soft caps, local/global layers), Phi-3 and OLMo 2 (q/k norms over the whole
projection: the mean square is all-reduced) give TP=1's greedy tokens; so do the mixtures of experts,
with every expert sliced over the ranks or (expert parallelism) whole experts on each."""
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


# Mixtures of experts: TP=2 slices every expert's intermediate size; with expert parallelism each
# rank holds half the experts whole. Both give TP=1's tokens (Qwen2-MoE: its shared expert too).
MOE_CASES = [("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe_many", True)]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return {arch: build_tiny_model(arch, str(tmp_path_factory.mktemp(f"tp-{arch}")), smollm2_tokenizer_dir)
            for arch in ("qwen2_moe", "qwen3_moe_many")}


def moe_llm(module_llms, moe_models, arch: str, expert_parallel: bool):
    return reused_llm(module_llms, f"{arch}-ep{expert_parallel}", moe_models[arch], tensor_parallel_size=2,
                      enable_expert_parallel=expert_parallel)


@pytest.mark.parametrize("arch,expert_parallel", MOE_CASES)
def test_moe_tp2_and_expert_parallel_equal_tp1(moe_models, module_llms, arch, expert_parallel):
    ref_ids, ref_lps = generate_with_logprobs(make_llm(moe_models[arch]), PROMPTS)
    ids, lps = generate_with_logprobs(moe_llm(module_llms, moe_models, arch, expert_parallel), PROMPTS)
    assert ids == ref_ids
    for got, want in zip(lps, ref_lps):
        assert got == pytest.approx(want, abs=1e-4)


def expert_weights(worker) -> tuple:
    experts = worker.model_runner.model.model.layers[1].mlp.experts
    expert_map = None if experts.expert_map is None else experts.expert_map.tolist()
    return (worker.rank, experts.gate_up_proj.detach().cpu().clone(), experts.down_proj.detach().cpu().clone(),
            expert_map)


@pytest.mark.parametrize("arch,expert_parallel", MOE_CASES)
def test_moe_ranks_hold_expert_slices_or_whole_experts(moe_models, module_llms, arch, expert_parallel):
    llm = moe_llm(module_llms, moe_models, arch, expert_parallel)
    hf_experts = _hf_model(moe_models[arch]).model.layers[1].mlp.experts  # transformers' fused [E, ...] tensors
    gate_up, down = hf_experts.gate_up_proj.detach(), hf_experts.down_proj.detach()
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    for rank, local_gate_up, local_down, expert_map in llm.collective_rpc(expert_weights):
        if expert_parallel:  # whole experts: rank r holds experts [r E/2, (r + 1) E/2)
            mine = slice(rank * num_experts // 2, (rank + 1) * num_experts // 2)
            assert local_gate_up.shape == (num_experts // 2, 2 * inter, 64)
            assert local_down.shape == (num_experts // 2, 64, inter)
            assert torch.equal(local_gate_up, gate_up[mine]) and torch.equal(local_down, down[mine])
            assert [i for i, e in enumerate(expert_map) if e >= 0] == list(range(num_experts))[mine]
        else:  # every expert, half its intermediate rows (gate's and up's) and down's columns
            half = slice(rank * inter // 2, (rank + 1) * inter // 2)
            assert local_gate_up.shape == (num_experts, inter, 64) and expert_map is None
            want = torch.cat([gate_up[:, :inter][:, half], gate_up[:, inter:][:, half]], dim=1)
            assert torch.equal(local_gate_up, want) and torch.equal(local_down, down[:, :, half])


def test_expert_parallel_needs_experts_divisible_by_ranks(moe_models):
    from pagedllm import EngineArgs

    args = EngineArgs(model=moe_models["qwen2_moe"], tensor_parallel_size=2, enable_expert_parallel=True,
                      hf_overrides={"num_experts": 7})
    with pytest.raises(ValueError, match="must divide the model's 7 experts"):
        args.create_engine_config()


def test_enable_expert_parallel_cli_flag():
    from pagedllm.entrypoints.cli import engine_args_from, make_parser

    parser = make_parser()
    assert engine_args_from(parser.parse_args(["serve", "m", "--enable-expert-parallel"])).enable_expert_parallel
    assert not engine_args_from(parser.parse_args(["serve", "m"])).enable_expert_parallel


def test_moe_dummy_weights_under_expert_parallel_equal_tp1_dummy(moe_models, module_llms):
    """Dummy weights draw each full [E, ...] tensor and keep this rank's experts: the same model."""
    model_dir = moe_models["qwen3_moe_many"]
    ref_ids, ref_lps = generate_with_logprobs(make_llm(model_dir, load_format="dummy"), PROMPTS)
    llm = reused_llm(module_llms, "moe-dummy-ep", model_dir, tensor_parallel_size=2, enable_expert_parallel=True,
                     load_format="dummy")
    ids, lps = generate_with_logprobs(llm, PROMPTS)
    assert ids == ref_ids
    for got, want in zip(lps, ref_lps):
        assert got == pytest.approx(want, abs=1e-4)
