"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the tokens of the
synchronous engine and of transformers, under chunking, preemption and prefix-cache hits,
and leaves no block or worker row behind."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams, TokensPrompt
from tests.engine.test_correctness import generate_ids, hf_greedy, make_llm, mixed_prompts, shared_prefix_prompts


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    {"num_gpu_blocks_override": 10, "max_model_len": 160, "max_num_batched_tokens": 32},
    {"block_size": 8},
], ids=["default", "chunked", "preempted", "prefix-cache"])
def test_async_greedy_matches_transformers(tiny_models, kwargs):
    prompts = shared_prefix_prompts() + mixed_prompts()
    llm = make_llm(tiny_models["qwen3"], async_scheduling=True, **kwargs)
    assert llm.llm_engine.engine_core.config.scheduler_config.async_scheduling
    ref = hf_greedy(tiny_models["qwen3"], prompts)
    assert generate_ids(llm, prompts) == ref
    assert generate_ids(llm, prompts) == ref  # second pass: prefix-cache hits
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    # The next step delivers the finished ids: only that step's own request is left, no row leaks.
    last = llm.generate(["flush"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert set(runner.requests) <= {last.request_id}
    assert len(runner.requests) + len(runner._free_rows) == runner.max_num_reqs


def test_async_mixed_lengths_and_early_stops_match_sync(tiny_models):
    """Requests ending at different steps (max_tokens, stop tokens) while later steps are
    already in flight: the same outputs as the synchronous engine, no token past a stop."""
    prompts = mixed_prompts()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 8, 13, 1, 4, 2, 9)]
    sync = make_llm(tiny_models["llama"], async_scheduling=False)
    ref = sync.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    stopped = [(p, o.outputs[0].token_ids[2]) for p, o in zip(prompts, ref) if len(o.outputs[0].token_ids) > 2]
    stop_prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in stopped]
    stop_params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[t], ignore_eos=True) for _, t in stopped]
    ref_stop = sync.generate(stop_prompts, stop_params, use_tqdm=False)
    fast = make_llm(tiny_models["llama"], async_scheduling=True)
    got = fast.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    got_stop = fast.generate(stop_prompts, stop_params, use_tqdm=False)
    for a, b in zip(got_stop, ref_stop):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) <= 3
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"


def test_generate_interrupted_with_a_step_in_flight_leaves_the_engine_empty(tiny_models, monkeypatch):
    """Ctrl-C (or a failed request's error) inside LLM.generate while a step is in flight: the
    call aborts its requests, the step in flight lands, no block or request is left, and the
    next call gives transformers' tokens."""
    prompts = mixed_prompts()
    llm = make_llm(tiny_models["qwen3"], async_scheduling=True, max_num_batched_tokens=32)
    engine = llm.llm_engine
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            assert engine.engine_core._batch_queue  # a step is in flight here
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        generate_ids(llm, prompts)
    monkeypatch.setattr(engine, "step", step)
    kv = engine.engine_core.kv_cache_manager
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models["qwen3"], prompts)
