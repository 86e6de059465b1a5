"""Sliding-window memory (issue 16): with every layer sliding (a tiny Mistral, window 16), the
KV blocks wholly before the window go back to the pool as decoding proceeds, so a long
request holds a bounded number of blocks; tokens stay those of transformers (prompts past
the window, every prefill chunked, preemption, prefix hits on freed-but-cached blocks)."""
from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams, TokensPrompt
from tests.conftest import build_tiny_model
from tests.engine.test_correctness import hf_greedy, make_llm, mixed_prompts

WINDOW, BLOCK = 16, 8


def generate_ids(llm, prompts, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_tokenizer_dir) -> str:
    return build_tiny_model("mistral", str(tmp_path_factory.mktemp("tiny-mistral")), smollm2_tokenizer_dir)


def test_greedy_matches_transformers_past_the_window(mistral):
    prompts = mixed_prompts()
    expected = hf_greedy(mistral, prompts, max_new_tokens=24)
    assert generate_ids(make_llm(mistral, block_size=BLOCK), prompts, max_tokens=24) == expected
    chunked = make_llm(mistral, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4)
    assert generate_ids(chunked, prompts, max_tokens=24) == expected
    small = make_llm(mistral, block_size=BLOCK, num_gpu_blocks_override=20, max_model_len=160,
                     max_num_batched_tokens=32, enable_prefix_caching=False)
    assert generate_ids(small, prompts, max_tokens=24) == expected
    core = small.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_a_long_request_holds_blocks_bounded_by_the_window_and_prefix_hits_stay_exact(mistral):
    llm = make_llm(mistral, block_size=BLOCK, max_model_len=400)
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert kv.sliding_window == WINDOW
    rng = random.Random(3)
    prompt = [rng.randrange(3, 40000) for _ in range(120)]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    held = []
    engine.add_request("long", TokensPrompt(prompt_token_ids=prompt), params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
        if "long" in kv.req_to_blocks:
            held.append(kv.num_held_blocks("long"))
    # The window's blocks, the one being written and one partly outside: never the 40 of the context.
    assert max(held[5:]) <= WINDOW // BLOCK + 2 < (120 + 200) // BLOCK
    assert tokens == hf_greedy(mistral, [prompt], max_new_tokens=200)[0]
    assert kv.num_free_blocks == kv.num_blocks
    # The prompt's blocks were freed but stay hashed: the same prompt again hits them.
    hits = kv.stats.hits
    again = generate_ids(llm, [prompt], max_tokens=200)[0]
    assert again == tokens and kv.stats.hits > hits


@pytest.mark.parametrize("arch, window", [("mistral", WINDOW), ("gemma2", None), ("llama", None)])
def test_only_models_whose_every_layer_slides_free_blocks(tmp_path, smollm2_tokenizer_dir, arch, window):
    model_dir = build_tiny_model(arch, str(tmp_path / arch), smollm2_tokenizer_dir)
    llm = make_llm(model_dir, max_model_len=64)
    core = llm.llm_engine.engine_core
    assert core.config.model_config.uniform_sliding_window == window
    windows = {getattr(layer, "sliding_window", None) for layer in core.executor.worker.model_runner.attn_layers}
    assert (windows == {window}) if window else (None in windows)
