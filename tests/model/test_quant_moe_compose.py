"""Quantized MoE experts (issue 17) compose with the engine's other features: a tiny Qwen3-MoE
with fp8 experts (block-wise ``weight_scale_inv``, as Qwen3-30B-A3B-FP8 ships) and one with
GPTQ int4 experts (tests/model/test_fp8_moe.py, test_int4_moe.py), each served by one
synchronous and one async-scheduling engine built once for the module, with 10 KV blocks of 16
tokens (one request fits, a batch does not) and every long prefill chunked (32-token steps).

Every comparison is exact on token ids, against the same quantized engine run without the
feature (accuracy against transformers is pinned in those files): each prompt alone after a
prefix-cache reset (no preemption, no hit: both asserted). Each test asserts its feature
engaged: preemptions counted, prefix-cache hits counted, sampled completions that differ,
two steps in flight. Seeded samples of one ``n`` request are the requests of seeds seed,
seed + 1, ... (engine/output_processor.split_samples). After finished and aborted requests
(running, waiting or preempted) every KV block is free (tests/conftest.py checks it again after
each test)."""
from __future__ import annotations

import random
import types

import pytest
import torch

from pagedllm import SamplingParams, TokensPrompt
from pagedllm.core.request import RequestStatus
from tests.model.test_fp8_moe import _experts, write_fp8_moe
from tests.model.test_int4_moe import write_int4_moe
from tests.model.test_quantization import make_llm

BLOCKS, BLOCK_SIZE, MAX_LEN, MAX_TOKENS = 10, 16, 160, 24
_rng = random.Random(17)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]  # the tiny MoE's vocabulary: 512


