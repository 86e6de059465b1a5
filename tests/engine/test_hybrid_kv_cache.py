"""Per-layer-group KV cache (issue 16, vLLM's hybrid allocator) on Gemma 2 (local/global 1:1) and
Gemma 3 (5 local : 1 global): a long request's sliding groups hold blocks bounded by the window
while the full group holds the whole context, tokens stay those of transformers (past the
window, chunked, preempted, from prefix hits), and every block goes back to the pool."""
from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams, TokensPrompt
from pagedllm.engine.arg_utils import EngineArgs
from tests.conftest import build_tiny_model
from tests.engine.test_correctness import hf_greedy, make_llm, mixed_prompts
from tests.engine.test_sliding_window import generate_ids

WINDOW, BLOCK = 12, 8  # the tiny Gemmas' window (tests/conftest.py)
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    out = tmp_path_factory.mktemp("hybrid")
    return {
        "gemma2": build_tiny_model("gemma2", str(out / "gemma2"), smollm2_tokenizer_dir),
        "gemma3": build_tiny_model("gemma3", str(out / "gemma3"), smollm2_tokenizer_dir, num_hidden_layers=6,
                                   layer_types=GEMMA3_LAYER_TYPES),
    }


def test_layers_form_one_full_group_and_sliding_groups_of_as_many_layers(gemmas):
    llm = make_llm(gemmas["gemma3"], max_model_len=64)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.group_windows == [None] + [WINDOW] * 5 and kv.sliding_window is None
    assert [layer.kv_cache_group for layer in runner.attn_layers] == [1, 2, 3, 4, 5, 0]
    # One layer per group: a block holds one layer's K/V, every layer reads the one tensor.
    assert len(runner.kv_caches) == 1 and all(layer.kv_cache is runner.kv_caches[0] for layer in runner.attn_layers)
    layer = runner.attn_layers[0]
    one_layer = 2 * runner.block_size * layer.num_kv_heads * layer.head_dim * 4  # K and V, float32
    assert runner.kv_cache_bytes_per_block() == one_layer


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_long_request_holds_the_window_in_sliding_groups_and_everything_in_the_full_one(gemmas, arch):
    model_dir = gemmas[arch]
    llm = make_llm(model_dir, block_size=BLOCK, max_model_len=400)
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    sliding = [g for g, w in enumerate(kv.group_windows) if w is not None]
    rng = random.Random(5)
    prompt = [rng.randrange(3, 40000) for _ in range(60)]
    engine.add_request("long", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    held_sliding, held_full, tokens = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
        if "long" in kv.req_to_blocks:
            held_sliding.append(max(kv.num_held_blocks("long", g) for g in sliding))
            held_full.append(kv.num_held_blocks("long", 0))
    # The window's blocks, the one being written and one partly outside; the full group: all.
    assert max(held_sliding[3:]) <= WINDOW // BLOCK + 2
    assert held_full[-1] == -(-(60 + 49) // BLOCK)
    assert tokens == hf_greedy(model_dir, [prompt], max_new_tokens=50)[0]
    assert kv.num_free_blocks == kv.num_blocks
    # The same prompt again starts from the prefix cache (each group's blocks were kept hashed).
    hits = kv.stats.hits
    assert generate_ids(llm, [prompt], max_tokens=50)[0] == tokens
    assert kv.stats.hits - hits == (len(prompt) - 1) // BLOCK * BLOCK


def test_gemma3_five_to_one_matches_transformers_chunked_preempted_and_from_prefix_hits(gemmas):
    model_dir = gemmas["gemma3"]
    prompts = mixed_prompts(8)
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    # 6 groups; a request of 144 tokens holds 9 blocks in the full group, 4 in each sliding one.
    llm = make_llm(model_dir, block_size=16, num_gpu_blocks_override=29, max_model_len=144,
                   max_num_batched_tokens=32)
    assert generate_ids(llm, prompts, max_tokens=12) == expected
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    hits = core.kv_cache_manager.stats.hits
    assert generate_ids(llm, prompts, max_tokens=12) == expected
    assert core.kv_cache_manager.stats.hits > hits


def test_a_cache_too_small_for_one_request_over_all_groups_is_refused(gemmas):
    with pytest.raises(ValueError, match="over its 2 KV cache groups"):
        make_llm(gemmas["gemma2"], block_size=16, num_gpu_blocks_override=12, max_model_len=144)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_draft_model_or_eagle_head_on_a_hybrid_target_is_refused(gemmas, method):
    args = EngineArgs(model=gemmas["gemma2"], speculative_config={
        "method": method, "model": gemmas["gemma2"], "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="2 KV cache groups"):
        args.create_engine_config()


def test_pipeline_stages_place_their_layers_by_group(gemmas):
    """PP=2 (gloo, a process per stage): stage 0 holds three local layers, stage 1 two local and
    the global one; each places its layers by their global index (a cache tensor per slot used)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("pipeline_parallel_size=2 on a GPU machine needs 2 GPUs")
    model_dir = gemmas["gemma3"]
    prompts = mixed_prompts(6)
    llm = make_llm(model_dir, pipeline_parallel_size=2, max_num_batched_tokens=32, block_size=8)
    try:
        assert generate_ids(llm, prompts, max_tokens=12) == hf_greedy(model_dir, prompts, max_new_tokens=12)
        kv = llm.llm_engine.engine_core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.llm_engine.engine_core.shutdown()
