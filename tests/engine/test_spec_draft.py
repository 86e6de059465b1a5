"""Speculative decoding with a draft model: a draft equal to the target accepts every guess
(and the target runs fewer steps than tokens); a different draft is often wrong, yet the
greedy tokens are the plain engine's, with chunked prefill and preemption; bad drafts are
refused naming the key."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.conftest import TEST_KV_BYTES, build_tiny_model
from tests.engine.test_correctness import mixed_prompts, shared_prefix_prompts
from tests.engine.test_spec_decode import count_calls

PROMPTS = mixed_prompts(6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _tokens(llm, prompts=PROMPTS):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, smollm2_tokenizer_dir):
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-draft")), smollm2_tokenizer_dir, seed=7,
                            num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(tiny_models):
    return _tokens(LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256))


def _stats(llm):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def test_the_target_as_its_own_draft_accepts_every_guess(tiny_models, reference):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256,
              speculative_config={"model": tiny_models["llama"], "num_speculative_tokens": 3})
    assert llm.llm_engine.engine_core.config.speculative_config.method == "draft_model"
    core = llm.llm_engine.engine_core
    steps = count_calls(core.executor, "execute_model")
    draft = core.executor.worker.model_runner.draft.model
    forwards = count_calls(draft, "forward")
    assert _tokens(llm, PROMPTS[:1]) == reference[:1]
    stats = _stats(llm)
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert len(steps) <= len(reference[0]) // 2 + 2
    # k forwards a step: the prompt's step (with the draft following it) proposes, and each
    # verifying step's first guess catches the draft up instead of a run over the step's inputs
    assert len(forwards) <= 1 + 3 * len(steps)
    del draft.forward
    del core.executor.execute_model
    assert _tokens(llm) == reference
    shared = shared_prefix_prompts()[:4]
    first = _tokens(llm, shared)
    before = _stats(llm)
    assert _tokens(llm, shared) == first  # their first blocks are prefix hits now
    stats = _stats(llm)
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    # the draft's cache is right over cached blocks and skipped runs: still every guess accepted
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > before.spec_num_draft_tokens
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_a_different_draft_leaves_the_greedy_tokens_chunked_and_preempted(tiny_models, other_draft, reference):
    llm = LLM(tiny_models["llama"], max_model_len=160, max_num_batched_tokens=16, num_gpu_blocks_override=12,
              speculative_config={"method": "draft_model", "model": other_draft, "num_speculative_tokens": 2})
    assert _tokens(llm) == reference
    stats = _stats(llm)
    assert 0 <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.num_preemptions > 0
    core = llm.llm_engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_bad_drafts_are_refused(tiny_models, tmp_path, smollm2_tokenizer_dir):
    import json
    import os

    small_vocab = build_tiny_model("llama", str(tmp_path / "v"), smollm2_tokenizer_dir)
    with open(os.path.join(small_vocab, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(small_vocab, "config.json"), "w") as f:
        json.dump({**cfg, "vocab_size": 1000}, f)
    for spec, match in (({"method": "draft_model"}, "needs model"),
                        ({"model": small_vocab}, "vocabulary of 1000 tokens"),
                        ({"model": tiny_models["llama"], "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
                        ({"method": "ngram", "model": tiny_models["llama"]}, "takes no model")):
        with pytest.raises(ValueError, match=match):
            LLM(tiny_models["llama"], max_model_len=64, speculative_config=spec)
