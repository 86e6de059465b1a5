"""Bad inputs get clear errors naming the parameter, and the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from tests.conftest import TEST_KV_BYTES


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64)


def still_serves(llm):
    out = llm.generate(["still here"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must be"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": -3}, "logprobs"),
    ({"seed": 2**64}, "seed"),
    # wrong types name their field too (not a bare "'<' not supported between ...")
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"top_p": None}, "top_p must be a number"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number"),
    ({"n": True}, "n must be"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"temperature": "x" * 10_000}, r"got 'x{30,40}\.\.\.\(truncated\)\.$"),
])
def test_invalid_sampling_params_raise_value_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_over_max_model_len_is_refused_and_engine_serves(llm):
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate(["word " * 200], SamplingParams(max_tokens=4), use_tqdm=False)
    still_serves(llm)


def test_bad_request_in_a_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams(), SamplingParams(logprobs=1000)],
                     use_tqdm=False)
    still_serves(llm)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [10**9]}, "token ids"),
    ({"nothing": 1}, "prompt"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    still_serves(llm)


def test_model_dependent_params_are_checked(llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    still_serves(llm)


def test_unknown_engine_argument_names_the_key(tiny_models):
    with pytest.raises(TypeError, match="not_a_real_option"):
        LLM(tiny_models["llama"], not_a_real_option=3)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 12}, "block_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"load_format": "zip"}, "load_format"),
    ({"device": "tpu"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"num_gpu_blocks_override": 2, "max_model_len": 256}, "max_model_len=256"),
])
def test_invalid_engine_args(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_models["llama"], **kwargs)


def test_unsupported_architecture_lists_supported_ones(tiny_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as info:
        LLM(str(bad), kv_cache_memory_bytes=TEST_KV_BYTES)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not"):
        EngineArgs(model=str(tmp_path / "nope")).create_engine_config()
    assert not os.path.exists(tmp_path / "nope")


def test_a_failing_logits_processor_fails_its_call_and_engine_still_serves(llm):
    def broken(output_ids, logits):
        raise RuntimeError("user processor failed")

    with pytest.raises(RuntimeError, match="user processor failed"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3,
                                                                               logits_processors=[broken])],
                     use_tqdm=False)
    still_serves(llm)


def test_top_k_beyond_the_vocabulary_means_all_tokens(llm):
    out = llm.generate(["x"], SamplingParams(top_k=2**40, temperature=0.7, max_tokens=2, seed=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
