"""The ROLL-style rollout adapter: strategy_config with sleep_level, generating_args mapped to
SamplingParams, grouped samples with per-token logprobs, offload/load/update, and the example."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.integrations.rollout import RolloutEngine, sampling_params_from_generating_args
from tests.conftest import TEST_KV_BYTES
from tests.engine.test_correctness import _hf_model, hf_greedy, hf_logprobs, mixed_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generating_args_map_to_sampling_params():
    sp = sampling_params_from_generating_args(
        {"max_new_tokens": 512, "top_p": 0.99, "top_k": 100, "temperature": 0.99, "num_return_sequences": 8,
         "eos_token_id": 2, "stop_strings": "\n\n", "logprobs": 0, "num_beams": 1})
    assert (sp.max_tokens, sp.top_p, sp.top_k, sp.temperature, sp.n) == (512, 0.99, 100, 0.99, 8)
    assert (sp.stop_token_ids, sp.stop, sp.logprobs) == ([2], ["\n\n"], 0)
    assert sampling_params_from_generating_args({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    with pytest.raises(ValueError, match="length_penalty"):
        sampling_params_from_generating_args({"length_penalty": 1.0})
    with pytest.raises(ValueError, match="num_beams"):
        sampling_params_from_generating_args({"num_beams": 4})


def test_strategy_config_rollout_groups_offload_and_update(tiny_models):
    model_dir = tiny_models["qwen2"]
    config = {"gpu_memory_utilization": 0.8, "block_size": 16, "max_model_len": 256, "load_format": "dummy",
              "sleep_level": 2, "kv_cache_memory_bytes": TEST_KV_BYTES, "dtype": "float32"}
    engine = RolloutEngine.from_strategy_config(model_dir, config)
    assert engine.sleep_level == 2 and engine.llm.llm_engine.config.model_config.enable_sleep_mode
    assert "sleep_level" in config  # the caller's dict is left alone
    weights = list(_hf_model(model_dir).state_dict().items())
    engine.update_weights(weights)
    prompts = mixed_prompts(3)
    prompt_dicts = [{"prompt_token_ids": p} for p in prompts]

    greedy = engine.generate(prompt_dicts, {"max_new_tokens": 6, "do_sample": False, "ignore_eos": True,
                                            "logprobs": 0})
    assert [g.samples[0].token_ids for g in greedy] == hf_greedy(model_dir, prompts, max_new_tokens=6)
    for prompt, group in zip(prompts, greedy):  # each sampled token's logprob, as transformers has it
        sample = group.samples[0]
        ids = prompt + sample.token_ids
        ref = hf_logprobs(model_dir, tuple(ids))
        want = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(sample.token_ids)]
        assert sample.logprobs == pytest.approx(want, abs=1e-4)
        assert group.prompt_token_ids == prompt and sample.finish_reason == "length"

    groups = engine.generate(prompt_dicts, {"max_new_tokens": 5, "num_return_sequences": 4, "temperature": 1.0,
                                            "top_k": 50, "top_p": 0.95, "logprobs": True, "seed": 7,
                                            "ignore_eos": True})
    assert len(groups) == 3 and all(len(g.samples) == 4 for g in groups)
    for g in groups:
        assert len({tuple(s.token_ids) for s in g.samples}) > 1  # n different samples, not one copied
        for s in g.samples:
            assert len(s.token_ids) == len(s.logprobs) == 5
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in s.logprobs)

    engine.offload()
    assert engine.llm.is_sleeping()
    engine.load()  # level 2: the weights are back but undefined until the update
    engine.update_weights(weights)
    again = engine.generate(prompt_dicts, {"max_new_tokens": 6, "do_sample": False, "ignore_eos": True})
    assert [g.samples[0].token_ids for g in again] == [g.samples[0].token_ids for g in greedy]
    assert again[0].samples[0].logprobs is None  # only when asked for


def test_sleep_level_zero_never_sleeps_and_bad_levels_are_refused(tiny_models):
    base = {"kv_cache_memory_bytes": TEST_KV_BYTES, "max_model_len": 128}
    engine = RolloutEngine.from_strategy_config(tiny_models["llama"], {**base, "sleep_level": 0})
    assert not engine.llm.llm_engine.config.model_config.enable_sleep_mode
    engine.offload()
    assert not engine.llm.is_sleeping()
    assert engine.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].samples[0].text
    with pytest.raises(ValueError, match="sleep_level"):
        RolloutEngine.from_strategy_config(tiny_models["llama"], {**base, "sleep_level": 3})
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        RolloutEngine.from_strategy_config(tiny_models["llama"], {**base, "sleep_level": 1,
                                                                   "enable_sleep_mode": False})


def test_example_rollout_loop_runs(smollm2_tokenizer_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rollout_loop.py"), "--steps", "2",
                           "--max-new-tokens", "8", "--tokenizer-dir", smollm2_tokenizer_dir],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all("2 groups x 8 samples" in s for s in steps)
    assert all("greedy matches transformers: True" in s for s in steps)
    assert lines[-1] == "done"


def test_device_mapping_parses_roll_forms_and_is_checked_per_rank(tiny_models):
    from pagedllm.integrations.rollout import parse_device_mapping

    assert parse_device_mapping("list(range(0,8))") == list(range(8))
    assert parse_device_mapping("list(range(2, 6, 2))") == [2, 4]
    assert parse_device_mapping("[1, 0]") == [1, 0]
    assert parse_device_mapping((3,)) == [3]
    for bad in ("__import__('os')", "list(range(n))", [0.5], [True]):
        with pytest.raises(ValueError, match="device_mapping"):
            parse_device_mapping(bad)
    config = {"kv_cache_memory_bytes": TEST_KV_BYTES, "dtype": "float32", "sleep_level": 0}
    if not torch.cuda.is_available():  # the mapping reaches the engine, which checks it
        with pytest.raises(ValueError, match=r"device_ids=\[0\] selects GPUs, but the device is 'cpu'"):
            RolloutEngine.from_strategy_config(tiny_models["llama"], config, device_mapping="list(range(0,1))")
    with pytest.raises(ValueError, match=r"names 2 GPU\(s\), but tensor_parallel_size x pipeline_parallel_size = 1"):
        RolloutEngine.from_strategy_config(tiny_models["llama"], {**config, "tensor_parallel_size": 1},
                                           device_mapping=[0, 1])
    with pytest.raises(ValueError, match="device_ids must be a list of distinct GPU indices"):
        RolloutEngine.from_strategy_config(tiny_models["llama"], {**config, "tensor_parallel_size": 2},
                                           device_mapping=[1, 1])
