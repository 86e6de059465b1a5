"""Tensor parallelism on CPU (gloo, two spawned worker processes): greedy outputs equal TP=1
for real and dummy weights, with fewer KV heads than ranks, after update_weights; a killed
worker fails the next generate promptly and leaves no process behind; bad sizes are refused."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import time

import pytest
import torch

from pagedllm import LLM, EngineArgs, SamplingParams, TokensPrompt
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.worker.executor import MultiprocExecutor
from pagedllm.utils import FULL_GC_AFTER
from pagedllm.worker.executor_base import WorkerFailedError
from tests.conftest import TEST_KV_BYTES, build_tiny_model
from tests.distributed.conftest import reused_llm
from tests.engine.test_correctness import _hf_model, generate_ids, make_llm, mixed_prompts
from tests.engine.test_gc_freeze import gc_full_after

PROMPTS = mixed_prompts(4)


@pytest.fixture(scope="module")
def tp_models(tiny_models, smollm2_tokenizer_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny Llama and Qwen3 (2 KV heads) and a Llama with one KV head (replicated on both ranks)."""
    kv1 = build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama-kv1")), smollm2_tokenizer_dir,
                           num_key_value_heads=1)
    return {"llama": tiny_models["llama"], "qwen3": tiny_models["qwen3"], "llama-kv1": kv1}


def tp2(llms: dict, name: str, model_dir: str, **kwargs) -> LLM:
    return reused_llm(llms, name, model_dir, tensor_parallel_size=2, enable_sleep_mode=True, **kwargs)


