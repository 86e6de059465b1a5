"""Pipeline parallelism on CPU (gloo, one spawned process per stage): greedy outputs equal
PP=1 (and transformers) with chunked prefill, prefix-cache hits, preemption and aborts, for
even and uneven layer splits, with tensor parallelism inside the stages, and with dummy
weights; the engine keeps one step in flight per stage; a killed stage fails fast."""
from __future__ import annotations

import multiprocessing
import time

import pytest

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.distributed.utils import pp_layer_partition
from pagedllm.worker.executor_base import WorkerFailedError
from tests.conftest import build_tiny_model
from tests.distributed.conftest import reused_llm
from tests.distributed.test_tensor_parallel import generate_with_logprobs
from tests.engine.test_correctness import (
    _hf_model, generate_ids, hf_greedy, make_llm, mixed_prompts, shared_prefix_prompts,
)

PROMPTS = mixed_prompts(6)


@pytest.fixture(scope="module")
def pp_models(tiny_models, smollm2_tokenizer_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny Llama and Qwen3 (2 layers, tied embeddings on Qwen3) and a 3-layer Llama (uneven splits)."""
    three = build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama-3l")), smollm2_tokenizer_dir,
                             num_hidden_layers=3)
    return {"llama": tiny_models["llama"], "qwen3": tiny_models["qwen3"], "llama-3l": three}


def pp2(llms: dict, name: str, model_dir: str, **kwargs) -> LLM:
    return reused_llm(llms, name, model_dir, pipeline_parallel_size=2, **kwargs)


def count_steps_in_flight(llm: LLM) -> list[int]:
    """Record, at each launch, how many steps the engine has in flight (this one included)."""
    core = llm.llm_engine.engine_core
    seen: list[int] = []
    launch = core.executor.execute_model

    def recording(sched, non_block=False):
        seen.append(len(core._batch_queue) + 1)
        return launch(sched, non_block)

    core.executor.execute_model = recording
    return seen


def assert_all_blocks_free(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_pp2_greedy_outputs_and_logprobs_equal_pp1(pp_models, module_llms, name):
    model_dir = pp_models[name]
    ref_ids, ref_lps = generate_with_logprobs(make_llm(model_dir), PROMPTS)
    llm = pp2(module_llms, name, model_dir)
    in_flight = count_steps_in_flight(llm)
    ids, lps = generate_with_logprobs(llm, PROMPTS)
    assert ids == ref_ids
    for got, want in zip(lps, ref_lps):
        assert got == pytest.approx(want, abs=1e-5)
    assert max(in_flight) == 2  # both stages had a micro-batch
    assert_all_blocks_free(llm)


def test_pp2_with_chunked_prefill_prefix_hits_and_preemption_matches_transformers(pp_models):
    model_dir = pp_models["qwen3"]
    prompts = shared_prefix_prompts() + mixed_prompts()
    llm = make_llm(model_dir, pipeline_parallel_size=2, num_gpu_blocks_override=10, max_model_len=160,
                   max_num_batched_tokens=32)
    try:
        assert generate_ids(llm, prompts) == hf_greedy(model_dir, prompts)
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        assert core.kv_cache_manager.stats.hits > 0
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pp2_seeded_sampling_and_aborts(pp_models, module_llms):
    model_dir = pp_models["llama"]
    sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True) for i in range(4)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:4]]
    ref = [o.outputs[0].token_ids for o in make_llm(model_dir).generate(prompts, sp, use_tqdm=False)]
    llm = pp2(module_llms, "llama", model_dir)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    # Abort requests while their steps are in flight; the rest finish and every block is freed.
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=p),
                           SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(0, len(PROMPTS), 2)])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == [f"abort-{i}" for i in range(1, len(PROMPTS), 2)]
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("partition", [None, "1,2"])
def test_pp2_uneven_layer_splits(pp_models, monkeypatch, partition):
    model_dir = pp_models["llama-3l"]
    ref = generate_ids(make_llm(model_dir), PROMPTS)
    if partition:
        monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", partition)  # inherited by the spawned stages
    llm = make_llm(model_dir, pipeline_parallel_size=2)
    try:
        ranges = llm.collective_rpc(stage_layers)
        assert ranges == ([(0, 2), (2, 3)] if partition is None else [(0, 1), (1, 3)])
        assert generate_ids(llm, PROMPTS) == ref
    finally:
        llm.llm_engine.engine_core.shutdown()


def stage_layers(worker) -> tuple[int, int]:
    model = worker.model_runner.model.model
    return model.start_layer, model.end_layer


def test_pp2_tp2_four_ranks_equal_tp1_and_dummy_weights_update(pp_models):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 4:
        pytest.skip("four ranks need four GPUs here (on CPU they are four gloo processes)")
    model_dir = pp_models["qwen3"]  # tied embeddings: the last stage's head loads the embedding
    ref_real = generate_ids(make_llm(model_dir), PROMPTS)
    ref_dummy = generate_ids(make_llm(model_dir, load_format="dummy"), PROMPTS)
    llm = make_llm(model_dir, pipeline_parallel_size=2, tensor_parallel_size=2, load_format="dummy")
    processes = llm.llm_engine.engine_core.executor.processes
    assert len(processes) == 4
    try:
        assert generate_ids(llm, PROMPTS) == ref_dummy != ref_real
        llm.update_weights(_hf_model(model_dir).state_dict().items())  # each stage keeps its layers
        assert generate_ids(llm, PROMPTS) == ref_real
        assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not set(processes) & set(multiprocessing.active_children())


def test_killed_stage_fails_generate_promptly(pp_models):
    llm = make_llm(pp_models["llama"], pipeline_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    assert generate_ids(llm, PROMPTS[:1])
    executor.processes[0].kill()  # the first stage: the last one would wait on it forever
    executor.processes[0].join(5)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="worker rank 0"):
        generate_ids(llm, PROMPTS)
    assert time.monotonic() - start < 10
    llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in executor.processes)


@pytest.mark.parametrize("kwargs,env,match", [
    (dict(pipeline_parallel_size=3), None, "pipeline_parallel_size=3 is larger than the model's 2 layers"),
    (dict(pipeline_parallel_size=2), "2,1", "must give 2 positive layer counts .* add up to the model's 2 layers"),
    (dict(pipeline_parallel_size=2, async_scheduling=True), None, "async_scheduling=True cannot be combined"),
])
def test_bad_pipeline_settings_are_refused(pp_models, monkeypatch, kwargs, env, match):
    if env:
        monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(ValueError, match=match):
        make_llm(pp_models["llama"], **kwargs)


def test_layer_partition_rules(monkeypatch):
    assert pp_layer_partition(32, 4) == [8, 8, 8, 8]
    assert pp_layer_partition(30, 4) == [8, 8, 7, 7]
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "20,12")
    assert pp_layer_partition(32, 2) == [20, 12]
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "a,b")
    with pytest.raises(ValueError, match="comma-separated"):
        pp_layer_partition(32, 2)
