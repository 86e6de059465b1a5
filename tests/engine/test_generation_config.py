"""generation_config as vLLM reads it: a folder's generation_config.json, nulls as unset, and
override_generation_config on top of 'vllm' (no file) too."""
from __future__ import annotations

import json

from pagedllm import LLM
from tests.conftest import TEST_KV_BYTES


def test_generation_config_folder_nulls_and_overrides(tiny_models, tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": None, "top_p": 0.8}))
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, generation_config=str(folder),
              override_generation_config={"top_p": 0.5, "max_new_tokens": 9})
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.3, 0.5, 9)
    assert sp.top_k in (0, -1)  # null: the SamplingParams default, not None
    plain = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, generation_config="vllm",
                override_generation_config={"temperature": 0.1})
    assert plain.get_default_sampling_params().temperature == 0.1
