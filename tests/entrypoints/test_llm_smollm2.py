"""The real SmolLM2-135M-Instruct (the embedded default model) through the offline API."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import TEST_KV_BYTES

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # model=None: the embedded default model is the SmolLM2 GGUF.
    return LLM(dtype="float32", kv_cache_memory_bytes=4 * TEST_KV_BYTES, max_model_len=2048)


def test_default_model_is_the_embedded_smollm2(llm, smollm2_gguf):
    assert llm.llm_engine.model_config.gguf_file == smollm2_gguf


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_chat_accepts_text_parts_and_batches_of_conversations(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    outs = llm.chat([QUESTION, parts], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_greedy_tokens_match_transformers_on_the_same_gguf(llm, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    prompt_ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    ref_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32).eval()
    n = 32
    # Both stop at EOS (and keep it as the last token), or run to n tokens.
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(prompt_ids):].tolist()
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref


def test_continue_final_message(llm):
    conv = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5), add_generation_prompt=False,
                   continue_final_message=True, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_structured_outputs_choice_and_pydantic_schema(llm):
    """Issue 15's check: the sentiment choice returns one of its members; a pydantic schema
    through the chat template returns a valid object."""
    pydantic = pytest.importorskip("pydantic")

    class Review(pydantic.BaseModel):
        sentiment: str = pydantic.Field(pattern="^(positive|negative)$")
        score: int = pydantic.Field(ge=1, le=5)

    messages = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
    out = llm.chat(messages, choice, use_tqdm=False)[0].outputs[0]
    assert out.text in ("positive", "negative") and out.finish_reason == "stop"
    schema = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=Review, disable_any_whitespace=True))
    out = llm.chat([{"role": "user", "content": "Review vLLM as JSON with a sentiment and a 1-5 score."}], schema,
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    Review.model_validate_json(out.text)



def test_ngram_speculation_gives_the_same_greedy_tokens_and_accepts_repeated_spans(llm):
    """The real model copying a list: prompt lookup proposes the list's next items, the target
    accepts them (several tokens per step), and the greedy tokens are those of the plain engine."""
    spec = LLM(dtype="float32", kv_cache_memory_bytes=4 * TEST_KV_BYTES, max_model_len=2048,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    chat = [{"role": "user", "content": "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, "
                                        "fig, grape, honeydew, kiwi, lemon, mango."}]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    got = spec.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and "banana" in got.text
    stats = spec.llm_engine.engine_core.scheduler.make_stats()
    assert stats.spec_num_accepted_tokens >= len(got.token_ids) // 4
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1] > 0
