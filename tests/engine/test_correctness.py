"""Greedy outputs and logprobs match Hugging Face transformers (fp32, CPU) on tiny random
Llama / Qwen2 / Qwen3 models, under every scheduling regime."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.conftest import TEST_KV_BYTES, TINY_ARCHS

MAX_TOKENS = 12


def mixed_prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 70, 17, 1, 45, 33, 8, 120, 5, 26][:n]
    return [[rng.randrange(3, 40000) for _ in range(length)] for length in lengths]


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 40000) for _ in range(40)]
    return [prefix + [rng.randrange(3, 40000) for _ in range(k)] for k in (1, 5, 12, 20, 31, 7, 16, 2)]


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {}
    if getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None):
        # SDPA has no soft cap: transformers versions that pick it for Gemma 2 (5.17 does) drop the cap.
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    # Like ignore_eos on our side: run to max_new_tokens without suppressing EOS.
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    model = _hf_model(model_dir)
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def generate_ids(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
    return LLM(model_dir, dtype="float32", seed=0, **kwargs)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_default_settings(tiny_models, arch):
    prompts = mixed_prompts()
    llm = make_llm(tiny_models[arch])
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models[arch], prompts)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_with_every_prefill_chunked(tiny_models, arch):
    prompts = mixed_prompts()
    llm = make_llm(tiny_models[arch], max_num_batched_tokens=16, max_num_seqs=4)
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models[arch], prompts)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_when_requests_are_preempted(tiny_models, arch):
    prompts = mixed_prompts()
    # 9 blocks of 16 tokens: one request of max_model_len fits, the batch does not.
    llm = make_llm(tiny_models[arch], num_gpu_blocks_override=9, max_model_len=144, enable_prefix_caching=False)
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models[arch], prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefix_cache_hits_give_the_same_tokens(tiny_models, arch):
    prompts = shared_prefix_prompts()
    llm = make_llm(tiny_models[arch], block_size=8)
    first = generate_ids(llm, prompts)
    stats = llm.llm_engine.engine_core.kv_cache_manager.stats
    hits_first = stats.hits
    second = generate_ids(llm, prompts)
    assert first == second == hf_greedy(tiny_models[arch], prompts)
    # The second pass finds every full block of each prompt (all but the last token).
    assert stats.hits - hits_first == sum((len(p) - 1) // 8 * 8 for p in prompts)
    assert hits_first >= (len(prompts) - 1) * 40 // 8 * 8  # the shared 40-token prefix, from pass one


def test_preemption_with_prefix_cache_and_chunking_together(tiny_models):
    prompts = shared_prefix_prompts() + mixed_prompts()
    llm = make_llm(tiny_models["qwen3"], num_gpu_blocks_override=10, max_model_len=160, max_num_batched_tokens=32)
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models["qwen3"], prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@functools.lru_cache(maxsize=None)
def hf_logprobs(model_dir: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([list(ids)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("chunk", [None, 16])
def test_logprobs_and_prompt_logprobs_match_reference(tiny_models, chunk):
    model_dir = tiny_models["llama"]
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = make_llm(model_dir, **kwargs)
    prompts = mixed_prompts()[:6]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(model_dir, tuple(prompt + gen))
        # Sample logprobs: the chosen token and the top 3 at each generated position.
        assert len(out.outputs[0].logprobs) == len(gen)
        cum = 0.0
        for j, (tok, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert tok in entry and len(entry) in (3, 4)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
                assert lp.rank == int((row > row[tid]).sum()) + 1
            assert entry[tok].rank == 1  # greedy
            cum += entry[tok].logprob
        assert out.outputs[0].cumulative_logprob == pytest.approx(cum, abs=1e-4)
        # Prompt logprobs: None for the first token, then the actual token + top 2.
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            assert prompt[i] in entry
            top2 = ref[i - 1].topk(2).indices.tolist()
            assert set(top2) <= set(entry)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[i - 1][tid].item(), abs=1e-4)


def test_text_prompts_and_outputs_round_trip_through_the_tokenizer(tiny_models):
    llm = make_llm(tiny_models["qwen2"])
    tok = llm.get_tokenizer()
    prompts = ["Hello, my name is", "The capital of France is", "ü 日本語 🙂"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length"
        assert out.finished and out.metrics.first_token_time >= out.metrics.arrival_time