def generate_with_logprobs(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return ids, lps


def _piece_replays(worker) -> int | None:
    pieces = worker.model_runner.graphs.piecewise
    return None if pieces is None else pieces.replays


@pytest.mark.parametrize("name,async_scheduling", [("llama", False), ("qwen3", True), ("llama-kv1", False)])
def test_tp2_greedy_outputs_equal_tp1(tp_models, module_llms, name, async_scheduling):
    model_dir = tp_models[name]
    ref_ids, ref_lps = generate_with_logprobs(make_llm(model_dir), PROMPTS)
    llm = tp2(module_llms, name, model_dir, async_scheduling=async_scheduling)
    ids, lps = generate_with_logprobs(llm, PROMPTS)
    assert ids == ref_ids
    replays = llm.collective_rpc(_piece_replays)  # GPU ranks: the prefill steps replayed piecewise graphs
    assert replays == [None, None] if not torch.cuda.is_available() else replays[0] == replays[1] > 0, replays
    assert llm.collective_rpc(gc_full_after) == [FULL_GC_AFTER] * 2  # worker processes: full collections rare
    # Row-parallel sums add in another order than one matmul: equal up to the last bits.
    for got, want in zip(lps, ref_lps):
        assert got == pytest.approx(want, abs=1e-4)


def test_tp2_async_structured_outputs_equal_tp1(tp_models, module_llms):
    """Constrained steps under async scheduling defer their sampling to a second call to the
    worker processes (sample_tokens): greedy outputs equal TP=1's synchronous ones."""
    from pagedllm import StructuredOutputsParams

    model_dir = tp_models["qwen3"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    so = StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){3}\.")
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = [plain if i % 2 else constrained for i in range(len(prompts))]

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = run(make_llm(model_dir))
    llm = tp2(module_llms, "qwen3", model_dir, async_scheduling=True)
    executor, deferred = llm.llm_engine.engine_core.executor, []
    executor.sample_tokens = lambda grammar: (deferred.append(grammar), type(executor).sample_tokens(executor, grammar))
    try:
        got = run(llm)
    finally:
        del executor.sample_tokens
    assert got == ref
    assert sum(g is not None for g in deferred) > 0  # masked rows sampled by the deferred call
    for ids, text in got[::2]:
        assert text.endswith(".") and len(text.split(" ")) == 4


def local_shapes(worker) -> tuple:
    attn = worker.model_runner.model.model.layers[0].self_attn
    return (attn.num_heads, attn.num_kv_heads, tuple(attn.o_proj.weight.shape),
            tuple(worker.model_runner.model.model.embed_tokens.weight.shape),
            worker.model_runner.kv_cache_bytes_per_block())


def test_tp2_shards_heads_vocab_and_kv_cache(tp_models, module_llms):
    llm = tp2(module_llms, "llama-kv1", tp_models["llama-kv1"])
    ref = make_llm(tp_models["llama-kv1"]).llm_engine.engine_core.executor.kv_cache_bytes_per_block()
    results = llm.collective_rpc(local_shapes)  # a module-level function: sent to each worker
    assert len(results) == 2 and results[0] == results[1]
    num_heads, num_kv_heads, o_shape, embed_shape, per_block = results[0]
    assert (num_heads, num_kv_heads, o_shape) == (2, 1, (64, 32))  # 4 heads, 1 KV head replicated
    assert embed_shape[0] == -(-_hf_model(tp_models["llama-kv1"]).config.vocab_size // 2)
    assert per_block == ref  # one KV head per rank: the same as the single-device cache


def test_tp2_dummy_weights_equal_tp1_dummy_and_update_weights_gives_reference(tp_models, module_llms):
    model_dir = tp_models["qwen3"]  # tied embeddings
    ref_llm = make_llm(model_dir)
    ref_real = generate_ids(ref_llm, PROMPTS)
    ref_dummy = generate_ids(make_llm(model_dir, load_format="dummy"), PROMPTS)
    llm = tp2(module_llms, "qwen3-dummy", model_dir, load_format="dummy")
    assert generate_ids(llm, PROMPTS) == ref_dummy != ref_real
    llm.update_weights(_hf_model(model_dir).state_dict().items())  # full tensors; each rank slices
    assert generate_ids(llm, PROMPTS) == ref_real


def test_tp2_sleep_and_wake_up_keep_outputs(tp_models, module_llms):
    model_dir = tp_models["llama"]
    ref = generate_ids(make_llm(model_dir), PROMPTS)
    llm = tp2(module_llms, "llama", model_dir)
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.is_sleeping()
        llm.wake_up(tags=["weights"])
        if level == 2:  # the weights are undefined after level 2: load them again
            llm.update_weights(_hf_model(model_dir).state_dict().items())
        llm.wake_up(tags=["kv_cache"])
        assert generate_ids(llm, PROMPTS) == ref


def test_tp2_runs_inside_the_server_s_engine_core_process(tp_models):
    """The engine core of `serve` / AsyncLLM is a daemonic process: it must still start its workers."""
    config = EngineArgs(model=tp_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
                        tensor_parallel_size=2, disable_log_stats=True).create_engine_config()
    ref = generate_ids(make_llm(tp_models["llama"]), PROMPTS[:1])[0]
    client = EngineCoreClient(config)
    try:
        client.add_request(EngineCoreRequest("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=len(ref)),
                                             eos_token_id=None, arrival_time=time.time()))
        tokens, finished = [], False
        while not finished:
            core_outputs = client.get_output(timeout_s=60)
            assert isinstance(core_outputs, EngineCoreOutputs)
            for out in core_outputs.outputs:
                tokens += out.new_token_ids
                finished = finished or out.finished
        assert tokens == ref
    finally:
        client.shutdown()
    assert client.process.exitcode == 0


def test_killed_worker_fails_generate_promptly_and_leaves_no_process(tp_models):
    llm = make_llm(tp_models["llama"], tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, MultiprocExecutor) and len(executor.processes) == 2
    assert generate_ids(llm, PROMPTS[:1])  # serving
    executor.processes[1].kill()
    executor.processes[1].join(5)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="worker rank 1"):
        generate_ids(llm, PROMPTS)
    assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in executor.processes)  # the survivors were stopped too
    with pytest.raises(WorkerFailedError, match="worker rank 1"):  # and the engine stays failed
        generate_ids(llm, PROMPTS)
    llm.llm_engine.engine_core.shutdown()
    assert not set(executor.processes) & set(multiprocessing.active_children())


