"""The offline API around generation: defaults from generation_config, model sources,
engine-core messages, chat templates, unknown keys."""
from __future__ import annotations

import json
import pickle
import shutil

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams, TokensPrompt
from pagedllm.engine.core import EngineCore
from tests.conftest import TEST_KV_BYTES


def test_default_sampling_params_come_from_generation_config(tiny_models, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7,
         "eos_token_id": [2, 77]}))
    llm = LLM(str(model), kv_cache_memory_bytes=TEST_KV_BYTES)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
    # Used when no SamplingParams are given: max_new_tokens caps the output.
    out = llm.generate(["hello"], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 7
    # generation_config's extra EOS ids stop generation like the tokenizer's EOS.
    assert 77 in llm.llm_engine.processor.generation_eos_ids
    # 'vllm' ignores the model's file; override_generation_config wins over it.
    plain = LLM(str(model), kv_cache_memory_bytes=TEST_KV_BYTES, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
    over = LLM(str(model), kv_cache_memory_bytes=TEST_KV_BYTES, override_generation_config={"temperature": 0.2})
    assert over.get_default_sampling_params().temperature == 0.2


def test_hub_id_resolves_from_the_local_hf_cache(tiny_models, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_models["qwen2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    llm = LLM("acme/tiny", kv_cache_memory_bytes=TEST_KV_BYTES)
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match="local HF cache"):
        LLM("acme/not-downloaded", kv_cache_memory_bytes=TEST_KV_BYTES)


def test_engine_core_messages_are_plain_and_picklable(tiny_models):
    config = EngineArgs(model=tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES).create_engine_config()
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES)
    engine = llm.llm_engine
    core: EngineCore = engine.engine_core
    engine.add_request("r", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                       SamplingParams(max_tokens=3, logprobs=2, temperature=0, ignore_eos=True))
    sched = core.scheduler.schedule()
    assert pickle.loads(pickle.dumps(sched)).num_scheduled_tokens == {"r": 3}
    result = core.executor.execute_model(sched)
    outputs = core.scheduler.update_from_output(sched, result)
    assert pickle.loads(pickle.dumps(outputs))[0].new_token_ids == outputs[0].new_token_ids
    engine.abort_request("r")
    assert pickle.loads(pickle.dumps(config)).model_config.max_model_len == config.model_config.max_model_len


def test_chat_template_override_and_missing_template_error(tiny_models, tmp_path):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    out = llm.chat([{"role": "user", "content": "abc"}], SamplingParams(max_tokens=1), chat_template=template,
                   add_generation_prompt=False, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("<<abc>>", add_special_tokens=False)
    path = tmp_path / "t.jinja"
    path.write_text(template)
    again = llm.chat([{"role": "user", "content": "abc"}], SamplingParams(max_tokens=1), chat_template=str(path),
                     add_generation_prompt=False, use_tqdm=False)[0]
    assert again.prompt_token_ids == out.prompt_token_ids
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = llm.chat([{"role": "user", "content": "abc"}], SamplingParams(max_tokens=1), tools=[tool],
                          chat_template="{% for t in tools %}[{{ t.function.name }}]{% endfor %}" + template,
                          add_generation_prompt=False, use_tqdm=False)[0]
    assert with_tools.prompt_token_ids == llm.get_tokenizer().encode("[get_weather]<<abc>>", add_special_tokens=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


def test_outputs_come_back_in_input_order_with_vllm_fields(tiny_models):
    llm = LLM(tiny_models["qwen3"], kv_cache_memory_bytes=TEST_KV_BYTES)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    params = [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.prompt == prompt and len(out.outputs[0].token_ids) == 2 + i
        assert out.finished and out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
        assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None
        assert out.metrics.first_scheduled_time is not None and out.metrics.finished_time is not None
        assert out.num_cached_tokens >= 0 and out.prompt_logprobs is None
    assert llm.generate("a single string", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt == \
        "a single string"


def test_dummy_weights_without_a_tokenizer(tiny_models):
    llm = LLM(tiny_models["qwen3"], load_format="dummy", skip_tokenizer_init=True,
              kv_cache_memory_bytes=TEST_KV_BYTES)
    out = llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5])],
                       SamplingParams(max_tokens=4, detokenize=False, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams(detokenize=False), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.get_tokenizer()
