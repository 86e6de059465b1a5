"""Start-up objects are moved out of the garbage collector's reach (gc.freeze), so a full
collection while serving walks only what serving allocated, not torch's and the model's
hundreds of thousands of objects (each full pass stalled a step for 120-140 ms on an H100).

Frozen objects are still freed by reference counting, never by the cycle collector; so the
engine must hold no reference cycles, or a dropped LLM would keep its weights and KV cache."""
from __future__ import annotations

import gc
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.utils import FULL_GC_AFTER
from tests.conftest import TEST_KV_BYTES


def gc_full_after(worker=None) -> int:
    """This process's full-collection threshold (run in a worker through collective_rpc)."""
    return gc.get_threshold()[2]


def test_engine_start_up_freezes_the_heap_and_a_dropped_engine_is_freed(tiny_models):
    gc.unfreeze()
    gc.collect()  # earlier tests' garbage: not what start-up keeps
    before = len(gc.get_objects())
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64,
              async_scheduling=True)
    frozen = gc.get_freeze_count()
    assert frozen >= 0.9 * before  # everything alive at start-up, the test session's objects included
    out = llm.generate(["a b c"] * 4, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    # What a full collection still walks: the few objects made since start-up.
    assert len(gc.get_objects()) < frozen // 10

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    refs = [weakref.ref(x) for x in (llm.llm_engine, runner, runner.model, runner.attn_layers[0].kv_cache)]
    del llm, runner, out
    assert [r() is None for r in refs] == [True] * len(refs)  # freed by reference counting alone
    gc.unfreeze()


def test_generate_makes_full_collections_rare_and_restores_the_thresholds(tiny_models):
    """Inside LLM.generate a full collection (which walks every live request's token lists and
    stalled the GPU as long) needs FULL_GC_AFTER young-generation passes instead of CPython's 10;
    the caller's thresholds are back afterwards, also when generate raises."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64)
    engine, seen = llm.llm_engine, []
    step = engine.step

    def recording_step():
        seen.append(gc.get_threshold())
        return step()

    engine.step = recording_step
    before = gc.get_threshold()
    assert before[2] < FULL_GC_AFTER
    llm.generate(["a b c"] * 3, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert seen and all(t == (before[0], before[1], FULL_GC_AFTER) for t in seen)
    assert gc.get_threshold() == before

    def failing_step():
        raise KeyboardInterrupt

    engine.step = failing_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a b c"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert gc.get_threshold() == before