BATCH = [_tokens(n) for n in (70, 21, 90, 9, 46, 33)]  # 6 x up to 8 blocks: preempted in 10
PREFIX = _tokens(64)  # four full blocks
FIRST = [PREFIX + _tokens(11)]
SECOND = [PREFIX + _tokens(n) for n in (5, 17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


def _sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, detokenize=False)


def _stats(llm):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def _generate(llm, prompts, params=GREEDY) -> list[list[list[int]]]:
    """Every sample's token ids, per prompt."""
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _greedy(llm, prompts) -> list[list[int]]:
    return [samples[0] for samples in _generate(llm, prompts)]


def _alone(llm, prompts, params=None) -> list[list[list[int]]]:
    """Each prompt by itself (``params``: one per prompt; greedy by default) after a prefix-cache
    reset: nothing preempted, nothing found cached."""
    before, out = _stats(llm), []
    for prompt, sp in zip(prompts, params or [GREEDY] * len(prompts)):
        assert llm.reset_prefix_cache()
        out += _generate(llm, [prompt], sp)
    after = _stats(llm)
    assert after.num_preemptions == before.num_preemptions and after.prefix_cache_hits == before.prefix_cache_hits
    return out


@pytest.fixture(scope="module", params=["fp8-block", "gptq"])
def engines(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gptq":
        write_int4_moe(path, "gptq")
    else:
        write_fp8_moe(path, BLOCK_SIZE)
    kwargs = dict(num_gpu_blocks_override=BLOCKS, max_model_len=MAX_LEN, max_num_batched_tokens=32)
    sync = make_llm(str(path), async_scheduling=False, **kwargs)
    fast = make_llm(str(path), async_scheduling=True, **kwargs)
    for llm in (sync, fast):  # the experts stay quantized in memory
        assert all(e.gate_up_proj.dtype == (torch.int32 if request.param == "gptq" else torch.float8_e4m3fn)
                   for e in _experts(llm))
        assert llm.llm_engine.engine_core.kv_cache_manager.num_blocks == BLOCKS
    assert fast.llm_engine.engine_core.config.scheduler_config.async_scheduling
    return types.SimpleNamespace(sync=sync, fast=fast)


@pytest.fixture(scope="module")
def reference(engines) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every prompt alone on the synchronous engine."""
    prompts = BATCH + FIRST + SECOND
    return {tuple(p): out[0] for p, out in zip(prompts, _alone(engines.sync, prompts))}


def _check_preempted_batch(llm, reference) -> None:
    assert llm.reset_prefix_cache()  # whatever ran before, these prompts find nothing cached
    before = _stats(llm).num_preemptions
    assert _greedy(llm, BATCH) == [reference[tuple(p)] for p in BATCH]
    assert _stats(llm).num_preemptions > before


def _check_prefix_rounds(llm, reference) -> None:
    """A first round leaves the shared prefix cached; the second round finds it."""
    assert llm.reset_prefix_cache()
    assert _greedy(llm, FIRST) == [reference[tuple(p)] for p in FIRST]
    hits = _stats(llm).prefix_cache_hits
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in SECOND], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference[tuple(p)] for p in SECOND]
    assert _stats(llm).prefix_cache_hits - hits >= len(SECOND) * len(PREFIX)
    assert all(o.num_cached_tokens >= len(PREFIX) for o in outs)


def test_preempted_batch_gives_each_prompts_tokens_alone(engines, reference):
    _check_preempted_batch(engines.sync, reference)


def test_prefix_cache_hits_give_the_tokens_computed_without_hits(engines, reference):
    _check_prefix_rounds(engines.sync, reference)


def _record_preemptions(llm) -> list[str]:
    """The ids of the engine requests preempted from now on (until ``del scheduler._preempt``)."""
    scheduler, preempted = llm.llm_engine.engine_core.scheduler, []
    preempt = scheduler._preempt

    def recording(request):
        preempted.append(request.request_id)
        preempt(request)

    scheduler._preempt = recording
    return preempted


def test_n_seeded_samples_are_the_requests_of_consecutive_seeds(engines, reference):
    """n=3 with seed s: the completions of three requests with seeds s, s+1, s+2, here batched
    after long greedy prompts so that samples are preempted and resume their random streams."""
    llm, prompt = engines.sync, BATCH[1]
    separate = [samples[0] for samples in _alone(llm, [prompt] * 3, [_sampled(1234 + i) for i in range(3)])]
    assert len({tuple(s) for s in separate}) == 3  # sampling engaged: the seeds give different tokens
    hits, preempted = _stats(llm).prefix_cache_hits, _record_preemptions(llm)
    try:
        outs = _generate(llm, [BATCH[0], BATCH[2], BATCH[4], prompt], [GREEDY] * 3 + [_sampled(1234, n=3)])
    finally:
        del llm.llm_engine.engine_core.scheduler._preempt
    assert outs[3] == separate
    assert [o[0] for o in outs[:3]] == [reference[tuple(BATCH[i])] for i in (0, 2, 4)]
    assert any("_" in rid for rid in preempted)  # a sample ("<i>_<id>": the n=3 request's) was preempted
    assert _stats(llm).prefix_cache_hits > hits  # samples 2 and 3 share the first's prompt blocks
    assert _generate(llm, [prompt], _sampled(1234, n=3)) == [separate]  # repeatable
    greedy = _generate(llm, [prompt], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     detokenize=False))[0]
    assert greedy == [reference[tuple(prompt)]] * 3


def _count_steps_in_flight(llm) -> list[int]:
    """Records, at each step launched, how many launched steps have not landed yet."""
    core, seen = llm.llm_engine.engine_core, []
    execute = core.executor.execute_model

    def counting(*args, **kwargs):
        seen.append(len(core._batch_queue))
        return execute(*args, **kwargs)

    core.executor.execute_model = counting
    return seen


def test_async_scheduling_gives_the_sync_tokens_preempted_and_with_prefix_hits(engines, reference):
    llm = engines.fast
    seen = _count_steps_in_flight(llm)
    try:
        _check_preempted_batch(llm, reference)
        _check_prefix_rounds(llm, reference)
        sync_samples = _generate(engines.sync, [BATCH[3]], _sampled(99, n=3))
        assert _generate(llm, [BATCH[3]], _sampled(99, n=3)) == sync_samples
    finally:
        del llm.llm_engine.engine_core.executor.execute_model
    assert max(seen) >= 1  # a step launched while the one before it was still in flight


def _run_with_aborts(llm, reference) -> tuple[dict[str, list[list[int]]], dict[str, str]]:
    """The batch (r1 sampled, n=3); the first request seen decoding, the first seen waiting and
    the first seen preempted are aborted. Returns the finished requests' tokens and the aborted
    requests' states."""
    engine = llm.llm_engine
    ids = [f"r{i}" for i in range(len(BATCH))]
    for rid, prompt in zip(ids, BATCH):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), _sampled(7, n=3) if rid == "r1" else GREEDY)
    done, aborted = {}, {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: [list(c.token_ids) for c in o.outputs] for o in engine.step() if o.finished})
        for request in list(engine.engine_core.scheduler.requests.values()):
            if request.status.is_finished:  # a sibling sample of a request aborted just now
                continue
            state = {RequestStatus.RUNNING: "decoding" if request.num_output_tokens else "prefilling",
                     RequestStatus.WAITING: "waiting", RequestStatus.PREEMPTED: "preempted"}[request.status]
            parent = engine.output_processor.states[request.request_id].parent.request_id
            if state != "prefilling" and state not in aborted.values() and parent not in aborted:
                engine.abort_request(parent)
                aborted[parent] = state
    assert not engine.has_unfinished_requests()
    assert set(done) == set(ids) - set(aborted)
    for rid, prompt in zip(ids, BATCH):
        if rid in done and rid != "r1":
            assert done[rid] == [reference[tuple(prompt)]]
    return done, aborted


@pytest.mark.parametrize("which", ["sync", "fast"])
def test_every_block_is_free_after_finished_and_aborted_requests(engines, reference, which):
    llm = getattr(engines, which)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    done, aborted = _run_with_aborts(llm, reference)
    assert sorted(aborted.values()) == ["decoding", "preempted", "waiting"] and done, (aborted, done)
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks
    assert not llm.llm_engine.engine_core.scheduler.requests and not llm.llm_engine.parents
    assert _greedy(llm, BATCH[:2]) == [reference[tuple(p)] for p in BATCH[:2]]  # the engine serves on