def test_worker_start_up_failure_names_the_rank(tp_models, tmp_path):
    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    shutil.copy(os.path.join(tp_models["llama"], "config.json"), model_dir / "config.json")
    before = set(multiprocessing.active_children())
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed during start-up(.|\n)*no safetensors"):
        LLM(str(model_dir), dtype="float32", load_format="safetensors", skip_tokenizer_init=True,
            tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20)
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 must divide the model's num_attention_heads=4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(distributed_executor_backend="dask"), "distributed_executor_backend must be None, 'uni', 'mp' or 'ray'"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "pipeline_parallel_size = 2; use 'mp'"),
])
def test_bad_parallel_settings_are_refused(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(tiny_models["llama"], **kwargs)


def test_tp2_speculative_decoding_gives_tp1_greedy_tokens(tp_models, module_llms):
    """Verification runs on every rank (each samples the same tokens and rolls back alike);
    drafts accepted and rejected at known places (the oracle proposer) leave TP=1's tokens."""
    from tests.engine.test_spec_decode import OracleProposer

    model_dir = tp_models["llama"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = make_llm(model_dir).generate(prompts, greedy, use_tqdm=False)
    full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref]
    llm = reused_llm(module_llms, "llama-spec", model_dir, tensor_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    core = llm.llm_engine.engine_core
    core.proposer = OracleProposer(full)
    out = llm.generate(prompts, greedy, use_tqdm=False)
    assert [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in out] == full
    stats = core.scheduler.make_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=3, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in sampled)
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def _kv_heads(worker) -> tuple[int, int]:
    """(the target's, the draft's) KV heads per layer on this rank."""
    runner = worker.model_runner
    return runner.attn_layers[0].num_kv_heads, runner.draft.attn_layers[0].num_kv_heads


@pytest.mark.parametrize("draft_tp", [1, 2])
def test_tp2_draft_model_whole_or_sharded_gives_tp1_greedy_tokens(tp_models, module_llms, draft_tp):
    """A draft model equal to the target, whole on every rank (draft_tensor_parallel_size=1: its
    collectives off) or sharded as the target: every guess accepted, TP=1's tokens."""
    model_dir = tp_models["llama"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = reused_llm(module_llms, "llama-tp1", model_dir).generate(prompts, greedy, use_tqdm=False)
    llm = make_llm(model_dir, tensor_parallel_size=2, speculative_config={
        "model": model_dir, "num_speculative_tokens": 3, "draft_tensor_parallel_size": draft_tp})
    try:
        assert llm.collective_rpc(_kv_heads) == [(1, 2 // draft_tp)] * 2  # 2 KV heads, sharded or whole
        out = llm.generate(prompts, greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in out] == [list(o.outputs[0].token_ids) for o in ref]
        core = llm.llm_engine.engine_core
        stats = core.scheduler.make_stats()
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tp2_lora_gives_peft_greedy_tokens(tp_models, tmp_path_factory):
    """Adapters sharded as their layers (column-parallel: B's rows of each projection; row-parallel:
    A's input columns, the partial deltas summed by the layer's all-reduce): a batch mixing two
    adapters (all projections; q/v only) and the base gives peft's greedy tokens on 2 ranks, with a
    KV head replicated on both (llama-kv1)."""
    from pagedllm import LoRARequest
    from tests.lora.test_lora import MAX_TOKENS, PROMPTS as LORA_PROMPTS, _make_adapter, _peft_greedy

    base = tp_models["llama-kv1"]
    specs = {"all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
             "qv4": (4, 8, ["q_proj", "v_proj"], True)}
    loras = [LoRARequest(n, i + 1, _make_adapter(base, str(tmp_path_factory.mktemp(f"tp-lora-{n}")), *spec, seed=i))
             for i, (n, spec) in enumerate(specs.items())]
    prompts = LORA_PROMPTS[:6]
    per_prompt = [loras[0], loras[1], None, loras[1], loras[0], None]
    want = [_peft_greedy(base, lora.lora_path if lora else None)[i] for i, lora in enumerate(per_prompt)]
    plain = _peft_greedy(base, None)
    assert want[0] != plain[0] and want[1] != plain[1]  # both adapters move the tokens
    llm = LLM(base, dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=128, kv_cache_memory_bytes=TEST_KV_BYTES)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False,
                        lora_request=per_prompt)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == want


def _custom_all_reduce_on(worker) -> bool:
    from pagedllm.distributed import parallel_state

    return parallel_state._CUSTOM_AR is not None


def test_custom_all_reduce_is_cuda_only_and_can_be_disabled(tp_models, module_llms):
    """gloo ranks sum with gloo, GPU ranks through peer memory (tests/gpu/test_custom_all_reduce.py);
    vLLM's disable_custom_all_reduce reaches the parallel config."""
    llm = tp2(module_llms, "llama", tp_models["llama"])
    assert llm.collective_rpc(_custom_all_reduce_on) == [torch.cuda.device_count() >= 2] * 2
    config = EngineArgs(tp_models["llama"], tensor_parallel_size=2, disable_custom_all_reduce=True).create_engine_config()
    assert config.parallel_config.disable_custom_all_reduce is True
    assert EngineArgs(tp_models["llama"]).create_engine_config().parallel_config.disable_custom_all_reduce is False
