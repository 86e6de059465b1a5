"""Sampling behaviour end to end: seeds, top-k, penalties, min_tokens, stop strings, n>1."""
from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutputKind, SamplingParams, TokensPrompt
from tests.conftest import TEST_KV_BYTES

PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "1, 2, 3,"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_models, request):
    # Every behaviour also under async scheduling (the default on GPU), where a step is
    # scheduled before the previous step's tokens are known.
    return LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
               async_scheduling=request.param)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_seeded_request_reproduces_whatever_it_is_batched_with(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, sp, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]] * 3, sp, use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone for o in again)


def test_unseeded_sampling_varies(llm):
    sp = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * 4, sp, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = [100, 200, 300]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, allowed_token_ids=allowed, max_tokens=10,
                                                ignore_eos=True), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)


def reference_penalized_greedy(model_dir, prompt_ids, n, bias, rep=1.0, freq=0.0, pres=0.0):
    """Greedy decoding with logit_bias, then vLLM's penalty rules, on transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for tid, b in bias.items():
                logits[tid] += b
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float() \
                if out else torch.zeros_like(logits)
            seen = counts > 0
            seen[torch.tensor(prompt_ids)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - freq * counts - pres * (counts > 0).float()
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.mark.parametrize("kwargs", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                    {"repetition_penalty": 2.0}, {"frequency_penalty": 0.7, "presence_penalty": 0.7}])
def test_penalties_follow_their_definitions(llm, tiny_models, kwargs):
    prompt = llm.get_tokenizer().encode("the the the cat cat sat sat on on the mat mat")
    # A bias toward three prompt tokens makes the plain output repetitive, so every
    # penalty has something to change.
    bias = {prompt[0]: 8.0, prompt[3]: 7.6, prompt[5]: 7.2}
    n = 16
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, logit_bias=bias, **kwargs), use_tqdm=False)[0]
    ref = reference_penalized_greedy(tiny_models["llama"], prompt, n, bias,
                                     rep=kwargs.get("repetition_penalty", 1.0),
                                     freq=kwargs.get("frequency_penalty", 0.0),
                                     pres=kwargs.get("presence_penalty", 0.0))
    assert out.outputs[0].token_ids == ref
    assert ref != reference_penalized_greedy(tiny_models["llama"], prompt, n, bias), "penalty had no effect"


def test_min_tokens_and_eos(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    # Force EOS as the only allowed token: without min_tokens the request stops at once.
    sp = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    out = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]


def test_stop_token_ids_report_stop_reason(llm):
    greedy = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[3]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:greedy.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens_truncate_text(llm, include):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 12
    stop = full[5:11]  # a piece that may well span a token boundary
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=include), use_tqdm=False)[0]
    o = out.outputs[0]
    cut = full.index(stop)
    assert o.text == (full[:cut + len(stop)] if include else full[:cut])
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert len(o.token_ids) < 30


def test_n_samples_share_the_prompt_and_differ(llm):
    prompt = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    stats = llm.llm_engine.engine_core.kv_cache_manager.stats
    hits_before = stats.hits
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    # Samples 2..4 reuse the first one's full prompt blocks instead of recomputing them.
    assert stats.hits - hits_before >= 3 * ((len(out.prompt_token_ids) - 1) // 16 * 16)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1


def test_bad_words_are_never_generated(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    word = tok.decode(out.token_ids[2:3]).strip()
    banned = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                      bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[2] not in banned.token_ids


def test_logits_processors_are_applied(llm):
    def only_token_42(output_ids, logits):
        logits[:] = float("-inf")
        logits[42] = 0.0
        return logits

    def prompt_aware(prompt_ids, output_ids, logits):
        logits[prompt_ids[0]] += 1000.0
        return logits

    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True,
                                                   logits_processors=[only_token_42]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 5
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   logits_processors=[prompt_aware]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [out.prompt_token_ids[0]] * 3


def test_truncate_prompt_tokens_and_detokenize_false(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3, detokenize=False, ignore_eos=True)
    out = llm.generate(["one two three four five six seven"], sp, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 3
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4


def test_engine_step_api_streams_deltas_and_aborts(llm):
    engine = llm.llm_engine
    engine.add_request("stream", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                      output_kind=RequestOutputKind.DELTA))
    engine.add_request("cancel", "to be aborted", SamplingParams(max_tokens=50, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "stream":
                deltas.append(out.outputs[0].token_ids)
        if len(deltas) == 2:
            engine.abort_request("cancel")
    assert sum(len(d) for d in deltas) == 6 and all(len(d) == 1 for d in deltas)


def test_priority_scheduling_runs_lower_values_first(tiny_models):
    llm = LLM(tiny_models["qwen2"], kv_cache_memory_bytes=TEST_KV_BYTES, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for req_id, prio in (("late", 5), ("urgent", -3), ("normal", 0)):
        engine.add_request(req_id, "same prompt", sp, priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "normal", "late"]


def test_prefix_cache_hits_are_reported_as_num_cached_tokens(llm):
    prompt = "A long shared system prompt that repeats itself. " * 8
    sp = SamplingParams(temperature=0, max_tokens=2)
    first, = llm.generate([prompt], sp, use_tqdm=False)
    second, = llm.generate([prompt], sp, use_tqdm=False)
    block_size = llm.llm_engine.config.cache_config.block_size
    assert first.num_cached_tokens == 0
    # Every full block of the prompt but the one holding its last token (computed to sample from).
    assert second.num_cached_tokens == (len(second.prompt_token_ids) - 1) // block_size * block_size > 0
    assert second.outputs[0].text == first.outputs[0].text


def test_streamed_prompt_logprobs_come_once_and_whole_under_chunked_prefill(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, max_num_batched_tokens=8,
              enable_chunked_prefill=True)
    engine = llm.llm_engine
    prompt_ids = list(range(5, 45))  # 40 tokens: prefilled in 5 chunks
    engine.add_request("delta", TokensPrompt(prompt_token_ids=prompt_ids),
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1,
                                      output_kind=RequestOutputKind.DELTA))
    sent = []
    while engine.has_unfinished_requests():
        # Copied as received: what a streaming consumer sees at that moment.
        sent += [list(out.prompt_logprobs) for out in engine.step() if out.prompt_logprobs is not None]
    final, = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)],
                          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
                          use_tqdm=False)
    assert len(sent) == 1 and len(sent[0]) == len(prompt_ids) and sent[0][0] is None
    assert [pos[t].logprob for t, pos in zip(prompt_ids[1:], sent[0][1:])] == \
        pytest.approx([pos[t].logprob for t, pos in zip(prompt_ids[1:], final.prompt_logprobs[1:])], abs=1e-5)
