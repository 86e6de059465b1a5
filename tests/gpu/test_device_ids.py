"""GPU-only (two GPUs): explicit per-rank GPUs (device_ids; the RL adapter's device_mapping)
put each rank where it was told, and the outputs stay those of the default placement."""
from __future__ import annotations

import pytest
import torch

from pagedllm.integrations.rollout import RolloutEngine
from tests.engine.test_correctness import generate_ids, make_llm, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")
PROMPTS = mixed_prompts(4)


def placement(worker) -> tuple[str, str, str]:
    """(the worker's device, where its weights are, where its KV cache is)"""
    runner = worker.model_runner
    return str(worker.device), str(next(runner.model.parameters()).device), str(runner.kv_caches[0].device)


def test_device_ids_place_each_rank(tiny_models):
    ref = generate_ids(make_llm(tiny_models["llama"]), PROMPTS)
    llm = make_llm(tiny_models["llama"], device_ids=[1])  # one rank, in this process
    assert llm.collective_rpc(placement) == [("cuda:1",) * 3]
    assert generate_ids(llm, PROMPTS) == ref
    llm = make_llm(tiny_models["llama"], tensor_parallel_size=2, device_ids=[1, 0])
    try:
        assert llm.collective_rpc(placement) == [("cuda:1",) * 3, ("cuda:0",) * 3]
        assert generate_ids(llm, PROMPTS) == ref
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_rollout_device_mapping(tiny_models):
    config = {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "sleep_level": 1}
    engine = RolloutEngine.from_strategy_config(tiny_models["llama"], config, device_mapping="list(range(1,2))")
    assert engine.llm.collective_rpc(placement) == [("cuda:1",) * 3]
    engine.offload()
    engine.load()
    assert engine.generate([{"prompt_token_ids": PROMPTS[0]}], {"max_new_tokens": 4, "do_sample": False})
