"""Gemma 2, Gemma 3, Phi-3, OLMo, OLMo 2 and the mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral,
32 experts top-8) of issue 16 match transformers in fp32 on CPU as the first three
families do: greedy tokens on a mixed-length batch (prompts far past the 12-token sliding
windows) with default settings, every prefill chunked, preemption, prefix-cache hits; prompt
logprobs within 1e-4. One tiny model per architecture for the module."""
from __future__ import annotations

import pytest
from pagedllm import SamplingParams, TokensPrompt
from tests.conftest import DENSE_ARCHS_16, MOE_ARCHS_16, build_tiny_model
from tests.engine.test_correctness import (
    generate_ids, hf_greedy, hf_logprobs, make_llm, mixed_prompts, shared_prefix_prompts,
)

ARCHS = DENSE_ARCHS_16 + MOE_ARCHS_16


class _TinyModels(dict):
    """Each architecture's tiny model, built when a test first asks for it (``-k`` runs build only theirs)."""

    def __init__(self, tmp_path_factory, tokenizer_dir: str):
        super().__init__()
        self.tmp_path_factory, self.tokenizer_dir = tmp_path_factory, tokenizer_dir

    def __missing__(self, arch: str) -> str:
        self[arch] = build_tiny_model(arch, str(self.tmp_path_factory.mktemp(f"tiny-{arch}")), self.tokenizer_dir)
        return self[arch]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return _TinyModels(tmp_path_factory, smollm2_tokenizer_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_default_chunked_and_preempted(arch_models, arch):
    model_dir = arch_models[arch]
    prompts = mixed_prompts()
    expected = hf_greedy(model_dir, prompts)
    assert generate_ids(make_llm(model_dir), prompts) == expected
    assert generate_ids(make_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=4), prompts) == expected
    # 9 blocks of 16 tokens: one request of max_model_len fits, the batch does not. Gemma's sliding
    # group holds a step's tokens and its window besides (32 + 11 tokens: 4 blocks).
    hybrid = dict(num_gpu_blocks_override=13, max_num_batched_tokens=32) if arch in ("gemma2", "gemma3") else {}
    llm = make_llm(model_dir, **{"num_gpu_blocks_override": 9, **hybrid}, max_model_len=144,
                   enable_prefix_caching=False)
    assert generate_ids(llm, prompts) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_and_prompt_logprobs(arch_models, arch):
    model_dir = arch_models[arch]
    llm = make_llm(model_dir, block_size=8)
    prompts = shared_prefix_prompts()
    first = generate_ids(llm, prompts)
    stats = llm.llm_engine.engine_core.kv_cache_manager.stats
    hits_first = stats.hits
    second = generate_ids(llm, prompts)
    assert first == second == hf_greedy(model_dir, prompts)
    assert stats.hits - hits_first == sum((len(p) - 1) // 8 * 8 for p in prompts)

    prompts = mixed_prompts()[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(model_dir, tuple(prompt + gen))
        for i in range(1, len(prompt)):
            for tid, lp in out.prompt_logprobs[i].items():
                assert lp.logprob == pytest.approx(ref[i - 1][tid].item(), abs=1e-4)
        for j, entry in enumerate(out.outputs[0].logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + j][tid].item(), abs=1e-4)
