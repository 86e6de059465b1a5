"""Routed experts for RL (``enable_return_routed_experts``): each finished CompletionOutput holds the
experts every MoE layer chose for every computed token (the prompt's, then the output's but the last),
the ids transformers' routers pick for the same tokens — also when prefills are chunked, when the
prompt comes from the prefix cache (its routing is kept by KV slot) and after preemption. Off by
default; refused for a dense model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import EngineArgs, SamplingParams, TokensPrompt
from tests.conftest import build_tiny_model
from tests.engine.test_correctness import _hf_model, make_llm, mixed_prompts, shared_prefix_prompts


@pytest.fixture(scope="module")
def routed_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return {arch: build_tiny_model(arch, str(tmp_path_factory.mktemp(f"routed-{arch}")), smollm2_tokenizer_dir)
            for arch in ("qwen2_moe", "qwen3_moe_many")}


def hf_routed_experts(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """[tokens, moe layers, top_k] from transformers' router logits, each token's ids sorted."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    ids = [torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(ids, dim=1).sort(dim=-1).values.numpy()


def generate(llm, prompts: list[list[int]], max_tokens: int = 6):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def check_against_transformers(model_dir: str, prompts: list[list[int]], outs) -> None:
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        routed = completion.routed_experts
        tokens = prompt + completion.token_ids[:-1]
        expected = hf_routed_experts(model_dir, tokens)
        assert routed.shape == expected.shape == (len(tokens), expected.shape[1], expected.shape[2])
        assert np.array_equal(np.sort(routed, axis=-1), expected)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe_many"])
def test_routed_experts_match_transformers_router(routed_models, arch):
    model_dir = routed_models[arch]
    prompts = mixed_prompts(6)
    outs = generate(make_llm(model_dir, enable_return_routed_experts=True), prompts)
    check_against_transformers(model_dir, prompts, outs)
    moe_layers = 2  # Qwen2-MoE: every 2nd of 4 layers (decoder_sparse_step); the other: 3 layers, one dense
    top_k = {"qwen2_moe": 2, "qwen3_moe_many": 8}[arch]
    assert outs[0].outputs[0].routed_experts.shape[1:] == (moe_layers, top_k)
    if arch == "qwen2_moe":  # async scheduling: a step's rows are read after the next step is launched
        outs = generate(make_llm(model_dir, enable_return_routed_experts=True, async_scheduling=True), prompts)
        check_against_transformers(model_dir, prompts, outs)


def test_routed_experts_with_chunks_prefix_hits_and_preemption(routed_models):
    model_dir = routed_models["qwen2_moe"]
    prompts = shared_prefix_prompts()[:5]
    llm = make_llm(model_dir, enable_return_routed_experts=True, block_size=8, max_num_batched_tokens=16)
    generate(llm, prompts)
    hits = llm.llm_engine.engine_core.kv_cache_manager.stats.hits
    outs = generate(llm, prompts)  # the prompts' full blocks now come from the prefix cache
    assert llm.llm_engine.engine_core.kv_cache_manager.stats.hits - hits >= 5 * 40
    check_against_transformers(model_dir, prompts, outs)
    prompts = mixed_prompts()
    llm = make_llm(model_dir, enable_return_routed_experts=True, num_gpu_blocks_override=9, max_model_len=144,
                   enable_prefix_caching=False)
    outs = generate(llm, prompts, max_tokens=12)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_against_transformers(model_dir, prompts, outs)


def test_routed_experts_off_by_default_and_refused_for_dense_models(routed_models, tiny_models):
    outs = generate(make_llm(routed_models["qwen2_moe"]), mixed_prompts(2))
    assert all(o.outputs[0].routed_experts is None for o in outs)
    with pytest.raises(ValueError, match="enable_return_routed_experts needs a mixture-of-experts model"):
        EngineArgs(model=tiny_models["llama"], enable_return_routed_experts=True).create_engine_config()
