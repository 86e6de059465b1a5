"""Sleep mode and weight updates: dummy weights + an update from a transformers state_dict give
transformers' greedy tokens; sleep(1)/sleep(2) + wake_up give the same tokens again; an update
resets the prefix cache; requests while asleep are refused and the engine recovers."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.utils import FULL_GC_AFTER
from tests.conftest import TEST_KV_BYTES
from tests.engine.test_correctness import _hf_model, generate_ids, hf_greedy, mixed_prompts
from tests.engine.test_gc_freeze import gc_full_after

PROMPTS = mixed_prompts(3)


def sleepy_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
    return LLM(model_dir, dtype="float32", seed=0, load_format="dummy", enable_sleep_mode=True, **kwargs)


def state_dict_items(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    return list(_hf_model(model_dir).state_dict().items())


def other_model(model_dir: str, seed: int):
    """Same architecture as model_dir's, different random weights (in memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_hf_model(model_dir).config, dtype=torch.float32).eval()


def model_greedy(model, prompts: list[list[int]], max_new_tokens: int = 12) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]


def parameters(llm: LLM) -> dict[str, torch.nn.Parameter]:
    """The one worker's parameters (the uni executor: the objects themselves come back)."""
    [params] = llm.collective_rpc(lambda worker: dict(worker.model_runner.model.named_parameters(
        remove_duplicate=False)))
    return params


def kv_cache_freed(worker) -> bool:
    runner = worker.model_runner
    return runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attn_layers)


@pytest.mark.parametrize("arch,async_scheduling", [("llama", False), ("qwen3", True)])
def test_dummy_weights_updated_then_slept_and_woken_match_transformers(tiny_models, arch, async_scheduling):
    model_dir = tiny_models[arch]
    expected = hf_greedy(model_dir, PROMPTS)
    llm = sleepy_llm(model_dir, async_scheduling=async_scheduling)
    assert generate_ids(llm, PROMPTS) != expected  # dummy weights: some other model
    llm.update_weights(state_dict_items(model_dir))
    assert generate_ids(llm, PROMPTS) == expected

    params = parameters(llm)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert llm.collective_rpc(kv_cache_freed) == [True]
    assert all(p.numel() == 0 for p in params.values())
    llm.wake_up()
    assert not llm.is_sleeping()
    assert parameters(llm) == params  # the same nn.Parameter objects (weight_loader attributes kept)
    if arch != "llama":  # tied embeddings come back as one tensor
        assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    assert generate_ids(llm, PROMPTS) == expected

    # Level 2 discards the weights: the vLLM / RL order is weights, update, then KV cache.
    llm.sleep(level=2)
    assert llm.collective_rpc(lambda worker: worker._weights_asleep.host is None) == [True]
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache is still asleep
    llm.update_weights(state_dict_items(model_dir))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert generate_ids(llm, PROMPTS) == expected


def test_weight_update_resets_the_prefix_cache(tiny_models):
    """Run a prompt, load other weights, run it again: its KV blocks were computed by the old
    weights, so reusing them would change the answer; it must be the new model's, with no hit."""
    model_dir = tiny_models["llama"]
    prompt = [list(range(100, 140))]  # five full blocks of 8
    first, second = _hf_model(model_dir), other_model(model_dir, seed=1)
    want_first, want_second = model_greedy(first, prompt), model_greedy(second, prompt)
    assert want_first != want_second
    llm = sleepy_llm(model_dir, block_size=8)
    stats = llm.llm_engine.engine_core.kv_cache_manager.stats
    llm.update_weights(first.state_dict().items())
    assert generate_ids(llm, prompt) == want_first
    hits = stats.hits
    assert generate_ids(llm, prompt) == want_first and stats.hits - hits == 32  # the cache works
    llm.update_weights(second.state_dict().items())
    hits = stats.hits
    assert generate_ids(llm, prompt) == want_second
    assert stats.hits == hits  # no stale hit

    # collective_rpc("load_weights") is the same update (one result per worker) and resets it too.
    results = llm.collective_rpc("load_weights", args=(list(first.state_dict().items()),))
    assert len(results) == 1 and "model.layers.0.self_attn.qkv_proj.weight" in results[0]
    hits = stats.hits
    assert generate_ids(llm, prompt) == want_first
    assert stats.hits == hits
    # A function of the worker works too.
    assert llm.collective_rpc(lambda worker, k: worker.num_kv_blocks * k, args=(2,)) == \
        [2 * llm.llm_engine.engine_core.kv_cache_manager.num_blocks]


def test_requests_while_asleep_are_refused_and_the_engine_recovers(tiny_models):
    model_dir = tiny_models["qwen2"]
    llm = sleepy_llm(model_dir)
    llm.update_weights(state_dict_items(model_dir))
    before = generate_ids(llm, PROMPTS)
    llm.sleep(1)
    with pytest.raises(ValueError, match="sleeping"):
        generate_ids(llm, PROMPTS)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.sleep(1)  # already asleep: a warning, nothing else (as in vLLM)
    llm.wake_up(tags=["weights"])
    with pytest.raises(ValueError, match="kv_cache"):  # half awake is still asleep
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6])], use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert generate_ids(llm, PROMPTS) == before
    llm.wake_up()  # not asleep: a warning, nothing else


def test_sleep_and_wake_up_errors_name_the_problem(tiny_models):
    model_dir = tiny_models["llama"]
    plain = LLM(model_dir, kv_cache_memory_bytes=TEST_KV_BYTES)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep()
    llm = sleepy_llm(model_dir)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights", "kvcache"])
    # Sleeping with a request in flight is the caller's error, as in vLLM.
    engine = llm.llm_engine
    engine.add_request("r", TokensPrompt(prompt_token_ids=[5, 6, 7]))
    engine.step()
    with pytest.raises(ValueError, match="unfinished"):
        llm.sleep()
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(2)
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.update_weights(state_dict_items(model_dir))
    llm.wake_up()


def test_async_llm_sleeps_wakes_and_updates_in_the_core_process(tiny_models):
    """The server's engine: the same calls cross to the core process as utility messages."""
    import asyncio

    from pagedllm import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    model_dir = tiny_models["llama"]
    prompt = PROMPTS[0]
    expected = hf_greedy(model_dir, [prompt])[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(
            model=model_dir, kv_cache_memory_bytes=TEST_KV_BYTES, load_format="dummy", enable_sleep_mode=True,
            dtype="float32", disable_log_stats=True))

        async def greedy(request_id: str) -> list[int]:
            outs = [o async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id)]
            return outs[-1].outputs[0].token_ids

        try:
            await engine.update_weights(state_dict_items(model_dir))
            assert await greedy("a") == expected
            await engine.sleep(2)
            assert await engine.is_sleeping()
            with pytest.raises(ValueError, match="sleeping"):
                await greedy("b")
            await engine.wake_up(["weights"])
            results = await engine.collective_rpc("load_weights", args=(state_dict_items(model_dir),))
            assert len(results) == 1
            # the core process (its worker runs there) makes full collections rare
            assert await engine.collective_rpc(gc_full_after) == [FULL_GC_AFTER]
            await engine.wake_up(["kv_cache"])
            assert not await engine.is_sleeping()
            assert await greedy("c") == expected
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_gpu_sleep_script_runs_its_sequence_on_cpu():
    """scripts/gpu_sleep.py (the GPU measurement) in its --cpu-smoke mode: same calls, tokens checked."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src")}
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "gpu_sleep.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "OK: greedy tokens identical" in proc.stdout
    assert proc.stdout.count(" True") == 2  # both checks in the table
