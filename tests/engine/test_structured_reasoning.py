"""A constraint under a reasoning parser applies to the answer only: the tokens up to the end
tag run free (identical to an unconstrained run), the ones after it obey the grammar. Async
scheduling is on: the step that samples the end tag must land before the next is scheduled.

The random model never writes ``</think>``, so the test's parser takes as its end tag a token
the model does write: the k-th token of its greedy output (one the prompt and the earlier
tokens lack). The tags are set on the class before the first constrained request (the
engine builds its parser then, with the tokenizer)."""
from __future__ import annotations

import pytest

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.reasoning import ReasoningParser, ReasoningParserManager

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches"
CHOICES = ["left", "right"]


@ReasoningParserManager.register_module("test_token_tags")
class TokenTagParser(ReasoningParser):
    start_tag = end_tag = ""  # set by the fixture

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self._split_thinking(text, final)


@pytest.fixture(scope="module")
def setup(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
              max_model_len=256, async_scheduling=True, max_num_batched_tokens=16,
              max_num_seqs=8, reasoning_parser="test_token_tags")
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    free = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    ref = list(free.token_ids)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] not in prompt_ids)
    start = next(t for t in range(1000, 2000) if t not in ref and t not in prompt_ids)
    TokenTagParser.end_tag = tokenizer.convert_ids_to_tokens(ref[k])
    TokenTagParser.start_tag = tokenizer.convert_ids_to_tokens(start)
    return llm, tokenizer, prompt_ids, ref, k, start


def _choice(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(choice=CHOICES))


def test_the_reasoning_runs_free_and_the_answer_after_the_end_tag_obeys(setup):
    llm, tokenizer, _, ref, k, _ = setup
    out = llm.generate(PROMPT, _choice())[0].outputs[0]
    ids = list(out.token_ids)
    assert ids[:k + 1] == ref[:k + 1]  # up to and with the end tag: the unconstrained tokens
    assert tokenizer.decode(ids[k + 1:], skip_special_tokens=True) in CHOICES
    assert out.finish_reason == "stop"
    assert ref[k + 1:k + 3] != ids[k + 1:k + 3]  # the free run went on differently: the grammar acted


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(setup):
    llm, tokenizer, prompt_ids, ref, k, start = setup
    closed = {"prompt_token_ids": prompt_ids + [start, ref[k]]}
    out = llm.generate(closed, _choice())[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"
    opened = {"prompt_token_ids": prompt_ids + [ref[k], start]}  # an end tag before the last start: still open
    out = llm.generate(opened, _choice(max_tokens=6))[0].outputs[0]
    assert out.text not in CHOICES and out.finish_reason == "length"


def test_nothing_is_held_after_reasoning_requests(setup):
    llm = setup[0]
    core = llm.llm_engine.engine_core
    assert core.structured_output.live == {} and core.structured_output.pending == {}
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_an_unknown_reasoning_parser_is_refused_naming_the_choices(tiny_models):
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*qwen3"):
        LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, reasoning_parser="o1")
